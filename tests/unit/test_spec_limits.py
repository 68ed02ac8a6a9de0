"""vLLM's speculative_config limits: disable_by_batch_size (no drafts while more than N requests run; at
or below N the configured controller chooses) and max_model_len (no drafts for a request past that
length); greedy output unchanged either way."""

from __future__ import annotations

from specserve import LLM, SamplingParams
from specserve.config import SpeculativeConfig
from specserve.speculative.control import (
    FixedController,
    TableController,
    build_controller,
)


def test_fixed_or_table_from_the_config() -> None:
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False, disable_by_batch_size=2)
    ctl = build_controller(cfg, costs=None)
    assert isinstance(ctl, FixedController) and not ctl.follows_load
    assert [ctl.choose(b) for b in (1, 2, 3, 64)] == [4, 4, 4, 4]  # the limit is the decoder's
    table = SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=4,
        disable_by_batch_size=3,
        num_speculative_tokens_per_batch_size=((1, 1, 4), (2, 8, 2)),
    )
    ctl = build_controller(table, costs=None)
    assert isinstance(ctl, TableController) and ctl.follows_load
    assert [ctl.choose(b) for b in (1, 2, 3, 9)] == [4, 2, 2, 0]


def test_no_drafts_above_the_limit(tiny_llama_dir) -> None:
    """Four requests of different lengths: while more than two run nothing is drafted, then the last
    two draft; the same greedy tokens as without speculation."""
    motif = [11, 42, 7, 99, 23]
    prompts = [{"prompt_token_ids": motif * (2 + r) + [3 + r]} for r in range(4)]
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 10 * r, ignore_eos=True) for r in range(4)]
    plain = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    drafts = {}
    for limit in (None, 2):
        spec = {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "adaptive": False,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        }
        if limit is not None:
            spec["disable_by_batch_size"] = limit
        llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20, speculative_config=spec)
        chosen = []
        real = llm.engine.spec.choose
        llm.engine.spec.choose = lambda b, real=real, chosen=chosen: chosen.append((b, real(b))) or chosen[-1][1]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
        drafts[limit] = llm.engine.stats.get("spec_decode_num_draft_tokens_total")
        if limit is not None:
            assert all(k == 0 for b, k in chosen if b > limit) and any(k > 0 for b, k in chosen if b <= limit)
    assert 0 < drafts[2] < drafts[None]


def test_no_drafts_past_the_speculative_max_model_len(tiny_llama_dir) -> None:
    """A draft model with max_model_len 40: a 20-token prompt drafts until its request nears 40 tokens,
    then decodes plainly to 60; the same tokens as without speculation, fewer drafts than unlimited."""
    prompt = {"prompt_token_ids": [5 + (7 * i) % 300 for i in range(20)]}
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20)
    want = plain.generate(prompt, params)[0].outputs[0].token_ids
    drafts = {}
    for limit in (None, 40):
        spec = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3, "adaptive": False}
        if limit is not None:
            spec["max_model_len"] = limit
        llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20, speculative_config=spec)
        assert llm.generate(prompt, params)[0].outputs[0].token_ids == want
        drafts[limit] = llm.engine.stats.get("spec_decode_num_draft_tokens_total")
        if limit is not None:
            assert llm.engine.spec.proposer.max_len == limit  # the draft's own window
    # Drafting covers ~20 of the 40 new tokens with the limit, all of them without.
    assert 0 < drafts[40] < drafts[None]
