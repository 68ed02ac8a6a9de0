"""Seeded random requests under a k that follows the load (a controller whose k varies per step, a
batch size table): the same seed samples the same tokens alone, in a batch, and as without speculation.
The rejection sampler draws k uniforms per step from a request's generator, so such requests do not
draft; greedy requests in the same batch still do."""

from __future__ import annotations

import itertools

import pytest

from specserve import LLM, SamplingParams
from specserve.speculative.control import Controller

K = 3
SPECS = {
    "varying": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "table": {
        "method": "ngram",
        "num_speculative_tokens": K,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        "num_speculative_tokens_per_batch_size": [[1, 1, K], [2, 8, 1]],
    },
}
PROMPT = {"prompt_token_ids": [11, 42, 7, 99, 23] * 6}
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)


class _Cycling(Controller):
    """k from a fixed cycle, whatever the batch: a k that follows something other than the request."""

    def __init__(self, max_k: int) -> None:
        super().__init__(max_k)
        self.ks = itertools.cycle([max_k, 0, 1, max_k, 2])

    def choose(self, batch_size: int) -> int:
        return next(self.ks)


GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.mark.parametrize("name", list(SPECS))
def test_seeded_samples_do_not_follow_the_load(tiny_llama_dir, monkeypatch, name) -> None:
    kw = {"progress": False, "kv_cache_memory_bytes": 4 << 20, "enable_prefix_caching": False}
    plain = LLM(model=str(tiny_llama_dir), **kw)
    want = plain.generate(PROMPT, SEEDED)[0].outputs[0].token_ids
    llm = LLM(model=str(tiny_llama_dir), **kw, speculative_config=SPECS[name])
    spec = llm.engine.spec
    if name == "varying":  # k varies from step to step, as under changing load and timings
        spec.controller = _Cycling(K)
    assert spec.k_follows_load
    alone = llm.generate(PROMPT, SEEDED)[0].outputs[0].token_ids
    batch = llm.generate([PROMPT, PROMPT, {"prompt_token_ids": [5, 6, 7] * 5}], [SEEDED, GREEDY, GREEDY])
    assert alone == want and batch[0].outputs[0].token_ids == want
    drafts = {m.name: m.value for m in llm.get_metrics() if not m.labels}["specserve:spec_decode_num_drafts_total"]
    assert drafts > 0  # the greedy requests drafted
    assert batch[1].outputs[0].token_ids == plain.generate(PROMPT, GREEDY)[0].outputs[0].token_ids


def test_fixed_k_keeps_drafting_seeded_requests(tiny_llama_dir) -> None:
    llm = LLM(
        model=str(tiny_llama_dir),
        progress=False,
        kv_cache_memory_bytes=4 << 20,
        speculative_config={**SPECS["varying"], "adaptive": False},
    )
    assert not llm.engine.spec.k_follows_load
    first = llm.generate(PROMPT, SEEDED)[0].outputs[0].token_ids
    drafts = {m.name: m.value for m in llm.get_metrics() if not m.labels}["specserve:spec_decode_num_drafts_total"]
    assert drafts > 0 and llm.generate(PROMPT, SEEDED)[0].outputs[0].token_ids == first


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
