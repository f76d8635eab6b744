"""The HTTP side: FastAPI routes over an `EngineLoop`, and `serve` to run them under uvicorn.

    POST /v1/completions, /v1/chat/completions   OpenAI's bodies (protocol.py); `"stream": true` answers with
                                                 server-sent events in OpenAI's chunk format, then `data: [DONE]`
    GET  /v1/models                              the served model
    GET  /health                                 200 while the engine's thread runs, else 503
    GET  /metrics                                Prometheus text (metrics.py)

Every refusal is an OpenAI error body (`{"error": {...}}`) with a 4xx status; the handlers run on the event loop and
never wait on the engine (tokenizing and checking a prompt run in a worker thread, pieces arrive on a queue). A
client that disconnects (a stream closed, or a plain request abandoned) has its request cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import pathlib
import threading
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from pulseinfer_jax.serving.engine_loop import EngineLoop, Handle
from pulseinfer_jax.serving.protocol import ApiError, Job, chunk, parse_job, response, usage_chunk

log = logging.getLogger("pulseinfer_jax")
DISCONNECT_POLL_S = 0.5  # how often a plain (non-streamed) request checks that its client is still there


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

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error in %s", request.url.path)
        return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").body(),
                            status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not loop.alive:
            return JSONResponse({"status": "down", "error": loop.error}, status_code=503)
        return JSONResponse({"status": "ok", "queued": loop.queued, "engine_steps": loop.steps})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                                         "owned_by": "pulseinfer"}]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(loop.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def generate(request: Request, kind: str) -> Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        job = parse_job(body, kind, model_name=model_name, config=loop.engine.config)
        handle = await asyncio.to_thread(loop.submit, job, asyncio.get_running_loop())
        if job.stream:
            return StreamingResponse(_events(loop, handle), media_type="text/event-stream",
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


async def _events(loop: EngineLoop, handle: Handle) -> AsyncIterator[bytes]:
    """A request's server-sent events; cancelling the request if the client goes away before the end."""
    job: Job = handle.job
    try:
        if job.kind == "chat":
            yield _sse(chunk(job, "", None, first=True))
        while True:
            piece = await handle.pieces.get()
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
    finally:
        if not handle.done:
            loop.cancel(handle)


async def _whole(loop: EngineLoop, handle: Handle, request: Request) -> Response:
    """A request's whole answer; cancelled if its client disconnects while it waits."""
    parts = []
    try:
        while True:
            try:
                piece = await asyncio.wait_for(handle.pieces.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    loop.cancel(handle)
                    return Response(status_code=499)  # (nobody reads it: the client is gone)
                continue
            if piece.error is not None:
                raise piece.error
            parts.append(piece.text)
            if piece.finish_reason is not None:
                return JSONResponse(response(handle.job, "".join(parts), piece.finish_reason, handle.prompt_tokens,
                                             handle.completion_tokens))
    finally:
        if not handle.done:
            loop.cancel(handle)


def serve(loop: EngineLoop, model_name: str, *, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> None:
    """Run the server until interrupted (uvicorn)."""
    import uvicorn

    uvicorn.run(create_app(loop, model_name), host=host, port=port, log_level=log_level)


class ServerThread:
    """The server on a thread of this process, on a port the OS picks (tests, benchmarks): `url` once `start` has
    returned; `stop` shuts it down (and the engine's thread with it)."""

    def __init__(self, loop: EngineLoop, model_name: str | None = None, *, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning"):
        import uvicorn

        self.loop = loop
        self.model_name = model_name or default_model_name(loop)  # (as `pulseinfer serve` names it)
        self.server = uvicorn.Server(uvicorn.Config(create_app(loop, self.model_name), host=host, port=port,
                                                    log_level=log_level))
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

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
