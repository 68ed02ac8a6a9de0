"""--batch-invariant end to end on the tiny model: the engine picks the mode's ops and attention, and
greedy output is the same with and without ngram speculation, all prompts at once or one by one."""

from __future__ import annotations

import random

import pytest
import torch

from specserve import LLM, SamplingParams


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    motif = [rng.randrange(10, 300) for _ in range(5)]
    return [motif * 4, [rng.randrange(10, 300) for _ in range(30)], motif + [9] + motif, [42], motif * 2 + [3, 4]]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """(token ids, each token's logprob) per prompt, greedy."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    return [(list(o.token_ids), [e[t].logprob for t, e in zip(o.token_ids, o.logprobs)]) for o in outs]


@pytest.fixture
def one_thread():
    """Many small GEMMs: one thread avoids the spin-waits that make them slow on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_greedy_same_with_and_without_speculation(tiny_llama_dir, one_thread, batch_invariant):
    """Tokens and their logprobs bit for bit (float32 on the CPU). Without the mode the tokens agree
    on this tiny model too (wide greedy margins) but the logprobs do not: the check can fail."""
    common = dict(model=str(tiny_llama_dir), progress=False, batch_invariant=batch_invariant)
    plain = LLM(**common)
    assert (plain.engine.runner.backend.name == "torch_batch_invariant") == batch_invariant
    together = _generate(plain, _prompts())
    ngram = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, "num_speculative_tokens": 3}
    spec = LLM(**common, speculative_config={**ngram, "adaptive": False})
    runs = {"one by one": [_generate(plain, [p])[0] for p in _prompts()], "ngram": _generate(spec, _prompts())}
    assert spec.engine.stats.get("spec_decode_num_accepted_tokens_total") > 0  # drafts were verified
    for got in runs.values():
        assert [ids for ids, _ in got] == [ids for ids, _ in together]
    same = [got == together for got in runs.values()]
    assert all(same) if batch_invariant else not all(same)
