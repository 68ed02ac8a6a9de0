"""The adaptive controller does not start exploring drafts from k = 0 while the batch fills.

On the H200 pair (twenty-third session) most explorations at 256 requests started in a part's first
steps, while the batch filled with new requests' prompt chunks (10-55 requests): each paid a draft
model's catch-up (proposals of 15-40 ms), measured a batch size gone a step later, and its warm
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
from specserve.spec.batch_growth import FILL_CHOICES
from tests.helpers.spec_world import World, _draft_and_verify, run_world

CFG12 = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=12)
PROMPT = 2048  # prompt tokens a filling step computes (the arrivals that join the next step)


def _world(alpha: float) -> World:
    """Batch 256 where drafts do not pay (a 4 ms decode step, 2 ms per draft forward, catch-ups)."""
    return World(256, alpha=alpha, step_s=0.004, per_token_s=2e-5, draft_s=0.002, catchup_s=0.01,
                 catchup_tok_s=4e-6, launch_s=0.0003, sync_host_s=0.0008, graph_qs=tuple(range(1, 14)),
                 fill=(1.0,) * 12)


def _warmed(world: World) -> AdaptiveController:
    """A controller with exploring uncapped (every slot explores), after 1,500 steps of `world`."""
    ctrl = AdaptiveController(CFG12, AdaptiveSettings(explore_budget=None, explore_backoff=1))
    run_world(world, ctrl, 1500)
    return ctrl


def _step(ctrl: AdaptiveController, world: World, rng: random.Random, now: list[float], b: int, k: int,
          prompt: int, since: int, feed_prompt: bool = False) -> int:
    """One step of b requests at k, computing `prompt` prompt tokens, observed by ctrl on the simulated
    clock `now`; feed_prompt: a proposal with drafts feeds those prompt tokens to the draft model too.
    Returns the steps since the last proposal with drafts, for the next step."""
    drafted, accepted = _draft_and_verify(world, [k] * b, rng)
    propose_s = world.propose_s(k, since, prompt if k and feed_prompt else 0)
    verify_s = world.verify_s(b + sum(drafted), 1 + k) + prompt * 2e-6
    now[0] += verify_s + propose_s
    reached, acc = verify_counts(drafted, accepted)
    proposal = ProposalStats.measure(k, [k] * b if k else [], drafted if k else [], propose_s)
    ctrl.observe(SpecStepStats(b, b + sum(drafted) + prompt, sum(drafted), verify_s, reached, acc, proposal))
    return 1 if k else since + 1


def _cycles(ctrl: AdaptiveController, world: World, rule: bool, cycles: int = 40,
            apart: bool = False, pauses: bool = False) -> tuple[Counter, Counter]:
    """Drain to 8 requests, fill back to 256 with prompt chunks, run steady; the k explored (chosen while
    the best k was another) in the fills' choices and in the steady ones (0: not exploring). rule=False:
    the controller believes the batch never grew. apart: the prompts run in steps of their own before
    each filling step (scheduler prefill_apart), reported with observe_apart; the observed steps compute
    none. pauses: each size of the fill lasts two steps (a prompt split over two), so half its choices
    see the batch as the choice before did."""
    rng = random.Random(0)
    now = [ctrl.clock()]
    ctrl.clock = lambda: now[0]
    filling, steady = Counter(), Counter()
    since = 1
    # (with pieces apart the fill's first choice follows the first prompt step directly)
    drain_end = [(8, 0, False)] * 3 if apart else [(8, 0, False)] * 2 + [(8, PROMPT, False)]
    schedule = ([(b, 0, False) for b in (200, 112, 48, 16) for _ in range(3)] + drain_end
                + [(b, PROMPT, True) for b in (16, 48, 112, 200) for _ in range(2 if pauses else 1)]
                + [(256, 0, True)]
                + [(256, 0, False)] * (27 if pauses else 31))  # (51 choices a cycle: the slots move through it)
    for _ in range(cycles):
        for b, prompt, fills in schedule:  # (batch, prompt tokens this step computes, a choice of the fill)
            if not rule:
                ctrl._prev_batch, ctrl._grew_at = 10 ** 9, -10 ** 9
            if apart and prompt:
                now[0] += prompt * 2e-6
                ctrl.observe_apart(prompt, 8)
                prompt = 0
            k = ctrl.choose(b)
            (filling if fills else steady)[k if ctrl._pending.exploring else 0] += 1
            since = _step(ctrl, world, rng, now, b, k, prompt, since)
    return filling, steady


@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_no_exploration_from_k0_while_the_batch_fills(alpha: float) -> None:
    world = _world(alpha)
    runs = {rule: _cycles(_warmed(world), world, rule) for rule in (True, False)}
    filling, steady = runs[True]
    assert set(filling) == {0}, filling  # no choice of the fills explores
    assert sum(n for k, n in steady.items() if k) > 100  # exploring goes on in the steady steps
    filling_without, _ = runs[False]
    assert sum(n for k, n in filling_without.items() if k) > 10  # without the rule the fills explore


@pytest.mark.parametrize("apart, pauses", [(True, False), (False, True)], ids=["apart", "pauses"])
def test_fills_with_prompts_apart_or_pauses(apart: bool, pauses: bool) -> None:
    """apart: with prompt pieces in steps of their own (prefill_apart) the choice right after them follows
    prompt chunks as well. Before, the controller's flag said what the last observed step did, and the
    fill's first choice (after a drain without prompts) explored.
    pauses: a fill where the batch keeps its size for a step now and then (a prompt's chunks over two
    steps, arrivals a step apart) is a fill throughout: the batch grew within FILL_CHOICES choices.
    Looking at the choice before only, this world's fills explored 20 times. On the H200 pair at 64
    requests (twenty-fifth session) an exploration started at 38 requests of a wave's 64 (its second
    step at 43), with 28 and 24 ms proposals."""
    world = _world(0.5)
    ctrl = _warmed(world)
    filling, steady = _cycles(ctrl, world, rule=True, apart=apart, pauses=pauses)
    assert set(filling) == {0}, filling
    assert sum(n for k, n in steady.items() if k) > 100


def _pair_world() -> World:
    """Batch 64 where drafting pays below ~32 requests and not at 64 (a compute-bound verify: 60 us per
    verified token on a 2 ms step; 0.5 ms per draft forward, catch-ups): a draft model's part start."""
    return World(64, alpha=0.8, step_s=0.002, per_token_s=6e-5, draft_s=0.0005, catchup_s=0.01,
                 catchup_tok_s=4e-6, launch_s=0.0003, sync_host_s=0.0008, graph_qs=tuple(range(1, 14)),
                 fill=(1.0,) * 12)


