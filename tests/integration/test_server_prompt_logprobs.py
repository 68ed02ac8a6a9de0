"""/v1/completions scores prompts as vLLM does: `echo` with `logprobs` puts the prompt tokens' logprobs
before the generated ones (the first prompt token has none; lm-eval's loglikelihood requests rely on
it), and the extra field `prompt_logprobs` returns each prompt token's {token id: logprob, rank,
decoded_token}. Checked against the engine's own prompt logprobs (LLM.generate) on the same model."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from specserve import LLM, SamplingParams
from specserve.config import EngineConfig
from specserve.engine.async_engine import AsyncEngine
from specserve.server.api import BackgroundServer
from specserve.server.cli_args import ServerConfig

PROMPT = [11, 42, 7, 99, 23, 5, 6]


@pytest.fixture(scope="module")
def url(tiny_llama_dir):
    engine = AsyncEngine.from_config(
        EngineConfig.from_kwargs(model=str(tiny_llama_dir), kv_cache_memory_bytes=4 << 20, max_model_len=128),
        progress=False,
    )
    srv = BackgroundServer(engine, ServerConfig(port=0, log_interval=0, uvicorn_log_level="warning")).start()
    yield srv.url
    srv.stop()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20)
    return llm.generate(
        {"prompt_token_ids": PROMPT},
        SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, prompt_logprobs=2, ignore_eos=True),
    )[0]


def _post(url: str, **body) -> dict:
    r = httpx.post(
        url + "/v1/completions",
        json={"model": None, "prompt": PROMPT, "max_tokens": 3, "temperature": 0.0, "ignore_eos": True, **body},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_scores_the_prompt(url, reference, stream) -> None:
    if stream:
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            json={
                "prompt": PROMPT,
                "max_tokens": 3,
                "temperature": 0.0,
                "ignore_eos": True,
                "echo": True,
                "logprobs": 2,
                "stream": True,
            },
            timeout=60,
        ) as r:
            lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]
        chunks = [json.loads(ln)["choices"][0] for ln in lines if json.loads(ln)["choices"]]
        token_logprobs = [v for ch in chunks if ch["logprobs"] for v in ch["logprobs"]["token_logprobs"]]
        tops = [v for ch in chunks if ch["logprobs"] for v in ch["logprobs"]["top_logprobs"]]
    else:
        lp = _post(url, echo=True, logprobs=2)["logprobs"]
        token_logprobs, tops = lp["token_logprobs"], lp["top_logprobs"]
        assert len(lp["tokens"]) == len(lp["text_offset"]) == len(PROMPT) + 3
        assert lp["text_offset"] == sorted(lp["text_offset"])
    assert len(token_logprobs) == len(PROMPT) + 3
    assert token_logprobs[0] is None and tops[0] is None
    want = [reference.prompt_logprobs[i][t].logprob for i, t in enumerate(PROMPT) if i > 0]
    close = [math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4) for a, b in zip(token_logprobs[1 : len(PROMPT)], want)]
    assert all(close), (token_logprobs, want)
    gen = reference.outputs[0]
    want_gen = [gen.logprobs[i][t].logprob for i, t in enumerate(gen.token_ids)]
    close = [math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4) for a, b in zip(token_logprobs[len(PROMPT) :], want_gen)]
    assert all(close), (token_logprobs, want_gen)
    # top-2, plus the token itself when outside them (ids that decode to the same text share a key)
    assert all(1 <= len(t) <= 3 for t in tops[1:]), tops


def test_prompt_logprobs_field(url, reference) -> None:
    choice = _post(url, prompt_logprobs=2)
    got = choice["prompt_logprobs"]
    assert len(got) == len(PROMPT) and got[0] is None
    for i, t in enumerate(PROMPT[1:], start=1):
        assert str(t) in got[i]
        assert math.isclose(
            got[i][str(t)]["logprob"], reference.prompt_logprobs[i][t].logprob, rel_tol=1e-4, abs_tol=1e-4
        )
        assert got[i][str(t)]["rank"] == reference.prompt_logprobs[i][t].rank
    assert "prompt_logprobs" not in _post(url) or _post(url)["prompt_logprobs"] is None
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "prompt_logprobs": 50}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
