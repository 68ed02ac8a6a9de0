"""Shadow n-gram drafts in the engine (spec/shadow.py): while the adaptive controller drafts nothing, it
learns what n-gram drafts would have got, from the tokens the requests generated; outputs stay those of
plain decoding (greedy, sync and async scheduling)."""
from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.spec.shadow import SHADOW_EVERY

K = 3
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "disable_by_batch_size": 2}  # above 2 requests: no drafts at all (the shadow's case)
PROMPTS = [{"prompt_token_ids": [11, 42, 7, 99, 23] * 4 + [i]} for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_controller_learns_acceptance_without_drafting(tiny_llama_dir, monkeypatch, async_scheduling) -> None:
    kw = {"progress": False, "kv_cache_memory_bytes": 4 << 20}
    want = [o.outputs[0].token_ids for o in LLM(model=str(tiny_llama_dir), **kw).generate(PROMPTS, GREEDY)]
    llm = LLM(model=str(tiny_llama_dir), **kw, speculative_config=SPEC, async_scheduling=async_scheduling)
    spec = llm.engine.spec
    assert spec.shadow is not None
    seen = []
    inner = spec.controller.inner
    observe_shadow = inner.observe_shadow
    monkeypatch.setattr(inner, "observe_shadow", lambda *counts: (seen.append(counts), observe_shadow(*counts)))
    before = list(inner.acceptance.trials)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert got == want
    assert not llm.engine.stats.get("spec_decode_num_drafts_total")  # 4 requests together: no drafts, and yet
    assert len(seen) >= (24 - K - 1) // SHADOW_EVERY - 1
    assert all(asked[0] > 0 for asked, *_ in seen)
    assert inner.acceptance.trials[0] > before[0]  # position 0's acceptance was measured


def test_draft_models_and_the_switch_take_no_shadow_and_fixed_k_ignores_it(tiny_llama_dir, monkeypatch) -> None:
    kw = {"progress": False, "kv_cache_memory_bytes": 4 << 20}
    monkeypatch.setenv("SPECSERVE_SHADOW_DRAFTS", "0")
    assert LLM(model=str(tiny_llama_dir), **kw, speculative_config=SPEC).engine.spec.shadow is None
    monkeypatch.delenv("SPECSERVE_SHADOW_DRAFTS")
    fixed = LLM(model=str(tiny_llama_dir), **kw, speculative_config={**SPEC, "adaptive": False})
    fixed.generate(PROMPTS, GREEDY)  # a fixed k has no observe_shadow: the samples go nowhere, nothing fails
    draft = LLM(model=str(tiny_llama_dir), **kw,
                speculative_config={"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": K})
    assert draft.engine.spec.shadow is None
