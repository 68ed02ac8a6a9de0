"""What proposals cost, as the adaptive controller learns it (estimators.StepCosts): a draft model's
catch-up, and warm proposals by k.

On the H200 pair (sixteenth session) small catch-ups took 10-16 ms and one at 256 requests 374 ms;
the controller then stopped drafting at once. Such a catch-up must be learned (here: 300-token ones of
10 ms, then one of 13k tokens and 370 ms): one far beyond the token counts measured is news (not
clipped as an outlier), and a cold proposal that no warm one of its k follows is priced against the
warm fits instead of dropped. Warm proposals cost no less for more drafts: per-k fits of a few
samples each are pooled where noise put them out of order.

On the next run (seventeenth session) proposals cut short by the output budget (1-5 draft forwards where
12 were chosen) had been priced as k = 12, and catch-ups at 2-4 requests cost 4x what the many prompt
feeds at 1 request had the pooled fit say: proposals are priced at their depth, catch-ups per bucket.
"""
from __future__ import annotations

import pytest

from specserve.spec.estimators import StepCosts
from specserve.spec.step_stats import ProposalStats, SpecStepStats

B, K, STEP_S, WARM_S = 4, 4, 0.004, 0.005


class _Feed:
    """StepCosts fed as the engine does, on a simulated clock (no pauses)."""

    def __init__(self, max_k: int = K) -> None:
        self.costs = StepCosts(max_k=max_k, window=32.0, ridge=1e-4, stale_after=1000, arrivals_window=2000.0)
        self.now = 0.0
        self.costs.clock = lambda: self.now

    def step(self, k: int, propose_s: float, cold: bool = False, unseen: float | None = None, b: int = B,
             budget: int | None = None) -> None:
        """budget: every request's draft budget (default k; fewer near the end of its output)."""
        drafts = [k if budget is None else budget] * b if k else []
        proposal = ProposalStats.measure(k, drafts, drafts, propose_s)
        self.now += STEP_S + propose_s
        self.costs.observe(SpecStepStats(b, b + sum(drafts), sum(drafts), STEP_S, proposal=proposal), cold, False,
                           unseen)

    def warm_up(self) -> None:
        for _ in range(20):
            self.step(K, WARM_S)
        for _ in range(12):  # catch-ups of 300 tokens, 10 ms each, each followed by a warm proposal
            self.step(0, 0.0)
            self.step(K, WARM_S + 0.010, cold=True, unseen=300.0)
            self.step(K, WARM_S)


def test_small_catch_ups_are_priced_as_measured() -> None:
    feed = _Feed()
    feed.warm_up()
    assert abs(feed.costs.catch_up_seconds(300.0, WARM_S) - 0.010) < 0.002


def test_a_catch_up_far_beyond_those_measured_is_learned_not_clipped() -> None:
    feed = _Feed()
    feed.warm_up()
    assert feed.costs.catch_up_seconds(13000.0, WARM_S) < 0.05  # only small ones seen: the fit is flat
    feed.step(0, 0.0)
    feed.step(K, WARM_S + 0.370, cold=True, unseen=13000.0)
    feed.step(K, WARM_S)  # paired with a warm one
    assert feed.costs.catch_up_seconds(13000.0, WARM_S) > 0.25


def test_a_cold_proposal_that_drafting_stops_after_is_still_measured() -> None:
    feed = _Feed()
    feed.warm_up()
    feed.step(0, 0.0)
    feed.step(K, WARM_S + 0.370, cold=True, unseen=13000.0)
    feed.step(0, 0.0)  # the controller went back to no drafts: no warm proposal of k follows
    feed.step(0, 0.0)
    assert feed.costs.catch_up_seconds(13000.0, WARM_S) > 0.25
    assert abs(feed.costs.catch_up_seconds(300.0, WARM_S) - 0.010) < 0.003  # the small ones still fit


def test_non_decreasing_pools_adjacent_violators() -> None:
    from specserve.spec.regression import non_decreasing

    assert non_decreasing([1.0, 2.0, 3.0], [1.0, 1.0, 1.0]) == [1.0, 2.0, 3.0]  # in order: unchanged
    pooled = non_decreasing([6.30, 5.73, 5.94], [1.0, 1.0, 1.0])
    assert pooled == [sum([6.30, 5.73, 5.94]) / 3] * 3
    # the weights decide where a violating pair meets: a well-measured k moves less than a guess
    a, b = non_decreasing([4.0, 2.0], [3.0, 1.0])
    assert a == b == 3.5
    out = non_decreasing([1.0, 5.0, 2.0, 6.0], [1.0, 1.0, 1.0, 1.0])
    assert out == [1.0, 3.5, 3.5, 6.0]


def test_warm_proposal_costs_never_fall_with_k() -> None:
    """Per-k fits of a few noisy samples each (the H200 pair at 2 requests priced k = 8 / 9 / 10 at
    6.30 / 5.73 / 5.94 ms): the prices the controller uses are in order, pooled where they were not."""
    costs = StepCosts(max_k=K, window=32.0, ridge=1e-4, stale_after=1000, arrivals_window=2000.0)
    measured = {1: 0.0020, 2: 0.0031, 3: 0.0026, 4: 0.0040}  # k = 3 below k = 2: noise
    for k, seconds in measured.items():
        for _ in range(4):
            drafts = [k] * B
            costs.observe(SpecStepStats(B, B * (k + 1), B * k, STEP_S,
                                        proposal=ProposalStats.measure(k, drafts, drafts, seconds)), False, False, 0.0)
    prices = costs.propose_seconds(float(B))
    assert all(a <= b + 1e-12 for a, b in zip(prices, prices[1:]))
    assert abs(prices[0] - measured[1]) < 2e-4 and abs(prices[3] - measured[4]) < 4e-4  # in order: kept
    assert abs(prices[1] - prices[2]) < 1e-9 and measured[3] < prices[1] < measured[2]  # the violators pooled


