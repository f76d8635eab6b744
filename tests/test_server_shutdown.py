"""Shutting the server down: admission stops at once (503, /health says so), running requests get the grace and then
end with finish_reason "abort" (streams with their last chunk and `[DONE]`), queued ones end at once, the engine is
left drained, and `pulseinfer serve` exits with status 0 on SIGINT, promptly and without a traceback."""

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from pulseinfer_jax import Engine, EngineConfig
from pulseinfer_jax.serving.app import ServerThread
from pulseinfer_jax.serving.engine_loop import EngineLoop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_S = 0.1  # each engine step is slowed down to this, so a stream outlasts the grace on any machine
CI_MARGIN_S = 3.0  # on top of the promised grace + 2 s, for a loaded test machine
LONG = {"prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True}  # (>= 4 s at STEP_S)


def slow_server(tiny, grace_s: float) -> tuple[ServerThread, dict]:
    """The tiny model one request at a time (a second one waits in the queue), warmed up (every step of a LONG request
    compiled), then each step taking >= STEP_S; setting the returned dict's "stall" makes the next step take that
    long."""
    eng = Engine(tiny, EngineConfig.of(block_size=4, max_batch=1, kv_cache_tokens=2048, progress=False))
    step, delay = eng.step, {"step": 0.0, "stall": 0.0}

    def slow_step():
        stall, delay["stall"] = delay["stall"], 0.0
        time.sleep(delay["step"] + stall)
        return step()

    eng.step = slow_step
    srv = ServerThread(EngineLoop(eng), "tiny", shutdown_grace=grace_s).start()
    assert httpx.post(f"{srv.url}/v1/completions", json=LONG, timeout=120).status_code == 200
    delay["step"] = STEP_S
    return srv, delay


def read_stream(url: str, body: dict, seen: threading.Event, t_end: dict, drop: threading.Event | None = None) -> list:
    """A stream's events (parsed JSON, or "[DONE]"); `seen` is set once tokens flow, `t_end` gets the end's time. With
    `drop`: the client goes away (closes the connection) at the first event after `drop` is set."""
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
                if len(events) == 3:
                    seen.set()
                if drop is not None and drop.is_set():
                    break
    t_end["t"] = time.perf_counter()
    return events


def ends_with_abort(events: list, usage: bool) -> None:
    """The stream's tail: a chunk with finish_reason "abort", the usage chunk if asked, then [DONE]."""
    assert events[-1] == "[DONE]"
    tail = events[-3] if usage else events[-2]
    assert tail["choices"][0]["finish_reason"] == "abort"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:events.index(tail)])
    if usage:
        assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] >= 3


def test_shutdown_aborts_open_requests_after_the_grace(tiny):
    """A running stream keeps streaming through the grace and then ends with "abort" + usage + [DONE]; a request
    waiting in the queue ends at once (its JSON answer says "abort"); new requests and /health get a 503 meanwhile;
    the engine holds no KV afterwards, and the whole shutdown takes at most grace + 2 s."""
    grace = 1.0
    srv, _ = slow_server(tiny, grace)
    url, loop = srv.url, srv.loop
    seen, t_end = threading.Event(), {}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        stream = pool.submit(read_stream, url, {**LONG, "stream": True, "stream_options": {"include_usage": True}},
                             seen, t_end)
        assert seen.wait(60), "the stream did not start"
        queued = pool.submit(httpx.post, f"{url}/v1/completions", json=LONG, timeout=60)
        t0 = time.perf_counter()
        while not loop.queued and time.perf_counter() - t0 < 10:
            time.sleep(0.01)
        assert loop.queued == 1  # (max_batch 1: it waits behind the stream)

        t0 = time.perf_counter()
        stopper = threading.Thread(target=srv.stop)
        stopper.start()
        while not loop.draining:
            time.sleep(0.005)
        answer = queued.result(30)
        t_queued = time.perf_counter() - t0
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": [5], "max_tokens": 2}, timeout=10)
        health = httpx.get(f"{url}/health", timeout=10)
        events = stream.result(30)
        stopper.join(30)
        t_stop = time.perf_counter() - t0

    assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "abort"
    assert t_queued < grace, "a queued request waits for no grace"
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert health.status_code == 503 and health.json()["status"] == "shutting_down"
    ends_with_abort(events, usage=True)
    assert t_end["t"] - t0 >= grace * 0.9, "the running stream had its grace"
    assert not stopper.is_alive() and not srv._thread.is_alive() and not loop.alive
    assert t_stop < grace + 2.0, f"shutdown took {t_stop:.1f} s"
    assert loop.drained and not loop._active and not loop.engine.busy
    loop.engine.check_drained()


