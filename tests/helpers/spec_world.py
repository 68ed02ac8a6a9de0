"""Synthetic serving worlds for the adaptive speculation controller's tests: a `World` prices a step
as an H200 shows it (graphs, eager verify, drafter and catch-up costs, asynchronous scheduling), and
`run_world` plays the engine's part for a controller or a fixed k. `run_serving` plays it with
request boundaries (requests finish and new ones bring their prompts: `serving_world`), `run_waves` with
waves of requests that end together (the batch drains, then fills again).
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from specserve.config import SpeculativeConfig
from specserve.spec.adaptive import (
    AdaptiveController,
    ProposalStats,
    SpecStepStats,
    verify_counts,
)

K = 4
CFG = SpeculativeConfig(method="ngram", num_speculative_tokens=K)


def mostly(chosen: list[int]) -> int:
    """The k chosen most often."""
    return Counter(chosen).most_common(1)[0][0]


@dataclass(frozen=True)
class World:
    """A serving step as an H200 shows it, in the units that matter to the controller.

    Verify steps replay a CUDA graph only for the query lengths in `graph_qs` (else an eager forward
    costs at least `eager_s`); the proposer costs `draft_s` per forward (a draft model runs k + 1 of
    them), `lookup_s` per request (n-gram), and after a step without drafts it first catches up on
    every skipped token (`catchup_s` + `catchup_tok_s` per token).

    With `launch_s` the engine schedules asynchronously (engine/overlap.py): a step without drafts
    overlaps its host work with the previous step's forward and costs `step_s`, but the first one
    after a step with drafts is timed at its launch (`launch_s`, host work only); a step with drafts
    runs synchronously and pays `sync_host_s` of host work on top.

    Request boundaries (`run_serving` only; `run_world` ignores these fields): each request generates
    `output_len` tokens, then the next one takes its slot; the step it joins also computes its prompt
    chunk (`prompt_len` tokens at `prompt_tok_s` each, an eager forward), after `arrival_s` of host
    work the engine does not time (the request's admission, the finished one's output), and a proposer
    that catches up feeds the prompt to its draft model at its next proposal with drafts."""

    batch: int
    alpha: float
    step_s: float = 0.002  # decode step (graph), memory-bound part
    per_token_s: float = 0.0  # compute-bound part, per verified token
    eager_s: float = 0.0  # an eager verify forward costs at least this
    graph_qs: tuple[int, ...] = (1, K + 1)
    draft_s: float = 0.0
    lookup_s: float = 0.0
    catchup_s: float = 0.0
    catchup_tok_s: float = 0.0
    fill: tuple[float, ...] = (1.0,) * K
    launch_s: float | None = None
    sync_host_s: float = 0.0
    output_len: int = 0
    prompt_len: int = 0
    prompt_tok_s: float = 0.0
    arrival_s: float = 0.0
    async_gap_s: float = 0.0  # host work per overlapped step that no timer covers (the engine loop, choose)
    # run_serving: an overlapped step right after one that computed a prompt chunk reads this much more on
    # its timer (it waits for that eager forward's GPU tail); the time is the prompt step's, counted there
    prompt_tail_s: float = 0.0
    # (from k, probability, seconds): a proposal of at least that k sometimes costs that much more (a
    # draft model falling off its CUDA graphs now and then); its mean cost is what throughput pays
    spikes: tuple[int, float, float] = (0, 0.0, 0.0)
    # run_world with launch_s: an overlapped step is observed when it is launched, as the engine does (its
    # forward lands in the next interval between observations; the first step that drafts after it waits
    # for that forward, so its interval holds two)
    observe_at_launch: bool = False
    # run_world with launch_s: host time no timer covers at each switch from no drafts to drafts (the engine
    # leaves its overlapped run: the step in flight is resolved, the proposal waits for it)
    switch_s: float = 0.0

    def verify_s(self, tokens: int, q: int) -> float:
        t = self.step_s + self.per_token_s * tokens
        return t if q in self.graph_qs else max(t, self.eager_s)

    def propose_s(self, k: int, gap: int, prompt_tokens: int = 0) -> float:
        """A proposal of k, `gap` steps after the last one with drafts, with `prompt_tokens` of new
        requests' prompts not fed to the proposer yet."""
        if k == 0:
            return 0.0
        t = (k + 1) * self.draft_s + self.batch * self.lookup_s
        if (gap > 1 or prompt_tokens) and self.catches_up:
            t += self.catchup_s + self.catchup_tok_s * ((gap * self.batch if gap > 1 else 0) + prompt_tokens)
        return t

    def timed(self, verify_s: float, sync: bool, was_sync: bool) -> tuple[float, float]:
        """(time the step takes, time the engine measures for it). With asynchronous scheduling a step
        that runs synchronously (`sync`: the last proposal drafted) pays `sync_host_s` of host work, the
        first overlapped one after such a step is timed at its launch (see the class doc), and every
        overlapped one takes `async_gap_s` more than its timer shows."""
        if self.launch_s is None:
            return verify_s, verify_s
        if sync:
            return verify_s + self.sync_host_s, verify_s + self.sync_host_s
        return verify_s + self.async_gap_s, (self.launch_s if was_sync else verify_s)

    @property
    def catches_up(self) -> bool:
        return bool(self.catchup_s or self.catchup_tok_s)


