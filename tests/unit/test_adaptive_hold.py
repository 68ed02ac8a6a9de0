"""The adaptive controller's hold (AdaptiveSettings.hold_margin): while every k > 0 is priced far below
no drafts, the choices up to the next exploration slot repeat k = 0 without pricing. At high load the
engine's host work bounds the step, and the controller's pricing was paid on every step.

What must hold: the same choices as a controller that prices every choice (the hold only skips work
whose answer is known), and pricing again at exploration slots, on another load and after anything
learnt about drafting."""
from __future__ import annotations

import dataclasses

import pytest

from specserve.config import SpeculativeConfig
from specserve.spec.adaptive import AdaptiveController, AdaptiveSettings
from tests.helpers.spec_world import World, run_world

CFG12 = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=12)


def _busy_world(alpha: float) -> World:
    """Batch 256 with a draft model whose drafts rarely pay (a decode step of 4 ms, 2 ms per draft
    forward, an eager catch-up after every pause)."""
    return World(256, alpha=alpha, step_s=0.004, per_token_s=2e-5, draft_s=0.002, catchup_s=0.01,
                 catchup_tok_s=4e-6, launch_s=0.0003, sync_host_s=0.0008, graph_qs=tuple(range(1, 14)),
                 fill=(1.0,) * 12)


def _pair(settings: AdaptiveSettings | None = None) -> tuple[AdaptiveController, AdaptiveController]:
    s = settings or AdaptiveSettings()
    return AdaptiveController(CFG12, s), AdaptiveController(CFG12, dataclasses.replace(s, hold_margin=None))


@pytest.mark.parametrize("alpha,seed", [(0.5, 0), (0.5, 1), (0.8, 2), (0.95, 3)])
def test_the_hold_makes_the_choices_of_pricing_every_one(alpha: float, seed: int) -> None:
    held, priced = _pair()
    world = _busy_world(alpha)
    rate_held, chosen_held = run_world(world, held, 1500, seed)
    rate_priced, chosen_priced = run_world(world, priced, 1500, seed)
    assert chosen_held == chosen_priced
    assert rate_held == pytest.approx(rate_priced)
    assert priced.num_held == 0
    if alpha <= 0.5:  # drafting far behind: most choices are held
        assert held.num_held > 0.6 * held.num_choices


def test_exploration_slots_are_priced() -> None:
    ctrl = AdaptiveController(CFG12)
    run_world(_busy_world(0.5), ctrl, 600)
    every = ctrl.settings.explore_every
    held_at = []
    real = ctrl._repeat_zero

    def spy() -> int:
        held_at.append(ctrl.num_choices + 1)  # the choice it answers
        return real()

    ctrl._repeat_zero = spy
    run_world(_busy_world(0.5), ctrl, 300)
    assert held_at and not [c for c in held_at if c % every == 0]
    assert max(b - a for a, b in zip(held_at, held_at[1:])) <= every + 1  # priced at most every slot or so


def test_another_load_or_a_drafting_step_ends_the_hold() -> None:
    ctrl = AdaptiveController(CFG12)
    world = _busy_world(0.5)
    run_world(world, ctrl, 600)
    every = ctrl.settings.explore_every
    for _ in range(100):  # to a state where the next choice is held: a hold, not at a slot, not too long
        hold = ctrl._hold
        nxt = ctrl.num_choices + 1
        if hold is not None and nxt % every != 0 and nxt - hold.since <= 8:
            break
        run_world(world, ctrl, 1)
    else:
        pytest.fail("no hold in 100 steps where drafting is far behind")
    assert ctrl._holds(hold, 256)
    assert not ctrl._holds(hold, 239)  # a batch 7% smaller: drafting may gain there
    assert not ctrl._holds(hold, 300)  # another batch bucket
    assert not ctrl._holds(hold._replace(epoch=hold.epoch - 1), 256)  # acceptance faded since
    n = ctrl.num_held
    assert ctrl.choose(256) == 0 and ctrl.num_held == n + 1  # held
    ctrl._drafting_version += 1  # a step with drafts observed
    assert not ctrl._holds(ctrl._hold, 256)


def test_no_hold_while_drafting_is_near_or_better() -> None:
    """At batch 1, where k = 12 with acceptance 0.95 beats no drafts, nothing is held."""
    ctrl = AdaptiveController(CFG12)
    world = dataclasses.replace(_busy_world(0.95), batch=1, step_s=0.0015, draft_s=0.0006, catchup_s=0.003)
    _, chosen = run_world(world, ctrl, 800)
    assert ctrl.num_held == 0 and sum(k > 0 for k in chosen[-200:]) > 150
