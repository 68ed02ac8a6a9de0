"""A batch-size bucket's cost fit beyond the batch sizes it measured (bucket_fits.local_price).

On the H200 pair at 256 requests (twenty-seventh session) the 129-256 bucket's decode fit had seen only
full batches (6.6 ms a step). In a part's fill, at 129-155 requests, it priced a decode step at 6.6 ms
(one at 128 requests takes 2.4), and drafting, priced on verify steps measured at those sizes, looked
1.3-2.0 times as fast as no drafts. Beyond its span a bucket's fit now takes its shape from the fit over
every batch size."""
from __future__ import annotations

import pytest

from specserve.spec.estimators import StepCosts
from specserve.spec.step_stats import ProposalStats, SpecStepStats


def decode_s(b: int) -> float:
    return 0.0005 + 0.00002 * b  # 5.5 ms at 250 requests, 3.2 at 135


def feed(costs: StepCosts, clock: list[float], b: int, k: int = 0, n: int = 40) -> None:
    """n steps at batch b: plain decode steps (k = 0), or verify steps of k drafts per request."""
    for _ in range(n):
        drafts = [k] * b if k else []
        seconds = decode_s(b) * (1 + 0.1 * k) if k else decode_s(b)
        propose = 0.002 if k else 0.0
        clock[0] += seconds + propose
        costs.observe(SpecStepStats(b, b + sum(drafts), sum(drafts), seconds,
                                    proposal=ProposalStats.measure(k, drafts, drafts, propose)), False, False, 0.0)


def costs_with_a_full_bucket() -> StepCosts:
    """Decode steps at 16, 64 and 100 requests (the fit over every batch size learns the slope), then the
    129-256 bucket measures only full batches of 250."""
    clock = [0.0]
    costs = StepCosts(max_k=4, window=32.0, ridge=1e-4, stale_after=1000, arrivals_window=2000.0)
    costs.clock = lambda: clock[0]
    for b in (16, 64, 100, 250):
        feed(costs, clock, b)
    return costs


def test_a_bucket_that_measured_only_full_batches_prices_smaller_ones_by_the_pooled_slope() -> None:
    costs = costs_with_a_full_bucket()
    full, _ = costs.decode_seconds(250.0)
    assert full == pytest.approx(decode_s(250), rel=0.05)
    price, trusted = costs.decode_seconds(135.0)
    assert trusted  # (its own bucket's data, fresh)
    assert price == pytest.approx(decode_s(135), rel=0.1)  # flat from 250, it was 5.5 ms against 3.2
    # within its span (give or take 10%) the bucket's own fit stands
    assert costs.decode_seconds(240.0)[0] == pytest.approx(decode_s(250), rel=0.05)


def test_verify_steps_beyond_a_buckets_span_scale_the_same_way() -> None:
    """k = 2 verify steps measured at 140 requests only, priced at 250: not at 140's price."""
    costs = costs_with_a_full_bucket()
    clock = [1e3]
    costs.clock = lambda: clock[0]
    for b in (16, 64, 100):
        feed(costs, clock, b, k=2, n=20)
    feed(costs, clock, 140, k=2, n=40)
    at_140 = costs.verify_seconds(140.0, [2 * 140.0, 3 * 140.0])[0][1]  # (k = 1, 2: index 1 is k = 2)
    at_250 = costs.verify_seconds(250.0, [2 * 250.0, 3 * 250.0])[0][1]
    assert at_140 == pytest.approx(1.2 * decode_s(140), rel=0.05)
    assert at_250 == pytest.approx(1.2 * decode_s(250), rel=0.12)
