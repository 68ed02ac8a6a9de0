"""The front door: one Ray Serve ingress routing OpenAI requests to replicas (`router.py`). A request whose
replica dies (or answers 503) before its first body bytes is retried elsewhere; a stream cut later ends with
an SSE `engine_unavailable` error event. (No `from __future__ import annotations`: FastAPI reads them.)"""

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from specserve.ray.prom import merge_metrics
from specserve.ray.router import Router, routing_key
from specserve.server.api import error_response
from specserve.server.serving_common import SSE_DONE, APIError, sse, unavailable

logger = logging.getLogger(__name__)
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
_DROPPED_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}
app = FastAPI(title="specserve (Ray Serve front door)", docs_url=None, redoc_url=None, openapi_url=None)


@dataclass(frozen=True)
class RouterOptions:
    policy: str = "affinity"
    prefix_blocks: int = 4
    max_imbalance: int = 32
    max_kv_usage: float = 0.9
    poll_interval_s: float = 0.5
    poll_timeout_s: float = 2.0


def _unavailable(message: str) -> APIError:
    return unavailable(message, {"Retry-After": "1"})


async def _head(gen: DeploymentResponseGenerator) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    status, headers = None, []
    with contextlib.suppress(StopAsyncIteration):
        while True:
            item = await gen.__anext__()
            if item[0] == "start":
                status, headers = item[1], item[2]
            elif status is not None:
                return status, headers, item[1]
    if status is None:
        raise RuntimeError("the replica ended the call without a response")
    return status, headers, b""


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


@serve.deployment(max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class FrontDoor:
    def __init__(self, replicas: Sequence[DeploymentHandle], options: RouterOptions | None = None) -> None:
        self.handles = list(replicas)
        self.opts = options or RouterOptions()
        self.router = Router(len(self.handles), self.opts.max_imbalance, self.opts.max_kv_usage, self.opts.policy)
        self.tokenizer: Any = None
        self.block_size = 16
        self._poller: asyncio.Task | None = None

    @app.get("/health")
    async def health(self) -> Response:
        self._start_polling()
        return Response(status_code=200) if self.router.live() else error_response(_unavailable("no replica is up"))

    @app.get("/metrics")
    async def metrics(self) -> Response:
        self._start_polling()
        texts = await asyncio.gather(*(self._call(h.metrics_text) for h in self.handles))
        pages = [(str(i), text) for i, text in enumerate(texts) if text is not None]
        return Response(merge_metrics(pages), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(self, request: Request) -> Response:
        self._start_polling()
        body, path = await request.body(), request.url.path
        key = self._key(path, body) if path in ROUTED_PATHS else None
        headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"host"]
        tried: list[int] = []
        while (i := self.router.choose(key, exclude=tried)) is not None:
            tried.append(i)
            self.router.started(i)
            call = self.handles[i].options(stream=True).request
            response = call.remote(request.method, path, request.url.query.encode(), headers, body)
            gen = cast(DeploymentResponseGenerator, response)
            try:
                status, head, first = await _head(gen)
            except Exception as e:  # noqa: BLE001 - the replica died or failed before answering
                logger.warning("replica %d failed before answering (%s); retrying elsewhere", i, e)
                self._release(i, gen, down=True)
                continue
            if status == 503 and self.router.live(exclude=tried):  # overloaded or stopping: try another
                self._release(i, gen)
                continue
            out = {k.decode("latin-1"): v.decode("latin-1") for k, v in head if k.lower() not in _DROPPED_HEADERS}
            is_sse = out.get("content-type", "").startswith("text/event-stream")
            relay = self._relay(i, gen, first, is_sse)
            return StreamingResponse(relay, status_code=status, headers={**out, "x-specserve-replica": str(i)})
        return error_response(_unavailable(f"no replica could take the request (tried {len(tried)})"))

    async def _relay(
        self, i: int, gen: DeploymentResponseGenerator, first: bytes, is_sse: bool
    ) -> AsyncIterator[bytes]:
        failed = False
        try:
            if first:
                yield first
            async for item in gen:
                if item[0] == "body":
                    yield item[1]
        except Exception as e:  # the replica died mid-response
            failed = True
            logger.warning("replica %d failed mid-response: %s", i, e)
            if not is_sse:
                raise
            err = _unavailable("the replica serving this stream failed; the output is incomplete")
            yield (sse(err.body()) + SSE_DONE).encode()
        finally:
            self._release(i, gen, down=failed)

    def _release(self, i: int, gen: DeploymentResponseGenerator, down: bool = False) -> None:
        gen.cancel()  # no-op when it ended; else the replica sees a disconnect and aborts
        self.router.finished(i)
        if down:
            self.router.mark_down(i)

    def _key(self, path: str, body: bytes) -> bytes | None:
        if self.tokenizer is None:
            return None
        try:
            req = json.loads(body)
            if path == "/v1/completions":
                prompt = req["prompt"]
                if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                    prompt = prompt[0]  # a batch: route by its first prompt
                ids = prompt if isinstance(prompt, list) else self._encode(prompt, True)
            else:
                conversation = [{"role": m["role"], "content": _text(m.get("content"))} for m in req["messages"]]
                text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
                ids = self._encode(text, False)
        except Exception:  # noqa: BLE001 - a malformed body is the replica's to reject (400)
            return None
        return routing_key(ids, self.block_size, self.opts.prefix_blocks)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        limit = 16 * self.block_size * self.opts.prefix_blocks  # only the first blocks matter
        return list(self.tokenizer.encode(text[:limit], add_special_tokens=add_special_tokens))

    def _start_polling(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def _poll_forever(self) -> None:
        while True:
            for i in self.router.live() if self.tokenizer is None else []:  # once: what routing keys need
                if (info := await self._call(self.handles[i].info)) is not None:
                    self.tokenizer, self.block_size = info["tokenizer"], info["block_size"]
                    break
            results = await asyncio.gather(*(self._call(h.stats) for h in self.handles))
            for i, stats in enumerate(results):
                self.router.mark_down(i) if stats is None else self.router.mark_up(i, **stats)
            await asyncio.sleep(self.opts.poll_interval_s)

    async def _call(self, method: Any) -> Any:
        """The result, or None if the call fails or outlasts the poll timeout."""
        response = method.remote()
        try:
            return await asyncio.wait_for(response, self.opts.poll_timeout_s)
        except Exception:  # noqa: BLE001 - down, restarting or busy past the timeout
            response.cancel()
            return None
