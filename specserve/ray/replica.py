"""One engine as a Ray Serve deployment, answering through `server.api.build_app` driven over ASGI
in-process: it yields ("start", status, headers), then ("body", bytes) pieces. A cancelled call is
an `http.disconnect` to the app, which aborts the engine request."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from specserve.config import EngineConfig
from specserve.engine.async_engine import AsyncEngine
from specserve.metrics.prometheus import PrometheusMetrics
from specserve.server.api import build_app
from specserve.server.cli_args import ServerConfig

Headers = list[tuple[bytes, bytes]]
_STATS = {
    "num_waiting": "num_requests_waiting",
    "num_running": "num_requests_running",
    "kv_usage": "kv_cache_usage_perc",
}


@serve.deployment(
    max_ongoing_requests=1024, health_check_period_s=2.0, health_check_timeout_s=10.0, graceful_shutdown_timeout_s=5.0
)
class SpecserveReplica:
    def __init__(self, engine_kwargs: dict[str, Any], settings: ServerConfig | None = None) -> None:
        self.settings = settings or ServerConfig()
        self.engine = AsyncEngine.from_config(EngineConfig.from_kwargs(**engine_kwargs), progress=False)
        self.app = build_app(self.engine, self.settings)  # its lifespan is not run: __del__ closes
        self.metrics = PrometheusMetrics(self.engine.stats, self.settings.metrics_prefix)

    async def request(
        self, method: str, path: str, query: bytes, headers: Headers, body: bytes
    ) -> AsyncIterator[tuple[Any, ...]]:
        queue: asyncio.Queue[Any] = asyncio.Queue()  # ASGI messages, then None when the app returns
        disconnected = asyncio.Event()
        body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def run() -> None:
            try:
                await self.app(_scope(method, path, query, headers), receive, queue.put)
            finally:
                queue.put_nowait(None)

        task = asyncio.create_task(run())
        try:
            done = False
            while not done:
                messages = [await queue.get()]
                while not queue.empty():  # coalesce what is ready: one Ray item per batch of deltas
                    messages.append(queue.get_nowait())
                pieces: list[bytes] = []
                for m in messages:
                    m = m or {"type": "http.response.body"}  # None: the app returned
                    done = done or (m["type"] == "http.response.body" and not m.get("more_body"))
                    if m["type"] == "http.response.start":
                        yield ("start", m["status"], list(m.get("headers", [])))
                    elif m.get("body"):
                        pieces.append(m["body"])
                if pieces:
                    yield ("body", b"".join(pieces))
        finally:
            disconnected.set()  # a cancelled call: the app aborts the engine request
            asyncio.get_running_loop().create_task(_reap(task))

    def stats(self) -> dict[str, float]:
        return {k: self.engine.stats.get(n) for k, n in _STATS.items()}

    def metrics_text(self) -> str:
        return self.metrics.render().decode()

    def info(self) -> dict[str, Any]:
        e = self.engine
        info = {"tokenizer": e.tokenizer, "block_size": e.config.cache.block_size, "model_name": e.model_name}
        return info | {"pid": os.getpid()}

    async def check_health(self) -> None:
        await self.engine.check_health()

    def __del__(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.engine.close(timeout=2.0)


def _scope(method: str, path: str, query: bytes, headers: Headers) -> dict[str, Any]:
    local = {"client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80), "asgi": {"version": "3.0"}}
    kw = dict(type="http", http_version="1.1", method=method, scheme="http", path=path, root_path="")  # noqa: C408
    return {**local, **kw, "raw_path": path.encode(), "query_string": query, "headers": headers}


async def _reap(task: asyncio.Task) -> None:
    with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
        await asyncio.wait_for(task, timeout=10.0)
