"""Seeded random requests draft under any k: a fixed k of 1, 2 or 4, a k that varies per step (as the
adaptive controller's does under load), a batch size table. Their noise is keyed by (seed, output position),
so the same seed samples the same tokens at temperature 1 with and without speculation, alone and in a batch."""

from __future__ import annotations

import itertools

import pytest

from specserve import LLM, SamplingParams
from specserve.speculative.control import Controller

K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SPECS = {
    **{f"k={k}": {**NGRAM, "num_speculative_tokens": k, "adaptive": False} for k in (1, 2, 4)},
    "varying": NGRAM,
    "table": {**NGRAM, "num_speculative_tokens_per_batch_size": [[1, 1, K], [2, 8, 1]]},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 2, "adaptive": False},
}
PROMPT = {"prompt_token_ids": [11, 42, 7, 99, 23] * 6}
SEEDED = SamplingParams(
    temperature=1.0, top_k=4, seed=1234, max_tokens=32, ignore_eos=True
)  # top_k: tokens repeat, n-grams draft
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
KW = {"progress": False, "kv_cache_memory_bytes": 4 << 20, "enable_prefix_caching": False}


class _Cycling(Controller):
    """k from a fixed cycle, whatever the batch: a k that follows something other than the request."""

    def __init__(self, max_k: int) -> None:
        super().__init__(max_k)
        self.ks = itertools.cycle([max_k, 0, 1, max_k, 2])

    def choose(self, batch_size: int) -> int:
        return next(self.ks)


def _counters(llm: LLM) -> dict[str, float]:
    return {m.name.removeprefix("specserve:"): m.value for m in llm.get_metrics() if not m.labels}


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), **KW)
    return llm.generate(PROMPT, SEEDED)[0].outputs[0].token_ids, llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids


@pytest.mark.parametrize("name", list(SPECS))
def test_seeded_requests_draft_and_sample_as_without_speculation(tiny_llama_dir, plain, name) -> None:
    spec_config = dict(SPECS[name])
    if name == "draft_model":
        spec_config["model"] = str(tiny_llama_dir)  # the target as its own draft: drafts with probabilities
    llm = LLM(model=str(tiny_llama_dir), **KW, speculative_config=spec_config)
    if name == "varying":  # k varies from step to step, as under changing load and timings
        llm.engine.spec.controller = _Cycling(K)
    alone = llm.generate(PROMPT, SEEDED)[0].outputs[0].token_ids
    assert alone == plain[0]
    c = _counters(llm)
    # The seeded request alone drafted, and some drafts were accepted.
    assert c.get("spec_decode_num_drafts_total", 0) > 0 and c.get("spec_decode_num_accepted_tokens_total", 0) > 0
    if name == "draft_model":  # the draft races on the target's keyed noise: its own copy agrees (not ~1/3)
        rate = c["spec_decode_num_accepted_tokens_total"] / c["spec_decode_num_draft_tokens_total"]
        assert rate >= 0.9, rate
    batch = llm.generate([PROMPT, PROMPT, {"prompt_token_ids": [5, 6, 7] * 5}], [SEEDED, GREEDY, GREEDY])
    assert batch[0].outputs[0].token_ids == plain[0] and batch[1].outputs[0].token_ids == plain[1]


def test_every_position_is_exported_before_any_acceptance(tiny_llama_dir) -> None:
    """spec_decode_num_accepted_tokens_per_pos_total{position} has positions 0..k-1 at 0 from the start
    (dashboards see the series before the first acceptance; found by an independent check)."""
    llm = LLM(
        model=str(tiny_llama_dir),
        progress=False,
        kv_cache_memory_bytes=4 << 20,
        speculative_config={**SPECS["varying"], "num_speculative_tokens": 5},
    )
    per_pos = {
        m.labels["position"]: m.value
        for m in llm.get_metrics()
        if m.name.endswith("spec_decode_num_accepted_tokens_per_pos_total")
    }
    assert per_pos == {str(p): 0.0 for p in range(5)}