def _part_starts(ctrl: AdaptiveController, world: World, rule: bool, cycles: int = 40) -> tuple[Counter, Counter]:
    """Drain to 2 requests (drafting pays from 16 down), then fill back to 64 in steps of prompt chunks while the
    rest of the part's requests queue to join (`arriving`), then run steady at 64. The k chosen in the
    fills' choices and in the drain's small batches. rule=False: the engine reports no queue."""
    rng = random.Random(1)
    now = [ctrl.clock()]
    ctrl.clock = lambda: now[0]
    filling, small = Counter(), Counter()
    since = 1
    schedule = ([(b, 0, 0) for b in (48, 16, 4, 2) for _ in range(6)]
                + [(b, PROMPT, 64 - b) for b in (4, 16, 31, 48)]  # (batch, prompt tokens, queued to join)
                + [(64, 0, 0)] * 30)
    for _ in range(cycles):
        for b, prompt, queued in schedule:
            ctrl.arriving = queued if rule else 0
            k = ctrl.choose(b)
            if queued:
                filling[k] += 1
            elif b <= 16:
                small[k] += 1
            since = _step(ctrl, world, rng, now, b, k, prompt, since, feed_prompt=True)
    return filling, small


def test_no_drafting_while_queued_requests_fill_the_batch() -> None:
    """A draft model's controller drafts nothing while the batch grows and more requests queue to join it
    (the arrivals rule), though the batch of the moment would pay for drafts: on the H200 pair at 64
    requests (twenty-eighth session) parts started at k = 0 and drafted at k = 9-11 at 4, 16 and 31
    requests of the fill, in steps of 28-41 ms that fed the new prompts to the draft model, and the point
    ran at 0.92 of no drafts. The drain's small batches, with nothing queued, still draft; without the
    queue reported the fills draft too."""
    world = _pair_world()
    runs = {rule: _part_starts(_warmed(world), world, rule) for rule in (True, False)}
    filling, small = runs[True]
    assert set(filling) == {0}, filling
    assert sum(n for k, n in small.items() if k) > 0.5 * sum(small.values()), small
    filling_without, _ = runs[False]
    assert sum(n for k, n in filling_without.items() if k) > 20, filling_without


