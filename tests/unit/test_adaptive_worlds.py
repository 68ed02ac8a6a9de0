"""The adaptive speculation controller against every fixed k in synthetic serving worlds
(tests/helpers/spec_world.py): graphs, catch-up, expensive drafters, asynchronous scheduling, and the
H200 pair sweep's under-drafting at concurrency 1-8."""
from __future__ import annotations

import itertools
from collections import Counter

import pytest

from specserve.spec.adaptive import (
    AdaptiveController,
    ProposalStats,
    SpecStepStats,
    verify_counts,
)
from tests.helpers.spec_world import (
    CFG,
    PAIR_STEP_S,
    K,
    World,
    assert_near_best,
    mostly,
    pair_world,
    run_world,
)

# -- against every fixed k, in synthetic worlds with graphs, catch-up and expensive drafters ---------
WORLDS = {
    # the 0.5B draft for the 1.5B target: a draft forward costs nearly a target step (both launch-bound)
    "draft-as-slow-as-target": World(batch=1, alpha=0.85, eager_s=0.004, draft_s=0.0017, catchup_s=0.004),
    # the same at batch 64: catching up costs per skipped token too
    "draft-as-slow-as-target-b64": World(batch=64, alpha=0.85, per_token_s=2e-5, eager_s=0.005, draft_s=0.002,
                                        catchup_s=0.004, catchup_tok_s=2e-6),
    # a cheap drafter (an EAGLE head) with good acceptance: full k pays
    "cheap-draft": World(batch=1, alpha=0.8, eager_s=0.004, draft_s=0.0002),
    # random weights + n-gram: drafts come back one token long (the model repeats itself) and are all accepted
    "ngram-one-token-drafts": World(batch=4, alpha=1.0, step_s=0.005, eager_s=0.0065, lookup_s=3e-5,
                                    fill=(0.95, 0.0, 0.0, 0.0)),
    # n-gram drafts that are never accepted, at a batch where lookups cost
    "ngram-useless": World(batch=128, alpha=0.0, step_s=0.005, per_token_s=7e-5, eager_s=0.0065, lookup_s=3e-5,
                           fill=(0.6, 0.5, 0.4, 0.3)),
    # compute-bound verify at a large batch: drafting cannot pay even with good acceptance
    "large-batch": World(batch=256, alpha=0.8, step_s=0.004, per_token_s=5e-5, eager_s=0.006, lookup_s=3e-5),
}


@pytest.mark.parametrize("name", list(WORLDS))
def test_within_5_percent_of_the_best_fixed_k_and_of_no_speculation(name: str) -> None:
    world = WORLDS[name]
    fixed = {k: run_world(world, k, 600)[0] for k in range(K + 1)}
    rate, chosen = run_world(world, AdaptiveController(CFG), 3000)
    best = max(fixed, key=fixed.__getitem__)
    assert rate >= 0.95 * fixed[best], (name, rate, fixed, Counter(chosen[-500:]))
    assert rate >= 0.95 * fixed[0], (name, rate, fixed[0])
    assert mostly(chosen[-500:]) == best or fixed[mostly(chosen[-500:])] >= 0.97 * fixed[best], (fixed, Counter(chosen))


