"""The adaptive controller with a draft model at the H200 pair's costs, where acceptance is the same
all along (flat) or changes in stretches along each request (code): the best k is chosen among near-ties
(AdaptiveSettings.prefer_fewer).

On the H200 pair (twenty-third session) the controller drafted more than the best fixed k at 1-2
requests (k = 9-10 where 8 was best; fixed 12 was 12% slower than 8 at 2) and ran at 0.95 of it: near
its top the rate is flat in k while the price of a deep draft is the least certain. Taking the smallest
k priced within 2% of the fastest (twenty-fourth session) mended 2 requests (1.00) but drafted k = 6
where 8 was best at 1 (0.94). Here, taking the fastest drafts 1.6-2.4 tokens too many where acceptance
comes in stretches (0.951 of the best fixed k at batch 1), a 2% band 1.3-3.0 too few where it is flat
(0.972 at batch 1), and the default 1% band stays within 2% of the best fixed k in both."""
from __future__ import annotations

from collections import Counter

import pytest

from specserve.config import SpeculativeConfig
from specserve.spec.adaptive import AdaptiveController, AdaptiveSettings
from tests.helpers.stretch_world import StretchWorld, run_stretches

CFG12 = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=12)
STEPS = 3000

# (regimes, stretch length): mostly predictable code with novel lines between; a harder mix; the same
# acceptance throughout
WORLDS = {
    "code": (((0.995, 0.5), (0.93, 0.3), (0.7, 0.2)), 60.0),
    "mixed": (((0.99, 0.35), (0.9, 0.35), (0.6, 0.3)), 40.0),
    "flat": (((0.955, 1.0),), 60.0),
}
COSTS = {1: (0.0023, 0.0006), 4: (0.0026, 0.0009), 16: (0.0033, 0.0009)}  # batch: (step, draft forward)


def _world(name: str, batch: int) -> StretchWorld:
    regimes, stretch = WORLDS[name]
    step_s, draft_s = COSTS[batch]
    return StretchWorld(batch, regimes, stretch, step_s, draft_s)


def _adaptive(world: StretchWorld, settings: AdaptiveSettings | None = None) -> tuple[float, list[int]]:
    ctrl = AdaptiveController(CFG12, settings)
    run_stretches(world, ctrl, 1000, seed=99)  # warmed up on other content
    return run_stretches(world, ctrl, STEPS, seed=1, first_request=200)


def _mean(chosen: list[int]) -> float:
    return sum(chosen) / len(chosen)


@pytest.mark.parametrize("name,batch", [("code", 1), ("code", 16), ("mixed", 1), ("mixed", 4), ("flat", 1),
                                        ("flat", 4)])
def test_within_2_5_percent_of_the_best_fixed_k(name: str, batch: int) -> None:
    world = _world(name, batch)
    fixed = {k: run_stretches(world, k, STEPS, seed=1, first_request=200)[0] for k in range(2, 13)}
    best = max(fixed, key=fixed.get)
    rate, chosen = _adaptive(world)
    assert rate >= 0.975 * fixed[best], (rate / fixed[best], best, Counter(chosen).most_common(4))
    assert best - 2.5 <= _mean(chosen) <= best + 1.5, (best, Counter(chosen).most_common(4))


def test_the_fastest_priced_k_drafts_too_much_where_acceptance_comes_in_stretches() -> None:
    world = _world("code", 1)
    rate, chosen = _adaptive(world)
    rate_fastest, chosen_fastest = _adaptive(world, AdaptiveSettings(prefer_fewer=0.0))
    assert _mean(chosen_fastest) > _mean(chosen) + 0.8
    assert rate_fastest < 0.985 * rate


def test_a_wider_band_drafts_too_little_where_acceptance_is_flat() -> None:
    world = _world("flat", 1)
    rate, chosen = _adaptive(world)
    rate_wide, chosen_wide = _adaptive(world, AdaptiveSettings(prefer_fewer=0.02))
    assert _mean(chosen_wide) < _mean(chosen) - 1.0
    assert rate_wide < 0.985 * rate
