"""The exploration budget in wall time (Exploration._account): a step's timers and proposal plus what the
interval since the last observation held beyond them, and the step after an exploration that runs the
other way (drafting or not), where asynchronous scheduling moves a forward between the two intervals.

On the H200 (thirty-first session, 8B shape with n-gram at 16 requests, every k 15-20% slower than no
drafts) the timers booked 28 ms lost over a point's 84 exploring steps and the wall time 168 ms of
5.3 s: the 1% budget never bound, the policy drafted in 10% of its steps and ran at 0.95 of no drafts."""
from __future__ import annotations

import pytest

from specserve.spec.adaptive import AdaptiveController
from tests.helpers.spec_world import CFG, World, run_world


def _switching_world(batch: int = 16, switch_s: float = 0.0036) -> World:
    """An 8B-like n-gram step: no drafts 4.63 ms at 16 requests; a draft token costs 0.13 ms to verify, so
    every fixed k loses 14-17%; overlapped steps are observed at their launch, and each switch to drafting
    holds `switch_s` of host time no timer covers."""
    return World(batch=batch, alpha=0.6, step_s=0.00463 - 0.0001335 * batch, per_token_s=0.0001335,
                 lookup_s=0.000075, fill=(0.42, 0.26, 0.21, 0.19), launch_s=0.0007, sync_host_s=0.0003,
                 graph_qs=(1, 2, 3, 4, 5), observe_at_launch=True, switch_s=switch_s)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_switches_no_timer_covers_count_against_the_budget(seed: int) -> None:
    world = _switching_world()
    off, _ = run_world(world, 0, 3000)
    assert max(run_world(world, k, 3000)[0] for k in (1, 2, 4)) < 0.9 * off  # no k pays here
    ctrl = AdaptiveController(CFG)
    run_world(world, ctrl, 1000, seed=seed, work_ahead=True)
    rate, chosen = run_world(world, ctrl, 2000, seed=seed + 10, work_ahead=True)
    # within the 1% budget and a little: booked on the timers alone, it drafted in 66-71 of the 2,000
    # steps and ran at 0.978
    assert rate >= 0.988 * off
    assert sum(1 for k in chosen if k) <= 40
    assert 0.005 < ctrl.exploration_loss_seconds / ctrl.observed_seconds < 0.012  # booked: about the budget


def test_without_switch_costs_the_booking_is_the_timers() -> None:
    """Where the timers cover every switch (no untimed host work), the wall booking keeps what the timers'
    booking gave: within the budget of no drafts, with about the budget booked."""
    world = _switching_world(switch_s=0.0)
    ctrl = AdaptiveController(CFG)
    run_world(world, ctrl, 1000, seed=4, work_ahead=True)
    rate, _ = run_world(world, ctrl, 2000, seed=14, work_ahead=True)
    off, _ = run_world(world, 0, 3000)
    assert rate >= 0.988 * off
    assert 0.005 < ctrl.exploration_loss_seconds / ctrl.observed_seconds < 0.012


@pytest.mark.parametrize("extra_s,booked", [(0.003, True), (1.0, False)])
def test_a_pause_is_no_exploration_loss(extra_s: float, booked: bool) -> None:
    """What an exploring step's interval held beyond its timers is booked up to a forward in flight's
    worth (3 ms: a switch); an idle engine between two observations (a second) is no step's price."""
    from specserve.spec.adaptive import _Choice
    from specserve.spec.step_stats import ProposalStats, SpecStepStats

    world = _switching_world()
    ctrl = AdaptiveController(CFG)
    run_world(world, ctrl, 600, seed=5, work_ahead=True)
    step = SpecStepStats(16, 16 + 20, 20, 0.0059, (16, 8, 4, 2), (6, 3, 1, 0),
                         ProposalStats.measure(4, [4] * 16, [1] * 16, 0.0012))
    choice = _Choice(4, True, 0, True, False, 0.0, (0.3, 0.1, 0.05, 0.02))
    rate = ctrl.estimate(16).tokens_per_s[0]
    timers = 0.0059 + 0.0012 - (16 + 10) / rate
    ctrl.costs.last_unexplained = extra_s
    loss = ctrl.exploration_loss_seconds * ctrl._budget_keep
    ctrl._account(step, step.proposal, choice)
    assert ctrl.exploration_loss_seconds - loss == pytest.approx(timers + (extra_s if booked else 0.0), rel=1e-6)
