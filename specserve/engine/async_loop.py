"""Asynchronous scheduling: the host prepares step N+1 while the GPU runs step N. One `AsyncLoop.step()`:
schedule and launch N+1 (its placeholders read N's sampled tokens on the device), resolve N, then sample N+1,
so penalties, min_tokens and grammar masks stay exact and outputs equal `Engine.step_sync`'s. With
speculation only steps that verify no drafts overlap (k > 0 resolves the step in flight, then runs sync)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specserve.outputs import RequestOutput
from specserve.runner.batch import PendingTokens
from specserve.runner.model_runner import StepOutput
from specserve.runner.streams import record
from specserve.sample.h2d import h2d
from specserve.sample.sampler import LogprobsTensors
from specserve.scheduler.request import Request
from specserve.scheduler.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from specserve.engine.engine import Engine


@dataclass
class InFlightStep:
    """A step whose sampled tokens are still on their way to the host."""

    sched: SchedulerOutput
    step_out: StepOutput  # the forward's output (a proposer drafting from this step reads it)
    rows: list[int | None]  # per scheduled entry: its row of tokens; None: sampled nothing (or dropped)
    reqs: list[Request]  # per row
    pending: PendingTokens | None  # None when no row sampled
    host_tokens: torch.Tensor | None = None  # [num_rows] int64, pinned on CUDA
    host_logprobs: LogprobsTensors | None = None
    event: torch.cuda.Event | None = None

    def wait(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host_tokens.tolist() if self.host_tokens is not None else []


def to_host_async(t: torch.Tensor) -> torch.Tensor:
    """Start a device->host copy into pinned memory (read it after an event recorded later)."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class AsyncLoop:
    """Engine.step() with asynchronous scheduling; the engine provides execute, update and sampling."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.inflight: InFlightStep | None = None

    def step(self) -> list[RequestOutput]:
        eng, spec = self.engine, self.engine.spec
        if spec is None:
            return self.overlapped()
        if self.inflight is None:
            # The last proposal (at the end of a synchronous step) chose whether this step drafts.
            if spec.last_k != 0 or eng.structured.num_requests or any(r.spec_token_ids for r in eng.scheduler.running):
                return eng.step_sync()
            return self.overlapped()
        # In a run of overlapped steps: the controller chooses for the next step, as propose() would.
        # (Structured requests always get a proposal: it also cuts drafts and starts their masks.)
        batch_size = len(eng.scheduler.running)
        k = None if eng.structured.num_requests else spec.choose(batch_size)
        if k == 0:
            spec.skip_proposal()
            return self.overlapped()
        prev, self.inflight = self.inflight, None
        outputs, new_tokens = self._resolve(prev)
        spec.propose_for(prev.sched, new_tokens, prev.step_out, batch_size, k)
        return outputs + eng.step_sync()

    def overlapped(self) -> list[RequestOutput]:
        """Schedule and launch step N+1, then resolve step N (steps 1-5 of the module doc)."""
        eng, spec = self.engine, self.engine.spec
        start = time.perf_counter()
        outputs = eng.take_outputs()
        prev, self.inflight = self.inflight, None
        sched = eng.scheduler.schedule()
        eng.fail_unfittable(sched, outputs)
        launched = None
        if not sched.empty:
            samples = [s.samples for s in sched.scheduled]  # before the advance changes the answer
            step_out = eng.execute(sched, prev.pending if prev is not None else None)
            for s, smp in zip(sched.scheduled, samples):
                eng.scheduler.update_computed(s, 0)
                if smp:
                    s.request.add_pending_token()
            if spec is not None:  # mid-prefill rows to an EAGLE head (their inputs are all known now)
                spec.absorb(sched, samples, step_out)
            launched = (sched, samples, step_out)
        if prev is not None:
            outputs.extend(self._resolve(prev)[0])
            if spec is not None and eng.structured.num_requests:  # no proposal follows: start the masks
                eng.structured.prepare(
                    [s.request for s, row in zip(prev.sched.scheduled, prev.rows) if row is not None]
                )
        if launched is not None:
            self.inflight = self._launch_sampling(*launched)
            if spec is not None:
                spec.observe(sched, time.perf_counter() - start)
        eng.record_step_stats(sched)
        return outputs

    def _resolve(self, step: InFlightStep) -> tuple[list[RequestOutput], list[list[int] | None]]:
        """(outputs, each scheduled entry's new tokens or None)."""
        tokens = step.wait()
        if step.host_logprobs is not None:
            self.engine.store_logprobs([None if r.is_finished else r for r in step.reqs], step.host_logprobs)
        new_tokens = [None if row is None else [tokens[row]] for row in step.rows]
        return self.engine.update(step.sched, new_tokens, [0] * len(new_tokens), advanced=True), new_tokens

    def _launch_sampling(self, sched: SchedulerOutput, samples: list[bool], step_out: StepOutput) -> InFlightStep:
        rows: list[int | None] = []
        reqs: list[Request] = []
        logit_rows: list[int] = []
        for s, smp, lr in zip(sched.scheduled, samples, step_out.batch.logit_rows):
            if not smp or s.request.is_finished:  # finished when step N was resolved, or aborted
                rows.append(None)
                continue
            assert lr is not None  # a sampling entry has logit rows
            rows.append(len(reqs))
            reqs.append(s.request)
            logit_rows.append(lr[0])
        if not reqs:
            return InFlightStep(sched, step_out, rows, reqs, None)
        logits = step_out.logits
        if len(logit_rows) != logits.shape[0]:
            logits = logits.index_select(0, h2d(torch.tensor(logit_rows), logits.device))
        logits = self.engine.structured.apply(logits, reqs, [0] * len(reqs))
        out = self.engine.sample_tokens(reqs, logits)
        tokens = out.token_ids.to(torch.int64)
        pending = PendingTokens(tokens, {r.request_id: i for i, r in enumerate(reqs)})
        step = InFlightStep(sched, step_out, rows, reqs, pending, to_host_async(tokens))
        if out.logprobs is not None:
            step.host_logprobs = LogprobsTensors(*(to_host_async(t) for t in out.logprobs))
        if tokens.device.type == "cuda":
            step.event = torch.cuda.Event()
            record(step.event, tokens.device)
        return step
