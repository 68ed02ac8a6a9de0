"""Requests that ask for logprobs are speculated too: each emitted token's logprob (and top-N) comes
from its verify row's raw logits, as plain decoding reports it. Greedy: the same tokens, logprobs and
cumulative logprob as without speculation; drafts were really verified."""

from __future__ import annotations

import math

import pytest

from specserve import LLM, SamplingParams

K = 3


def _spec(model: str, method: str) -> dict:
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": K,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
            "adaptive": False,
        }
    return {"method": "draft_model", "model": model, "num_speculative_tokens": K, "adaptive": False}


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_greedy_logprobs_with_speculation(tiny_llama_dir, method) -> None:
    model = str(tiny_llama_dir)
    prompts = [{"prompt_token_ids": [11, 42, 7, 99, 23] * 4}, {"prompt_token_ids": [5, 6, 7, 8]}]
    params = [
        SamplingParams(temperature=0.0, max_tokens=14, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=9, logprobs=1, ignore_eos=True),
    ]
    kw = {"progress": False, "kv_cache_memory_bytes": 4 << 20}
    plain = LLM(model=model, **kw).generate(prompts, params)
    llm = LLM(model=model, **kw, speculative_config=_spec(model, method))
    got = llm.generate(prompts, params)
    drafts = {m.name: m.value for m in llm.get_metrics() if not m.labels}["specserve:spec_decode_num_drafts_total"]
    assert drafts > 0
    for want, have, p in zip(plain, got, params):
        a, b = want.outputs[0], have.outputs[0]
        assert b.token_ids == a.token_ids
        assert len(b.logprobs) == len(b.token_ids)
        for tok, ea, eb in zip(a.token_ids, a.logprobs, b.logprobs):
            assert tok in eb and len(eb) <= p.logprobs + 1
            assert math.isclose(eb[tok].logprob, ea[tok].logprob, rel_tol=1e-4, abs_tol=1e-4)
            assert eb[tok].rank == ea[tok].rank
        assert math.isclose(b.cumulative_logprob, a.cumulative_logprob, rel_tol=1e-4, abs_tol=1e-4)


def test_logprobs_end_with_a_stop_string_inside_a_step(tiny_llama_dir) -> None:
    """A stop string inside the accepted tokens: the logprobs and the cumulative logprob cover only the
    tokens kept."""
    model = str(tiny_llama_dir)
    kw = {"progress": False, "kv_cache_memory_bytes": 4 << 20}
    plain = LLM(model=model, **kw)
    ref = plain.generate(["numbers 0 1"], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    stop = ref.outputs[0].text[7:9]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2, stop=[stop])
    want = plain.generate(["numbers 0 1"], params)[0].outputs[0]
    llm = LLM(model=model, **kw, speculative_config=_spec(model, "draft_model"))
    got = llm.generate(["numbers 0 1"], params)[0].outputs[0]
    assert got.token_ids == want.token_ids and len(got.logprobs) == len(got.token_ids)
    total = sum(e[t].logprob for t, e in zip(got.token_ids, got.logprobs))
    assert math.isclose(got.cumulative_logprob, total, rel_tol=1e-5, abs_tol=1e-5)
    assert math.isclose(got.cumulative_logprob, want.cumulative_logprob, rel_tol=1e-4, abs_tol=1e-4)
