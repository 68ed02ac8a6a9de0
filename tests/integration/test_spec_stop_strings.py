"""A stop string inside a speculative step's accepted tokens: the output ends at the token that
completes it, as without speculation (text, token ids, finish and stop reason, usage). A model drafting
for itself has every draft accepted, so a step appends k + 1 tokens and most stop strings fall inside."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams

K = 4


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    kw = {"progress": False, "kv_cache_memory_bytes": 4 << 20}
    plain = LLM(model=str(tiny_llama_dir), **kw)
    spec = LLM(
        model=str(tiny_llama_dir),
        **kw,
        speculative_config={
            "method": "draft_model",
            "model": str(tiny_llama_dir),
            "num_speculative_tokens": K,
            "adaptive": False,
        },
    )
    return plain, spec


def test_stop_strings_inside_accepted_drafts(engines) -> None:
    plain, spec = engines
    full = plain.generate(["numbers 0 1"], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    text = full.outputs[0].text
    assert len(full.outputs[0].token_ids) == 30 and len(text) > 20
    stops = [text[a : a + n] for a, n in ((3, 2), (7, 3), (11, 1), (15, 4), (19, 2)) if text[a : a + n].strip()]
    assert len(stops) >= 3
    trimmed = 0
    for stop in stops:
        for include in (False, True):
            params = SamplingParams(
                temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop], include_stop_str_in_output=include
            )
            want, got = (llm.generate(["numbers 0 1"], params)[0].outputs[0] for llm in (plain, spec))
            assert got.text == want.text, stop
            assert got.token_ids == want.token_ids, stop
            assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason) == ("stop", stop)
            trimmed += len(got.token_ids) % (K + 1) != 0  # ended inside a step's accepted tokens
    assert trimmed > 0
    metrics = {m.name: m.value for m in spec.get_metrics() if not m.labels}
    assert metrics["specserve:spec_decode_num_accepted_tokens_total"] > 0
