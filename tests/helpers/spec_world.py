"""Synthetic serving worlds for the adaptive speculation controller's tests: a `World` prices a step
as an H200 shows it (graphs, eager verify, drafter and catch-up costs, asynchronous scheduling), and
`run_world` plays the engine's part for a controller or a fixed k.
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
    runs synchronously and pays `sync_host_s` of host work on top."""

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

    def verify_s(self, tokens: int, q: int) -> float:
        t = self.step_s + self.per_token_s * tokens
        return t if q in self.graph_qs else max(t, self.eager_s)

    def propose_s(self, k: int, gap: int) -> float:
        if k == 0:
            return 0.0
        t = (k + 1) * self.draft_s + self.batch * self.lookup_s
        if gap > 1 and (self.catchup_s or self.catchup_tok_s):
            t += self.catchup_s + self.catchup_tok_s * gap * self.batch
        return t


def run_world(world: World, policy: AdaptiveController | int, steps: int, seed: int = 0) -> tuple[float, list[int]]:
    """Output tokens per second of `policy` (a controller, or a fixed k) over `steps` steps."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    chosen, since_draft, was_sync = [], 1, False  # (a run goes on from where the last one stopped)
    if isinstance(policy, AdaptiveController):
        start = policy.clock()
        policy.clock = lambda: start + seconds  # simulated time (the controller looks for pauses)
    for _ in range(steps):
        k = policy.choose(world.batch) if isinstance(policy, AdaptiveController) else policy
        chosen.append(k)
        b = world.batch
        drafted = [sum(1 for j in range(k) if rng.random() < world.fill[j]) for _ in range(b)] if k else [0] * b
        drafted = [min(d, k) for d in drafted]
        accepted = []
        for d in drafted:
            a = 0
            while a < d and rng.random() < world.alpha:
                a += 1
            accepted.append(a)
        propose_s = world.propose_s(k, since_draft)
        since_draft = 1 if k else since_draft + 1
        qs = {1 + d for d in drafted}
        verify_s = world.verify_s(b + sum(drafted), qs.pop() if len(qs) == 1 else -1)
        if world.launch_s is not None:  # asynchronous scheduling: see World
            if k:
                verify_s += world.sync_host_s
            seconds += verify_s
            if not k and was_sync:
                verify_s = world.launch_s  # what the engine measures; the forward still takes step_s
            was_sync = k > 0
        else:
            seconds += verify_s
        tokens += b + sum(accepted)
        seconds += propose_s
        if isinstance(policy, AdaptiveController):
            proposal = ProposalStats.measure(k, [k] * b if k else [], drafted if k else [], propose_s)
            reached, acc = verify_counts(drafted, accepted)
            policy.observe(SpecStepStats(b, b + sum(drafted), sum(drafted), verify_s, reached, acc, proposal))
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


def assert_near_best(world: World, ctrl: AdaptiveController, steps: int, seed: int = 0) -> list[int]:
    fixed = {k: run_world(world, k, 600)[0] for k in range(K + 1)}
    rate, chosen = run_world(world, ctrl, steps, seed)
    best = max(fixed.values())
    assert rate >= 0.95 * best and rate >= 0.95 * fixed[0], (world.batch, rate, fixed, Counter(chosen[-300:]))
    return chosen
