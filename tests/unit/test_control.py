"""speculative/control.py: the controllers' choices on cost and acceptance tables, through choose,
observe, the constructor and the adaptive controller's read-outs only."""

from __future__ import annotations

import copy

import pytest

from specserve.config import SpeculativeConfig
from specserve.runner.step_costs import CostTable
from specserve.speculative.control import (
    AdaptiveController,
    FixedController,
    StepRecord,
    TableController,
    build_controller,
)

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def table(fn, max_q: int = 9) -> CostTable:
    """A cost table of fn(batch_size, query_len) seconds at SIZES x 1..max_q."""
    return CostTable({(b, q): fn(b, q) for b in SIZES for q in range(1, max_q + 1)})


def drafting(
    batch: int,
    k: int,
    alphas: list[float],
    propose_seconds: float = 0.0,
    catch_up_tokens: int = 0,
    asked: int | None = None,
    drafted: int | None = None,
) -> StepRecord:
    """The expected counts of a step where `asked` requests (default: batch) drafted k tokens, of which
    `drafted` (default: all) got a first draft, accepted position by position at rates `alphas`."""
    asked = batch if asked is None else asked
    alive = float(asked if drafted is None else drafted)
    reached, accepted = [], []
    for j in range(k):
        reached.append(round(alive))
        alive *= alphas[j]
        accepted.append(round(alive))
    return StepRecord(batch, k, tuple(reached), tuple(accepted), 0.01, propose_seconds, catch_up_tokens, asked)


def plain(batch: int) -> StepRecord:
    return StepRecord(batch, 0, (), (), 0.01, 0.0)


def brute_force(c: AdaptiveController, costs: CostTable, b: int) -> tuple[int, list[float]]:
    """The stated objective, computed here from the controller's read-outs of its inputs."""
    alphas, m = c.acceptance(), c.match_rate()
    verifies = 1 - (1 - m) ** b  # the chance that any of the b requests got a draft
    rates = []
    for k in range(c.max_k + 1):
        gain, survive = 0.0, 1.0
        for a in alphas[:k]:
            survive *= a
            gain += survive
        cost = costs.seconds(b, 1)
        if k > 0:
            cost = verifies * costs.seconds(b, k + 1) + (1 - verifies) * cost
            cost += c.draft_seconds(b, k) + c.switch_seconds(b) / c.switch_horizon
        rates.append(b * (1 + m * gain) / cost)
    best = max(range(len(rates)), key=lambda k: (rates[k], -k))  # ties: the smaller k
    return best, rates


# -- fixed and table ---------------------------------------------------------------------------
def test_fixed_and_table_controllers() -> None:
    assert [FixedController(3).choose(b) for b in (1, 64, 512)] == [3, 3, 3]
    t = TableController(4, ((1, 4, 6), (5, 16, 2)))
    assert [t.choose(b) for b in (1, 4, 5, 16, 17)] == [4, 4, 2, 2, 0]


def test_build_controller_picks_by_config() -> None:
    costs = table(lambda b, q: 0.01)
    cfg = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert isinstance(build_controller(cfg, costs), AdaptiveController)
    assert isinstance(build_controller(cfg, None), FixedController)
    off = SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False)
    assert isinstance(build_controller(off, costs), FixedController)
    rows = SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, num_speculative_tokens_per_batch_size=((1, 8, 2),)
    )
    assert isinstance(build_controller(rows, costs), TableController)


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="switch_horizon"):
        AdaptiveController(3, table(lambda b, q: 0.01), switch_horizon=0)
    with pytest.raises(ValueError, match="prior"):
        AdaptiveController(3, table(lambda b, q: 0.01), prior=1.5)


# -- adaptive ----------------------------------------------------------------------------------
def test_fresh_controller_drafts_to_measure() -> None:
    c = AdaptiveController(4, table(lambda b, q: 0.010 + 0.0002 * q))
    assert c.choose(1) == 4


def test_high_acceptance_and_cheap_verify_draft_max_k() -> None:
    c = AdaptiveController(4, table(lambda b, q: 0.010 + 0.00001 * b * q))
    for _ in range(50):
        c.observe(drafting(8, 4, [0.95] * 4, propose_seconds=0.0004))
    assert c.match_rate() == 1.0  # every request asked got a draft: the plain-step share is 0
    assert [c.choose(b) for b in (1, 8, 32)] == [4, 4, 4]


def test_zero_acceptance_drafts_nothing() -> None:
    c = AdaptiveController(4, table(lambda b, q: 0.010 * (1 + 0.05 * (q - 1))))
    for _ in range(50):
        c.observe(drafting(1, 4, [0.0] * 4, propose_seconds=0.002))
    assert all(c.choose(b) == 0 for b in SIZES)


