"""Scheduler budgets: token budget, max_num_seqs, chunked prefill, FCFS, lookahead."""

from __future__ import annotations

from specserve.kv.manager import KVCacheManager
from specserve.sampling_params import SamplingParams
from specserve.scheduler.request import Request
from specserve.scheduler.scheduler import Scheduler


def _sched(**kw) -> Scheduler:
    kv = KVCacheManager(kw.pop("num_blocks", 64), 4, kw.pop("prefix", True))
    return Scheduler(kv, kw.pop("max_num_seqs", 4), kw.pop("budget", 10), kw.pop("max_model_len", 256), **kw)


def _req(rid: str, n: int) -> Request:
    base = 1000 * (1 + sum(map(ord, rid)))  # distinct tokens per request: no accidental prefix hits
    return Request(rid, list(range(base, base + n)), SamplingParams(max_tokens=8), 8)


def test_token_budget_and_chunked_prefill():
    s = _sched(budget=10)
    for i, n in enumerate([7, 6, 3]):
        s.add_request(_req(f"r{i}", n))
    out = s.schedule()
    assert [x.num_new_tokens for x in out.scheduled] == [7, 3]  # r1 chunked to the remaining budget
    assert out.num_batched_tokens <= 10
    assert [x.samples for x in out.scheduled] == [True, False]
    for x in out.scheduled:
        s.update_computed(x, 0)
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("r1", 3), ("r2", 3)]


def test_max_num_seqs_and_fcfs():
    s = _sched(max_num_seqs=2, budget=100)
    for i in range(4):
        s.add_request(_req(f"r{i}", 3))
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["r0", "r1"]
    assert s.num_waiting == 2


def test_no_chunking_waits_for_budget():
    s = _sched(budget=5, enable_chunked_prefill=False)
    s.add_request(_req("big", 4))
    s.add_request(_req("next", 4))
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["big"]


def test_lookahead_slots_reserved():
    s = _sched(budget=100, num_lookahead_tokens=5)
    s.add_request(_req("r", 4))
    s.schedule()
    # 4 tokens + 5 lookahead = 9 slots = 3 blocks of 4
    assert len(s.kv.block_ids("r")) == 3


def test_preemption_frees_latest_and_requeues_first():
    s = _sched(num_blocks=4, budget=100)
    a, b = _req("a", 8), _req("b", 7)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    for x in out.scheduled:
        s.update_computed(x, 0)
    a.append_output_tokens([9])  # a needs a third block; none free -> b is preempted
    out = s.schedule()
    assert [p.request_id for p in out.preempted] == ["b"]
    assert s.waiting[0] is b and b.num_computed_tokens == 0
    assert [x.request.request_id for x in out.scheduled] == ["a"]
    s.kv.check_integrity()


def test_num_spec_tokens_counts_the_scheduled_drafts_also_after_a_preemption():
    """SchedulerOutput.num_spec_tokens (what the adaptive controller reads every step) is the sum over
    the scheduled entries: drafts cut by the budget count as cut, and a step that preempts a request
    counts only the entries it kept."""
    s = _sched(num_blocks=6, budget=100)
    a, b = _req("a", 6), _req("b", 6)
    s.add_request(a)
    s.add_request(b)
    for x in s.schedule().scheduled:  # 2 blocks each
        s.update_computed(x, 0)
    a.append_output_tokens([1])
    b.append_output_tokens([2])
    a.spec_token_ids, b.spec_token_ids = [5], [8]
    out = s.schedule()  # 8 slots each: still 2 blocks each
    assert not out.preempted
    assert [x.num_spec_tokens for x in out.scheduled] == [1, 1] and out.num_spec_tokens == 2
    for x in out.scheduled:
        s.update_computed(x, x.num_spec_tokens)  # every draft rejected
    a.append_output_tokens([3] * 6)  # 13 tokens + 2 drafts: 4 blocks, which only b's give back
    a.spec_token_ids = [5, 6]
    b.spec_token_ids = [8, 9]
    out = s.schedule()
    assert [p.request_id for p in out.preempted] == ["b"]
    assert [x.request.request_id for x in out.scheduled] == ["a"]
    assert out.num_spec_tokens == sum(x.num_spec_tokens for x in out.scheduled) == 2
    tight = _sched(budget=3)
    r = _req("r", 2)
    tight.add_request(r)
    for x in tight.schedule().scheduled:
        tight.update_computed(x, 0)
    r.append_output_tokens([1])
    r.spec_token_ids = [4, 5, 6]
    out = tight.schedule()  # the budget holds the new token and 2 of the 3 drafts
    assert out.scheduled[0].num_spec_tokens == 2 == out.num_spec_tokens


def _steps(s: Scheduler) -> list[list[tuple[str, int]]]:
    """Schedule until nothing is left to compute (each step's tokens counted computed, no sampling)."""
    steps = []
    while True:
        out = s.schedule()
        todo = [
            (x.request.request_id, x.num_new_tokens)
            for x in out.scheduled
            if x.request.num_computed_tokens < x.request.num_tokens
        ]
        if not todo:
            return steps
        steps.append(todo)
        for x in out.scheduled:
            s.update_computed(x, 0)


def test_short_prompts_go_in_graph_pieces():
    """With prefill graphs of 16 tokens: a prompt of 17-64 tokens goes 16 at a time while at most two
    requests are live; a longer one, a third live request or prompt scoring keep the whole chunk."""
    s = _sched(budget=100, num_blocks=128)
    s.prefill_piece = 16
    s.add_request(_req("a", 50))
    assert _steps(s) == [[("a", 16)], [("a", 16)], [("a", 16)], [("a", 2)]]
    s = _sched(budget=100, num_blocks=128)
    s.prefill_piece = 16
    s.add_request(_req("a", 20))
    s.add_request(_req("b", 40))  # two live: both in pieces, in the same steps
    assert _steps(s) == [[("a", 16), ("b", 16)], [("a", 4), ("b", 16)], [("b", 8)]]
    s = _sched(budget=100, num_blocks=128)
    s.prefill_piece = 16
    s.add_request(_req("long", 65))  # more than 4 pieces: one chunk
    assert _steps(s) == [[("long", 65)]]
    s = _sched(budget=100, num_blocks=128)
    s.prefill_piece = 16
    for rid in ("a", "b", "c"):  # three live requests: no graph holds the step anyway
        s.add_request(_req(rid, 20))
    assert _steps(s) == [[("a", 20), ("b", 20), ("c", 20)]]
    s = _sched(budget=100, num_blocks=128)
    s.prefill_piece = 16
    scored = Request("p", list(range(500, 530)), SamplingParams(max_tokens=8, prompt_logprobs=1), 8)
    scored.prompt_logprobs = []  # as the engine admits it: prompt tokens to score
    s.add_request(scored)
    assert _steps(s) == [[("p", 30)]]
    s = _sched(budget=100, num_blocks=128)  # no prefill graphs: as before
    s.add_request(_req("a", 50))
    assert _steps(s) == [[("a", 50)]]
