"""The adaptive speculation controller (issue 7) on synthetic costs and acceptance, then in the engine.

`simulate` plays the engine's part: each step it asks the controller for k, drafts k tokens per
request (some come back short when `fill` < 1), accepts them position by position with the given
acceptance, and reports the step time a synthetic cost curve gives for that many batched tokens.
"""
from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import pytest

from specserve.spec.adaptive import (
    AdaptiveController,
    AdaptiveSettings,
    ProposalStats,
    SpecStepStats,
    verify_counts,
)
from tests.helpers.spec_world import CFG, K, mostly

CostFn = Callable[[int], float]
PREFILL_S_PER_TOKEN = 1e-5  # prompt chunks: compute-efficient, unlike a verify batch of scattered sequences


def linear(a: float, b: float) -> CostFn:
    """Step seconds for a batch of x tokens: a fixed part (weights read) plus a per-token part."""
    return lambda x: a + b * x


def roofline(flat_s: float, per_token_s: float) -> CostFn:
    """Memory-bound (flat) until the batch is large enough to be compute-bound."""
    return lambda x: max(flat_s, per_token_s * x)


def simulate(ctrl: AdaptiveController, batch: int, alpha: float, steps: int, verify: CostFn,
             draft_s: float = 0.0, fill: float = 1.0, seed: int = 0, prefill: int = 0) -> list[int]:
    """Run `steps` steps at a fixed batch size; returns the k chosen at each. With `prefill`, every
    third step also computes a prompt chunk of that many tokens (a new request arriving), at a
    per-token cost unlike decode's (PREFILL_S_PER_TOKEN)."""
    rng = random.Random(seed)
    chosen = []
    clock = [ctrl.clock()]
    ctrl.clock = lambda: clock[0]  # simulated time: the controller looks for pauses between observations
    for _ in range(steps):
        k = ctrl.choose(batch)
        chosen.append(k)
        drafted = [k if rng.random() < fill else rng.randrange(k) for _ in range(batch)] if k else [0] * batch
        accepted = []
        for d in drafted:
            a = 0
            while a < d and rng.random() < alpha:
                a += 1
            accepted.append(a)
        proposal = ProposalStats.measure(k, [k] * batch, drafted, k * draft_s) if k else None
        reached, acc = verify_counts(drafted, accepted)
        decode = batch + sum(drafted)
        chunk = prefill if len(chosen) % 3 == 0 else 0
        seconds = (verify(decode) + chunk * PREFILL_S_PER_TOKEN) * (1.0 + 0.05 * (rng.random() - 0.5))
        clock[0] += seconds + (proposal.seconds if proposal is not None else 0.0)
        ctrl.observe(SpecStepStats(batch, decode + chunk, sum(drafted), seconds, reached, acc, proposal))
    return chosen


def oracle_k(batch: int, alpha: float, verify: CostFn, draft_s: float = 0.0) -> int:
    """The best k knowing the true costs and acceptance."""
    def rate(k: int) -> float:
        expected = sum(alpha ** j for j in range(k + 1))
        return batch * expected / (verify(batch * (k + 1)) + k * draft_s)
    return max(range(K + 1), key=rate)


# -- the controller (its building blocks: test_step_stats.py, test_estimators.py) ----------------------
def test_fresh_controller_is_optimistic_and_exposes_its_estimates() -> None:
    ctrl = AdaptiveController(CFG)
    assert ctrl.choose(8) == K and ctrl.last_choice == K
    est = ctrl.last
    assert est is not None and est.chosen_k == est.best_k == K and est.batch_size == 8
    # prior acceptance 0.8 at every position, every draft produced: E = 1 + .8 + .64 + ...
    assert est.expected_tokens == pytest.approx([sum(0.8 ** j for j in range(k + 1)) for k in range(K + 1)])
    assert len(est.tokens_per_s) == len(est.step_seconds) == K + 1 and len(est.acceptance_per_pos) == K
    assert ctrl.estimate(8).best_k == K  # estimate() does not advance the exploration schedule
    assert ctrl.num_choices == 1


