"""bench/sweep_point.merge_points: a point run in parts (controller_sweep --interleave) reports what one
run of all its requests would: throughput over the summed time, percentiles over every request and
token gap, acceptance over every draft."""
from __future__ import annotations

import random
import sys
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
