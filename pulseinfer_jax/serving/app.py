"""The HTTP side: FastAPI routes over an `EngineLoop`, and `serve` to run them under uvicorn.

    POST /v1/completions, /v1/chat/completions   OpenAI's bodies (protocol.py); `"stream": true` answers with
                                                 server-sent events in OpenAI's chunk format, then `data: [DONE]`
    GET  /v1/models                              the served model
    GET  /health                                 200 while the engine's thread runs, else 503
    GET  /metrics                                Prometheus text (metrics.py)

Every refusal is an OpenAI error body (`{"error": {...}}`) with a 4xx status, the router's too (404, 405), and no
input gets a 5xx: a body is read up to `MAX_BODY_BYTES` (413 past it, 415 unless it is JSON), then parsed and checked
(protocol.py: `read_json`, `parse_job`). The handlers run on the event loop and never wait on the engine (parsing a
body, tokenizing and checking a prompt run in a worker thread, pieces arrive on a queue). A client that disconnects (a
stream closed, or a plain request abandoned) has its request cancelled at once: a task per request waits for the
connection's `http.disconnect` (`_cancel_on_disconnect`), so the engine stops the request before its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import pathlib
import threading
import time
from collections.abc import AsyncIterator
from types import FrameType

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pulseinfer_jax.serving.engine_loop import EngineLoop, Handle, Piece
from pulseinfer_jax.serving.protocol import (
    MAX_BODY_BYTES,
    ApiError,
    Job,
    chunk,
    parse_job,
    read_json,
    response,
    usage_chunk,
)

log = logging.getLogger("pulseinfer_jax")
SHUTDOWN_GRACE_S = 5.0  # how long running requests may go on after SIGINT / SIGTERM (`--shutdown-grace`)


def default_model_name(loop: EngineLoop) -> str:
    """The name a server answers to unless told otherwise (`--served-model-name`): the model file's or folder's stem,
    e.g. SmolLM2-135M-Instruct.Q4_1 for the embedded model."""
    return pathlib.Path(loop.engine.model.source).stem


def create_app(loop: EngineLoop, model_name: str) -> FastAPI:
    """The server's routes over `loop` (started with the app if it is not running yet, stopped with it)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        started_here = not loop.alive
        if started_here:
            await asyncio.to_thread(loop.start)
        yield
        if started_here:
            await asyncio.to_thread(loop.stop)

    app = FastAPI(title="PulseInfer-JAX", lifespan=lifespan)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        """The router's own refusals (an unknown route, a method a route does not take) in OpenAI's error shape."""
        where = f"{request.method} {request.url.path}"
        if e.status_code == 404:
            message = (f"no such route: {where}; this server serves POST /v1/completions, POST /v1/chat/completions, "
                       "GET /v1/models, GET /health and GET /metrics")
        elif e.status_code == 405:
            message = f"{where}: method not allowed; use {(e.headers or {}).get('Allow', 'another method')}"
        else:
            message = str(e.detail)
        return JSONResponse(ApiError(e.status_code, message).body(), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        """(No route declares a typed body today; should one, its refusals are OpenAI errors too.)"""
        first = e.errors()[0] if e.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return JSONResponse(ApiError(400, f"invalid request: {first.get('msg', e)}", param=param).body(),
                            status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error in %s", request.url.path)
        return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").body(),
                            status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not loop.alive:
            return JSONResponse({"status": "down", "error": loop.error}, status_code=503)
        if loop.draining:
            return JSONResponse({"status": "shutting_down", "queued": loop.queued}, status_code=503)
        return JSONResponse({"status": "ok", "queued": loop.queued, "engine_steps": loop.steps})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                                         "owned_by": "pulseinfer"}]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(loop.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def read_body(request: Request) -> bytes:
        """The body's bytes: ApiError 415 unless it is declared JSON (or not declared), 413 past MAX_BODY_BYTES,
        found from Content-Length before reading or while reading a chunked body (never holding more)."""
        ctype = request.headers.get("content-type", "")
        media = ctype.partition(";")[0].strip().lower()
        if media and media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
            raise ApiError(415, f"the request body must be JSON, sent with 'Content-Type: application/json' (got "
                                f"{ctype[:80]!r})", code="unsupported_media_type")
        too_large = ApiError(413, f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB, the most this server "
                                  "reads; send a shorter prompt", code="request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isascii() and declared.isdigit() and (len(declared) > 15 or int(declared) > MAX_BODY_BYTES):
            raise too_large  # (the server discards what the client still sends, and the connection goes on)
        parts, size = [], 0
        try:
            async for part in request.stream():
                size += len(part)
                if size > MAX_BODY_BYTES:
                    raise too_large
                parts.append(part)
        except ClientDisconnect:  # (nobody reads the answer: the client is gone)
            raise ApiError(400, "the client disconnected before sending the whole body") from None
        return b"".join(parts)

    def parse(data: bytes, kind: str) -> Job:
        """A checked job from a body's bytes. A failure no check foresaw still comes from the body: a 400 (logged
        without a traceback), not a server error."""
        try:
            return parse_job(read_json(data), kind, model_name=model_name, config=loop.engine.config)
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the body makes a check raise is the body's fault
            log.warning("a request body failed its checks unexpectedly: %s: %.200s", type(e).__name__, e)
            raise ApiError(400, f"the request body could not be read: {type(e).__name__}: {str(e)[:200]}") from None

    async def generate(request: Request, kind: str) -> Response:
        data = await read_body(request)
        aloop = asyncio.get_running_loop()
        # reading a large body and tokenizing a long prompt take a while: a worker thread, not the event loop
        handle = await asyncio.to_thread(lambda: loop.submit(parse(data, kind), aloop))
        job = handle.job
        if job.stream:
            return StreamingResponse(_events(loop, handle, request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _whole(loop, handle, request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    return app


def _sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


_GONE = Piece("")  # put on a handle's queue when its client disconnects: its reader stops at once


@contextlib.asynccontextmanager
async def _cancel_on_disconnect(loop: EngineLoop, handle: Handle, request: Request) -> AsyncIterator[None]:
    """While inside: the moment the client disconnects, cancel `handle` (the engine stops the request before its next
    step, freeing its KV) and wake its reader with `_GONE`. The request's body is already read, so the next ASGI
    message is `http.disconnect`, whether or not pieces keep coming."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        if not handle.done:
            loop.cancel(handle)
            handle.pieces.put_nowait(_GONE)

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        if not handle.done:  # (left early: an error, or cancelled by the server)
            loop.cancel(handle)


async def _events(loop: EngineLoop, handle: Handle, request: Request) -> AsyncIterator[bytes]:
    """A request's server-sent events; the request is cancelled as soon as the client goes away."""
    job: Job = handle.job
    async with _cancel_on_disconnect(loop, handle, request):
        if job.kind == "chat":
            yield _sse(chunk(job, "", None, first=True))
        while True:
            piece = await handle.pieces.get()
            if piece is _GONE:
                return
            if piece.error is not None:
                yield _sse(piece.error.body())
                break
            if piece.token_id is not None:  # one event per token (its text may be "": held back, or no tokenizer)
                yield _sse(chunk(job, piece.text, None))
            if piece.finish_reason is not None:
                yield _sse(chunk(job, None if job.kind == "chat" else "", piece.finish_reason))
                if job.include_usage:
                    yield _sse(usage_chunk(job, handle.prompt_tokens, handle.completion_tokens))
                break
        yield _sse("[DONE]")


async def _whole(loop: EngineLoop, handle: Handle, request: Request) -> Response:
    """A request's whole answer; the request is cancelled as soon as the client goes away."""
    parts = []
    async with _cancel_on_disconnect(loop, handle, request):
        while True:
            piece = await handle.pieces.get()
            if piece is _GONE:
                return Response(status_code=499)  # (nobody reads it: the client is gone)
            if piece.error is not None:
                raise piece.error
            parts.append(piece.text)
            if piece.finish_reason is not None:
                return JSONResponse(response(handle.job, "".join(parts), piece.finish_reason, handle.prompt_tokens,
                                             handle.completion_tokens))


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose exit (SIGINT / SIGTERM, or `begin_exit`) drains the engine first: new requests get a
    503 at once, running ones have `grace_s` seconds to finish and then end with finish_reason "abort" (streams with
    their last chunk and `[DONE]`). It keeps listening meanwhile (/health says it is shutting down) and exits as
    uvicorn does once the engine is drained. A second signal ends the requests at once; a third is uvicorn's force
    quit."""

    EXIT_MARGIN_S = 0.5  # past the grace, how long the engine may take to end the requests before the server ends
    # them itself (`EngineLoop.abandon`) and exits
    BACKSTOP_S = 1  # then how long uvicorn waits for open connections before cancelling them

    def __init__(self, config: uvicorn.Config, loop: EngineLoop, grace_s: float = SHUTDOWN_GRACE_S):
        if not grace_s >= 0:
            raise ValueError(f"shutdown grace {grace_s} s must be >= 0")
        config.timeout_graceful_shutdown = self.BACKSTOP_S
        super().__init__(config)
        self.engine_loop, self.grace_s = loop, grace_s
        self._signals = 0
        self._exit_by = math.inf  # (time.monotonic) the server exits at the latest then, drained or not

    def begin_exit(self, grace_s: float | None = None) -> None:
        """Start shutting down with `grace_s` (default: the server's) for the running requests; non-blocking."""
        grace_s = self.grace_s if grace_s is None else grace_s
        self.engine_loop.drain(grace_s)
        self._exit_by = min(self._exit_by, time.monotonic() + grace_s + self.EXIT_MARGIN_S)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """The signal handler: the first signal drains with the grace, the second without; the signals are handled
        here, so the process exits normally rather than by re-raising them once the server is down."""
        self._signals += 1
        if self._signals <= 2:
            self.begin_exit(None if self._signals == 1 else 0.0)
        else:
            super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        loop = self.engine_loop
        if self._exit_by < math.inf and not self.should_exit:
            if loop.drained or not loop.alive:
                self.should_exit = True
            elif time.monotonic() >= self._exit_by:  # the engine is stuck in a step: end the requests without it
                log.warning("shutting down: the engine is inside a long step; requests ended without it: %d",
                            loop.abandon())
                self.should_exit = True
        return await super().on_tick(counter)


def serve(loop: EngineLoop, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info", shutdown_grace: float = SHUTDOWN_GRACE_S) -> None:
    """Run the server until SIGINT / SIGTERM, then shut down within `shutdown_grace` + ~1 s (`DrainingServer`)."""
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is outside 1-65535, the TCP port numbers")
    server = DrainingServer(uvicorn.Config(create_app(loop, model_name), host=host, port=port, log_level=log_level),
                            loop, shutdown_grace)
    server.run()


class ServerThread:
    """The server on a thread of this process, on a port the OS picks (tests, benchmarks): `url` once `start` has
    returned; `stop` shuts it down as SIGINT would (`shutdown_grace` for the running requests, then the engine's
    thread with it)."""

    def __init__(self, loop: EngineLoop, model_name: str | None = None, *, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning", shutdown_grace: float = SHUTDOWN_GRACE_S):
        if not 0 <= port <= 65535:
            raise ValueError(f"port {port} is outside 0-65535 (0: a free port the OS picks)")
        self.loop = loop
        self.model_name = model_name or default_model_name(loop)  # (as `pulseinfer serve` names it)
        self.server = DrainingServer(uvicorn.Config(create_app(loop, self.model_name), host=host, port=port,
                                                    log_level=log_level), loop, shutdown_grace)
        self._thread = threading.Thread(target=self.server.run, name="pulseinfer-http", daemon=True)
        self.url = ""

    def start(self, timeout: float = 300.0) -> ServerThread:
        self._thread.start()
        t0 = time.perf_counter()
        while not self.server.started:
            if not self._thread.is_alive() or time.perf_counter() - t0 > timeout:
                raise RuntimeError("the server did not start (see its log)")
            time.sleep(0.05)
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def stop(self, timeout: float = 60.0, grace_s: float | None = None) -> None:
        """Shut down (`grace_s`: default the server's) and wait for the server's thread."""
        self.server.begin_exit(grace_s)
        self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
