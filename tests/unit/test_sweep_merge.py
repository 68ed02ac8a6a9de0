"""bench/sweep_point.merge_points: a point run in parts (controller_sweep --interleave) reports what one
run of all its requests would: throughput over the summed time, percentiles over every request and
token gap, acceptance over every draft."""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from sweep_point import merge_points, output_lengths, percentiles, steady_window  # noqa: E402


def _part(rng: random.Random, num_requests: int, seconds: float, spec: tuple[int, int, int] | None) -> dict:
    """A run_point-shaped row with random per-request records (TTFT, TPOT, E2EL ms, tokens)."""
    reqs = [[rng.uniform(5, 50), rng.uniform(1, 3), rng.uniform(200, 400), rng.randint(100, 256)]
            for _ in range(num_requests)]
    itls = [rng.uniform(0.5, 6) for _ in range(5 * num_requests)]
    row = {"num_requests": num_requests, "output_len": 256, "seconds": seconds, "steps": 10 * num_requests,
           "output_tokens": sum(r[3] for r in reqs), "tokens_per_s": sum(r[3] for r in reqs) / seconds,
           "requests": reqs, "_itls_ms": list(itls)}
    if spec is not None:
        row["_spec"] = spec
    return row, itls


def test_parts_merge_into_one_point() -> None:
    rng = random.Random(3)
    (a, itls_a), (b, itls_b) = _part(rng, 8, 1.5, (40, 120, 60)), _part(rng, 5, 0.9, (25, 80, 20))
    reqs = a["requests"] + b["requests"]
    merged = merge_points([a, b])
    assert merged["seconds"] == pytest.approx(2.4)
    assert merged["num_requests"] == 13 and merged["steps"] == 130
    assert merged["tokens_per_s"] == pytest.approx(sum(r[3] for r in reqs) / 2.4)
    assert merged["latency_ms"]["ttft"] == percentiles([r[0] for r in reqs])
    assert merged["latency_ms"]["tpot"] == percentiles([r[1] for r in reqs])
    assert merged["latency_ms"]["e2el"] == percentiles([r[2] for r in reqs])
    assert merged["latency_ms"]["itl"] == percentiles(itls_a + itls_b)
    assert merged["acceptance_rate"] == pytest.approx(80 / 200)
    assert merged["mean_acceptance_length"] == pytest.approx(1 + 80 / 65)
    assert [r["seconds"] for r in merged["runs"]] == [1.5, 0.9]
    assert "_itls_ms" not in merged and "_spec" not in merged


def test_step_profile_names_the_steps_a_stalled_run_spent_its_time_in() -> None:
    """sweep_point.step_profile: a run's step wall times as a median, a total and the slowest steps
    (ms, index, requests running); merge_points keeps each run's profile."""
    from sweep_point import step_profile

    steps = [(5.0 + 0.01 * i, i, 256) for i in range(150)]
    steps[40] = (400.0, 40, 250)  # one step took the stall
    prof = step_profile(steps)
    assert prof["p50"] == pytest.approx(5.75, abs=0.01)
    assert prof["total"] == pytest.approx(sum(t for t, _, _ in steps), abs=0.1)
    assert prof["slowest"][0] == [400.0, 40, 250] and prof["slowest"][1][1] == 149 and len(prof["slowest"]) == 3
    assert step_profile([]) == {"p50": None, "total": 0, "slowest": []}
    rng = random.Random(5)
    (a, _), (b, _) = _part(rng, 4, 1.0, None), _part(rng, 4, 1.1, None)
    a["steps_ms"], b["steps_ms"] = prof, step_profile(steps[:10])
    assert [r["steps_ms"] for r in merge_points([a, b])["runs"]] == [prof, step_profile(steps[:10])]


def test_step_profile_tells_full_batch_steps_apart() -> None:
    """With the point's concurrency, step_profile also gives the median of the steps that ran a full batch:
    two parts with the same medians overall but slower full-batch steps ran the same steps slower."""
    from sweep_point import step_profile

    fill = [(20.0, i, i + 1) for i in range(31)]  # prompt-heavy steps while the batch fills
    full = [(3.0 + 0.001 * i, 31 + i, 32) for i in range(60)]
    prof = step_profile(fill + full, full=32)
    assert prof["full_steps"] == 60 and prof["full_p50"] == pytest.approx(3.03, abs=0.001)
    assert step_profile(fill, full=32)["full_p50"] is None
    assert "full_p50" not in step_profile(fill + full)


