"""A serving world whose acceptance changes along each request's output, in stretches (code: runs of
boilerplate the draft model predicts, then lines it does not), for the adaptive controller's tests.

Whether a draft token at an output position is accepted is a property of the request's content there
(greedy decoding), so every policy run on the same seed meets the same content: their throughputs
compare without sampling noise between them. A closed loop of `batch` requests of `output_len` tokens;
a finished request is replaced by the next one at once (no prompt steps: what is measured is drafting).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

from specserve.spec.adaptive import AdaptiveController, ProposalStats, SpecStepStats, verify_counts


@dataclass(frozen=True)
class StretchWorld:
    batch: int
    regimes: tuple[tuple[float, float], ...]  # (acceptance per position, share of the stretches)
    stretch_tokens: float  # mean length of a stretch (exponential)
    step_s: float  # a decode (or verify) step
    draft_s: float  # one draft forward (a proposal of k runs k + 1)
    per_token_s: float = 2e-6  # per verified token
    verify_host_s: float = 0.0003  # a step with drafts runs synchronously: host work on top
    output_len: int = 256
    max_k: int = 12
    num_requests: int = 400

    def content(self, seed: int) -> list[list[bool]]:
        """Per request, per output position: whether a draft token there is accepted."""
        rng = random.Random(seed)
        out = []
        for _ in range(self.num_requests):
            ok, left, alpha = [], 0.0, 0.0
            for _ in range(self.output_len + self.max_k + 2):
                if left <= 0:
                    r, acc = rng.random(), 0.0
                    alpha = self.regimes[-1][0]
                    for a, share in self.regimes:
                        acc += share
                        if r < acc:
                            alpha = a
                            break
                    left = rng.expovariate(1.0 / self.stretch_tokens)
                ok.append(rng.random() < alpha)
                left -= 1
            out.append(ok)
        return out


def run_stretches(world: StretchWorld, policy: AdaptiveController | int, steps: int, seed: int = 0,
                  first_request: int = 0, late: bool = False) -> tuple[float, list[int]]:
    """Output tokens per second of `policy` (a controller or a fixed k) over `steps` steps, and the k of
    every choice. The batch starts with requests first_request.. at staggered points of their outputs.
    late: as the engine's synchronous steps do, a step the controller lets be observed late
    (defer_observation) is observed after the next proposal (as the next forward launches: the engine's
    SpecDecoder.deliver_late), with that proposal's host seconds."""
    content = world.content(seed)
    b, n = world.batch, world.output_len
    slots = [first_request + i for i in range(b)]
    done = [(i * n) // b for i in range(b)]
    nxt = first_request + b
    ctrl = policy if isinstance(policy, AdaptiveController) else None
    seconds = tokens = 0.0
    if ctrl is not None:
        start = ctrl.clock()
        ctrl.clock = lambda: start + seconds
    chosen = []
    waiting: SpecStepStats | None = None  # a step to observe after the next proposal
    for _ in range(steps):
        k = ctrl.choose(b) if ctrl is not None else policy
        chosen.append(k)
        propose_s = (k + 1) * world.draft_s if k else 0.0
        seconds += propose_s  # (the proposal's host work: all of it, in this world)
        if waiting is not None:
            ctrl.observe(replace(waiting, ahead_seconds=propose_s))
            waiting = None
        budgets = [max(0, min(k, n - d - 1)) for d in done]
        accepted = []
        for slot, d, m in zip(slots, done, budgets):
            ok = content[slot % len(content)]
            a = 0
            while a < m and ok[d + a]:
                a += 1
            accepted.append(a)
        verify_s = world.step_s + (world.per_token_s * sum(budgets) + world.verify_host_s if k else 0.0)
        seconds += verify_s
        for i, a in enumerate(accepted):
            got = min(1 + a, n - done[i])
            tokens += got
            done[i] += got
            if done[i] >= n:
                slots[i], done[i], nxt = nxt, 0, nxt + 1
        if ctrl is not None:
            proposal = ProposalStats.measure(k, budgets if k else [], budgets if k else [], propose_s)
            reached, acc = verify_counts(budgets, accepted)
            stats = SpecStepStats(b, b + sum(budgets), sum(budgets), verify_s, reached, acc, proposal)
            if late and ctrl.defer_observation():
                waiting = stats
            else:
                ctrl.observe(stats)
    if waiting is not None:
        ctrl.observe(waiting)
    return tokens / seconds, chosen
