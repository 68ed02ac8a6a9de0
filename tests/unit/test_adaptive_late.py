"""Observing a synchronous step after the next proposal, once the forward it feeds is launched
(AdaptiveController.defer_observation, SpecDecoder.deliver_late): the controller's observe (~0.05-0.1 ms
of host time) then runs while the GPU computes, instead of while it waits (an n-gram proposer leaves the
GPU idle between a step and the next: the 8B shape at 1 request takes ~4.5 ms a step on the H200).

What must hold: the same prices and choices as observing first (the observation's interval then holds
the next proposal's host time, SpecStepStats.ahead_seconds takes it out), only while drafting steadily
(an exploration decides its next step on what it measured), and in the engine every step observed once,
with greedy output unchanged; the estimates prepare() makes while a forward runs are the ones choose()
would make."""
from __future__ import annotations

import copy
import random

import pytest

from specserve import LLM, SamplingParams
from specserve.config import SpeculativeConfig
from specserve.spec.adaptive import AdaptiveController
from tests.helpers.spec_world import CFG, World, run_world
from tests.helpers.stretch_world import StretchWorld, run_stretches

CFG12 = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=12)
CODE = ((0.995, 0.5), (0.93, 0.3), (0.7, 0.2))


class _Counting(AdaptiveController):
    """Counts the observations made late and those made at once."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.late = self.now = 0

    def observe(self, step) -> None:
        if self._set_aside is not None:
            self.late += 1
        else:
            self.now += 1
        super().observe(step)


def _run(world: StretchWorld, late: bool) -> tuple[float, list[int], _Counting]:
    ctrl = _Counting(CFG12)
    run_stretches(world, ctrl, 800, seed=99, late=late)
    rate, chosen = run_stretches(world, ctrl, 2500, seed=1, first_request=200, late=late)
    return rate, chosen, ctrl


@pytest.mark.parametrize("regimes,batch", [(CODE, 1), (CODE, 4), (((0.955, 1.0),), 16)])
def test_observing_late_prices_and_chooses_as_observing_first(regimes, batch: int) -> None:
    world = StretchWorld(batch, regimes, 60.0, step_s=0.0026, draft_s=0.0009)
    rate, chosen, first = _run(world, late=False)
    rate_late, chosen_late, late = _run(world, late=True)
    assert first.late == 0 and late.late > 0.5 * (late.late + late.now)  # steady drafting: mostly late
    assert rate_late == pytest.approx(rate, rel=0.01)
    assert sum(chosen_late) / len(chosen_late) == pytest.approx(sum(chosen) / len(chosen), abs=0.5)
    k = late.best_k
    assert k > 0
    est, est_first = late.estimate(batch), first.estimate(batch)
    # this world has no untimed host work: a verify step is priced at what it takes, not at it plus the
    # next proposal's host time (which the late observation's interval holds)
    verify = est.step_seconds[k] - est.propose_seconds[k]
    assert verify == pytest.approx(world.step_s + world.per_token_s * batch * k + world.verify_host_s, rel=0.05)
    assert est.step_seconds[k] == pytest.approx(est_first.step_seconds[k], rel=0.03)
    assert est.step_seconds[0] == pytest.approx(est_first.step_seconds[0], rel=0.03)


def test_explorations_are_observed_first() -> None:
    """An exploration (or a burst) decides its next step on what it measured: never set aside."""
    world = StretchWorld(4, CODE, 60.0, step_s=0.0026, draft_s=0.0009)
    ctrl = _Counting(CFG12)
    seen = []
    defer = ctrl.defer_observation

    def recording() -> bool:
        pending = ctrl._pending
        ok = defer()
        seen.append((pending.exploring or pending.k != pending.best_k or pending.k == 0, ok))
        return ok

    ctrl.defer_observation = recording
    run_stretches(world, ctrl, 2000, seed=3, late=True)
    assert any(special for special, _ in seen) and any(ok for _, ok in seen)
    assert not any(special and ok for special, ok in seen)


def test_the_engine_observes_every_step_once_and_decodes_as_before(tiny_llama_dir) -> None:
    """A model drafting for itself (every draft accepted: the controller drafts steadily), adaptive: the
    engine delivers late observations, each step is observed once, and the output is plain decoding's."""
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 300) for _ in range(n)] for n in (5, 17, 9, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20)
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params)]
    spec = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 4}
    llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20, speculative_config=spec)
    decoder = llm.engine.spec
    ctrl = decoder.controller
    assert isinstance(ctrl, AdaptiveController)
    counts = {"steps": 0, "observed": 0, "late": 0}
    observe_step, observe = decoder.observe_step, ctrl.observe

    def counting_step(*a, **kw):
        counts["steps"] += 1
        return observe_step(*a, **kw)

    def counting_observe(step) -> None:
        counts["observed"] += 1
        counts["late"] += step.ahead_seconds > 0
        observe(step)

    decoder.observe_step, ctrl.observe = counting_step, counting_observe
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == want
    assert counts["observed"] == counts["steps"] > 0
    assert counts["late"] > 0
    assert ctrl._set_aside is None  # nothing left waiting