def test_prepared_terms_serve_one_choice_at_the_same_batch_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """prepare() computes the next choice's drafting terms ahead (the engine calls it while a forward
    runs); choose() takes them once, at the batch size they were made for, at most one step behind."""
    ctrl = AdaptiveController(CFG)
    simulate(ctrl, batch=4, alpha=0.8, steps=60, verify=linear(0.005, 1e-4))
    computed = []
    real = ctrl._drafting_terms
    monkeypatch.setattr(ctrl, "_drafting_terms", lambda b: computed.append(b) or real(b))
    ctrl.prepare(4)
    assert computed == [4.0]
    ahead = ctrl._ahead[2]
    simulate(ctrl, batch=4, alpha=0.8, steps=1, verify=linear(0.005, 1e-4))  # choose takes them, one observed
    assert computed == [4.0] and ctrl._ahead is None
    assert ctrl.last.acceptance_per_pos == tuple(ahead.alpha)
    ctrl.prepare(4)
    ctrl.choose(8)  # another batch size: computed now
    assert computed == [4.0, 4.0, 8.0]
    ctrl.prepare(8)
    simulate(ctrl, batch=8, alpha=0.8, steps=2, verify=linear(0.005, 1e-4))  # the 2nd choice: none prepared
    assert computed[-2:] == [8.0, 8.0] and len(computed) == 5


# -- decisions on synthetic costs ------------------------------------------------------------------
def test_full_k_when_acceptance_is_high_and_the_batch_small() -> None:
    ctrl = AdaptiveController(CFG)
    chosen = simulate(ctrl, batch=1, alpha=0.8, steps=200, verify=linear(0.010, 5e-5))
    assert ctrl.best_k == K and mostly(chosen[-100:]) == K
    assert Counter(chosen[-100:])[K] >= 85  # only the exploration steps try K-1


@pytest.mark.parametrize("cost", [linear(0.005, 1e-4), roofline(0.010, 5e-5)], ids=["linear", "roofline"])
def test_drafts_less_as_the_batch_grows(cost: CostFn) -> None:
    best = []
    for batch in (1, 8, 32, 128, 512):
        ctrl = AdaptiveController(CFG)
        chosen = simulate(ctrl, batch, alpha=0.8, steps=300, verify=cost)
        want = oracle_k(batch, 0.8, cost)
        assert abs(ctrl.best_k - want) <= 1, (batch, ctrl.best_k, want, ctrl.last)
        best.append(mostly(chosen[-100:]))
    assert best == sorted(best, reverse=True), best
    assert best[0] == K and best[-1] == 0


@pytest.mark.parametrize(("batch", "want"), [(4, K), (512, 0)])
def test_prompt_chunks_in_the_step_do_not_mislead_it(batch: int, want: int) -> None:
    ctrl = AdaptiveController(CFG)
    cost = linear(0.005, 1e-4)
    chosen = simulate(ctrl, batch, alpha=0.8, steps=300, verify=cost, prefill=1024)
    assert oracle_k(batch, 0.8, cost) == want
    assert ctrl.best_k == want and mostly(chosen[-100:]) == want


def test_follows_the_batch_size_up_and_down() -> None:
    ctrl = AdaptiveController(CFG)
    seen = {}
    for batch in (1, 32, 512, 32, 1):
        chosen = simulate(ctrl, batch, alpha=0.8, steps=300, verify=linear(0.005, 1e-4))
        seen.setdefault(batch, []).append(mostly(chosen[-100:]))
    assert seen[1] == [K, K] and seen[512] == [0]
    assert all(abs(k - oracle_k(32, 0.8, linear(0.005, 1e-4))) <= 1 for k in seen[32])


def test_no_drafts_when_acceptance_is_low() -> None:
    ctrl = AdaptiveController(CFG)
    cost = linear(0.010, 2e-4)
    chosen = simulate(ctrl, batch=8, alpha=0.05, steps=300, verify=cost)
    assert oracle_k(8, 0.05, cost) == 0
    assert ctrl.best_k == 0 and Counter(chosen[-100:])[0] >= 80  # k=1 on exploration steps (and rare noise)
    assert ctrl.last.acceptance_per_pos[0] == pytest.approx(0.05, abs=0.07)


def test_no_drafts_when_drafting_costs_more_than_it_saves() -> None:
    ctrl = AdaptiveController(CFG)
    cost = linear(0.010, 1e-5)
    chosen = simulate(ctrl, batch=1, alpha=0.8, steps=300, verify=cost, draft_s=0.012)  # a slow draft model
    assert oracle_k(1, 0.8, cost, draft_s=0.012) == 0
    assert ctrl.best_k == 0 and mostly(chosen[-100:]) == 0


def test_short_ngram_drafts_cost_less_and_still_pay() -> None:
    ctrl = AdaptiveController(CFG)
    simulate(ctrl, batch=32, alpha=0.8, steps=300, verify=linear(0.005, 1e-4), fill=0.2)
    est = ctrl.last
    assert est.fill_per_pos[-1] < 0.5 < est.fill_per_pos[0]  # short drafts: later positions rarely filled
    full = AdaptiveController(CFG)
    simulate(full, batch=32, alpha=0.8, steps=300, verify=linear(0.005, 1e-4))
    assert est.step_seconds[K] < full.last.step_seconds[K]  # fewer drafted tokens to verify