def _draft_and_verify(world: World, budgets: list[int], rng: random.Random) -> tuple[list[int], list[int]]:
    """Per request asked for `budgets[i]` drafts: how many it got (position j with probability
    world.fill[j]) and how many of them the target accepted (each with world.alpha, until one fails)."""
    drafted = [sum(1 for j in range(m) if rng.random() < world.fill[j]) for m in budgets]
    accepted = []
    for d in drafted:
        a = 0
        while a < d and rng.random() < world.alpha:
            a += 1
        accepted.append(a)
    return drafted, accepted


def run_world(world: World, policy: AdaptiveController | int, steps: int, seed: int = 0,
              work_ahead: bool = False) -> tuple[float, list[int]]:
    """Output tokens per second of `policy` (a controller, or a fixed k) over `steps` steps. work_ahead:
    the controller prepares its next choice during each step, before observing it (as the engine does
    while a synchronous step's forward runs)."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    chosen, since_draft, was_sync = [], 1, False  # (a run goes on from where the last one stopped)
    observed_at = None  # (observe_at_launch: the simulated time of the observation, if not now)
    if isinstance(policy, AdaptiveController):
        start = policy.clock()
        # simulated time (the controller looks for pauses)
        policy.clock = lambda: start + (seconds if observed_at is None else observed_at)
    for _ in range(steps):
        launched_at = seconds
        k = policy.choose(world.batch) if isinstance(policy, AdaptiveController) else policy
        chosen.append(k)
        b = world.batch
        drafted, accepted = _draft_and_verify(world, [k] * b, rng)
        propose_s = world.propose_s(k, since_draft)
        if world.spikes[1] and k >= world.spikes[0] > 0 and rng.random() < world.spikes[1]:
            propose_s += world.spikes[2]
        since_draft = 1 if k else since_draft + 1
        qs = {1 + d for d in drafted}
        verify_s = world.verify_s(b + sum(drafted), qs.pop() if len(qs) == 1 else -1)
        spent, verify_s = world.timed(verify_s, k > 0, was_sync)
        if k > 0 and not was_sync and world.launch_s is not None:
            spent += world.switch_s
        seconds += spent
        was_sync = k > 0
        tokens += b + sum(accepted)
        seconds += propose_s
        if isinstance(policy, AdaptiveController):
            if work_ahead:
                policy.prepare(b)
            overlapped = world.observe_at_launch and world.launch_s is not None and k == 0
            observed_at = launched_at + world.launch_s if overlapped else None
            proposal = ProposalStats.measure(k, [k] * b if k else [], drafted if k else [], propose_s)
            reached, acc = verify_counts(drafted, accepted)
            policy.observe(SpecStepStats(b, b + sum(drafted), sum(drafted), verify_s, reached, acc, proposal))
    return tokens / seconds, chosen


def run_serving(world: World, policy: AdaptiveController | int, steps: int, seed: int = 0) -> tuple[float, list[int]]:
    """Like run_world, with request boundaries (the World's output_len, prompt_len, prompt_tok_s,
    arrival_s): output tokens per second of `policy` over `steps` steps, and the k of every choice.

    The batch's `world.batch` slots start at staggered points of their requests (slot i has generated
    i / batch of its tokens: arrivals spread out); they are warm (the proposer has seen them). As in
    the engine: a request asks for at most output_len - generated - 1 drafts (draft_budget); the
    proposal after its last step is not for it (the controller chooses for the requests still running,
    and not at all when none is); the next step computes the new request's prompt chunk (no drafts for
    it; eager, and synchronous when the last proposal drafted) and its first token; a proposer that
    catches up feeds that prompt at its next proposal with drafts."""
    assert world.output_len > 0, "run_serving needs a World with output_len"
    rng = random.Random(seed)
    b, n = world.batch, world.output_len
    tokens = seconds = 0.0
    done = [(i * n) // b for i in range(b)]  # tokens each slot's request has generated
    joining = [False] * b  # the slot's next request joins in the next step (its prompt chunk)
    chosen: list[int] = []
    since_draft, was_sync, last_k, unseen_prompt, prev_prompt = 1, False, None, 0, False
    ctrl = policy if isinstance(policy, AdaptiveController) else None
    if ctrl is not None:
        start = ctrl.clock()
        ctrl.clock = lambda: start + seconds  # simulated time (the controller looks for pauses)
    for _ in range(steps):
        running = [i for i in range(b) if not joining[i]]
        new = b - len(running)
        if running:
            k = ctrl.choose(len(running)) if ctrl is not None else policy
            chosen.append(k)
            last_k = k
        else:  # no request to propose for: the engine asks the controller nothing
            k = 0
        budgets = [max(0, min(k, n - done[i] - 1)) for i in running]
        drafted, accepted = _draft_and_verify(world, budgets, rng)
        asked = [m for m in budgets if m]
        propose_s = world.propose_s(k, since_draft, unseen_prompt) if asked else 0.0
        if asked:
            since_draft, unseen_prompt = 1, 0
        else:
            since_draft += 1
        qs = {1 + d for d in drafted}
        q = -1 if new or len(qs) != 1 else qs.pop()  # a step with a prompt chunk runs eagerly
        verify_s = world.verify_s(len(running) + sum(drafted), q) + new * world.prompt_len * world.prompt_tok_s
        sync = last_k != 0  # the last proposal drafted (or none was made yet): the step runs synchronously
        spent, verify_s = world.timed(verify_s, sync, was_sync)
        if prev_prompt and not sync:
            verify_s += world.prompt_tail_s
        prev_prompt = new > 0
        seconds += spent
        was_sync = sync
        seconds += propose_s + new * world.arrival_s  # (admitting a request: host work nobody times)
        for i, a in zip(running, accepted):
            got = min(1 + a, n - done[i])
            tokens += got
            done[i] += got
        for i in range(b):
            if joining[i]:
                joining[i], done[i] = False, 1
                tokens += 1
            elif done[i] >= n:
                joining[i] = True  # finished: the next request takes the slot in the next step
        unseen_prompt += new * world.prompt_len
        if ctrl is not None:
            proposal = None
            if running:
                proposal = ProposalStats.measure(k, [m for m in budgets if m] if k else [],
                                                 [d for d, m in zip(drafted, budgets) if m] if k else [], propose_s,
                                                 sum(1 for m in budgets if not m) if k else 0)
            reached, acc = verify_counts(drafted, accepted)
            ctrl.observe(SpecStepStats(b, len(running) + sum(drafted) + new * world.prompt_len, sum(drafted),
                                       verify_s, reached, acc, proposal))
    return tokens / seconds, chosen


def run_waves(world: World, policy: AdaptiveController | int, waves: int, seed: int = 0, rooms: bool = True,
              admit: int = 12) -> tuple[float, list[tuple[int, int, bool]]]:
    """Output tokens per second of `policy` over `waves` waves of `world.batch` requests, and (batch, k,
    whether the batch drains: every request of the wave admitted, some finished) of every choice. Each
    wave's requests are admitted `admit` a step (a token budget's worth of prompt chunks, prompt_len tokens
    each at prompt_tok_s, eager; the controller learns how many wait, as from the engine's set_arriving),
    each generates output_len tokens, and the next wave starts once the last has finished: the batch
    drains at each wave's end with every request near its end (one max_tokens, ignore_eos), as in
    bench/controller_sweep.py's parts. rooms: the controller reads the running requests' output rooms (the
    engine's SpecDecoder gives it them: spec/output_room.py).

    A proposer that catches up (catchup_s, catchup_tok_s) feeds, at a proposal with drafts, every token of
    the running requests it has not seen: their prompts, and what steps without drafts made; a warm
    proposal's feed of the last step's tokens is in its own cost. Verify steps as run_world's."""
    rng = random.Random(seed)
    b, n = world.batch, world.output_len
    tokens = seconds = 0.0
    ctrl = policy if isinstance(policy, AdaptiveController) else None
    if ctrl is not None:
        start = ctrl.clock()
        ctrl.clock = lambda: start + seconds  # simulated time (the controller looks for pauses)
    chosen: list[tuple[int, int, bool]] = []
    last_k, was_sync = None, False
    for _ in range(waves):
        done: list[int | None] = [None] * b  # output tokens of each request (None: not admitted yet)
        seen = [0] * b  # tokens of each request the proposer has seen, prompt included
        while True:
            running = [i for i in range(b) if done[i] is not None and done[i] < n]
            new = [i for i in range(b) if done[i] is None][:admit]
            if not running and not new:
                break
            waiting = sum(1 for d in done if d is None)
            if ctrl is not None:
                ctrl.arriving = min(waiting, admit)
                if rooms:
                    ctrl.output_room = lambda running=running: [n - done[i] - 1 for i in running]
            k = 0
            if running:
                k = ctrl.choose(len(running)) if ctrl is not None else policy
                last_k = k
                chosen.append((len(running), k, not waiting and len(running) < b))
            budgets = [max(0, min(k, n - done[i] - 1)) for i in running]
            drafted, accepted = _draft_and_verify(world, budgets, rng)
            depth = max(budgets, default=0)
            propose_s = 0.0
            if depth:
                behind = sum(world.prompt_len + done[i] - seen[i] for i in running)
                propose_s = (depth + 1) * world.draft_s + len(running) * world.lookup_s
                if behind and world.catches_up:
                    propose_s += world.catchup_s + world.catchup_tok_s * behind
            qs = {1 + d for d in drafted}
            q = -1 if new or len(qs) != 1 else qs.pop()  # a step with a prompt chunk runs eagerly
            verify_s = world.verify_s(len(running) + sum(drafted), q) + len(new) * world.prompt_len * world.prompt_tok_s
            sync = last_k != 0
            spent, timed = world.timed(verify_s, sync, was_sync)
            was_sync = sync
            seconds += spent + propose_s
            for i, a in zip(running, accepted):
                got = min(1 + a, n - done[i])
                tokens += got
                done[i] += got
                if depth:  # the next warm proposal feeds this step's tokens as part of its own cost
                    seen[i] = world.prompt_len + done[i]
            for i in new:
                done[i] = 1
                tokens += 1
            if ctrl is not None and running:
                asked = [m for m in budgets if m] if k else []
                proposal = ProposalStats.measure(k, asked, [d for d, m in zip(drafted, budgets) if m] if k else [],
                                                 propose_s, sum(1 for m in budgets if not m) if k else 0)
                reached, acc = verify_counts(drafted, accepted)
                ctrl.observe(SpecStepStats(len(running), len(running) + sum(drafted) + len(new) * world.prompt_len,
                                           sum(drafted), timed, reached, acc, proposal))
    return tokens / seconds, chosen


# -- the H200 sweep's failure: under-drafting at concurrency 1-8 with a draft model --------------------
# A 0.5B draft model for a 1.5B target on an H200 with asynchronous scheduling, per batch size (from
# bench/controller_sweep.py, /work/.device/31): a decode step (overlapped) costs 1.3-1.8 ms, a verify
# step pays 0.75 ms of host work on top (it runs synchronously), a draft forward 0.56-1.06 ms, and a
# catch-up after a pause an eager forward (3 ms + 4 us per token). Acceptance 0.93 per position: only
# k = K beats no drafts at batch 1-8 (by 8-23%); from batch 16 on nothing does.
PAIR_STEP_S = {1: 0.00132, 2: 0.00165, 4: 0.00172, 8: 0.00176, 16: 0.00182}
PAIR_DRAFT_S = {1: 0.00056, 2: 0.00062, 4: 0.00070, 8: 0.00084, 16: 0.00106}


def pair_world(batch: int, **overrides: object) -> World:
    fields = {"alpha": 0.93, "step_s": PAIR_STEP_S[batch], "per_token_s": 2e-5, "draft_s": PAIR_DRAFT_S[batch],
              "catchup_s": 0.003, "catchup_tok_s": 4e-6, "launch_s": 0.0003, "sync_host_s": 0.00075,
              "graph_qs": tuple(range(1, K + 2))}
    fields.update(overrides)
    return World(batch, **fields)


# -- the same pair serving requests: arrivals (bench/controller_sweep.py, its later H200 sweep) ---------
# Each request has a ~172-token prompt (HumanEval through the chat template) and generates 256 tokens
# (greedy, concurrency = batch size). The sweep measured, in tokens/s, no speculation / fixed k = 4:
# 770 / 860 at concurrency 1, 4263 / 2923 at 8, 8089 / 6603 at 16. Timed costs, as measured or as the
# controller fitted them there: a decode step 1.24 ms at batch 1 (1.76, 1.82 ms at 8, 16: PAIR_STEP_S);
# a k = 4 verify step 2.03 ms at batch 1 and 2.66 ms at 16 (so 0.76 ms of synchronous host work and
# ~1 us per verified token); a k = 4 proposal 2.99, 4.74, 5.03 ms at batch 1, 8, 16 (five draft
# forwards); acceptance ~0.95 per position. Arrivals: the step a request joins computes its prompt
# eagerly (3 ms at least, + 10 us per prompt token), and the draft model feeds that prompt at its next
# proposal (an eager catch-up: 3 ms + 4 us per token, as after a pause). With these the world gives
# 773 / 852, 4302 / 4256, 7937 / 7467: at concurrency 1 the sweep's per-request overhead (~16 ms, TTFT
# ~15 ms) needs `arrival_s` = 11 ms that the engine does not time (its controller sees a pause). At 8
# and 16 the sweep's k = 4 ran 1.5-4 ms per drafting step slower than its timed verify and proposal
# costs explain (their averages with arrivals: 3.41 + 5.83 ms at 16): time neither timer shows, not
# modelled here (a controller cannot see it either).
SERVE_STEP_S = {1: 0.00124, 8: PAIR_STEP_S[8], 16: PAIR_STEP_S[16]}
SERVE_DRAFT_S = {1: 0.000598, 8: 0.000948, 16: 0.001006}
SERVE_ARRIVAL_S = {1: 0.011, 8: 0.0, 16: 0.0}


def serving_world(batch: int, **overrides: object) -> World:
    fields = {"alpha": 0.95, "step_s": SERVE_STEP_S[batch], "per_token_s": 1e-6, "eager_s": 0.003,
              "draft_s": SERVE_DRAFT_S[batch], "catchup_s": 0.003, "catchup_tok_s": 4e-6, "launch_s": 0.0003,
              "sync_host_s": 0.00076, "graph_qs": tuple(range(1, K + 2)), "output_len": 256, "prompt_len": 172,
              "prompt_tok_s": 1e-5, "arrival_s": SERVE_ARRIVAL_S[batch]}
    fields.update(overrides)
    return World(batch, **fields)


def assert_near_best(world: World, ctrl: AdaptiveController, steps: int, seed: int = 0) -> list[int]:
    fixed = {k: run_world(world, k, 600)[0] for k in range(K + 1)}
    rate, chosen = run_world(world, ctrl, steps, seed)
    best = max(fixed.values())
    assert rate >= 0.95 * best and rate >= 0.95 * fixed[0], (world.batch, rate, fixed, Counter(chosen[-300:]))
    return chosen
