"""A client that disconnects mid-generation, streamed or not, has its request cancelled while tokens keep coming: the
server sees the disconnect at once, the engine stops the request before its next step, and every KV block comes
back."""

import json
import socket
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pulseinfer_jax import Engine, EngineConfig
from pulseinfer_jax.request import Status
from pulseinfer_jax.serving.app import ServerThread
from pulseinfer_jax.serving.engine_loop import EngineLoop, Handle

MAX_TOKENS = 400  # far more than are made before the client hangs up (the tiny model has 512 positions)
SEEN_TOKENS = 4  # the client hangs up once the request has made this many
PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def server(tiny):
    engine = Engine(tiny, EngineConfig.of(block_size=4, max_batch=4, progress=False))
    with ServerThread(EngineLoop(engine), "tiny") as srv:
        # every shape the tests run is compiled here, so no step of theirs stalls for a compile
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                          "ignore_eos": True}, timeout=600)
        assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
        yield srv


def wait_for(what: str, ready, timeout: float = 60.0) -> None:
    t0 = time.perf_counter()
    while not ready():
        assert time.perf_counter() - t0 < timeout, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.001)


class Spy:
    """Paces the engine one step at a time (`step`), and records the handle `EngineLoop.submit` returns and how many
    tokens its request had made when the server first called `EngineLoop.cancel` on it (and whether it had ended)."""

    def __init__(self, loop: EngineLoop, monkeypatch):
        self.loop = loop
        self.handle: Handle | None = None
        self.cancelled_at: tuple[bool, int] | None = None  # (done, tokens made) at the first cancel
        self.paced = True
        self.go = threading.Semaphore(0)
        submit, cancel, step = loop.submit, loop.cancel, loop.engine.step

        def spy_submit(job, aloop):
            self.handle = submit(job, aloop)
            return self.handle

        def spy_cancel(h):
            if self.cancelled_at is None:
                self.cancelled_at = (h.done, len(h.req.output))
            cancel(h)

        def paced_step():
            if self.paced:
                assert self.go.acquire(timeout=60), "the test did not let the engine step"
            return step()

        monkeypatch.setattr(loop, "submit", spy_submit)
        monkeypatch.setattr(loop, "cancel", spy_cancel)
        monkeypatch.setattr(loop.engine, "step", paced_step)

    def step(self) -> None:
        """Let the engine run one step, and wait until it has (or the request is cancelled: then it may not step)."""
        n = self.loop.steps
        self.go.release()
        wait_for("an engine step", lambda: self.loop.steps > n or self.cancelled_at is not None)

    def free(self) -> None:
        self.paced = False
        self.go.release()


def cancelled_total(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "pulseinfer_requests_total" and s.labels.get("outcome") == "cancelled")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_disconnected_client_is_cancelled_within_a_step(server, monkeypatch, stream):
    """Tokens keep coming after the client hangs up (the test lets the engine step, then asks the server for /health
    so its event loop turns, step after step): the server must still see the disconnect and cancel the request, and
    the engine stop it before its next step."""
    loop = server.loop
    before = cancelled_total(server.url)
    spy = Spy(loop, monkeypatch)
    body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": stream}).encode()
    url = httpx.URL(server.url)
    try:
        with socket.create_connection((url.host, url.port), timeout=60) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            wait_for("the request to reach the engine", lambda: spy.handle is not None)
            h = spy.handle
            while len(h.req.output) < SEEN_TOKENS:
                spy.step()
            if stream:
                assert s.recv(1 << 16).startswith(b"HTTP/1.1 200")  # the stream has begun
        # hung up: the engine goes on stepping, a token each time, until the server cancels the request
        while spy.cancelled_at is None and not h.done:
            spy.step()
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    finally:
        spy.free()
    assert spy.cancelled_at is not None, f"the request ran to its end ({len(h.req.output)} tokens) after its " \
                                         "client disconnected"
    done, made = spy.cancelled_at
    assert not done and SEEN_TOKENS <= made < MAX_TOKENS
    wait_for("the engine to go idle", lambda: not (loop.engine.busy or loop.queued or loop._active))
    # the engine stopped it before its next step: at most the token of the step under way when it was cancelled
    assert h.req.status is Status.FINISHED and len(h.req.output) <= made + 1
    loop.engine.check_drained()  # every KV block free, the allocator consistent
    assert loop.engine.allocator.num_free == loop.engine.allocator.capacity
    assert cancelled_total(server.url) == before + 1