def test_machine_state_is_carried_per_part() -> None:
    """machine_state gives the run's process CPU seconds and the load average (and the GPU's clocks where
    nvidia-smi is there); merge_points keeps each part's beside its step profile."""
    from sweep_point import machine_state

    state = machine_state(1.23456)
    assert state["cpu_s"] == 1.235 and state["load1"] >= 0.0
    rng = random.Random(6)
    (a, _), (b, _) = _part(rng, 4, 1.0, None), _part(rng, 4, 1.1, None)
    a["machine"], b["machine"] = {"cpu_s": 1.0, "load1": 0.5}, {"cpu_s": 2.0, "load1": 0.7}
    assert [r["machine"]["cpu_s"] for r in merge_points([a, b])["runs"]] == [1.0, 2.0]
    (one, _), = [_part(rng, 4, 1.0, None)]
    one["machine"] = {"cpu_s": 3.0, "load1": 0.1}
    assert merge_points([one])["machine"] == {"cpu_s": 3.0, "load1": 0.1}


def test_slow_runs_are_told_with_their_slowest_steps() -> None:
    """sweep_point.slow_runs: a run of a point at 1.15x its median run or more gets a line with its
    slowest steps beside a typical run's; a point of fewer than 3 runs has no median to judge by."""
    from sweep_point import slow_runs

    typical = {"p50": 5.0, "total": 740.0, "slowest": [[12.0, 3, 256]]}
    stalled = {"p50": 5.1, "total": 1150.0, "slowest": [[400.0, 40, 250]]}
    runs = [{"seconds": s, "steps_ms": typical} for s in (0.75, 0.76, 0.74)]
    assert slow_runs(runs) == []
    lines = slow_runs(runs + [{"seconds": 1.16, "steps_ms": stalled}])
    assert len(lines) == 1 and lines[0].startswith("slow run 3: 1.160 s (median 0.760)")
    assert "[[400.0, 40, 250]]" in lines[0] and "[[12.0, 3, 256]]" in lines[0]
    assert slow_runs(runs[:2] + [{"seconds": 1.16, "steps_ms": stalled}]) != []
    assert slow_runs([{"seconds": 1.0, "steps_ms": typical}, {"seconds": 2.0, "steps_ms": stalled}]) == []


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_rounds_balance_positions_and_predecessors(n: int) -> None:
    """sweep_point.round_order (a Williams design): over n rounds each of n policies runs once in each
    position; each follows every other equally often over n rounds (n even) or 2n rounds (n odd), so
    the adaptive policy does not always run right after the same fixed k."""
    from sweep_point import round_order

    names = [f"p{i}" for i in range(n)]
    rounds = [round_order(names, r) for r in range(n)]
    assert all(sorted(r) == names for r in rounds)
    for pos in range(n):
        assert sorted(r[pos] for r in rounds) == names
    full = rounds if n % 2 == 0 else [round_order(names, r) for r in range(2 * n)]
    pairs = [(a, b) for r in full for a, b in zip(r, r[1:])]
    every = [(a, b) for a in names for b in names if a != b]
    assert sorted(pairs) == sorted(every * (1 if n % 2 == 0 else 2))  # every ordered pair equally often
    assert round_order(names, 2 * n + 1) == round_order(names, 1) and round_order([], 3) == []


def test_one_part_is_the_run_itself() -> None:
    row, itls = _part(random.Random(4), 6, 1.2, None)
    expected_rate = row["tokens_per_s"]
    merged = merge_points([row])
    assert merged["tokens_per_s"] == pytest.approx(expected_rate)
    assert merged["latency_ms"]["itl"] == percentiles(itls)
    assert "runs" not in merged and "acceptance_rate" not in merged


