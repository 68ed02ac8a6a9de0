"""FastAPI app: OpenAI-compatible routes over an AsyncEngine. Routes validate bodies themselves (413, 400
with the OpenAI error body, never 422); auth is pure ASGI (BaseHTTPMiddleware breaks disconnect detection)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from specserve import __version__
from specserve.engine.async_engine import AsyncEngine
from specserve.metrics.log import StatsLogger
from specserve.metrics.prometheus import PrometheusMetrics
from specserve.server import protocol as proto
from specserve.server import serving_common as common
from specserve.server.cli_args import ServerConfig
from specserve.server.serving_chat import create_chat_completion, render_chat
from specserve.server.serving_common import APIError
from specserve.server.serving_completion import create_completion

logger = logging.getLogger(__name__)
OPEN_PATHS = ("/health", "/metrics")  # reachable without the API key (probes, scrapers)


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class GuardMiddleware:
    """API key (Bearer), Content-Type of POSTs (application/json: no cross-site simple requests) and
    Content-Length, before any route runs."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            error = self._check(scope["method"], scope["path"], headers)
            if error is not None:
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, method: str, path: str, headers: dict[str, str]) -> APIError | None:
        if self.api_key and path not in OPEN_PATHS:
            given = headers.get("authorization", "")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                return APIError("Incorrect API key provided.", 401, code="invalid_api_key")
        media_type = headers.get("content-type", "").split(";")[0].strip().lower()
        if method == "POST" and media_type != "application/json":
            msg = f"Content-Type must be application/json, got {media_type or 'none'}"
            return APIError(msg, 415, code="unsupported_media_type")
        if (length := headers.get("content-length", "")).isdigit() and int(length) > self.max_body_bytes:
            return common.body_too_large(self.max_body_bytes)
        return None


