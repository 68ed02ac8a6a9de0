"""The adaptive controller does not start exploring drafts from k = 0 while the batch fills.

On the H200 pair (twenty-third session) most explorations at 256 requests started in a part's first
steps, while the batch filled with new requests' prompt chunks (10, 16, 43, 55, 116 requests): each paid
a draft model's catch-up (proposals of 15-141 ms), measured a batch size gone a step later, and its warm
proposal (after prompt chunks) was kept out of the bucket's fits. Here a controller at k = 0 goes through
drains and fills again and again, with exploration uncapped (so every slot explores), and must explore
in the steady steps only; the same run without the rule explores in the fills too."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from specserve.config import SpeculativeConfig
from specserve.spec.adaptive import (
    AdaptiveController,
    AdaptiveSettings,
    ProposalStats,
    SpecStepStats,
    verify_counts,
)
from tests.helpers.spec_world import World, _draft_and_verify, run_world

CFG12 = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=12)
PROMPT = 2048  # prompt tokens a filling step computes (the arrivals that join the next step)


def _world(alpha: float) -> World:
    """Batch 256 where drafts do not pay (a 4 ms decode step, 2 ms per draft forward, catch-ups)."""
    return World(256, alpha=alpha, step_s=0.004, per_token_s=2e-5, draft_s=0.002, catchup_s=0.01,
                 catchup_tok_s=4e-6, launch_s=0.0003, sync_host_s=0.0008, graph_qs=tuple(range(1, 14)),
                 fill=(1.0,) * 12)


def _cycles(ctrl: AdaptiveController, world: World, rule: bool, cycles: int = 40) -> tuple[Counter, Counter]:
    """Drain to 8 requests, fill back to 256 with prompt chunks, run steady; the k chosen in the fills'
    choices and in the steady ones. rule=False: the controller believes the batch never grew."""
    rng = random.Random(0)
    now = [ctrl.clock()]
    ctrl.clock = lambda: now[0]
    filling, steady = Counter(), Counter()
    since = 1
    schedule = ([(b, 0, False) for b in (200, 112, 48) for _ in range(3)] + [(8, 0, False)] * 2 + [(8, PROMPT, False)]
                + [(b, PROMPT, True) for b in (16, 48, 112, 200)] + [(256, 0, True)] + [(256, 0, False)] * 30)
    for _ in range(cycles):
        for b, prompt, fills in schedule:  # (batch, prompt tokens this step computes, a choice of the fill)
            if not rule:
                ctrl._prev_batch = 10 ** 9
            k = ctrl.choose(b)
            (filling if fills else steady)[k] += 1
            drafted, accepted = _draft_and_verify(world, [k] * b, rng)
            propose_s = world.propose_s(k, since)
            since = 1 if k else since + 1
            verify_s = world.verify_s(b + sum(drafted), 1 + k) + prompt * 2e-6
            now[0] += verify_s + propose_s
            reached, acc = verify_counts(drafted, accepted)
            proposal = ProposalStats.measure(k, [k] * b if k else [], drafted if k else [], propose_s)
            ctrl.observe(SpecStepStats(b, b + sum(drafted) + prompt, sum(drafted), verify_s, reached, acc, proposal))
    return filling, steady


@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_no_exploration_from_k0_while_the_batch_fills(alpha: float) -> None:
    world = _world(alpha)
    runs = {}
    for rule in (True, False):
        ctrl = AdaptiveController(CFG12, AdaptiveSettings(explore_budget=None, explore_backoff=1))
        run_world(world, ctrl, 1500)
        runs[rule] = _cycles(ctrl, world, rule)
    filling, steady = runs[True]
    assert set(filling) == {0}, filling  # every choice of the fills: no drafts
    assert sum(n for k, n in steady.items() if k) > 100  # exploring goes on in the steady steps
    filling_without, _ = runs[False]
    assert sum(n for k, n in filling_without.items() if k) > 10  # without the rule the fills explore
