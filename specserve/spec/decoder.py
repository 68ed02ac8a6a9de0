"""Speculative decoding around the engine: propose after a step, verify in the next one.

Owns the proposer, the controller (how many tokens to draft) and the rejection sampler, and
records the spec_decode_* metrics.
"""
from __future__ import annotations

import dataclasses
import time

import torch

from specserve import envs
from specserve.config import SpeculativeConfig
from specserve.metrics.stats import StatsCollector
from specserve.runner.batch import PendingTokens
from specserve.runner.model_runner import StepOutput
from specserve.sample.metadata import SamplingMetadata
from specserve.sample.rejection import RejectionSampler
from specserve.sample.structured import StructuredOutputs
from specserve.scheduler.request import Request
from specserve.scheduler.scheduler import SchedulerOutput
from specserve.spec.adaptive import ProposalStats, SpecStepStats, verify_counts
from specserve.spec.base import ProposeInput, Proposer, draft_budget, stack_draft_probs
from specserve.spec.controller import FixedController
from specserve.spec.draft_tokens import DeferredDrafts
from specserve.spec.output_room import output_rooms


class _PositionLabels(dict):
    """position -> its metric labels, built once."""

    def __missing__(self, pos: int) -> dict[str, str]:
        self[pos] = {"position": str(pos)}
        return self[pos]


_POSITION_LABELS = _PositionLabels()


def build_proposer(cfg: SpeculativeConfig, engine_parts) -> Proposer:
    if cfg.method == "ngram":
        from specserve.spec.ngram import NgramProposer

        lo = cfg.prompt_lookup_min or cfg.prompt_lookup_max or 3
        hi = cfg.prompt_lookup_max or max(lo, 5)
        return NgramProposer(lo, hi)
    if cfg.method == "draft_model":
        from specserve.spec.draft_model import DraftModelProposer

        return DraftModelProposer(cfg, engine_parts)
    from specserve.spec.eagle import EagleProposer

    return EagleProposer(cfg, engine_parts)


def build_controller(cfg: SpeculativeConfig):
    controller = _controller(cfg)
    if cfg.disable_by_batch_size is not None:
        from specserve.spec.controller import BatchSizeLimit

        return BatchSizeLimit(controller, cfg.disable_by_batch_size)
    return controller


def _controller(cfg: SpeculativeConfig):
    if cfg.adaptive and not cfg.num_speculative_tokens_per_batch_size:
        try:
            from specserve.spec.adaptive import AdaptiveController

            return AdaptiveController(cfg)
        except ImportError:
            pass
    return FixedController(cfg)