def test_an_adaptive_policy_traces_its_choices_and_steps() -> None:
    """sweep_policy.Policy.trace: what an adaptive controller chose (with the best k it saw and whether it
    explored) and what every step measured, in order (the JSON keeps it up to concurrency 32)."""
    from sweep_policy import Policy

    from specserve.config import SpeculativeConfig
    from specserve.spec.adaptive import AdaptiveController, SpecStepStats

    ctrl = AdaptiveController(SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    policy = Policy("adaptive", ctrl, None)
    ks, seen = [], []
    for _ in range(3):
        ks.append(ctrl.choose(4))
        rates = ctrl.last.tokens_per_s
        k1 = max(range(1, 4), key=rates.__getitem__)  # the fastest k > 0 as priced
        seen.append([ctrl.last.best_k, int(ctrl._pending.exploring), 0, round(rates[0], 1), k1,
                     round(rates[k1], 1), round(ctrl.last.expected_tokens[k1], 3),
                     round(1e3 * ctrl.last.step_seconds[k1], 3), round(1e3 * ctrl.last.step_seconds[0], 3)])
    ctrl.observe(SpecStepStats(4, 4, 0, 0.002))
    time.sleep(0.01)
    ctrl.observe(SpecStepStats(4, 4 + 300, 0, 0.012))  # two new requests' prompts (150 tokens each) besides
    trace = policy.trace()
    assert trace["choices"] == [[4, k, *s] for k, s in zip(ks, seen)]
    assert [st[:-1] for st in trace["steps"]] == [[-1, 2.0, 0.0, 4, 4, 0, 0.0, 0], [-1, 12.0, 0.0, 4, 4, 0, 0.0, 300]]
    # the wall time between observations: none before the first, the sleep (at least) before the second
    assert trace["steps"][0][-1] == 0.0 and trace["steps"][1][-1] >= 10.0
    policy.clear()
    assert policy.trace() == {"choices": [], "steps": []}


def test_a_slow_proposal_reports_its_batch_and_the_catch_up_predicted_for_it() -> None:
    """sweep_policy.Policy.slow_proposals: a stall's batch size, the tokens the proposer had not seen and
    the catch-up the controller predicted for them (the pair's 374 ms stall at 256 requests had none of
    these in the sixteenth session's JSON)."""
    from types import SimpleNamespace

    from sweep_policy import Policy

    from specserve.spec.adaptive import ProposalStats, SpecStepStats

    class Scripted:  # the controller interface Policy records: choose / observe, last / _pending / costs
        def __init__(self) -> None:
            self.last = SimpleNamespace(best_k=1, propose_seconds=[0.0, 0.005])
            self._pending = SimpleNamespace(exploring=False, cold=True, unseen_tokens=13000.0)
            self.costs = SimpleNamespace(catch_up_seconds=lambda tokens, warm, b: 0.015 if tokens == 13000.0 else 0.0)

        def choose(self, batch_size: int) -> int:
            return 1

        def observe(self, step: SpecStepStats) -> None:
            self._pending = SimpleNamespace(exploring=False, cold=False, unseen_tokens=0.0)

    ctrl = Scripted()
    policy = Policy("adaptive", ctrl, None)
    for seconds in (0.374, 0.005, 0.005, 0.005):
        k = ctrl.choose(57)
        ctrl.observe(SpecStepStats(57, 57 * (k + 1), 57 * k, 0.004, proposal=ProposalStats.measure(k, [k] * 57,
                                                                                                   [k] * 57, seconds)))
    assert policy.slow_proposals() == [[0, 1, 374.0, -1, 57, 13000, 15.0]]
    assert [e[0] for e in policy.step_extras] == [57] * 4 and policy.step_extras[1][1:4] == (0.0, 0.0, 0)


def test_dropping_a_warm_up_keeps_every_record_aligned() -> None:
    """controller_sweep drops what a policy recorded during the warm-up between two parts of a point:
    the choices with their batch sizes and beliefs, the steps with their extras, all from the same mark."""
    from sweep_policy import Policy

    from specserve.config import SpeculativeConfig
    from specserve.spec.adaptive import AdaptiveController, SpecStepStats

    ctrl = AdaptiveController(SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    policy = Policy("adaptive", ctrl, None)

    def one(batch: int) -> None:
        ctrl.choose(batch)
        ctrl.observe(SpecStepStats(batch, batch, 0, 0.002))

    one(4)
    mark = policy.mark()
    one(8)  # the warm-up
    policy.drop_after(mark)
    one(2)
    trace = policy.trace()
    assert [c[0] for c in trace["choices"]] == [4, 2] and [s[4] for s in trace["steps"]] == [4, 2]
    assert len(policy.beliefs) == len(policy.choices) == len(policy.batches) == 2
    assert len(policy.step_extras) == len(policy.steps) == 2


def test_the_steady_window_ends_where_the_queue_ran_dry() -> None:
    """Two requests in flight, four in all: the window runs from the first submission to the last (when
    the slower first request finished); the drain after it, where one request runs alone, is left out."""
    arrival = {"a": 10.0, "b": 10.0, "c": 11.0, "d": 11.5}  # c replaced a (done at 11.0), d replaced b
    finished = {"a": 11.0, "b": 11.5, "c": 12.0, "d": 12.6}
    events = [("a", 10.2, 1), ("b", 10.2, 1), ("a", 11.0, 9), ("b", 11.0, 4), ("c", 11.2, 1), ("b", 11.5, 5),
              ("c", 11.5, 3), ("d", 11.7, 1), ("c", 12.0, 6), ("d", 12.6, 9)]
    seconds, tokens, done = steady_window(arrival, finished, events, 2)
    assert seconds == pytest.approx(1.5)
    assert tokens == 1 + 1 + 9 + 4 + 1 + 5 + 3  # every token up to 11.5, none of the drain's
    assert done == 2


def test_no_steady_window_without_a_replacement() -> None:
    """One wave (at most c requests): nothing was replaced, so the whole run is the measure."""
    arrival = {"a": 1.0, "b": 1.0}
    assert steady_window(arrival, {"a": 2.0, "b": 3.0}, [("a", 2.0, 5), ("b", 3.0, 5)], 2) is None


def test_windowed_parts_merge_their_windows() -> None:
    """Parts measured over their steady windows merge by window time and tokens; the whole runs' time
    is kept beside it (what the sweep's time budget predicts from)."""
    rng = random.Random(5)
    (a, _), (b, _) = _part(rng, 8, 1.0, None), _part(rng, 8, 0.5, None)
    a.update(run_seconds=1.4, requests_per_s=4 / 1.0, window="steady")
    b.update(run_seconds=0.9, requests_per_s=5 / 0.5, window="steady")
    merged = merge_points([a, b])
    assert merged["seconds"] == pytest.approx(1.5) and merged["run_seconds"] == pytest.approx(2.3)
    assert merged["requests_per_s"] == pytest.approx(9 / 1.5)
    assert merged["window"] == "steady"
    assert [r["run_seconds"] for r in merged["runs"]] == [1.4, 0.9]


def test_the_decode_price_names_each_source() -> None:
    """controller_sweep.decode_price: the bucket's own decode fit, the pooled decode and verify fits and
    the clean-decode count, as the controller holds them (a k = 0 priced far above a real decode step
    shows which one it came from)."""
    from sweep_beliefs import decode_price

    from specserve.config import SpeculativeConfig
    from specserve.spec.adaptive import AdaptiveController, SpecStepStats

    ctrl = AdaptiveController(SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    ctrl.costs.clock = iter(i * 0.002 for i in range(1000)).__next__  # a step apart: no gap, no pause
    for _ in range(6):
        ctrl.observe(SpecStepStats(16, 16, 0, 0.002))
    price = decode_price(ctrl.costs, 16)
    assert price["local_ms"] is not None and abs(price["local_ms"] - 2.0) < 0.1
    assert price["local_weight"] >= 1 and price["pure_decode_weight"] > 1
    assert price["verify_fit_ms"] is None  # no verify step was seen
    assert decode_price(ctrl.costs, 64)["local_ms"] is None  # another bucket has no fit of its own


def test_a_warm_up_trace_holds_only_what_came_after_its_mark() -> None:
    from sweep_policy import Policy

    from specserve.config import SpeculativeConfig
    from specserve.spec.adaptive import AdaptiveController, SpecStepStats

    ctrl = AdaptiveController(SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    policy = Policy("adaptive", ctrl, None)
    ctrl.choose(4)
    ctrl.observe(SpecStepStats(4, 4, 0, 0.002))
    mark = policy.mark()
    ctrl.choose(8)
    ctrl.observe(SpecStepStats(8, 8 + 100, 0, 0.009))
    warm = policy.trace_after(mark)
    assert [c[0] for c in warm["choices"]] == [8]
    assert [st[:-1] for st in warm["steps"]] == [[-1, 9.0, 0.0, 8, 8, 0, 0.0, 100]]
    assert len(policy.trace()["steps"]) == 2


def test_a_drafting_trace_keeps_only_drafting_choices_and_steps_with_their_indices() -> None:
    """Above concurrency 32 the JSON keeps only the choices with k > 0 and the steps verifying drafts."""
    from sweep_policy import Policy

    from specserve.config import SpeculativeConfig
    from specserve.spec.adaptive import AdaptiveController, ProposalStats, SpecStepStats, verify_counts

    ctrl = AdaptiveController(SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    policy = Policy("adaptive", ctrl, None)
    ks = [ctrl.choose(b) for b in (4, 4, 64)]
    plain = ProposalStats.measure(0, [], [], 0.0)
    ctrl.observe(SpecStepStats(4, 4, 0, 0.002, (), (), plain))
    counts = verify_counts([3] * 4, [2] * 4)
    ctrl.observe(SpecStepStats(4, 16, 12, 0.004, *counts, ProposalStats.measure(3, [3] * 4, [3] * 4, 0.001)))
    ctrl.observe(SpecStepStats(4, 4, 0, 0.002, (), (), plain))
    full, drafting = policy.trace(), policy.drafting_trace()
    assert [row[0] for row in full["steps"]] == [0, 3, 0]
    assert drafting["steps"] == [[1, *full["steps"][1]]]
    assert [c[0] for c in drafting["choices"]] == [i for i, k in enumerate(ks) if k > 0]
    assert [c[1:] for c in drafting["choices"]] == [c for c in full["choices"] if c[1] > 0]


def test_time_by_batch_sums_the_wall_time_between_observations_per_batch_size() -> None:
    """sweep_policy.Policy.time_by_batch: per batch size, steps, the ms between observations and the
    tokens, over a point's parts; a part starts afresh (the time since the policy's last part, while
    other policies ran, is no step's)."""
    from sweep_policy import Policy

    from specserve.config import SpeculativeConfig
    from specserve.spec.adaptive import SpecStepStats
    from specserve.spec.controller import FixedController

    ctrl = FixedController(SpeculativeConfig(method="ngram", num_speculative_tokens=2))
    policy = Policy("k=2", ctrl, None)
    for b in (4, 4, 3):
        ctrl.observe(SpecStepStats(b, b, 0, 0.001))
        time.sleep(0.005)
    mark = policy.mark()
    time.sleep(0.05)  # another policy's part
    policy.drop_after(mark)
    ctrl.observe(SpecStepStats(4, 4, 0, 0.001))
    got = policy.time_by_batch()
    assert list(got) == ["3", "4"] and got["3"][0] == 1 and got["4"][0] == 3
    assert got["3"][2] == 3 and got["4"][2] == 12
    assert 5.0 <= got["4"][1] < 25.0  # one gap of ~5 ms (the first step has none), none of the 50 ms
    assert got["3"][1] >= 5.0


def test_output_lengths_spread_around_the_mean_and_match_across_parts() -> None:
    """Without a spread every request asks for output_len; with one, lengths lie in [L(1-s), L(1+s)], vary
    (a closed loop must not stay in lockstep), average near L, and request i's length depends on i and the
    seed alone (every policy's part of a point runs the same requests)."""
    assert output_lengths(256, 0.0, 5, 0) == [256] * 5
    lengths = output_lengths(256, 0.5, 2000, 0)
    assert min(lengths) >= 128 and max(lengths) <= 384
    assert len(set(lengths)) > 100
    assert abs(sum(lengths) / len(lengths) - 256) < 8
    assert output_lengths(256, 0.5, 40, 0) == lengths[:40]
    assert output_lengths(256, 0.5, 40, 1) != lengths[:40]
    with pytest.raises(ValueError, match="output_len_spread"):
        output_lengths(256, 1.0, 3, 0)
