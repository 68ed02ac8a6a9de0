"""Prompts apart (scheduler/scheduler.py prefill_apart): new requests' short prompts arriving beside a
decoding batch run in steps of their own, in pieces, and their last token joins a decoding step. The same
greedy tokens as the usual mixed steps, without speculation, with n-gram and with a draft model,
synchronous and asynchronous; the steps apart really ran and held no decode row."""
from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.scheduler.scheduler import PIECE_MAX_SEQS, PIECES
from specserve.spec.adaptive import AdaptiveController
from specserve.spec.eagle import EagleProposer
from specserve.spec.eagle_head import make_random_head_dir

SPECS = {"none": None,
         "ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
         "draft_model": {"method": "draft_model"},
         "eagle3": {"method": "eagle3"}}  # a random head: takes the prompts' target features as they run
PIECE = 16


def _prompt(seed: int, n: int) -> list[int]:
    return [5 + (7 * i + 13 * seed) % 300 for i in range(n)]


# (step at which it arrives, prompt): 4 decoding from the start, then arrivals alone or in pairs (apart),
# a burst of three (the usual mixed step), and one too long for pieces (the usual chunk).
ARRIVALS = [(0, _prompt(0, 20)), (0, _prompt(1, 33)), (0, _prompt(2, 9)), (0, _prompt(3, 40)),
            (3, _prompt(4, 50)), (12, _prompt(5, 17)), (12, _prompt(6, 2)), (22, _prompt(7, 30)),
            (30, _prompt(8, 41)), (30, _prompt(9, 25)), (30, _prompt(10, 12)),
            (40, _prompt(11, PIECES * PIECE + 30))]
ALONE = ("r4", "r7")  # arrive alone beside a decoding batch


def _run(llm: LLM, apart: bool, max_tokens: int = 64) -> tuple[dict[str, list[int]], list]:
    eng = llm.engine
    eng.scheduler.prefill_piece = PIECE  # no prefill graphs on the CPU: as where they were captured
    eng.scheduler.prefill_apart = apart
    eng.stream_outputs = False
    steps = []
    real = eng.scheduler.schedule

    def spy():
        out = real()
        steps.append((out.apart, [(s.request.request_id, s.num_new_tokens, s.request.num_output_tokens,
                                   s.request.num_tokens - s.request.num_computed_tokens) for s in out.scheduled]))
        return out

    eng.scheduler.schedule = spy
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    done: dict[str, list[int]] = {}
    pending = list(enumerate(ARRIVALS))
    step = 0
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt) = pending.pop(0)
            eng.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
        for out in eng.step():
            done[out.request_id] = out.outputs[0].token_ids
        step += 1
        assert step < 2000
    eng.kv.check_integrity()
    return done, steps


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("method", list(SPECS))
def test_prompts_apart_give_the_same_tokens(tiny_llama_dir, tmp_path, monkeypatch, method,
                                            async_scheduling) -> None:
    spec = SPECS[method]
    if spec is not None:
        spec = {**spec, "num_speculative_tokens": 3, "adaptive": method == "ngram"}
        if method == "draft_model":
            spec["model"] = str(tiny_llama_dir)
        if method == "eagle3":
            monkeypatch.setattr(EagleProposer, "step_graphs", "eager")
            spec["model"] = str(make_random_head_dir(str(tiny_llama_dir), tmp_path / "head", "eagle3"))
    told: list[tuple[int, int]] = []  # what the adaptive controller heard of steps apart
    monkeypatch.setattr(AdaptiveController, "observe_apart",
                        lambda self, tokens, started: told.append((tokens, started)))
    runs = {}
    for apart in (False, True):
        llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=8 << 20,
                  enable_prefix_caching=False, speculative_config=spec, async_scheduling=async_scheduling)
        runs[apart] = _run(llm, apart)
    (want, plain_steps), (got, apart_steps) = runs[False], runs[True]
    assert len(want) == len(ARRIVALS) and got == want
    assert not any(a for a, _ in plain_steps)
    apart = [entries for a, entries in apart_steps if a]
    assert {rid for entries in apart for rid, *_ in entries} >= set(ALONE)
    for entries in apart:
        assert len(entries) <= PIECE_MAX_SEQS
        # prompt pieces only: no decode row, no piece over PIECE, never a prompt's last token
        assert all(out == 0 and 1 <= n <= PIECE and n < left for _, n, out, left in entries), entries
    if method == "ngram":  # (adaptive) each step apart reported, its tokens, the prompts it started
        assert [t for t, _ in told] == [sum(n for _, n, *_ in entries) for entries in apart]
        assert sum(s for _, s in told) == len({rid for entries in apart for rid, *_ in entries})
    else:
        assert not told


def test_a_burst_or_a_long_prompt_runs_as_usual(tiny_llama_dir) -> None:
    """Three prompts at once (more than PIECE_MAX_SEQS) and one longer than PIECES pieces take the usual
    mixed step; the prompts that do come apart leave the decoding batch steps of its own."""
    llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=8 << 20, enable_prefix_caching=False)
    _, steps = _run(llm, True)
    mixed_chunks = [n for a, entries in steps if not a for _, n, out, left in entries if out == 0 and n > 1]
    assert PIECES * PIECE + 30 in mixed_chunks  # the long prompt, whole
    assert any(n > PIECE for n in mixed_chunks if n != PIECES * PIECE + 30)  # the burst, whole prompts
    # Between two steps apart the decoding batch ran (without the prompts that were apart).
    flags = [a for a, _ in steps]
    assert any(flags[i] and not flags[i + 1] and flags[i + 2] for i in range(len(flags) - 2))


def test_prompts_apart_with_preemption(tiny_llama_dir) -> None:
    """A pool of 16 blocks of 16 (the longest request needs 8): requests are preempted between steps apart
    and decoding steps; the same tokens as the usual steps in a large pool."""
    plain = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=8 << 20, enable_prefix_caching=False)
    want, _ = _run(plain, False, max_tokens=32)
    block = plain.engine.runner.spec.bytes_per_block
    llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=16 * block, enable_prefix_caching=False)
    got, steps = _run(llm, True, max_tokens=32)
    assert got == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert any(a for a, _ in steps)
