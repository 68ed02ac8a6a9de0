"""bench/controller_sweep.py's speculation policies: fixed k or an adaptive controller, installed on the
shared speculative engine in turn, and what each recorded of its choices and steps (its trace)."""
from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

from specserve import LLM
from specserve.spec.adaptive import AdaptiveController, AdaptiveSettings
from specserve.spec.controller import FixedController


def _priced(est: Any) -> tuple[float, ...]:
    """What a choice's estimates say of no drafts against the fastest k > 0 (see Policy.beliefs); () for
    a controller that prices nothing."""
    rates = getattr(est, "tokens_per_s", ())
    if len(rates) < 2:
        return ()
    k1 = max(range(1, len(rates)), key=rates.__getitem__)
    return (round(rates[0], 1), k1, round(rates[k1], 1), round(est.expected_tokens[k1], 3),
            round(1e3 * est.step_seconds[k1], 3), round(1e3 * est.step_seconds[0], 3))


class Policy:
    """A controller for the shared speculative engine, and the verify graph lengths it may use."""

    def __init__(self, name: str, controller: Any, graph_qs: tuple[int, ...] | None) -> None:
        self.name, self.controller, self.graph_qs = name, controller, graph_qs
        self.choices: list[int] = []
        self.batches: list[int] = []  # the batch size of each choice
        # per choice of an adaptive one: (best k, 1 if it explores, 1 if the hold answered it, then as priced
        # (the last priced choice's, if held): tokens/s at k = 0, the fastest k > 0 and its tokens/s, tokens
        # per request and step ms predicted for it, step ms predicted for k = 0)
        self.beliefs: list[tuple[float, ...]] = []
        self.steps: list[tuple[int, float, float, int]] = []  # per step: (k, step s, proposal s, tokens)
        # per step: (batch size, tokens the proposer had not seen, the catch-up the controller predicted
        # for them, s; the two only for a cold proposal of an adaptive controller, else 0; prompt tokens)
        self.step_extras: list[tuple[int, float, float, int, float]] = []  # (..., prompt tokens, s since the last)
        self._catch_up: tuple[float, float] = (0.0, 0.0)  # of the last choice: (unseen tokens, predicted s)
        self._observed_at: float | None = None  # perf_counter at the last observation
        choose, observe = controller.choose, controller.observe

        def recording(batch_size: int) -> int:
            held = getattr(controller, "num_held", 0)
            k = choose(batch_size)
            held = int(getattr(controller, "num_held", 0) > held)
            self.choices.append(k)
            self.batches.append(batch_size)
            last, pending = getattr(controller, "last", None), getattr(controller, "_pending", None)
            if last is not None and pending is not None:
                self.beliefs.append((last.best_k, int(pending.exploring), held, *_priced(last)))
                unseen = pending.unseen_tokens
                cold = k > 0 and pending.cold and unseen is not None
                self._catch_up = ((unseen, controller.costs.catch_up_seconds(unseen, last.propose_seconds[k],
                                                                                  batch_size))
                                  if cold else (0.0, 0.0))
            return k

        def observing(step) -> None:
            p = step.proposal
            self.steps.append((p.num_speculative_tokens if p is not None else -1, step.step_seconds,
                               p.seconds if p is not None else 0.0, step.batch_size + sum(step.accepted_per_pos)))
            prompt = max(step.num_batched_tokens - step.batch_size - step.num_draft_tokens, 0)
            # the wall time since the observation before: the step's real price, host work that no timer
            # covers included (the controller's cost fits add it where two steps ran the same way)
            now = time.perf_counter()
            since, self._observed_at = (0.0 if self._observed_at is None else now - self._observed_at), now
            self.step_extras.append((step.batch_size, *self._catch_up, prompt, since))
            self._catch_up = (0.0, 0.0)
            observe(step)

        controller.choose, controller.observe = recording, observing

    def mark(self) -> tuple[int, int]:
        """Where the records stand (choices, steps): drop_after(mark) forgets what came after."""
        return len(self.choices), len(self.steps)

    def drop_after(self, mark: tuple[int, int]) -> None:
        """Forget every record (choices and what goes with them, steps and theirs) made after `mark`."""
        choices, steps = mark
        del self.choices[choices:], self.batches[choices:], self.beliefs[choices:]
        del self.steps[steps:], self.step_extras[steps:]
        self._observed_at = None  # (a part starts: the time since what was dropped is no step's)

    def clear(self) -> None:
        self.choices.clear()
        self.batches.clear()
        self.beliefs.clear()
        self.steps.clear()
        self.step_extras.clear()
        self._observed_at = None

    def trace(self) -> dict[str, list[list[float]]]:
        """Every choice ([batch, k, best k, explores, held, then as priced: tokens/s at k = 0, the fastest
        k > 0, its tokens/s, its tokens per request, its step ms, k = 0's step ms]) and every step ([k of the
        proposal it verified, step ms, proposal ms, tokens, batch, tokens the proposer had not seen and the
        catch-up ms predicted for them (a cold proposal of an adaptive controller, else 0), prompt tokens
        the step computed (new requests: such a step runs eagerly), ms since the observation before (0 for
        a part's first)]) of a point, in order: why an adaptive policy lost where it did (what it believed
        against what the steps got)."""
        return self.trace_after((0, 0))

    def trace_after(self, mark: tuple[int, int]) -> dict[str, list[list[float]]]:
        """trace() of the records made after `mark` (a point's warm-up, say: where the controller met the
        point's load first)."""
        c0, s0 = mark
        choices = [[b, k, *bel] for b, k, bel in zip(self.batches[c0:], self.choices[c0:], self.beliefs[c0:])]
        steps = [[k, round(1e3 * t, 3), round(1e3 * p, 3), n, b, round(unseen), round(1e3 * predicted, 2), prompt,
                  round(1e3 * since, 3)]
                 for (k, t, p, n), (b, unseen, predicted, prompt, since)
                 in zip(self.steps[s0:], self.step_extras[s0:])]
        return {"choices": choices, "steps": steps}

    def drafting_trace(self) -> dict[str, list[list[float]]]:
        """trace()'s choices with k > 0 and the steps verifying a proposal of k > 0, each led by its index in
        the point: above TRACE_UP_TO (controller_sweep.py) the whole trace is too large to keep, and where
        drafting is rare (an exploration, its catch-up) these few records are what it cost."""
        full = self.trace()
        return {"choices": [[i, *c] for i, c in enumerate(full["choices"]) if c[1] > 0],
                "steps": [[i, *st] for i, st in enumerate(full["steps"]) if st[0] > 0]}

    def steps_by_k(self) -> dict[str, dict[str, float]]:
        """What the engine measured per step during a point, by the k of the proposal the step verified
        (-1: no proposal, e.g. a prompt step): steps, mean step and proposal ms, tokens per step, the
        costs the adaptive controller fits (so its beliefs can be checked against them)."""
        out: dict[str, dict[str, float]] = {}
        for k in sorted({s[0] for s in self.steps}):
            rows = [s for s in self.steps if s[0] == k]
            n = len(rows)
            out[str(k)] = {"steps": n, "step_ms": round(1e3 * sum(r[1] for r in rows) / n, 4),
                           "propose_ms": round(1e3 * sum(r[2] for r in rows) / n, 4),
                           "tokens_per_step": round(sum(r[3] for r in rows) / n, 3)}
        return out

    def time_by_batch(self) -> dict[str, list[float]]:
        """Per batch size: [steps, ms between observations (host work outside the timers included),
        tokens] over a point's parts: where in a point a policy spent its time, and at what rate (at the
        full batch, and in the fills and drains around it), to compare with another policy's."""
        out: dict[str, list[float]] = {}
        for (_, _, _, n), (b, _, _, _, since) in zip(self.steps, self.step_extras):
            row = out.setdefault(str(b), [0, 0.0, 0])
            row[0], row[1], row[2] = row[0] + 1, row[1] + 1e3 * since, row[2] + n
        return {b: [n, round(ms, 2), tokens] for b, (n, ms, tokens) in sorted(out.items(), key=lambda kv: int(kv[0]))}

    def drafting_by_batch(self) -> dict[str, list[int]]:
        """Per batch size: [choices, choices with k > 0, sum of k] (where in a point the controller drafted)."""
        out: dict[str, list[int]] = {}
        for b, k in zip(self.batches, self.choices):
            row = out.setdefault(str(b), [0, 0, 0])
            row[0], row[1], row[2] = row[0] + 1, row[1] + (k > 0), row[2] + k
        return dict(sorted(out.items(), key=lambda kv: int(kv[0])))

    def slow_proposals(self, factor: float = 4.0, floor_ms: float = 20.0) -> list[list[float]]:
        """Proposals that took over `floor_ms` and `factor` x the median of their k in this point: [step
        index, k, proposal ms, the previous step's k, batch size, tokens the proposer had not seen, the
        catch-up ms the controller predicted] (a stall: JIT, a shape without a graph, a catch-up)."""
        by_k: dict[int, list[float]] = {}
        for k, _, prop, _ in self.steps:
            by_k.setdefault(k, []).append(prop)
        median = {k: sorted(v)[len(v) // 2] for k, v in by_k.items()}
        out = []
        for i, (k, _, prop, _) in enumerate(self.steps):
            if k > 0 and 1e3 * prop > floor_ms and prop > factor * median[k]:
                b, unseen, predicted, _, _ = self.step_extras[i]
                out.append([i, k, round(1e3 * prop, 2), self.steps[i - 1][0] if i else -1, b, round(unseen),
                            round(1e3 * predicted, 2)])
        return out

    def install(self, llm: LLM) -> None:
        self._observed_at = None  # (the time since this policy's last part is no step's)
        spec = llm.engine.spec
        spec.controller = self.controller
        spec._proposal = None  # the last proposal belonged to another policy's controller
        graphs = llm.engine.runner.graphs
        if graphs is not None and self.graph_qs is not None:
            verify = {q for q in self.graph_qs if any(key[1] == q for key in graphs.graphs)}
            # Short prefills keep their graphs under every policy (as in the "off" engine).
            graphs.query_lens = tuple(sorted(verify | set(graphs.prefill_query_lens)))


def _fixed(cfg: Any, k: int) -> FixedController:
    """Fixed k; k = 0 is the speculative engine that never drafts (no controller work either): against
    "off" it prices what carrying a proposer costs, against "adaptive" what the controller does."""
    if k == 0:
        ctl = FixedController(dataclasses.replace(cfg, adaptive=False))
        ctl.k = 0
        return ctl
    return FixedController(dataclasses.replace(cfg, num_speculative_tokens=k, adaptive=False))


def make_policies(args: argparse.Namespace, cfg: Any, own_qs: tuple[int, ...], cuda_graphs: bool) -> list[Policy]:
    wanted = set(args.policies.split(","))
    ks = sorted({int(k) for k in args.ks.split(",")})
    max_k = cfg.num_speculative_tokens
    out = []
    if "fixed" in wanted:
        out += [Policy(f"k={k}", _fixed(cfg, k), (1, k + 1)) for k in ks]
    if "adaptive" in wanted:
        out.append(Policy("adaptive", AdaptiveController(cfg), own_qs or (1, max_k + 1)))
    if "adaptive-uncalibrated" in wanted:  # A/B of estimators.TokenCalibration
        out.append(Policy("adaptive-uncalibrated", AdaptiveController(cfg, AdaptiveSettings(calibrate=False)),
                          own_qs or (1, max_k + 1)))
    if "adaptive+graphs" in wanted and cuda_graphs:
        out.append(Policy("adaptive+graphs", AdaptiveController(cfg), tuple(range(1, max_k + 2))))
    return out


# -- one point --------------------------------------------------------------------------------------