def test_a_second_signal_ends_the_grace_even_inside_a_long_step(tiny):
    """SIGINT twice: the second one ends the requests at once, as cleanly, even while the engine is stuck in a long
    step (a compile, say): the server ends the stream itself and the engine frees its KV once the step returns. (The
    server's own signal handler, called directly: the server runs on a thread here.)"""
    stall = 4.0
    srv, delay = slow_server(tiny, 60.0)
    seen, t_end = threading.Event(), {}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stream = pool.submit(read_stream, srv.url, {**LONG, "stream": True}, seen, t_end)
        assert seen.wait(60), "the stream did not start"
        srv.server.handle_exit(signal.SIGINT, None)
        time.sleep(0.3)
        assert srv.loop.draining and not stream.done()  # still streaming: the grace is 60 s
        delay["stall"] = stall
        time.sleep(2 * STEP_S)  # (the stalled step has begun)
        t0 = time.perf_counter()
        srv.server.handle_exit(signal.SIGINT, None)
        events = stream.result(30)
        t_stream = t_end["t"] - t0
        srv._thread.join(30)
    ends_with_abort(events, usage=False)
    assert t_stream < 2.0 < stall, "the stream ended without waiting for the engine's step"
    assert not srv._thread.is_alive() and not srv.server.force_exit
    assert srv.loop.drained
    srv.loop.engine.check_drained()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pulseinfer_serve_exits_cleanly_on_sigint(tmp_path):
    """The real process: the embedded SmolLM2 (slow enough on a CPU for a stream to outlast the grace; the tiny test
    checkpoints finish their 500 positions within it). SIGINT during two long streams: new requests get 503, one
    stream ends with "abort" and [DONE], the other's client goes away during the grace, and the process exits with
    status 0 within grace + 2 s (+ CI_MARGIN_S) with no traceback or error in its log."""
    grace, port = 2.0, free_port()
    url = f"http://127.0.0.1:{port}"
    out, err = open(tmp_path / "out", "w+"), open(tmp_path / "err", "w+")  # (files: a full pipe would block it)
    proc = subprocess.Popen([sys.executable, "-m", "pulseinfer_jax.cli", "serve", "--port", str(port),
                             "--shutdown-grace", str(grace)], cwd=ROOT, stdout=out, stderr=err, text=True)
    try:
        t0 = time.perf_counter()
        while True:
            assert proc.poll() is None, (tmp_path / "err").read_text()
            assert time.perf_counter() - t0 < 300, "the server did not come up"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        body = {"prompt": "Tell me a long story.", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        seen, seen_dropped, drop, t_end = threading.Event(), threading.Event(), threading.Event(), {}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            stream = pool.submit(read_stream, url, body, seen, t_end)
            dropped = pool.submit(read_stream, url, body, seen_dropped, {}, drop)
            assert seen.wait(120) and seen_dropped.wait(120), "the streams did not start"
            t_signal = time.perf_counter()
            proc.send_signal(signal.SIGINT)
            time.sleep(0.2)
            drop.set()
            refused = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
            events = stream.result(grace + 2.0 + CI_MARGIN_S)
            assert dropped.result(1)[-1] != "[DONE]"  # (it went away before the end)
        rc = proc.wait(grace + 2.0 + CI_MARGIN_S)
        t_exit = time.perf_counter() - t_signal
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close(), err.close()
    out, err = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    assert rc == 0, err
    assert t_exit < grace + 2.0 + CI_MARGIN_S, f"exit took {t_exit:.1f} s"
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    ends_with_abort(events, usage=False)
    assert "Traceback" not in err and "Traceback" not in out and "ERROR" not in err + out, err
    assert "shutting down" in err and "KV freed" in err