def _guarded(fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """APIError -> its OpenAI body; anything else -> a plain 500 (the trace goes to the log)."""

    @functools.wraps(fn)
    async def route(request: Request) -> Response:
        try:
            return await fn(request)
        except APIError as e:
            return error_response(e)
        except Exception:
            logger.exception("unhandled error in %s %s", request.method, request.url.path)
            return error_response(common.INTERNAL_ERROR)

    return route


async def _log_stats(engine: AsyncEngine, interval: float) -> None:
    stats_logger = StatsLogger(engine.stats)
    while True:
        await asyncio.sleep(interval)
        stats_logger.maybe_log()


def build_app(engine: AsyncEngine, settings: ServerConfig) -> FastAPI:
    """The server app. Its lifespan shuts the engine down (after uvicorn drained connections)."""
    metrics = PrometheusMetrics(engine.stats, settings.metrics_prefix)
    spec = engine.config.speculative
    if spec is not None:  # what `advise` sizes k against
        info = {"method": spec.method, "adaptive": spec.adaptive, "num_speculative_tokens": spec.num_speculative_tokens}
        engine.stats.set("spec_decode_config_info", 1, {k: str(v) for k, v in info.items()})
    limit = settings.max_request_body_bytes

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(_log_stats(engine, settings.log_interval)) if settings.log_interval else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
            await engine.shutdown(timeout=2.0)  # SpecserveServer already drained it

    app = FastAPI(title="specserve", version=__version__, lifespan=lifespan)
    app.add_middleware(GuardMiddleware, api_key=settings.api_key, max_body_bytes=limit)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(APIError(str(exc.detail), exc.status_code, type_))

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(common.validation_error(list(exc.errors())))

    @app.post("/v1/completions")
    @_guarded
    async def completions(request: Request) -> Response:
        req = common.parse_model(proto.CompletionRequest, await common.read_json(request, limit))
        return await create_completion(engine, req, request)

    @app.post("/v1/chat/completions")
    @_guarded
    async def chat_completions(request: Request) -> Response:
        req = common.parse_model(proto.ChatCompletionRequest, await common.read_json(request, limit))
        if req.chat_template is not None and not settings.trust_request_chat_template:
            # A client's Jinja runs sandboxed but may loop for long: opt in (as vLLM).
            msg = "a chat_template in the request needs the server started with --trust-request-chat-template"
            raise APIError(msg, param="chat_template", code="unsupported")
        return await create_chat_completion(engine, req, request)

    card = proto.ModelCard(id=engine.model_name, root=engine.config.model.model, max_model_len=engine.max_model_len)

    app.get("/v1/models")(lambda: JSONResponse(proto.ModelList(data=[card])))

    @app.get("/v1/models/{model_id:path}")
    @_guarded
    async def model(request: Request) -> Response:
        common.check_model(engine, request.path_params["model_id"])
        return JSONResponse(card)

    @app.post("/tokenize")
    @_guarded
    async def tokenize(request: Request) -> Response:
        req = common.parse_model(proto.TokenizeRequest, await common.read_json(request, limit))
        return JSONResponse(await asyncio.to_thread(_tokenize, engine, req))

    @app.post("/detokenize")
    @_guarded
    async def detokenize(request: Request) -> Response:
        req = common.parse_model(proto.DetokenizeRequest, await common.read_json(request, limit))
        common.check_model(engine, req.model)
        common.check_token_ids(req.tokens, engine.vocab_size, "tokens")
        return JSONResponse({"prompt": common.require_tokenizer(engine, "tokens").decode(req.tokens)})

    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health()
        except Exception as e:  # noqa: BLE001 - any failure means "not healthy"
            return error_response(common.unavailable(str(e)))
        return Response(status_code=200)

    app.get("/version")(lambda: JSONResponse({"version": __version__}))

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    return app


def _tokenize(engine: AsyncEngine, req: proto.TokenizeRequest) -> dict[str, Any]:
    common.check_model(engine, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError("give exactly one of prompt or messages", param="prompt")
    if req.messages is not None:
        ids = render_chat(engine, req.messages, req.add_generation_prompt)
    else:
        tokenizer = common.require_tokenizer(engine, "prompt")
        ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    strs = engine.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs and engine.tokenizer else None
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs}


class SpecserveServer(uvicorn.Server):
    """uvicorn.Server that drains the engine when shutdown starts: in-flight requests run for
    `graceful_shutdown_timeout` s, then end with finish_reason "abort"."""

    DEAD_ENGINE_GRACE_S = 3.0  # /health answers 503 this long after the engine died, then exit 1

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, settings: ServerConfig) -> None:
        super().__init__(config)
        self.engine, self.settings = engine, settings
        self.engine_died_at: float | None = None

    async def on_tick(self, counter: int) -> bool:
        if self.engine_died_at is None and not self.engine.is_running:
            self.engine_died_at = time.monotonic()
            logger.error("engine loop died; exiting in %.0f s", self.DEAD_ENGINE_GRACE_S)
        if self.engine_died_at is not None and time.monotonic() - self.engine_died_at > self.DEAD_ENGINE_GRACE_S:
            return True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        drain = asyncio.create_task(self.engine.drain(self.settings.graceful_shutdown_timeout))
        try:
            await super().shutdown(sockets)
        finally:
            drain.cancel()


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) before the model loads, so a port in use fails at once."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot bind {host}:{port}: {e.strerror}") from None
    return sock


def make_server(engine: AsyncEngine, settings: ServerConfig, **overrides: Any) -> SpecserveServer:
    """The app and a uvicorn server for it (not started). uvicorn's own shutdown timeout is a backstop."""
    kw: dict[str, Any] = {"host": settings.host, "port": settings.port, "log_level": settings.uvicorn_log_level}
    kw.update(timeout_graceful_shutdown=settings.graceful_shutdown_timeout + 5.0, lifespan="on")
    return SpecserveServer(uvicorn.Config(build_app(engine, settings), **{**kw, **overrides}), engine, settings)


class BackgroundServer:
    """Serve an engine on a daemon thread (tests, notebooks), as `serve` would; port 0: a free one."""

    def __init__(self, engine: AsyncEngine, settings: ServerConfig | None = None, **overrides: Any) -> None:
        settings = settings or ServerConfig(port=0)
        self.engine = engine
        self._sock = bind_socket(settings.host, settings.port)
        self.host, self.port = self._sock.getsockname()[:2]
        self.server = make_server(engine, settings, **overrides)
        serve = lambda: asyncio.run(self.server.serve(sockets=[self._sock]))
        self._thread = threading.Thread(target=serve, name="specserve-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()
