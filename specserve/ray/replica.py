"""One specserve engine as a Ray Serve deployment, answering through specserve's own server app.

Each request runs through the same FastAPI app `specserve serve` serves (`server.api.build_app`),
driven in-process over ASGI, so every endpoint validates, streams and fails exactly as a single
server does. The replica streams the app's ASGI messages back to the front door over Ray's
streaming handle calls: ("start", status, headers) first, then ("body", bytes) pieces. When the
caller goes away (Ray cancels the call), the app sees `http.disconnect` and aborts the request
in the engine, freeing its KV blocks.
"""

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


@serve.deployment(
    max_ongoing_requests=1024, health_check_period_s=2.0, health_check_timeout_s=10.0, graceful_shutdown_timeout_s=5.0
)
class SpecserveReplica:
    """A Ray Serve replica holding one engine (its own GPU or tensor-parallel group, or CPU).

    `engine_kwargs` are `EngineConfig.from_kwargs`' (vLLM's flat names), `settings` the HTTP
    settings the app applies per request (API key, body limit, metrics prefix).
    """

    def __init__(self, engine_kwargs: dict[str, Any], settings: ServerConfig | None = None) -> None:
        self.settings = settings or ServerConfig()
        self.engine = AsyncEngine.from_config(EngineConfig.from_kwargs(**engine_kwargs), progress=False)
        self.app = build_app(self.engine, self.settings)  # its lifespan is not run: __del__ closes
        self.metrics = PrometheusMetrics(self.engine.stats, self.settings.metrics_prefix)

    async def request(
        self, method: str, path: str, query: bytes, headers: Headers, body: bytes
    ) -> AsyncIterator[tuple[Any, ...]]:
        """Run one HTTP request through the app; yield its response start, then body pieces."""
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
                    if m is None or (m["type"] == "http.response.body" and not m.get("more_body")):
                        done = True
                    if m is not None and m["type"] == "http.response.start":
                        yield ("start", m["status"], list(m.get("headers", [])))
                    elif m is not None and m.get("body"):
                        pieces.append(m["body"])
                if pieces:
                    yield ("body", b"".join(pieces))
        finally:
            disconnected.set()  # a cancelled call: the app aborts the engine request
            asyncio.get_running_loop().create_task(_reap(task))

    def stats(self) -> dict[str, float]:
        """Load signals for the router."""
        get = self.engine.stats.get
        return {
            "num_waiting": get("num_requests_waiting"),
            "num_running": get("num_requests_running"),
            "kv_usage": get("kv_cache_usage_perc"),
        }

    def metrics_text(self) -> str:
        return self.metrics.render().decode()

    def info(self) -> dict[str, Any]:
        """What the front door needs once: the tokenizer (for routing keys), block size, pid."""
        return {
            "tokenizer": self.engine.tokenizer,
            "block_size": self.engine.config.cache.block_size,
            "pid": os.getpid(),
            "model_name": self.engine.model_name,
        }

    async def check_health(self) -> None:
        """Ray Serve replaces the replica when this raises (the engine loop died)."""
        await self.engine.check_health()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close(timeout=2.0)


def _scope(method: str, path: str, query: bytes, headers: Headers) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 80),
    }


async def _reap(task: asyncio.Task) -> None:
    """Let the app finish its abort (it saw the disconnect); cancel it if it hangs."""
    with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
        await asyncio.wait_for(task, timeout=10.0)
