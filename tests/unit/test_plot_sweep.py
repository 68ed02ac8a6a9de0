"""bench/plot_sweep.py: the closed-loop throughput (Little's law) and its table beside the measured one."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from plot_sweep import closed_loop_tps, markdown_tables, paired_ratios, verdicts  # noqa: E402


def _row(tps: float, e2e_ms: list[float], tokens: int = 100) -> dict:
    reqs = [[5.0, 1.0, e, tokens] for e in e2e_ms]
    return {"tokens_per_s": tps, "requests": reqs, "latency_ms": {m: {"p50": 1.0, "p99": 2.0}
                                                                  for m in ("tpot", "ttft", "e2el", "itl")}}


def _result() -> dict:
    # At c = 4: off's requests take 400 ms each (4 x 100 / 0.4 s = 1000 tok/s in a closed loop); the
    # adaptive policy's take 300 ms but its last one 900 ms (a drain the measured rate charged it).
    points = {"off": {"4": _row(1000.0, [400.0] * 8)}, "k=4": {"4": _row(900.0, [450.0] * 8)},
              "adaptive": {"4": _row(850.0, [300.0] * 7 + [900.0])}}
    return {"mode": "pair", "what": "test", "device": "cpu", "concurrency": [4], "policies": ["off", "k=4", "adaptive"],
            "points": points, "min_requests": 8, "max_k": 4,
            "config": {"output_len": 100, "high_from": 64, "output_len_high": 100}}


def test_closed_loop_rate_is_c_times_mean_tokens_over_mean_latency() -> None:
    assert closed_loop_tps(_row(0.0, [400.0] * 8), 4) == pytest.approx(1000.0)
    assert closed_loop_tps(_row(0.0, [300.0] * 7 + [900.0]), 4) == pytest.approx(4 * 100 / 0.375)
    assert closed_loop_tps({"requests": []}, 4) is None


def test_verdicts_by_either_measure() -> None:
    result = _result()
    assert verdicts(result)[0][1:] == pytest.approx((0.85, 0.85))
    assert verdicts(result, metric="closed_loop")[0][1:] == pytest.approx((1066.67 / 1000.0,) * 2, rel=1e-4)


def test_the_tables_give_both_measures_and_their_verdicts() -> None:
    md = markdown_tables(_result())
    assert md.count("adaptive: target met at") == 2
    assert "target met at 0 of 1" in md and "target met at 1 of 1" in md
    assert "Closed-loop output tokens/s by Little's law" in md
    # closed loop: k = 4's requests took 450 ms (889 tok/s); the adaptive's mean is 375 ms (1067)
    assert "| 4 | 1000 | 889 | 1067 | off (1000) | 1.07 | 1.07 | - |" in md


def test_rounds_are_paired_with_the_same_round_of_the_other_policy() -> None:
    """A slow spell that hits one round slows both policies' parts of it: the paired ratios see through it
    where the pooled totals do not (here 0.9 pooled against 1.0 in every round but the slow one)."""
    result = _result()
    runs = {"off": [1000.0, 1000.0, 500.0], "k=4": [900.0, 900.0, 450.0], "adaptive": [1000.0, 1000.0, 250.0]}
    for p, tps in runs.items():
        result["points"][p]["4"]["runs"] = [{"tokens_per_s": t} for t in tps]
    assert paired_ratios(result, "adaptive", "off", 4) == pytest.approx([1.0, 1.0, 0.5])
    assert paired_ratios(result, "adaptive", "k=9", 4) == []  # no such policy: nothing to pair
    md = markdown_tables(result)
    assert "Paired by round" in md
    assert "| 4 | 3 | 1.00 [0.50-1.00] | 1.00 [0.50-1.00] |" in md  # best fixed is off (1000 pooled)
