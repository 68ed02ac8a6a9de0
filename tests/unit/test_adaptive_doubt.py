"""The benefit of the doubt for a k measured once or twice (spec/exploration.py, Exploration._may_explore).

A k that a bucket measured far from paying only once or twice may have met a fluke (JIT, an eager first
run), so exploring it is not held back by what exploring already spent. That doubt is about k's step
price. A draft model's exploration from k = 0 also pays a catch-up, priced on measurements of its own:
on the H200 pair at 256 requests (thirtieth session) k = 12, measured once at 129-256 requests, was
explored from k = 0 again 76 choices later, with a catch-up of 55,533 tokens in a 150 ms proposal."""
from __future__ import annotations

import pytest

from specserve.config import SpeculativeConfig
from specserve.spec.adaptive import AdaptiveController
from tests.helpers.spec_world import World, run_world

K = 12


def _warm(draft_model: bool) -> AdaptiveController:
    """256 requests where no k pays (a 9 ms decode step, 2 ms a draft forward or a costly lookup);
    a draft model also catches up after steps without drafts (10 ms + 4 us a token)."""
    if draft_model:
        cfg = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=K)
        world = World(256, alpha=0.6, step_s=0.004, per_token_s=2e-5, draft_s=0.002, catchup_s=0.01,
                      catchup_tok_s=4e-6, launch_s=0.0003, sync_host_s=0.0008, graph_qs=tuple(range(1, K + 2)),
                      fill=(1.0,) * K)
    else:
        cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=K)
        world = World(256, alpha=0.6, step_s=0.004, per_token_s=2e-5, lookup_s=2e-5, launch_s=0.0003,
                      sync_host_s=0.0008, graph_qs=tuple(range(1, K + 2)), fill=(1.0,) * K)
    ctrl = AdaptiveController(cfg)
    run_world(world, ctrl, 600)
    return ctrl


def _may_explore_once_measured(ctrl: AdaptiveController, spent_share: float) -> bool:
    """Whether K may be explored from k = 0 now, as a k this bucket measured once (a possible fluke), with
    `spent_share` of the exploration budget already spent, and a catch-up of 20,000 tokens to pay."""
    est = ctrl.estimate(256)
    assert est.best_k == 0
    assert est.tokens_per_s[K] < 0.9 * est.tokens_per_s[0]  # far from paying: the doubt is a fluke's
    ctrl.costs.samples = lambda b, k: 1  # (measured once at this bucket lately)
    ctrl.costs.unseen_tokens = 20000.0
    window = max(ctrl.observed_seconds, ctrl.settings.budget_window * est.step_seconds[0])
    ctrl.exploration_loss_seconds = spent_share * ctrl.settings.explore_budget * window
    return ctrl._may_explore(K, ctrl._burst_steps(K), est)


def test_a_fluke_that_starts_with_a_catch_up_waits_for_the_budget() -> None:
    ctrl = _warm(draft_model=True)
    assert ctrl.catches_up() and ctrl.costs.catch_up_cost.weight >= 3  # (its catch-up is measured)
    assert _may_explore_once_measured(ctrl, 0.0)  # fits the budget on its own
    assert not _may_explore_once_measured(ctrl, 0.9)  # ... but not on top of what was spent


@pytest.mark.parametrize("spent_share", [0.0, 0.9])
def test_a_fluke_without_a_catch_up_keeps_its_doubt(spent_share: float) -> None:
    ctrl = _warm(draft_model=False)
    assert not ctrl.catches_up()
    assert _may_explore_once_measured(ctrl, spent_share)
