"""The OpenAI server with asynchronous scheduling forced on (the CUDA default; here on the CPU):
real uvicorn on loopback, the official `openai` client. Streams equal the synchronous server's
output, concurrent streams equal sequential ones, and clients that leave free their KV blocks."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specserve.config import EngineConfig
from specserve.engine.async_engine import AsyncEngine
from specserve.server.api import BackgroundServer
from specserve.server.cli_args import ServerConfig


def _start(path, async_scheduling: bool) -> tuple[BackgroundServer, AsyncEngine]:
    config = EngineConfig.from_kwargs(
        model=str(path),
        kv_cache_memory_bytes=4 << 20,
        max_model_len=256,
        max_num_seqs=16,
        async_scheduling=async_scheduling,
    )
    engine = AsyncEngine.from_config(config, progress=False)
    return BackgroundServer(engine, ServerConfig(port=0, log_interval=0, uvicorn_log_level="warning")).start(), engine


@pytest.fixture(scope="module")
def servers(tiny_llama_dir):
    started = [_start(tiny_llama_dir, mode) for mode in (False, True)]
    assert [e._engine.async_scheduling for _, e in started] == [False, True]
    yield [s for s, _ in started]
    for s, _ in started:
        s.stop()


def _client(srv: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital", "numbers 0 1 2 3"]


def test_streams_equal_the_synchronous_server(servers):
    texts = []
    for srv in servers:
        client = _client(srv)
        model = client.models.list().data[0].id
        out = []
        for i, p in enumerate(PROMPTS):
            kw = {
                "model": model,
                "prompt": p,
                "max_tokens": 20,
                "temperature": 0.0,
                "extra_body": {"ignore_eos": i % 2 == 0},
                "stop": [" the"] if i == 2 else None,
            }
            full = client.completions.create(**kw)
            streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
            assert streamed == full.choices[0].text
            out.append((full.choices[0].text, full.choices[0].finish_reason, full.usage.completion_tokens))
        texts.append(out)
    assert texts[1] == texts[0]


def test_concurrent_streams_and_disconnects(servers):
    srv = servers[1]
    client = _client(srv)
    model = client.models.list().data[0].id
    want = {
        p: client.completions.create(
            model=model, prompt=p, max_tokens=16, temperature=0.0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for p in PROMPTS
    }

    async def run() -> dict[str, str]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:

            async def full(p: str) -> tuple[str, str]:
                r = await http.post(
                    "/v1/completions",
                    json={"model": model, "prompt": p, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True},
                )
                return p, r.json()["choices"][0]["text"]

            async def leave_early(i: int) -> None:
                body = {
                    "model": model,
                    "prompt": f"long story {i}",
                    "max_tokens": 200,
                    "stream": True,
                    "temperature": 0.0,
                    "ignore_eos": True,
                }
                async with http.stream("POST", "/v1/completions", json=body) as resp:
                    seen = 0
                    async for line in resp.aiter_lines():
                        seen += line.startswith("data: ")
                        if seen >= 3:
                            return  # the connection closes with tokens still in flight

            results = await asyncio.gather(*(full(p) for p in PROMPTS), *(leave_early(i) for i in range(4)))
            return dict(r for r in results if r is not None)

    got = asyncio.run(run())
    assert got == want
    deadline = time.monotonic() + 10
    while _metric(srv, "specserve:num_requests_running") or _metric(srv, "specserve:kv_cache_usage_perc"):
        assert time.monotonic() < deadline, "KV blocks were not freed after the clients left"
        time.sleep(0.05)
    assert _metric(srv, "specserve:request_success_total", "abort") >= 4


def _metric(srv: BackgroundServer, name: str, finished_reason: str | None = None) -> float:
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and (
                finished_reason is None or sample.labels.get("finished_reason") == finished_reason
            ):
                total += sample.value
    return total
