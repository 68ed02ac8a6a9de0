"""The adaptive speculation controller's tuning (AdaptiveSettings) and what it reports about a choice
(ControllerEstimates); the controller itself is spec/adaptive.py."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdaptiveSettings:
    """Tuning of the adaptive controller; the defaults are what the engine uses."""

    acceptance_prior: float = 0.8  # optimistic: a fresh controller drafts and measures
    prior_weight: float = 4.0  # samples the prior is worth
    acceptance_window: float = 100.0  # samples per position
    acceptance_horizon: float = 1000.0  # observations over which acceptance measured then fades toward the prior
    # For a proposer that catches up (a draft model), observations over which a bucket's calibration
    # ratio (acceptance.TokenCalibration) fades toward 1; else acceptance_horizon. A ratio that dipped by
    # chance just before the controller stopped drafting gets no samples to recover from, and a draft
    # model's explorations from k = 0 are rare (each starts with a catch-up): in a simulated pair at 16
    # requests (acceptance 0.93 at every step) the controller stopped at a ratio of 0.93, where drafting
    # got 0.98 of the prediction on average, and ran at 0.89 of fixed k = 7 for the 3,000 steps after
    # (0.98 with 250; tests/unit/test_adaptive_calibration.py). An n-gram lookup explores cheaply and
    # often, and its ratio far below 1 (the H200 8B at 8-16 requests) is no chance dip.
    calibration_horizon: float = 250.0
    cost_window: float = 32.0  # steps per cost model
    slope_ridge: float = 1e-4
    explore_every: int = 10  # every n-th choice tries a neighbour of the best k (0: never)
    # A neighbour predicted this much slower is tried on every explore_backoff-th slot only. At 0.25 a
    # load where every k is 19-28% slower than no drafts (the H200 8B n-gram sweep at 16 requests)
    # had bursts of drafts on every slot until the budget cut in: 11-12% of the next 500 steps.
    explore_max_loss: float = 0.1
    explore_backoff: int = 4
    explore_burst: int = 2  # steps an exploration from k = 0 lasts (a draft model's catch-up, then a warm step)
    explore_budget: float | None = 0.01  # exploring may lose at most this fraction of the time (None: no cap)
    budget_window: float = 2000.0  # steps over which the exploration budget is counted
    switch_margin: float = 0.02  # between drafting and not: keep the previous best unless another k is this much faster
    # The best k: the smallest priced within this share of the fastest (0: the fastest). 1%: where
    # acceptance comes in stretches the fastest drafts too much, and where it is flat 2% drafts too little
    # (AdaptiveController._among_near_ties).
    prefer_fewer: float = 0.01
    calibrate: bool = True  # scale predicted drafts per bucket by what drafting got (TokenCalibration)
    stale_after: int = 1000  # observations after which a bucket's measurement of a k is a guess again
    reprobe_after: int = 250  # while drafting, re-measure a plain decode step this often (observations)
    # While every k > 0 is priced this far below no drafts (and nothing drafting-related changed), the
    # choices up to the next exploration slot repeat k = 0 without pricing again (AdaptiveController's
    # hold; None: price every choice). At high load the engine's host work bounds the step, so the
    # controller's own is paid on every step (H200, 64-256 requests: choose + observe 0.13-0.17 ms a step
    # priced, 0.10-0.12 with the hold; bench/spec_host_cost.py).
    hold_margin: float | None = 0.2


@dataclass(frozen=True)
class ControllerEstimates:
    """What the controller believed when it chose; tuples indexed by k (0..K) or position."""

    batch_size: int
    best_k: int
    chosen_k: int
    acceptance_per_pos: tuple[float, ...]
    fill_per_pos: tuple[float, ...]
    expected_tokens: tuple[float, ...]  # per request per step
    step_seconds: tuple[float, ...]  # predicted verify (or decode) + proposal time
    tokens_per_s: tuple[float, ...]
    trusted: tuple[int, ...] = ()  # the k priced on fresh data of this batch bucket (0 always)
    propose_seconds: tuple[float, ...] = ()  # the (warm) proposal's share of step_seconds
    decode_trusted: bool = True  # the decode cost (k = 0) is priced on fresh data of this batch bucket
