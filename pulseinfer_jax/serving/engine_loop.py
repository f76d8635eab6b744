"""The engine's own thread, shared by every client of the server.

HTTP handlers never touch the engine: they `submit` a job (tokenized in their own worker thread) and read its
`Handle`; the loop thread takes new jobs into the engine's scheduler between steps (so they join the running batch:
continuous batching), runs `Engine.step`, turns each request's tokens into text (stop strings included) and hands
them to the handle through the event loop. A cancelled handle (the client went away) is stopped at the next step,
which frees its GPU blocks and host rows. An exception inside a step fails the requests in flight with a server
error and reopens the engine's pools; the server keeps going.

Shutting down, `drain(grace_s)` stops admission (new jobs get a 503) and ends every request with finish_reason
"abort": at once for those not yet running, after the grace for the running ones (which keep stepping until then).
`drained` turns true once none is left and the engine holds no KV, so the server can exit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
import traceback
from typing import Any

from pulseinfer_jax.engine.core import Engine
from pulseinfer_jax.engine.text import TextTracker, encode_prompt
from pulseinfer_jax.request import Request, Status
from pulseinfer_jax.serving.metrics import ServerMetrics
from pulseinfer_jax.serving.protocol import ApiError, Job

log = logging.getLogger("pulseinfer_jax")


def _as_request(message: str, index: int) -> str:
    """An engine refusal in the request's own terms: its fields as the API names them."""
    return message.replace(f"request {index}", "the request").replace("max_new_tokens", "max_tokens")


@dataclasses.dataclass(frozen=True)
class Piece:
    """What a handle receives: new text (and the token that made it), or the end (finish_reason / error set)."""

    text: str
    token_id: int | None = None
    finish_reason: str | None = None
    error: ApiError | None = None


class Handle:
    """One job in the engine: its pieces arrive on `pieces` (an asyncio queue of the server's event loop)."""

    def __init__(self, job: Job, ids: list[int], req: Request, aloop: asyncio.AbstractEventLoop):
        self.job, self.ids, self.req = job, ids, req
        self.aloop = aloop
        self.pieces: asyncio.Queue[Piece] = asyncio.Queue()
        self.t_submit = time.perf_counter()
        self.t_first: float | None = None
        self.tracker: TextTracker | None = None
        self.done = False  # its last piece is out (or it was cancelled)
        self.counted = False  # no longer counts against --max-queue (admitted or ended)

    @property
    def prompt_tokens(self) -> int:
        return len(self.ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.req.output)

    def put(self, piece: Piece) -> None:  # (from the loop thread)
        self.aloop.call_soon_threadsafe(self.pieces.put_nowait, piece)