@pytest.mark.parametrize("name", list(WORLDS))
def test_choices_prepared_a_step_ahead_stay_near_the_best(name: str) -> None:
    """The engine has the controller prepare its next choice while a forward runs (terms one step
    behind): the same bar as choosing on up-to-date terms."""
    world = WORLDS[name]
    fixed = {k: run_world(world, k, 600)[0] for k in range(K + 1)}
    rate, chosen = run_world(world, AdaptiveController(CFG), 3000, work_ahead=True)
    best = max(fixed, key=fixed.__getitem__)
    assert rate >= 0.95 * fixed[best] and rate >= 0.95 * fixed[0], (name, rate, fixed, Counter(chosen[-500:]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_host_work_outside_the_step_timers_counts_against_no_drafts(seed: int) -> None:
    """Overlapped (k = 0) steps cost more than their timers show: the engine loop and the controller's
    own choice run outside them (~0.07 of a 1.24 ms step at the H200 pair's concurrency 1; 0.2 ms of
    1.32 here). Priced on the timers alone, no drafts looks faster than k = 4; it is 12% slower."""
    world = pair_world(1, alpha=0.85, async_gap_s=0.0002)
    fixed = {k: run_world(world, k, 600)[0] for k in range(K + 1)}
    rate, chosen = run_world(world, AdaptiveController(CFG), 3000, seed)
    # drafting is >10% faster, but no drafts priced on its step timer alone (1 token per 1.32 ms) beats it
    assert 1.1 * fixed[0] < max(fixed.values()) < 1 / 0.00132, fixed
    assert rate >= 0.95 * max(fixed.values()), (rate, fixed, Counter(chosen[-500:]))


@pytest.mark.parametrize("drafter", ["draft-model", "cheap-head"])
def test_one_controller_through_a_concurrency_sweep(drafter: str) -> None:
    """Like bench/controller_sweep.py: one controller serves batch 1, then 8, 32, 128 in turn."""
    ctrl = AdaptiveController(CFG)
    for batch in (1, 8, 32, 128):
        step_s = max(0.002 + 1.25e-5 * batch, batch / 18000)
        if drafter == "draft-model":  # a 0.5B draft for a 1.5B target: both launch-bound
            world = World(batch, alpha=0.8, step_s=step_s, per_token_s=3e-5 if batch > 32 else 0.0, eager_s=0.004,
                          draft_s=max(0.0017, batch / 50000), catchup_s=0.004, catchup_tok_s=2.5e-6)
        else:
            world = World(batch, alpha=0.8, step_s=step_s, per_token_s=3e-5 if batch > 32 else 1e-6, eager_s=0.004,
                          draft_s=0.0002 + batch * 2e-6)
        fixed = {k: run_world(world, k, 300)[0] for k in range(K + 1)}
        rate, chosen = run_world(world, ctrl, 400, seed=batch)
        best = max(fixed.values())
        assert rate >= 0.95 * best and rate >= 0.95 * fixed[0], (drafter, batch, rate, fixed, Counter(chosen))


def test_a_batch_jump_with_fresh_requests_does_not_stall_drafting() -> None:
    """Batch 1 -> 4 of brand-new requests (n-gram finds nothing for a few steps) on a compute-bound
    device (the decode cost grows with the batch, so batch 1 mispriced it): drafting resumes quickly."""
    cpu_like = {"step_s": 0.05, "per_token_s": 0.0125, "eager_s": 0.0, "lookup_s": 1e-4}
    ctrl = AdaptiveController(CFG)
    run_world(World(batch=1, alpha=1.0, fill=(0.95, 0.0, 0.0, 0.0), **cpu_like), ctrl, 20)  # little budget banked
    run_world(World(batch=4, alpha=1.0, fill=(0.0,) * K, **cpu_like), ctrl, 3)
    world = World(batch=4, alpha=1.0, fill=(0.95, 0.0, 0.0, 0.0), **cpu_like)
    _, chosen = run_world(world, ctrl, 60)
    assert run_world(world, 1, 60)[0] > 1.2 * run_world(world, 0, 60)[0]  # drafting pays here
    assert sum(1 for k in chosen[-50:] if k) >= 40, chosen


def test_exploring_an_expensive_drafter_stays_within_budget() -> None:
    world = WORLDS["draft-as-slow-as-target"]
    ctrl = AdaptiveController(CFG)
    rate, chosen = run_world(world, ctrl, 3000)
    off = run_world(world, 0, 600)[0]
    assert mostly(chosen) == 0 and rate >= (0.99 - ctrl.settings.explore_budget) * off
    assert ctrl.exploration_loss_seconds <= 1.5 * ctrl.settings.explore_budget * ctrl.observed_seconds
    explored = [i for i, k in enumerate(chosen[100:]) if k]
    assert 0 < len(explored) < 3000 // ctrl.settings.explore_every // 4  # far rarer than the schedule's slots
    # explorations from k = 0 come in bursts: the second step of each is a warm proposal to learn from
    assert any(b - a == 1 for a, b in itertools.pairwise(explored))
    k = chosen[100 + explored[-1]]
    warm = world.propose_s(k, 1)  # what the fit learned: the warm cost, not the catch-up's
    assert ctrl.propose_cost.predict((1, k, k, 1)) == pytest.approx(warm, rel=0.15)
    assert ctrl.catches_up() and ctrl.cold_extra == pytest.approx(world.catchup_s / warm, rel=0.3)
    assert ctrl.costs.catch_up_cost.predict((1.0, 500.0)) == pytest.approx(world.catchup_s, rel=0.15)


def test_a_captured_verify_length_beats_a_smooth_cost_curve() -> None:
    """k = K replays a graph, k < K runs eagerly: the per-k offsets find that K pays while 1..K-1 do not."""
    world = World(batch=1, alpha=0.7, eager_s=0.009, draft_s=0.0003)
    fixed = {k: run_world(world, k, 400)[0] for k in range(K + 1)}
    assert max(fixed, key=fixed.__getitem__) == K and fixed[1] < fixed[0]
    ctrl = AdaptiveController(CFG)
    _, chosen = run_world(world, ctrl, 1500)
    assert ctrl.best_k == K and mostly(chosen[-300:]) == K
    est = ctrl.estimate(1)
    assert est.step_seconds[K - 1] > est.step_seconds[K]  # learned: the eager length costs more
    assert ctrl.verify_cost_by_k[K - 1].predict((1, 4, 0)) > ctrl.verify_cost_by_k[K].predict((1, 5, 0))


def test_decode_cost_is_not_taken_from_prompt_steps() -> None:
    """A fresh controller that has only seen a prefill step (no drafts) must not think decoding costs that."""
    ctrl = AdaptiveController(CFG)
    assert ctrl.choose(1) == K
    ctrl.observe(SpecStepStats(1, 400, 0, 0.030, (), (), None))  # a 400-token prompt: 30 ms
    k = ctrl.choose(1)
    ctrl.observe(SpecStepStats(1, 1 + k, k, 0.002, *verify_counts([k], [0]),
                               ProposalStats.measure(k, [k], [k], 0.008)))
    ctrl.choose(1)
    ctrl.observe(SpecStepStats(1, 1 + K, K, 0.002, *verify_counts([K], [0]),
                               ProposalStats.measure(K, [K], [K], 0.008)))  # warm: drafting costs 8 ms
    est = ctrl.estimate(1)
    assert est.step_seconds[0] < 0.005  # a decode step is priced like a verify step, not like the prompt
    assert ctrl.choose(1) == 0



def test_a_plain_step_after_prompt_chunks_is_no_decode_measurement() -> None:
    """With asynchronous scheduling a plain step's timer also waits for the step before it to finish on
    the GPU; after an eager step with prompt chunks (new requests) that is several ms more than decoding
    costs. In the H200 pair sweep (nineteenth session) the controller's decode fit at batch 17-32 priced a
    decode step at 4.76 ms where it took 1.92, and it drafted where no speculation made 25% more."""
    ctrl = AdaptiveController(CFG)
    now = [0.0]
    ctrl.clock = lambda: now[0]

    def observe(batch: int, tokens: int, seconds: float) -> None:
        ctrl.choose(batch)
        now[0] += seconds  # no pause between observations
        ctrl.observe(SpecStepStats(batch, tokens, 0, seconds, (), (), ProposalStats.measure(0, [], [], 0.0)))

    for _ in range(8):
        observe(16, 16, 0.0018)
    for _ in range(4):  # a burst of new requests: their prompts in chunks, between decode steps
        observe(32, 32 + 1500, 0.015)  # an eager step with a prompt chunk
        observe(32, 32, 0.008)  # decoding, timed with the prompt step's tail
    observe(32, 32, 0.0019)  # one clean decode step, then the controller drafts here (as on the H200)
    decode_s, _ = ctrl.costs.decode_seconds(32)
    assert decode_s == pytest.approx(0.0019, rel=0.1)

# -- the H200 sweep's failure: under-drafting at concurrency 1-8 with a draft model --------------------
# A 0.5B draft model for a 1.5B target on an H200 with asynchronous scheduling, per batch size (from
# bench/controller_sweep.py, /work/.device/31): a decode step (overlapped) costs 1.3-1.8 ms, a verify
# step pays 0.75 ms of host work on top (it runs synchronously), a draft forward 0.56-1.06 ms, and a
# catch-up after a pause an eager forward (3 ms + 4 us per token). Acceptance 0.93 per position: only
# k = K beats no drafts at batch 1-8 (by 8-23%); from batch 16 on nothing does.
def test_a_decode_step_timed_at_its_launch_is_not_what_decoding_costs() -> None:
    """With asynchronous scheduling the first step without drafts after a verify step is timed when its
    forward is launched (0.3 ms here, 1.3 ms in truth). Taken for a decode measurement (the controller's
    own probes produce one each), it made no drafts look 4x faster than they are: the H200 sweep's
    controller drafted little at concurrency 1 (0.91 of k = 4) and 2 (0.81)."""
    world = pair_world(1)
    assert run_world(world, K, 600)[0] > 1.1 * run_world(world, 0, 600)[0]
    ctrl = AdaptiveController(CFG)
    chosen = assert_near_best(world, ctrl, 1000)
    assert mostly(chosen[-300:]) == K
    assert ctrl.estimate(1).step_seconds[0] == pytest.approx(world.step_s, rel=0.1)


@pytest.mark.parametrize("batch", [1, 4, 8])
def test_a_controller_that_saw_only_plain_decode_steps_comes_to_draft(batch: int) -> None:
    """A controller that has seen only plain decode steps, at this batch size (it settled on k = 0, say):
    drafting must still be tried, measured and chosen where it pays."""
    ctrl = AdaptiveController(CFG)
    step_s, plain = PAIR_STEP_S[batch], ProposalStats.measure(0, [], [], 0.0)
    for _ in range(300):
        ctrl.observe(SpecStepStats(batch, batch, 0, step_s, (), (), plain))
    chosen = assert_near_best(pair_world(batch), ctrl, 800)
    assert mostly(chosen[-300:]) == K


def test_noisy_first_costs_do_not_stop_drafting_for_good() -> None:
    """The first steps run eagerly at 40 ms (JIT, graphs not captured yet): drafting K measured then
    looks 10x dearer than it is. Once steps are fast the controller must come back to drafting: a k
    measured only slowly is explored again, and a fit fed rarely follows a changed cost at once."""
    ctrl = AdaptiveController(CFG)
    run_world(pair_world(4, eager_s=0.040, graph_qs=()), ctrl, 30)
    chosen = assert_near_best(pair_world(4), ctrl, 800, seed=3)
    assert mostly(chosen[-300:]) == K


def test_one_controller_through_an_async_concurrency_sweep() -> None:
    """bench/controller_sweep.py's protocol on the pair: one controller, batch 1 up to 16 and back."""
    ctrl = AdaptiveController(CFG)
    for batch in (1, 2, 4, 8, 16, 8, 4, 2, 1):
        chosen = assert_near_best(pair_world(batch), ctrl, 400, seed=batch)
        assert mostly(chosen[-200:]) == (0 if batch == 16 else K), (batch, Counter(chosen))


def test_costs_measured_at_another_batch_size_are_only_a_guess() -> None:
    """Settled on no drafts at batch 16 (where drafting loses), then batch 4 (where K wins by 23%): the
    batch-16 costs must not keep it from measuring drafting at batch 4."""
    ctrl = AdaptiveController(CFG)
    _, chosen = run_world(pair_world(16), ctrl, 600)
    assert mostly(chosen[-300:]) == 0
    chosen = assert_near_best(pair_world(4), ctrl, 600, seed=1)
    assert mostly(chosen[-300:]) == K
    assert K in ctrl.estimate(4).trusted  # measured at batch 4 itself


def test_a_step_after_a_pause_is_no_decode_measurement() -> None:
    """The engine idled (no step for 2 s): the first step after it, and the one after that (the first
    overlapped one was launched behind a synchronous step), may be timed at their launch."""
    ctrl = AdaptiveController(CFG)
    now = [0.0]
    ctrl.clock = lambda: now[0]
    plain = ProposalStats.measure(0, [], [], 0.0)
    for _ in range(5):
        now[0] += 0.002
        ctrl.observe(SpecStepStats(4, 4, 0, 0.002, (), (), plain))
    weight = ctrl.decode_cost.weight
    now[0] += 2.0
    for seconds in (0.0003, 0.0005):  # launch-timed
        now[0] += seconds
        ctrl.observe(SpecStepStats(4, 4, 0, seconds, (), (), plain))
    assert ctrl.decode_cost.weight == weight  # not fed
    now[0] += 0.002
    ctrl.observe(SpecStepStats(4, 4, 0, 0.002, (), (), plain))
    assert ctrl.decode_cost.weight > weight
    assert ctrl.estimate(4).step_seconds[0] == pytest.approx(0.002, rel=0.01)


def test_a_decode_cost_measured_in_a_disturbance_is_measured_again() -> None:
    """A bucket's decode cost measured once while steps were slow (warm-up: 3x the true cost) made
    drafting look better than no drafts. Where drafting does not pay (drafts mostly rejected, the verify
    step dearer than a decode step), periodic decode probes must correct it and the controller settle
    on k = 0, within 5% of no speculation; the probes must stay rare while drafting does pay."""
    world = World(batch=2, alpha=0.2, step_s=0.0046, per_token_s=2e-5, lookup_s=3e-5, launch_s=0.0003,
                  sync_host_s=0.0012, fill=(0.5, 0.4, 0.3, 0.2), graph_qs=tuple(range(1, K + 2)))
    assert run_world(world, 0, 600)[0] > 1.05 * max(run_world(world, k, 600)[0] for k in range(1, K + 1))
    ctrl = AdaptiveController(CFG)
    plain = ProposalStats.measure(0, [], [], 0.0)
    for _ in range(5):  # decode steps of the warm-up, three times slower than they are
        ctrl.observe(SpecStepStats(2, 2, 0, 3 * world.step_s, (), (), plain))
    chosen = assert_near_best(world, ctrl, 1500)
    assert mostly(chosen[-300:]) == 0
    good = World(batch=2, alpha=0.9, step_s=0.0046, per_token_s=2e-5, lookup_s=3e-5, launch_s=0.0003,
                 sync_host_s=0.0006, graph_qs=tuple(range(1, K + 2)))
    chosen = assert_near_best(good, AdaptiveController(CFG), 1500)
    assert chosen[-1000:].count(0) <= 20


def test_a_draft_model_is_not_re_probed_while_drafting_pays() -> None:
    """Periodic decode probes would make a draft model catch up each time drafting resumes (the H200
    pair left drafting for long stretches after them): a proposer that catches up is only probed while
    its bucket's decode cost is unknown (or stale: one probe per `stale_after` observations)."""
    ctrl = AdaptiveController(CFG)
    chosen = assert_near_best(pair_world(1), ctrl, 2000)
    assert chosen[-1200:].count(0) <= 3  # re-probing every 250 observations: 12


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_proposal_cost_with_spikes_is_priced_at_its_mean(seed: int) -> None:
    """Proposals of k = 4 cost 1 ms, and 5 ms one time in four (a draft model falling off its CUDA
    graphs now and then): on average 2 ms, so k = 3 is the best by far. A fit by relative least squares
    alone prices k = 4 near 1.05 ms and picks it (the H200 pair at concurrency 1: a k = 11 proposal
    fitted 4.4 ms, averaged 6.6, and the controller drafted 11 where 8 was faster)."""
    world = World(batch=1, alpha=0.85, step_s=0.0012, draft_s=0.0002, graph_qs=tuple(range(1, K + 2)),
                  spikes=(K, 0.25, 0.004))
    fixed = {k: run_world(world, k, 2000, seed)[0] for k in range(K + 1)}
    assert max(fixed, key=fixed.__getitem__) == K - 1 and fixed[K] < 0.8 * fixed[K - 1], fixed
    rate, chosen = run_world(world, AdaptiveController(CFG), 3000, seed)
    assert rate >= 0.95 * fixed[K - 1], (rate, fixed, Counter(chosen[-500:]))
    assert mostly(chosen[-500:]) == K - 1, Counter(chosen[-500:])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_load_where_drafts_stop_paying_explores_little(seed: int) -> None:
    """From batch 8, where n-gram k = 4 pays (8%), to batch 16, where every k is 19-28% slower than no
    drafts (the 8B sweep's concurrency 8 -> 16, 250-step parts): neighbours that far from paying are
    explored on every 4th slot only. With a 25% threshold the controller drafted 11-12% of the next
    500 steps (an exploration burst of 2 steps every 10 choices until the budget cut in) and ran at
    0.96 of no drafts; the H200 sweep measured 0.90-0.91 there."""
    eight = World(batch=8, alpha=0.45, step_s=0.0039, per_token_s=2e-5, eager_s=0.0052, graph_qs=(1,),
                  lookup_s=8e-5, fill=(0.6, 0.5, 0.4, 0.3))
    sixteen = World(batch=16, alpha=0.3, step_s=0.0044, per_token_s=2e-5, eager_s=0.0065, graph_qs=(1,),
                    lookup_s=8e-5, fill=(0.6, 0.5, 0.4, 0.3))
    fixed = {k: run_world(sixteen, k, 600)[0] for k in range(K + 1)}
    assert max(fixed, key=fixed.__getitem__) == 0 and max(fixed[k] for k in range(1, K + 1)) < 0.85 * fixed[0], fixed
    ctrl = AdaptiveController(CFG)
    run_world(eight, ctrl, 450, seed)
    rate, chosen = run_world(sixteen, ctrl, 500, seed)
    drafting = sum(k > 0 for k in chosen) / len(chosen)
    assert rate >= 0.97 * fixed[0] and drafting <= 0.08, (rate / fixed[0], drafting, Counter(chosen))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_load_whose_requests_accept_less_than_the_last_measured_stops_drafting(seed: int) -> None:
    """Bursts of 2 requests that accept 95% of n-gram drafts between stretches of 16 that accept 30%
    (and get fewer): the shared acceptance windows, refreshed by every burst, over-predict at 16 each
    time the load comes back, as on the H200 8B n-gram sweep at 8 and 16 requests (k = 4 steps got
    0.23-0.31 and 0.17-0.25 accepted drafts per request where 0.61 and 0.44-0.49 were predicted).
    Without the per-bucket calibration
    (estimators.TokenCalibration) the controller drafted 25% of the steps at 16 and ran at 0.92 of no
    drafts there; with it, <= 8% and >= 0.97. At 2 requests it still drafts (k = 4 pays 2.5x there)."""
    def world(batch: int, alpha: float, fill: tuple[float, ...]) -> World:
        return World(batch=batch, alpha=alpha, step_s=0.0044, per_token_s=2e-5, eager_s=0.0065, graph_qs=(1,),
                     lookup_s=8e-5, fill=fill)

    small, big = world(2, 0.95, (0.9, 0.8, 0.7, 0.6)), world(16, 0.3, (0.5, 0.3, 0.25, 0.2))
    off = run_world(big, 0, 600)[0]
    assert max(run_world(big, k, 600)[0] for k in range(1, K + 1)) < 0.8 * off
    ctrl, rates, chosen, small_chosen = AdaptiveController(CFG), [], [], []
    for cycle in range(12):
        small_chosen += run_world(small, ctrl, 80, 50 * seed + cycle)[1]
        rate, ks = run_world(big, ctrl, 80, 50 * seed + cycle)
        if cycle >= 4:  # past the first measurements of both loads
            rates.append(rate)
            chosen += ks
    drafting = sum(k > 0 for k in chosen) / len(chosen)
    assert sum(rates) / len(rates) >= 0.97 * off and drafting <= 0.08, (sum(rates) / len(rates) / off, drafting)
    assert mostly(small_chosen[-300:]) == K