def test_a_lookup_that_finds_nothing_gains_nothing() -> None:
    """Requests asked for drafts that got none gain nothing: with 1 in 10 drafting at batch 10, most steps
    still verify a draft and pay for it, which the gain does not cover."""
    costs = table(lambda b, q: 0.010 * (1 + 0.2 * (q - 1)))
    found, rare = AdaptiveController(2, costs), AdaptiveController(2, costs)
    for _ in range(50):
        found.observe(drafting(10, 2, [0.9, 0.9]))
        rare.observe(drafting(10, 2, [0.9, 0.9], drafted=1))
    assert found.choose(10) == 2
    assert rare.choose(10) == 0


def test_a_lookup_that_finds_nothing_for_a_while_keeps_asking_at_batch_one() -> None:
    """At batch 1 a step where the lookup found nothing is a plain decode step: drafting pays whenever an
    accepted draft does, however rarely one is found. Under load nearly every step verifies some draft."""
    costs = table(lambda b, q: 0.0018 + 0.0001 * q + 0.00002 * b * q)
    c = AdaptiveController(8, costs)
    for _ in range(50):
        c.observe(drafting(1, 8, [0.9] * 8))
    found = c.choose(1)
    for _ in range(200):  # asked every step, found nothing
        c.observe(drafting(1, 8, [0.9] * 8, drafted=0))
    assert c.match_rate() < 0.1
    assert found > 0 and c.choose(1) == found
    assert c.choose(256) == 0


def test_verify_cost_growing_with_batch_turns_drafting_off_under_load() -> None:
    costs = table(lambda b, q: 0.010 + 0.002 * b * q)
    c = AdaptiveController(4, costs)
    for _ in range(50):
        c.observe(drafting(4, 4, [0.8] * 4, propose_seconds=0.0004))
    choices = [c.choose(b) for b in SIZES]
    assert choices[0] > 0 and choices[-1] == 0
    assert choices == sorted(choices, reverse=True)  # fewer drafts as the batch grows


def test_no_acceptance_can_keep_drafting_where_verify_costs_its_tokens() -> None:
    """From 32 requests on, a step of q tokens costs q times a decode step: even every draft accepted
    and free drafts do not pay, so perfect (or noisy) acceptance never keeps drafting there."""
    costs = table(lambda b, q: 0.010 * (q if b >= 32 else 1 + 0.01 * q))
    c = AdaptiveController(6, costs)
    for i in range(200):
        c.observe(drafting(64, 6, [1.0 if i % 2 else 0.9] * 6))
        assert c.choose(64) == 0 and c.choose(256) == 0
    assert c.choose(1) == 6


def test_acceptance_collapsing_at_position_two_drafts_two() -> None:
    c = AdaptiveController(5, table(lambda b, q: 0.010 + 0.0005 * q))
    for _ in range(50):
        c.observe(drafting(16, 5, [0.95, 0.95, 0.0, 0.9, 0.9], propose_seconds=0.001))
    assert c.choose(1) == 2 and c.choose(16) == 2
    alphas = c.acceptance()
    assert alphas[0] > 0.9 and alphas[1] > 0.9 and alphas[2] < 0.01


def _stopped_after_catch_up(cost_per_token: float, idle_steps: int) -> AdaptiveController:
    """A draft model that drafted k = 1 at batch 10 (1 ms per draft step, acceptance 0.6: a gain of
    ~3% over no drafts), stopped, resumed once paying `cost_per_token` per token it caught up on, and
    has stood still for `idle_steps` steps since."""
    c = AdaptiveController(2, table(lambda b, q: 0.010 + 0.001 * b * q))
    for _ in range(40):
        c.observe(drafting(10, 1, [0.6] * 2, propose_seconds=0.001))
    for _ in range(20):
        c.observe(plain(10))
    c.observe(drafting(10, 1, [0.6] * 2, propose_seconds=0.002 + 80 * cost_per_token, catch_up_tokens=80))
    for _ in range(idle_steps):
        c.observe(plain(10))
    return c


def test_an_expensive_catch_up_keeps_drafting_off_when_the_gain_is_small() -> None:
    costly = _stopped_after_catch_up(cost_per_token=0.001, idle_steps=50)
    free = _stopped_after_catch_up(cost_per_token=0.0, idle_steps=50)
    assert costly.switch_seconds(10) > free.switch_seconds(10) > 0.0  # (free: one draft step)
    assert free.choose(10) == 1  # the same gain with nothing to catch up on: drafts
    assert costly.choose(10) == 0
    # a controller that is drafting pays no catch-up, so the same small gain keeps it drafting
    drafting_now = _stopped_after_catch_up(cost_per_token=0.001, idle_steps=50)
    drafting_now.observe(drafting(10, 1, [0.6] * 2, propose_seconds=0.001))
    assert drafting_now.switch_seconds(10) == 0.0 and drafting_now.choose(10) == 1


