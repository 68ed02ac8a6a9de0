"""What a draft model's catch-up costs, as the adaptive controller learns it (estimators.StepCosts).

On the H200 pair (sixteenth session) small catch-ups took 10-16 ms and one at 256 requests 374 ms;
the controller then stopped drafting at once. Such a catch-up must be learned (here: 300-token ones of
10 ms, then one of 13k tokens and 370 ms): one far beyond the token counts measured is news (not clipped as an outlier), and a cold
proposal that no warm one of its k follows is priced against the warm fits instead of dropped.
"""
from __future__ import annotations

from specserve.spec.estimators import StepCosts
from specserve.spec.step_stats import ProposalStats, SpecStepStats

B, K, STEP_S, WARM_S = 4, 4, 0.004, 0.005


class _Feed:
    """StepCosts fed as the engine does, on a simulated clock (no pauses)."""

    def __init__(self) -> None:
        self.costs = StepCosts(max_k=K, window=32.0, ridge=1e-4, stale_after=1000, arrivals_window=2000.0)
        self.now = 0.0
        self.costs.clock = lambda: self.now

    def step(self, k: int, propose_s: float, cold: bool = False, unseen: float | None = None) -> None:
        drafts = [k] * B if k else []
        proposal = ProposalStats.measure(k, drafts, drafts, propose_s)
        self.now += STEP_S + propose_s
        self.costs.observe(SpecStepStats(B, B * (k + 1), B * k, STEP_S, proposal=proposal), cold, False, unseen)

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