class EngineLoop:
    """One engine, one thread, every client (see the module docstring)."""

    def __init__(self, engine: Engine, *, max_queue: int = 256, metrics: ServerMetrics | None = None,
                 seed: int = 0):
        if max_queue < 1:
            raise ValueError(f"max_queue={max_queue} must be >= 1")
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics or ServerMetrics()
        self.seed = seed
        self._inbox: queue.Queue[tuple[str, Handle]] = queue.Queue()
        self._active: dict[int, Handle] = {}  # request index -> handle (loop thread only)
        self._ids = itertools.count()
        self._queued = 0  # jobs submitted and not yet admitted (approximate outside the loop thread)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.error: str | None = None  # the last step failure, if any (reported by /health)
        self._deadline: float | None = None  # draining: when running requests end (time.monotonic)
        self._drain_noted = False  # (the loop thread logged the drain's start)
        self.drained = False  # draining, and every request ended with the engine's KV free

    @property
    def draining(self) -> bool:
        """Shutting down: new jobs are refused (`drain`)."""
        return self._deadline is not None

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self.engine.open(seed=self.seed)
        self.metrics.pools(self.engine)
        self._thread = threading.Thread(target=self._run, name="pulseinfer-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def drain(self, grace_s: float) -> None:
        """Begin shutting down: refuse new jobs (503) at once, end the queued ones at once and the running ones
        `grace_s` seconds from now, each with finish_reason "abort" (the loop thread does it between steps; `drained`
        says when it is done). Called again, the earlier deadline wins. Non-blocking and lock-free: a signal handler
        calls it."""
        deadline = time.monotonic() + max(0.0, grace_s)
        if self._deadline is None or deadline < self._deadline:
            self._deadline = deadline

    def abandon(self) -> int:
        """Draining and the engine is late (inside a long step, e.g. a compile): end every open request now with
        finish_reason "abort" without waiting for it; its KV is freed once the step returns. Call it on the server's
        event loop (the handles' pieces are put straight on their queues). Returns how many were ended."""
        ended = 0
        for h in list(self._active.values()):  # (a snapshot: the loop thread may change the dict meanwhile)
            if not h.done:
                h.done = True
                h.pieces.put_nowait(Piece("", finish_reason="abort"))
                ended += 1
        return ended

    # ---- from the handlers ---------------------------------------------------------------------
    def submit(self, job: Job, aloop: asyncio.AbstractEventLoop) -> Handle:
        """Tokenize and check `job` and queue it for the engine (call it from a worker thread, not the event loop:
        tokenizing a long prompt takes a while). ApiError 400 for a prompt the model cannot take, a `max_tokens` that
        does not fit the model's positions with the prompt, or a request that could never fit the pools; 429 when the
        queue is full, 503 once the server is shutting down."""
        if self.draining:
            self.metrics.rejected("shutting_down")
            raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")
        with self._lock:
            if self._queued >= self.max_queue:
                self.metrics.rejected("queue_full")
                raise ApiError(429, f"the server's queue is full ({self._queued} requests waiting, --max-queue "
                                    f"{self.max_queue}); retry later", type="rate_limit_error", code="queue_full")
            self._queued += 1
        try:
            eng = self.engine
            index = next(self._ids)
            try:
                ids, _ = encode_prompt(eng, index, job.prompt, job.kind == "chat")
                req = eng.make_request(index, ids, job.sampling)
            except ValueError as e:
                raise ApiError(400, str(e).replace(f"prompt {index}", "the prompt"),
                               param="messages" if job.kind == "chat" else "prompt") from None
            positions = eng.model.cfg.max_position_embeddings
            if job.budget_param is not None and len(ids) + job.sampling.max_new_tokens > positions:
                raise ApiError(400, f"'{job.budget_param}' is {job.sampling.max_new_tokens} but the model handles "
                                    f"{positions} positions and the prompt takes {len(ids)} of them; ask for at most "
                                    f"{positions - len(ids)} tokens", param=job.budget_param,
                               code="context_length_exceeded")
            req.stream, req.mode = job.stream_id, job.mode
            try:
                eng.scheduler.check(req)  # (reads only the pools' sizes: safe beside the loop thread)
            except ValueError as e:  # it could never fit the GPU / host pools
                self.metrics.rejected("never_fits")
                raise ApiError(400, _as_request(str(e), index), code="too_large") from None
            handle = Handle(job, ids, req, aloop)
            handle.tracker = TextTracker(eng.model.tokenizer, job.sampling.stop)
        except BaseException:
            with self._lock:
                self._queued -= 1
            raise
        self._inbox.put(("add", handle))
        return handle

    def cancel(self, handle: Handle) -> None:
        """The client is gone: stop the request at the next step (frees its KV)."""
        if not handle.done:
            self._inbox.put(("cancel", handle))

    @property
    def queued(self) -> int:
        return self._queued

    # ---- the loop thread -----------------------------------------------------------------------
    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            self._take_inbox(block=not eng.busy)
            if self._deadline is not None:
                self._drain()
            if not eng.busy:
                continue
            try:
                events = list(eng.step())
            except Exception:  # noqa: BLE001 - a bug in a step must not take the server down
                self._fail_all(traceback.format_exc())
                continue
            self.steps += 1
            for ev in events:
                self._deliver(ev)
            self._admitted()
            self.metrics.step(eng, self._active.values())
        if self.draining:  # stopped while draining: the rest end now, their KV freed
            self.drain(0.0)
            self._drain()
        while True:  # stopped: jobs still in the inbox end with the running ones
            try:
                kind, h = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._active.setdefault(h.req.index, h)
        for h in list(self._active.values()):
            h.done = True
            h.put(Piece("", error=ApiError(503, "the server is shutting down", type="server_error",
                                           code="shutting_down")))

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, h = item
            if kind == "add":
                self._add(h)
            elif not h.done:
                self._finish(h, None, cancelled=True)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
        self.metrics.state(self.engine)

    def _drain(self) -> None:
        """Shutting down: requests not yet running end at once, running ones at the deadline, each with finish_reason
        "abort" (its KV freed); once none is left the engine must hold no KV, and `drained` is set."""
        late = time.monotonic() >= self._deadline
        if not self._drain_noted:
            self._drain_noted = True
            log.info("shutting down: requests in flight: %d; they get %.1f s to finish, then end with finish_reason "
                     "abort", len(self._active), max(0.0, self._deadline - time.monotonic()))
        for h in list(self._active.values()):
            if late or (h.req.status is Status.WAITING and not h.req.output):
                self._finish(h, "abort")
        if not self._active and not self.drained:
            try:
                self.engine.check_drained()
            except Exception as e:  # noqa: BLE001 - report a leak, but let the server exit
                log.error("shutting down: the engine still holds KV after every request ended: %s", e)
            self.metrics.state(self.engine)
            self.drained = True
            log.info("shutting down: every request ended, KV freed")

    def _add(self, h: Handle) -> None:
        try:
            self.engine.submit(h.req)
        except ValueError as e:  # can never fit the GPU / host pools
            self._uncount(h)
            h.done = True
            self.metrics.rejected("never_fits")
            h.put(Piece("", error=ApiError(400, _as_request(str(e), h.req.index),
                                           code="too_large")))
            return
        self._active[h.req.index] = h

    def _admitted(self) -> None:
        """Jobs that left the queue this step (admitted or finished) no longer count against --max-queue."""
        for h in self._active.values():
            if not h.counted and h.req.status is not Status.WAITING:
                self._uncount(h)

    def _uncount(self, h: Handle) -> None:
        if not h.counted:
            h.counted = True
            with self._lock:
                self._queued -= 1

    def _deliver(self, ev: Any) -> None:
        h = self._active.get(ev.index)
        if h is None or h.done:
            return
        if h.t_first is None:
            h.t_first = time.perf_counter()
        tr = h.tracker
        if tr.stopped:
            return  # a stop string already ended it; this token came from the same batch
        delta = tr.add(ev.token_id, final=ev.finish_reason is not None)
        reason = ev.finish_reason
        if tr.stopped and reason is None:
            self.engine.stop_request(h.req, "stop")
            reason = "stop"
        h.put(Piece(delta, ev.token_id))
        if reason is not None:
            self._finish(h, reason)

    def _finish(self, h: Handle, reason: str | None, *, cancelled: bool = False) -> None:
        """End a handle: its last piece, its request out of the engine (KV freed), its metrics."""
        h.done = True
        if h.req.status is not Status.FINISHED:
            self.engine.stop_request(h.req, "abort")
        self._uncount(h)
        self._active.pop(h.req.index, None)
        self.metrics.finished(h, cancelled=cancelled)
        if not cancelled:
            h.put(Piece("", finish_reason=reason))

    def _fail_all(self, trace: str) -> None:
        """A step raised: every request in flight ends with a server error, and the engine's pools start afresh."""
        self.error = trace.strip().splitlines()[-1]
        log.error("engine step failed; failing %d requests and reopening the pools:\n%s", len(self._active), trace)
        for h in list(self._active.values()):
            h.done = True
            self._uncount(h)
            h.put(Piece("", error=ApiError(500, f"the engine failed: {self.error}", type="server_error",
                                           code="engine_error")))
            self.metrics.rejected("engine_error")
        self._active.clear()
        self.engine.open(seed=self.seed)