def test_a_catch_up_amortized_over_the_horizon_still_pays_for_a_large_gain() -> None:
    c = _stopped_after_catch_up(cost_per_token=0.001, idle_steps=0)
    for _ in range(40):  # acceptance rose to 0.95
        c.observe(drafting(10, 2, [0.95] * 2, propose_seconds=0.002))
    for _ in range(50):
        c.observe(plain(10))
    assert c.switch_seconds(10) > 0.1
    assert c.choose(10) == 2


def test_after_drafting_stops_the_prior_brings_it_back() -> None:
    c = AdaptiveController(3, table(lambda b, q: 0.010 * (1 + 0.05 * (q - 1))))
    choices = []
    for _ in range(1000):  # acceptance is 0: drafting stops; retries (the prior) stay rare
        k = c.choose(1)
        choices.append(k)
        c.observe(drafting(1, k, [0.0] * 3, propose_seconds=0.0002) if k else plain(1))
    assert choices[0] == 3 and choices[-1] == 0
    assert sum(1 for k in choices[100:] if k) < 0.1 * len(choices[100:])
    k = 0
    for _ in range(5000):  # it measures nothing while it does not draft: the prior brings it back
        k = c.choose(1)
        if k:
            break
        c.observe(plain(1))
    assert k > 0, "never drafted again"
    for _ in range(100):  # and acceptance is back
        c.observe(drafting(1, k, [0.9] * 3, propose_seconds=0.0002))
        k = c.choose(1)
    assert k == 3


def test_draft_cost_follows_the_batch_bucket() -> None:
    c = AdaptiveController(3, table(lambda b, q: 0.010 + 0.0001 * b * q))
    for _ in range(40):
        c.observe(drafting(2, 2, [0.9] * 3, propose_seconds=0.002))
        c.observe(drafting(64, 2, [0.9] * 3, propose_seconds=0.010))
    assert c.draft_seconds(2, 3) == pytest.approx(0.003, rel=1e-6)
    assert c.draft_seconds(64, 1) == pytest.approx(0.005, rel=1e-6)
    assert c.draft_seconds(48, 1) == pytest.approx(0.005, rel=1e-6)  # same bucket
    assert c.draft_seconds(1, 1) == pytest.approx(0.001, rel=1e-6)  # nearest measured bucket
    assert c.draft_seconds(64, 0) == 0.0


@pytest.mark.parametrize("shape", ["flat", "growing", "steep"])
def test_the_choice_maximises_the_stated_objective(shape: str) -> None:
    fn = {
        "flat": lambda b, q: 0.008 + 0.0001 * q,
        "growing": lambda b, q: 0.008 + 0.0004 * b * q,
        "steep": lambda b, q: 0.008 + 0.003 * b * q**1.5,
    }[shape]
    costs = table(fn)
    worlds = [
        [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2],
        [0.5] * 8,
        [0.99, 0.1, 0.99, 0.99, 0.9, 0.9, 0.9, 0.9],
        [0.3, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9],
    ]
    seen = set()
    for alphas in worlds:
        c = AdaptiveController(8, costs)
        for i in range(60):
            batch = 1 + i % 40
            drafted = batch // 2 if alphas is worlds[1] else None  # the lookup finds a draft for half
            c.observe(drafting(batch, 8, alphas, propose_seconds=0.0003 * batch, drafted=drafted))
        for _ in range(3):
            c.observe(plain(8))
        c.observe(drafting(8, 8, alphas, propose_seconds=0.05, catch_up_tokens=24))
        for idle in (False, True):
            if idle:  # stood still since: resuming pays the catch-up
                for _ in range(50):
                    c.observe(plain(8))
                assert c.switch_seconds(8) > 0.0
            for b in list(range(1, 40)) + [48, 64, 100, 128, 200, 256, 400]:
                each = copy.deepcopy(c)  # (a choice changes what the next one pays to resume)
                want, rates = brute_force(each, costs, b)
                assert [each.expected_rate(b, k) for k in range(9)] == pytest.approx(rates, rel=1e-12)
                assert each.choose(b) == want
                seen.add((idle, want))
    assert len({k for _, k in seen}) >= 2  # the worlds put the optimum at different k