def test_a_queue_the_batch_does_not_take_in_holds_drafting_back_briefly() -> None:
    """A queue that does not join (the KV cache is full, say) beside a batch of steady size holds nothing
    back beyond FILL_CHOICES choices after the batch last grew; one or two queued requests beside a large
    batch are no fill; and a proposer that does not catch up (n-gram lookup) is never held back."""
    world = _pair_world()
    ctrl = _warmed(world)
    _part_starts(ctrl, world, rule=True, cycles=10)
    ctrl.choose(8)  # the batch shrinks to 8 and stays
    ctrl.arriving = 20
    assert ctrl._arrivals_due(8) is False  # (steady since the last choice)
    assert ctrl._arrivals_due(12) is True  # grew, with the queue
    ctrl.arriving = 2
    assert ctrl._arrivals_due(9) is False  # 2 queued beside 9 running: under a quarter of the batch
    ctrl.arriving = 3
    assert ctrl._arrivals_due(9) is True
    for _ in range(FILL_CHOICES):  # the batch stays at 8 with the queue beside it: held back no longer
        ctrl.choose(8)
    assert ctrl._arrivals_due(8) is False
    ngram = AdaptiveController(SpeculativeConfig(method="ngram", num_speculative_tokens=4))
    run_world(World(8, alpha=0.8, step_s=0.002, per_token_s=2e-5, lookup_s=1e-5), ngram, 600)
    assert not ngram.catches_up()  # (measured: no extra cost after a step without drafts)
    ngram.arriving = 50
    assert not ngram._arrivals_due(16)


@pytest.mark.parametrize("limit", [None, 64], ids=["adaptive", "disable_by_batch_size"])
def test_the_engine_reports_the_queue_before_each_choice(tiny_llama_dir, limit: int | None) -> None:
    """In an engine with a draft model: before each choice the controller learns how many waiting requests
    can join (at most the free seats); with a token budget that admits a few prompts a step, the first
    choices see the rest of the burst queued, the later ones none; the output is plain decoding's. Behind
    vLLM's disable_by_batch_size (a wrapper around the controller) the count reaches the controller too."""
    from specserve import LLM, SamplingParams

    rng = random.Random(7)
    prompts = [[rng.randrange(10, 300) for _ in range(40)] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = dict(progress=False, kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=96, max_num_seqs=6)
    plain = LLM(model=str(tiny_llama_dir), **kw)
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params)]
    spec = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3}
    if limit is not None:
        spec["disable_by_batch_size"] = limit
    llm = LLM(model=str(tiny_llama_dir), speculative_config=spec, **kw)
    ctrl, sch = llm.engine.spec.controller, llm.engine.scheduler
    if limit is not None:
        ctrl = ctrl.inner  # (BatchSizeLimit)
    assert isinstance(ctrl, AdaptiveController)
    assert ctrl.token_budget == 96  # (the scheduler's: drafting is priced within it, test_adaptive_budget.py)
    seen = []
    choose = ctrl.choose

    def recording(batch_size: int) -> int:
        seen.append((ctrl.arriving, min(len(sch.waiting), sch.max_num_seqs - len(sch.running))))
        return choose(batch_size)

    ctrl.choose = recording
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == want
    assert seen and all(reported == queue for reported, queue in seen), seen
    assert seen[0][0] > 0 and seen[-1][0] == 0, seen