def test_late_observations_wait_for_the_next_forward(tiny_llama_dir) -> None:
    """In the engine, a step set aside is observed after the next forward is launched (or once nothing
    is left to run), never later than the next step's own observation."""
    rng = random.Random(8)
    prompts = [[rng.randrange(10, 300) for _ in range(n)] for n in (6, 11)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    spec = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 4}
    llm = LLM(model=str(tiny_llama_dir), progress=False, kv_cache_memory_bytes=4 << 20, speculative_config=spec)
    decoder, runner = llm.engine.spec, llm.engine.runner
    ctrl = decoder.controller
    events: list[str] = []
    execute, observe_step, observe = runner.execute, decoder.observe_step, ctrl.observe

    def counting_execute(*a, **kw):
        events.append("launch")
        return execute(*a, **kw)

    def counting_step(*a, **kw):
        out = observe_step(*a, **kw)
        events.append("set aside" if decoder._late is not None else "step")
        return out

    def counting_observe(step) -> None:
        events.append("late" if ctrl._set_aside is not None else "now")  # (its choice, set aside for it)
        observe(step)

    runner.execute, decoder.observe_step, ctrl.observe = counting_execute, counting_step, counting_observe
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    asides = [i for i, e in enumerate(events) if e == "set aside"]
    assert len(asides) > 3 and decoder._late is None and ctrl._set_aside is None
    for i in asides:
        nxt = next(j for j in range(i + 1, len(events)) if events[j] in ("late", "now"))
        assert events[nxt] == "late"  # the set-aside one, first
        assert "launch" in events[i + 1:nxt] or nxt == len(events) - 1  # after the next launch, or at the end
        assert "step" not in events[i + 1:nxt] and "set aside" not in events[i + 1:nxt]


@pytest.mark.parametrize("batch", [1, 8])
def test_prepared_estimates_are_the_ones_choose_would_make(batch: int) -> None:
    """prepare() then choose() gives the choice and estimates choose() alone gives on the same state."""
    world = World(batch, alpha=0.6, step_s=0.0042, lookup_s=0.0002, fill=(0.4, 0.35, 0.3, 0.25))
    ctrl = AdaptiveController(CFG)
    run_world(world, ctrl, 300, work_ahead=True)
    reused = 0
    for _ in range(40):
        alone = copy.deepcopy(ctrl)
        alone._ahead = None
        ctrl.prepare(batch)
        reused += ctrl._ahead is not None and ctrl._prepared(float(batch))[1] is not None
        ctrl.prepare(batch)
        assert ctrl.choose(batch) == alone.choose(batch)
        assert ctrl.last == alone.last
        run_world(world, ctrl, 3, work_ahead=True)
    assert reused == 40
