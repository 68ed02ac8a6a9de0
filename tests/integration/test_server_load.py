"""Concurrency, client disconnects, metrics and overload against one real uvicorn server."""

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

MAX_QUEUED = 60  # requests beyond the 64 running slots: one request of 125 prompts overflows it


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    config = EngineConfig.from_kwargs(
        model=str(tiny_llama_dir),
        kv_cache_memory_bytes=4 << 20,
        max_model_len=256,
        max_num_seqs=64,
        max_num_queued_requests=MAX_QUEUED,
    )
    engine = AsyncEngine.from_config(config, progress=False)
    settings = ServerConfig(port=0, log_interval=0, uvicorn_log_level="warning")
    srv = BackgroundServer(engine, settings).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def model(server):
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def metric(server, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of the samples called `name` (full name, prefix included) whose labels include `labels`."""
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                total += sample.value
    return total


def wait_idle(server, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (
            metric(server, "specserve:num_requests_running") == 0
            and metric(server, "specserve:num_requests_waiting") == 0
            and metric(server, "specserve:kv_cache_usage_perc") == 0
        ):
            return
        time.sleep(0.05)
    raise AssertionError("server did not return to idle (running/waiting/KV usage)")


def test_64_concurrent_streams_match_sequential(server, model):
    prompts = [f"request {i}: the quick brown fox {i % 7}" for i in range(64)]
    kw = {"model": model, "max_tokens": 6, "temperature": 0.0, "extra_body": {"ignore_eos": True}}

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)

        async def one(prompt: str) -> str:
            stream = await client.completions.create(prompt=prompt, stream=True, **kw)
            return "".join([c.choices[0].text async for c in stream])

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), timeout=150)
        finally:
            await client.close()

    concurrent = asyncio.run(run())
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    sequential = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    assert concurrent == sequential
    wait_idle(server)


@pytest.fixture
def slow_steps(server):
    """Each engine step takes >= 10 ms, so a 200-token request is surely running when its
    client leaves, however fast the machine."""
    engine = server.engine._engine
    fast_step = engine.step

    def slow_step():
        time.sleep(0.01)
        return fast_step()

    engine.step = slow_step
    yield
    engine.step = fast_step


@pytest.mark.usefixtures("slow_steps")
def test_disconnect_mid_stream_frees_everything(server, model):
    aborted_before = metric(server, "specserve:request_success_total", {"finished_reason": "abort"})

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:

            async def leave_early(i: int) -> None:
                body = {
                    "model": model,
                    "prompt": f"long story {i}",
                    "max_tokens": 200,
                    "stream": True,
                    "temperature": 0.0,
                    "ignore_eos": True,
                }
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    seen = 0
                    async for line in resp.aiter_lines():
                        seen += line.startswith("data: ")
                        if seen >= 3:
                            return  # closes the connection with the request still running

            await asyncio.gather(*(leave_early(i) for i in range(6)))

    asyncio.run(run())
    wait_idle(server, timeout=10)
    assert metric(server, "specserve:request_success_total", {"finished_reason": "abort"}) == aborted_before + 6


@pytest.mark.usefixtures("slow_steps")
def test_disconnect_non_streaming_aborts(server, model):
    aborted_before = metric(server, "specserve:request_success_total", {"finished_reason": "abort"})
    body = {"model": model, "prompt": "wait for me", "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    wait_idle(server, timeout=10)
    assert metric(server, "specserve:request_success_total", {"finished_reason": "abort"}) == aborted_before + 1


def test_metrics_count_prompt_tokens_and_prefix_hits(server, model):
    prompt = "Paris is the capital of France. " * 6  # several full KV blocks
    num_prompt = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["count"]
    assert num_prompt > 32
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    tokens_before = metric(server, "specserve:prompt_tokens_total")
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    assert metric(server, "specserve:prompt_tokens_total") == tokens_before + num_prompt
    hits_before = metric(server, "specserve:prefix_cache_hits_total")
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    assert metric(server, "specserve:prefix_cache_hits_total") >= hits_before + 16
    assert metric(server, "specserve:time_to_first_token_seconds_count") > 0


def test_overload_answers_503_and_admits_nothing(server, model):
    body = {"model": model, "prompt": [f"p{i}" for i in range(64 + MAX_QUEUED + 1)], "max_tokens": 2}
    resp = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "overloaded"
    wait_idle(server)
    ok = httpx.post(server.url + "/v1/completions", json={**body, "prompt": ["a", "b"]}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