def test_proposals_cut_short_by_the_output_budget_are_priced_at_their_depth() -> None:
    """k = 12 proposals of 7.2 ms, and near each request's end ones whose budget allowed 1 draft (one
    forward, 0.6 ms): k = 12 stays priced at 7.2 ms, and the short ones price k = 1."""
    feed = _Feed(max_k=12)
    for i in range(48):
        if i % 4 == 3:
            feed.step(12, 0.0006, b=1, budget=1)
        else:
            feed.step(12, 0.0072, b=1)
    prices = feed.costs.propose_seconds(1.0)
    assert abs(prices[11] - 0.0072) < 0.0005
    assert abs(prices[0] - 0.0006) < 0.0002


def test_catch_ups_are_priced_per_batch_size_where_measured() -> None:
    """Many cheap catch-ups (prompt feeds, say) at 1 request, two dear ones at 4 (the H200 pair: 2.6 ms
    against 10-16 ms): at 4 the controller expects the dear ones, at 1 the cheap ones; at a batch size
    without any it falls back to the fit over every size."""
    feed = _Feed()
    for _ in range(20):
        feed.step(0, 0.0, b=1)
        feed.step(K, WARM_S + 0.0026, cold=True, unseen=172.0, b=1)
        feed.step(K, WARM_S, b=1)
    for _ in range(2):
        feed.step(0, 0.0)
        feed.step(K, WARM_S + 0.012, cold=True, unseen=60.0)
        feed.step(K, WARM_S)
    assert abs(feed.costs.catch_up_seconds(60.0, WARM_S, B) - 0.012) < 0.002
    assert abs(feed.costs.catch_up_seconds(172.0, WARM_S, 1) - 0.0026) < 0.001
    pooled = feed.costs.catch_up_seconds(60.0, WARM_S)
    assert pooled == feed.costs.catch_up_seconds(60.0, WARM_S, 64)  # no data at 64: the pooled fit


def test_a_pause_far_beyond_the_prompt_feeds_measured_costs_no_less_than_the_cold_ratio() -> None:
    """Where requests come and go, a bucket's catch-up fit learns mostly from prompt feeds: warm
    proposals right after a prompt chunk, a few hundred tokens each, often no dearer than a warm proposal
    (measured as ~0). Extrapolated to a pause's catch-up the fit says ~0: on the H200 pair at 128 requests
    (twenty-first session) one of 44,880 tokens was priced 0.0 ms and took 177 ms, on an exploration.
    Beyond twice the token counts a fit has seen, a catch-up costs no less than the measured ratio of
    cold to warm proposals (here 2: 10 ms extra on 5 ms) says."""
    feed = _Feed()
    feed.warm_up()
    for _ in range(40):  # prompt feeds of 172 tokens that cost nothing over a warm proposal
        proposal = ProposalStats.measure(K, [K] * B, [K] * B, WARM_S)
        feed.now += STEP_S + WARM_S
        feed.costs.observe(SpecStepStats(B, B + K * B, K * B, STEP_S, proposal=proposal), False, True, 172.0)
    local = feed.costs.local_catch_up.get(B, 0)
    assert local is not None and local.predict((1.0, 44880.0)) < 0.002  # what the fit alone says
    assert feed.costs.catch_up_seconds(44880.0, WARM_S, B) >= 0.0099  # 2 x the 5 ms warm proposal
    assert feed.costs.catch_up_seconds(172.0, WARM_S, B) < 0.002  # within the fit's data: the fit


def test_large_catch_ups_price_larger_ones_per_token() -> None:
    """Catch-ups of thousands of tokens run as large forwards, so their time is their tokens': on the
    H200 pair (twenty-third session) 27k, 68k and 137k tokens took 26, 62 and 141 ms, and the last had
    been priced 24 ms. Far beyond what the fits saw, a catch-up costs no less than the large ones
    measured per token."""
    feed = _Feed()
    feed.warm_up()  # 300-token catch-ups of 10 ms
    for _ in range(2):  # 20,000 tokens in 20 ms: 1 us per token
        feed.step(0, 0.0)
        feed.step(K, WARM_S + 0.020, cold=True, unseen=20000.0)
        feed.step(K, WARM_S)
    fit = feed.costs.catch_up_cost
    assert fit.predict((1.0, 137000.0)) < 0.1  # what the fit alone says (its slope is the small ones')
    assert feed.costs.catch_up_seconds(137000.0, WARM_S) == pytest.approx(0.137, rel=0.05)
    assert feed.costs.catch_up_seconds(300.0, WARM_S) == pytest.approx(0.010, abs=0.003)  # the fit's own


def test_small_catch_ups_do_not_set_a_per_token_price() -> None:
    """Only catch-ups of _LARGE_CATCH_UP tokens or more price others per token: a 300-token one of 10 ms
    (mostly per-call costs) says nothing of 100,000 tokens."""
    feed = _Feed()
    feed.warm_up()
    assert feed.costs._large_catch_ups == (0.0, 0.0)
    assert feed.costs.catch_up_seconds(100000.0, WARM_S) < 0.1  # 33 us a token would say 3.3 s