def test_adapts_when_acceptance_changes_mid_stream() -> None:
    ctrl = AdaptiveController(CFG)
    cost = linear(0.010, 2e-4)
    assert oracle_k(8, 0.9, cost) == K and oracle_k(8, 0.1, cost) == 0
    phases = []
    for i, alpha in enumerate((0.9, 0.1, 0.9)):
        phases.append(simulate(ctrl, batch=8, alpha=alpha, steps=300, verify=cost, seed=i))
    high, low, again = phases
    assert mostly(high[-100:]) == K
    assert mostly(low[-100:]) == 0 and low[:20].count(K) >= 10  # it notices within the phase, not at once
    assert mostly(again[-100:]) == K  # exploring k=1 from k=0 sees acceptance come back


def test_explores_a_neighbour_that_is_far_from_paying_less_often() -> None:
    cost = linear(0.010, 2e-3)  # compute-bound: one draft per request costs 60% more than a decode step
    counts = []
    for max_loss in (0.25, 1.0):
        # the schedule alone: no exploration budget, single-step explorations (both tested below)
        settings = AdaptiveSettings(explore_max_loss=max_loss, explore_budget=None, explore_burst=1)
        ctrl = AdaptiveController(CFG, settings)
        chosen = simulate(ctrl, batch=8, alpha=0.05, steps=400, verify=cost)
        assert ctrl.best_k == 0 and ctrl.last.tokens_per_s[1] < 0.75 * ctrl.last.tokens_per_s[0]
        counts.append(sum(1 for k in chosen[-200:] if k))  # explorations (of 1, and of K: see _neighbour)
    assert counts[1] == 200 // 10 and counts[0] <= counts[1] // 4 + 2


def test_exploration_is_a_fixed_schedule() -> None:
    runs = []
    for _ in range(2):
        ctrl = AdaptiveController(CFG)
        runs.append(simulate(ctrl, batch=32, alpha=0.8, steps=200, verify=linear(0.005, 1e-4)))
    assert runs[0] == runs[1]
    # every explore_every-th choice, a neighbour (the prior's K - 1 is 12% slower than K: within this
    # threshold, so never backed off)
    ctrl = AdaptiveController(CFG, AdaptiveSettings(explore_max_loss=0.25))
    off_best = 0
    for _ in range(100):
        k = ctrl.choose(4)
        off_best += k != ctrl.best_k
        assert abs(k - ctrl.best_k) <= 1
    assert off_best == 100 // ctrl.settings.explore_every


# -- through the engine ------------------------------------------------------------------------------
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown",
           "def add(a, b):\n    return a + b\ndef add(", "alpha beta gamma delta alpha beta gamma",
           "Paris is the capital of France. Paris"]


def test_engine_greedy_output_does_not_depend_on_the_controller(tiny_llama_dir) -> None:
    from specserve import LLM, SamplingParams
    from specserve.spec.controller import FixedController

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs, controllers, chosen = {}, {}, {}
    configs = {"off": None, "adaptive": NGRAM, "fixed": {**NGRAM, "adaptive": False},
               "table": {**NGRAM, "num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 256, 1]]}}
    for name, spec in configs.items():
        llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20, speculative_config=spec)
        outputs[name] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        if spec is not None:
            controllers[name] = llm.engine.spec.controller
            metrics = {m.name: m for m in llm.get_metrics()}
            assert metrics["specserve:spec_decode_num_drafts_total"].value > 0, name
            chosen[name] = metrics["specserve:spec_decode_chosen_num_tokens"].value
    assert outputs["adaptive"] == outputs["off"] == outputs["fixed"] == outputs["table"]
    adaptive = controllers["adaptive"]
    assert isinstance(adaptive, AdaptiveController)
    assert isinstance(controllers["fixed"], FixedController) and isinstance(controllers["table"], FixedController)
    assert adaptive.num_choices > 0 and adaptive.last is not None and chosen["adaptive"] == adaptive.last_choice
    assert adaptive.verify_cost.weight > 0 and adaptive.decode_cost.weight > 0  # it measured both kinds of step
    assert adaptive.acceptance.trials[0] > 0 and adaptive.fill.trials[0] > 0


@pytest.mark.parametrize("num_seqs", [0, 1, 256])
def test_a_proposal_of_nothing_is_measure_of_k_0(num_seqs: int) -> None:
    """ProposalStats.nothing (the record of each k = 0 choice at high load) is what measure() makes of
    it, field for field: the controller learns the same from either."""
    assert ProposalStats.nothing(num_seqs) == ProposalStats.measure(0, [0] * num_seqs, [], 0.0)
    assert ProposalStats.nothing(num_seqs).depth == 0
