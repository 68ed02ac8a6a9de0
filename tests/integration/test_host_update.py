"""Host work per step in Engine.update and Scheduler.schedule (issue 48): a request with no stop strings and
no grammar is detokenized when its output is built, not each step, and an offline step (stream_outputs
False) builds no output for unfinished requests; the outputs (streamed and final) are exactly those of
detokenizing every step. Timed part: a ratio of two timings in one process, best of N."""

from __future__ import annotations

import random
import sys
from collections import Counter
from pathlib import Path

import specserve.engine.engine as engine_module
from specserve import LLM, SamplingParams
from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.kv.manager import KVCacheManager
from specserve.runner.batch import tree_roots
from specserve.scheduler.request import Request
from specserve.scheduler.scheduler import ScheduledRequest, Scheduler, SchedulerOutput

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from host_step import engine_host_table  # noqa: E402

PROMPTS = ["numbers 0 1", "The quick brown", "def add(a, b):", "Unicode: caf", "Paris is"]


def _eager(*args, deferred: bool = False, **kw) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(*args, **kw)  # every step feeds the text (the behaviour before deferral)


def _params(stop_ids: list[int]) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=30),  # EOS may end it (its text hidden)
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=stop_ids),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=stop_ids, include_stop_str_in_output=True),
        SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=25, stop_token_ids=stop_ids, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=20, skip_special_tokens=False, ignore_eos=True),
    ]


def _run(llm: LLM, params: list[SamplingParams], stream: bool) -> list[tuple]:
    """Every output the engine returns, in order: (id, finished, [(text, ids, reason, stop_reason)])."""
    eng = llm.engine
    eng.stream_outputs = stream
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        eng.add_request(f"q{i}", prompt, p)
    seen = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            outs = [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in out.outputs]
            seen.append((out.request_id, out.finished, outs))
    return seen


def test_deferred_text_is_the_text_of_every_step(tiny_llama_dir, monkeypatch) -> None:
    # (no prefix caching: every run computes the same positions the same way)
    llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20, enable_prefix_caching=False)
    ref = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    common = Counter(t for o in ref for t in o.outputs[0].token_ids).most_common(3)
    stop_ids = [t for t, _ in common]  # tokens the model emits: the stop rules fire
    params = _params(stop_ids)
    runs = {}
    for stream in (False, True):
        runs[stream, "deferred"] = _run(llm, params, stream)
        with monkeypatch.context() as m:
            m.setattr(engine_module, "IncrementalDetokenizer", _eager)
            runs[stream, "eager"] = _run(llm, params, stream)
    for stream in (False, True):
        assert runs[stream, "deferred"] == runs[stream, "eager"]
    finals = [x for x in runs[True, "deferred"] if x[1]]
    assert sorted(finals) == sorted(runs[False, "deferred"])  # offline: the finished outputs, the same
    reasons = [c[2:] for _, _, outs in finals for c in outs]
    assert any(r[0] == "stop" and r[1] in stop_ids for r in reasons) and any(r[0] == "length" for r in reasons)
    assert len(runs[True, "deferred"]) > len(finals)  # streaming returned unfinished outputs too


def test_batched_token_count_is_the_sum_under_preemption() -> None:
    """schedule() counts num_batched_tokens from the budget left unless a preemption dropped entries."""
    rng = random.Random(0)
    kv = KVCacheManager(24, 4, True)
    sched = Scheduler(kv, 6, 20, 200)
    for i in range(12):
        base = 1000 * (i + 1)
        sched.add_request(Request(f"r{i}", list(range(base, base + rng.randint(1, 15))), SamplingParams(), 40))
    preempted = 0
    for _ in range(60):
        out = sched.schedule()
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled) <= 20
        assert not out.draft_trees or sched.draft_trees
        preempted += len(out.preempted)
        for s in out.scheduled:
            sched.update_computed(s, 0)
            if s.samples:
                s.request.append_output_tokens([rng.randrange(900)])
    assert preempted  # the pool is small: the loop preempted


def test_tree_scan_only_with_a_tree_shape(tiny_llm) -> None:
    req = Request("t", [1, 2, 3], SamplingParams(), 8)
    req.num_computed_tokens, req.spec_token_ids, req.spec_tree_parents = 2, [7, 8], [0, 0]
    out = SchedulerOutput([ScheduledRequest(req, 3, 2)], 3, 2)
    assert tree_roots(out) == [(0, [0, 0])]
    out.draft_trees = False
    assert tree_roots(out) == []
    assert tiny_llm.engine.spec is None and not tiny_llm.engine.scheduler.draft_trees


def test_offline_update_skips_output_work() -> None:
    """An offline step's update costs well under a streaming step's: no RequestOutput and no decoding for
    requests still running. At batch 1024 the ratio was ~0.65 before (update detokenized and stop-checked
    through the same per-request path either way) and is ~0.15 now (bench/host_step.py --engine-host).
    update itself stays linear in the batch (1024 vs 64: ~20x before and after; the per-request cost fell)."""
    (row,) = engine_host_table([1024], steps=8, rounds=3)
    assert row["update_ms"] < 0.4 * row["update_stream_ms"], row