class SpecDecoder:
    def __init__(self, cfg: SpeculativeConfig, engine_parts, stats: StatsCollector) -> None:
        self.cfg = cfg
        self.proposer = build_proposer(cfg, engine_parts)
        self._scheduler = getattr(engine_parts, "scheduler", None)
        # Drafts stop where a request reaches the context window, or speculative_config.max_model_len.
        window = engine_parts.loaded.max_model_len
        self.max_model_len = min(window, cfg.max_model_len or window)
        self.controller = build_controller(cfg)  # (the setter wires the engine's side into it)
        # Seeded random requests draft only when k does not follow the load: the rejection sampler draws
        # k uniforms per step from a request's generator, so with k chosen per step (adaptive
        # controller, batch-size table, disable_by_batch_size) the same seed would sample differently
        # under other load. Without drafts such a request draws exactly as plain sampling does.
        self.k_follows_load = type(self.controller) is not FixedController or bool(
            cfg.num_speculative_tokens_per_batch_size)
        self.rejection = RejectionSampler()
        self.stats = stats
        for pos in range(cfg.num_speculative_tokens):  # every position exported from the start, at 0
            stats.inc("spec_decode_num_accepted_tokens_per_pos_total", 0, _POSITION_LABELS[pos])
        self.vocab_size = engine_parts.loaded.arch.vocab_size
        self.device = engine_parts.device
        # structured output (issue 8): set by the engine; cuts drafts at grammar-invalid tokens.
        self.structured: StructuredOutputs | None = None
        self._proposal: ProposalStats | None = None  # the last proposal, verified by the next step
        self.last_k: int | None = None  # the k of the last proposal (0: the next step drafts nothing)
        self._verified: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())  # verify_counts of this step
        # Drafts left on the device for the verify step (spec/draft_tokens.py DeferredDrafts): one
        # device, the runner's placeholder fill. SPECSERVE_DEFER_DRAFTS=0 reads them back in propose,
        # =1 defers them for every proposer; unset, the proposer's default.
        wanted = envs.defer_drafts()
        if wanted is None:
            wanted = getattr(self.proposer, "defers_by_default", True)
        self.proposer.defer_drafts = getattr(engine_parts.runner, "accepts_pending", False) and wanted
        self._deferred: DeferredDrafts | None = None
        self._wait_s = 0.0  # this step's wait for deferred drafts: the proposal's time, not the step's
        self._apart_ids: set[str] = set()  # the requests of the last step of prompt pieces apart

    @property
    def controller(self):
        """Chooses k per step (spec/controller.py, spec/adaptive.py), possibly inside wrappers."""
        return self._controller

    @controller.setter
    def controller(self, controller) -> None:
        """Sets the controller and wires the engine's side into the innermost one, whenever one is set
        (benches swap theirs in): the scheduler's token budget, within which the adaptive controller
        prices drafting, and the running requests' output rooms (how far into a draft they can go: their
        output budgets' ends), read when it prices a choice. Without them it prices every request as
        able to take k drafts and a step as admitting any number of tokens: on the H200 pair at 64
        requests (thirty-first session, a controller swapped in without them) it explored k = 11 at a
        wave's end, priced at 9.2 tokens per request, where the 12 requests left made 1.25."""
        if getattr(self, "_late", None) is not None:
            self.deliver_late()  # an observation set aside goes to the controller whose step it was
        self._controller = controller
        self._late: SpecStepStats | None = None  # observe_step's, set aside until the next launch
        inner, sched = self._innermost_controller(), self._scheduler
        if sched is None:
            return
        fields = getattr(inner, "__dict__", {})
        if "token_budget" in fields:
            inner.token_budget = sched.max_num_batched_tokens
        if "output_room" in fields:
            limit = self.max_model_len
            inner.output_room = lambda: output_rooms(sched.running, limit)

    def pending_drafts(self) -> PendingTokens | None:
        """The last proposal's drafts still on the device: the verify step's placeholders read them."""
        return self._deferred.pending if self._deferred is not None else None

    def resolve_drafts(self) -> None:
        """Bring deferred drafts to the host (waits for the proposer's last forward); a no-op if none."""
        if self._deferred is None:
            return
        start = time.perf_counter()
        deferred, self._deferred = self._deferred, None
        deferred.resolve()
        self._wait_s += time.perf_counter() - start

    def verify(self, reqs: list[Request], num_drafts: list[int], logits: torch.Tensor,
               meta: SamplingMetadata) -> tuple[list[list[int]], list[int]]:
        """logits: [sum(num_drafts) + len(reqs), vocab]. Returns tokens and accepted counts per request."""
        self.resolve_drafts()
        drafts = [r.spec_token_ids[:k] for r, k in zip(reqs, num_drafts)]
        draft_probs = stack_draft_probs(reqs, num_drafts, self.vocab_size, logits.device)
        out = self.rejection(drafts, draft_probs, logits, meta)
        self._record(num_drafts, out.num_accepted)
        return out.output_token_ids, out.num_accepted

    def _record(self, num_drafts: list[int], num_accepted: list[int]) -> None:
        """The spec_decode_* counters, one increment each per step (not per request and position:
        at 256 requests that was ~1500 locked dict updates per step)."""
        st = self.stats
        self._verified = verify_counts(num_drafts, num_accepted)
        num_seqs = len(num_drafts) - num_drafts.count(0)
        if not num_seqs:
            return
        st.inc("spec_decode_num_drafts_total", num_seqs)
        st.inc("spec_decode_num_draft_tokens_total", sum(num_drafts))
        st.inc("spec_decode_num_accepted_tokens_total", sum(num_accepted))  # 0 where k is 0
        for pos, count in enumerate(self._verified[1]):  # requests that accepted position pos
            if count:
                st.inc("spec_decode_num_accepted_tokens_per_pos_total", count, _POSITION_LABELS[pos])

    def observe_step(self, sched: SchedulerOutput, step_seconds: float, late: bool = False) -> None:
        """The controller observes the step that just ran. late: the caller proposes next, and the
        observation may wait, if the controller agrees (defer_observation), until the forward after that
        proposal is launched (deliver_late): observing then runs while the GPU computes instead of while
        it waits. The adaptive controller's observe takes ~0.05-0.1 ms of host time; with an n-gram
        proposer nothing else runs on the GPU between a step and the next (the 8B shape at 1 request
        takes ~4.5 ms a step on the H200)."""
        self.deliver_late()
        (reached, accepted), self._verified = self._verified, ((), ())
        wait, self._wait_s = self._wait_s, 0.0
        proposal = self._proposal
        if wait and proposal is not None:  # priced as when propose read its drafts back itself
            proposal = dataclasses.replace(proposal, seconds=proposal.seconds + wait)
            step_seconds = max(0.0, step_seconds - wait)
        stats = SpecStepStats(len(sched.scheduled), sched.num_batched_tokens, sched.num_spec_tokens, step_seconds,
                              reached, accepted, proposal)
        self._proposal = None
        defer = getattr(self.controller, "defer_observation", None) if late and proposal is not None else None
        if defer is not None and defer():
            self._late = stats
            return
        self.controller.observe(stats)

    def deliver_late(self) -> None:
        """Observe the step observe_step(late=True) set aside, if any: the engine calls this once the next
        forward is launched, or where none follows (every other observation delivers it first, so the
        controller sees its steps in order). The proposal made since is in the interval since the last
        observation: its host seconds go with it (SpecStepStats.ahead_seconds)."""
        stats, self._late = self._late, None
        if stats is None:
            return
        ahead = self._proposal.seconds if self._proposal is not None else 0.0
        self.controller.observe(dataclasses.replace(stats, ahead_seconds=ahead))

    def observe_apart(self, sched: SchedulerOutput) -> None:
        """A step of prompt pieces apart (sched.apart): no observation of its own (it verifies nothing;
        the next step pairs with the proposal), but the adaptive controller learns the prompts it
        computed and keeps its time out of the next step's price (StepCosts.observe_apart)."""
        self.deliver_late()
        ids = {s.request.request_id for s in sched.scheduled}
        started, self._apart_ids = len(ids - self._apart_ids), ids  # a prompt's pieces run in consecutive ones
        observe = getattr(self.controller, "observe_apart", None)
        if observe is not None:
            observe(sched.num_batched_tokens, started)

    def set_arriving(self, num_waiting: int, free_seats: int) -> None:
        """Before a choice: how many queued requests can join the batch (waiting ones, at most the free
        seats), for a controller that holds drafting back while the batch fills (AdaptiveController's
        arrivals rule). Wrappers (BatchSizeLimit, benches' timers) pass it to the controller inside."""
        target = self._innermost_controller()
        if "arriving" in getattr(target, "__dict__", {}):
            target.arriving = max(0, min(num_waiting, free_seats))

    def _innermost_controller(self) -> object:
        """The controller inside any wrappers (BatchSizeLimit, benches' timers): by __dict__, since a
        wrapper's __getattr__ reads the inner controller's attributes, but setting one on the wrapper would
        not reach it."""
        target = self.controller
        while "inner" in getattr(target, "__dict__", {}):
            target = target.inner
        return target

    def work_ahead(self, batch_size: int) -> None:
        """Called while the GPU runs a synchronous step: the controller prepares its next choice."""
        prepare = getattr(self.controller, "prepare", None)
        if prepare is not None:
            prepare(batch_size)

    def propose(self, reqs: list[Request], batch_index: list[int], step: StepOutput | None,
                batch_size: int, k: int | None = None) -> None:
        """k: already chosen by the controller for this proposal (None: choose now)."""
        self.resolve_drafts()  # an earlier proposal no step verified (its requests were not scheduled)
        start = time.perf_counter()
        if k is None:
            k = self.controller.choose(batch_size)
        self.last_k = k
        self.stats.set("spec_decode_chosen_num_tokens", k)
        # -1: a seeded sampled request, which drafts only where k does not follow the load (see __init__);
        # 0: one whose output budget or the context window ends here
        budgets = [-1 if self.k_follows_load and r.generator is not None and not r.params.greedy
                   else draft_budget(r, k, self.max_model_len) for r in reqs]
        chosen = [(r, b, i) for r, b, i in zip(reqs, budgets, batch_index) if b > 0]
        for r in reqs:
            r.spec_token_ids, r.spec_draft_probs = [], None
        if chosen:
            self.proposer.propose(ProposeInput([c[0] for c in chosen], [c[1] for c in chosen], step,
                                               [c[2] for c in chosen]))
            take = getattr(self.proposer, "take_deferred", None)
            self._deferred = take() if take is not None else None
        if self.structured is not None:  # structured output (issue 8): cut drafts, start next masks
            if self.structured.num_requests:  # grammars read the drafts now
                self.resolve_drafts()
            self.structured.prepare(reqs)
        self._proposal = ProposalStats.measure(k, [c[1] for c in chosen], [len(c[0].spec_token_ids) for c in chosen],
                                               time.perf_counter() - start, budgets.count(0) if k else 0)

    def absorb(self, sched: SchedulerOutput, samples: list[bool], step: StepOutput) -> None:
        """After a forward: the scheduled requests that did not sample (mid-prefill) hand their rows to a
        proposer that keeps target features (EAGLE heads' `absorb`), so a prompt fed in pieces or
        chunks is whole in its context. samples: per scheduled entry, whether it sampled."""
        absorb = getattr(self.proposer, "absorb", None)
        if absorb is None:  # every step calls this: proposers without target features stop here
            return
        chosen = [(s.request, i) for i, (s, smp) in enumerate(zip(sched.scheduled, samples))
                  if not smp and not s.request.is_finished]
        if chosen:
            absorb(ProposeInput([c[0] for c in chosen], [1] * len(chosen), step, [c[1] for c in chosen]))

    def skip_proposal(self, num_reqs: int) -> None:
        """The controller chose k = 0 for the next step, which runs without proposing (asynchronous
        scheduling): recorded as a proposal of nothing, as propose() would with k = 0."""
        self.last_k = 0
        self.stats.set("spec_decode_chosen_num_tokens", 0)
        self._proposal = ProposalStats.nothing(num_reqs)

    def on_finished(self, req: Request) -> None:
        self.proposer.on_request_finished(req)

    def on_preempted(self, req: Request) -> None:
        self.proposer.on_request_preempted(req)
