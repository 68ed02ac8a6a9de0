"""Bad input: a clear ValueError naming the problem, and the engine unchanged afterwards."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20, max_model_len=64)


def _state(llm):
    e = llm.engine
    return (e.num_unfinished_requests(), e.num_blocks_in_use(), e.scheduler.num_waiting, e.scheduler.num_running)


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ("", {}, "prompt must not be empty"),
        ({"prompt_token_ids": []}, {}, "empty"),
        ({"prompt_token_ids": [1, 2, 10**6]}, {}, "outside the vocabulary"),
        ({"prompt_token_ids": [1, -3]}, {}, "outside the vocabulary"),
        ({"prompt_token_ids": list(range(5, 80))}, {}, "max_model_len"),
        ({"prompt_token_ids": [5, 6, 7]}, {"max_tokens": 62}, "max_tokens"),
        ({"bogus": 1}, {}, "prompt_token_ids"),
    ],
)
def test_bad_prompts(llm, prompt, params, match):
    before = _state(llm)
    good = llm.generate("alpha beta", SamplingParams(temperature=0.0, max_tokens=5))
    with pytest.raises(ValueError, match=match):
        llm.generate(["gamma", prompt], SamplingParams(**{"temperature": 0.0, "max_tokens": 5, **params}))
    assert _state(llm) == before
    llm.engine.kv.check_integrity()
    again = llm.generate("alpha beta", SamplingParams(temperature=0.0, max_tokens=5))
    assert again[0].outputs[0].token_ids == good[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"n": 0}, "n"),
        ({"min_p": 2.0}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
    ],
)
def test_bad_sampling_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ValueError, match="no-such-model"):
        LLM(model="no-such-model", progress=False)


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"kv_cache_dtype": "int3"}, "kv_cache_dtype"),
        ({"block_size": 12}, "block_size"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"speculative_config": {"method": "magic"}}, "method"),
        ({"unknown_arg": 1}, "unknown_arg"),
    ],
)
def test_bad_engine_args(tiny_llama_dir, kw, field):
    with pytest.raises(ValueError, match=field):
        LLM(model=str(tiny_llama_dir), progress=False, **kw)
