"""Speculative decoding around the engine: propose after a step, verify in the next one."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from specserve.config import SpeculativeConfig
from specserve.metrics.stats import StatsCollector
from specserve.runner.batch import PendingTokens
from specserve.runner.model_runner import StepOutput
from specserve.runner.step_costs import CostTable, measure_step_costs, step_cost_batch_sizes
from specserve.sample.metadata import SamplingMetadata
from specserve.sample.rejection import RejectionSampler
from specserve.sample.structured import StructuredOutputs
from specserve.scheduler.request import Request
from specserve.scheduler.scheduler import SchedulerOutput
from specserve.speculative.control import Controller, StepRecord, build_controller
from specserve.speculative.proposers import build_proposer
from specserve.speculative.proposers.base import ProposeInput, draft_budget
from specserve.speculative.proposers.draft_tokens import DeferredDrafts
from specserve.speculative.tree import (
    TreeShape,
    accepted_kv_moves,
    compact_kv,
    tree_allowed,
    tree_depth,
    tree_eligible,
    tree_shape,
)
from specserve.speculative.verify import position_counts, position_labels, record_verify_metrics, verify_drafts

if TYPE_CHECKING:
    from specserve.runner.build import EngineParts


@dataclass
class _Proposal:
    """The last proposal, read by the step that verifies it."""

    k: int
    seconds: float
    catch_up_tokens: int
    num_asked: int  # requests asked for drafts (those whose budget allowed one)


_NO_PROPOSAL = _Proposal(0, 0.0, 0, 0)


class SpecDecoder:
    def __init__(
        self, cfg: SpeculativeConfig, parts: EngineParts, stats: StatsCollector, structured: StructuredOutputs
    ) -> None:
        self.cfg = cfg
        self.proposer = build_proposer(cfg, parts)
        window = parts.loaded.max_model_len  # drafts stop there, or at speculative_config.max_model_len
        self.max_model_len = min(window, cfg.max_model_len or window)
        # Built after the proposer: an EAGLE head recaptures the target's graphs, whose steps are timed here.
        self.controller: Controller = build_controller(cfg, _step_costs(cfg, parts))
        self.disable_above = cfg.disable_by_batch_size  # vLLM's disable_by_batch_size: no drafts above it
        self.rejection = RejectionSampler()
        self.stats = stats
        self.tree: TreeShape | None = tree_shape(
            cfg.num_speculative_tokens, cfg.tree_branching, cfg.tree_node_budget, cfg.speculative_token_tree
        )
        if self.tree is not None and not tree_allowed(parts.runner):
            raise ValueError("draft trees need a single-device runner and, on the GPU, an unquantized KV cache.")
        self.runner, self.block_ids_of = parts.runner, parts.kv.block_ids
        depth = max(cfg.num_speculative_tokens, self.tree.depth if self.tree else 0)
        for pos in range(depth):  # every position (tree depth - 1) exported from the start, at 0
            stats.inc("spec_decode_num_accepted_tokens_per_pos_total", 0, position_labels(pos))
        self.vocab_size = parts.loaded.arch.vocab_size
        self.structured = structured  # cuts drafts at grammar-invalid tokens
        self.last_k: int | None = None  # the k of the last proposal (0: the next step drafts nothing)
        self._proposal: _Proposal | None = None  # the last proposal, verified by the next step
        self._verified: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())  # this step's position_counts
        self.proposer.allow_deferred(parts.runner.accepts_pending)  # only where the runner fills placeholders
        self._deferred: DeferredDrafts | None = None
        self._wait_s = 0.0  # this step's wait for deferred drafts: the proposal's time, not the step's
        self._paths: dict[str, list[int]] = {}  # this step's accepted tree nodes, per request id

    def pending_drafts(self) -> PendingTokens | None:
        """The last proposal's drafts still on the device, for the verify step's placeholders."""
        return self._deferred.pending if self._deferred is not None else None

    def resolve_drafts(self) -> None:
        """Bring deferred drafts to the host (waits for the proposer's last forward)."""
        if self._deferred is None:
            return
        start = time.perf_counter()
        deferred, self._deferred = self._deferred, None
        deferred.resolve()
        self._wait_s += time.perf_counter() - start

    def verify(
        self, reqs: list[Request], num_drafts: list[int], logits: torch.Tensor, meta: SamplingMetadata
    ) -> tuple[list[list[int]], list[int]]:
        """logits: [sum(num_drafts) + len(reqs), vocab]. Returns tokens and accepted counts per request."""
        self.resolve_drafts()
        tokens, num_accepted, paths = verify_drafts(self.rejection, reqs, num_drafts, logits, meta, self.vocab_size)
        depths = num_drafts
        if paths is not None:  # the accepted tree nodes' KV to consecutive positions; the rest lies beyond
            self._compact(reqs, paths)
            self._paths = {r.request_id: p for r, p in zip(reqs, paths) if p}
            depths = [tree_depth((r.spec_tree_parents or list(range(n)))[:n]) for r, n in zip(reqs, num_drafts)]
        k = self._proposal.k if self._proposal is not None else 0
        self._verified = position_counts(depths, num_accepted, max(k, max(depths, default=0)))
        record_verify_metrics(self.stats, num_drafts, num_accepted, self._verified[1])
        return tokens, num_accepted

    def _compact(self, reqs: list[Request], paths: list[list[int] | None]) -> None:
        """Move each tree's accepted nodes' KV from their query slots to the slots after the root."""
        src: list[int] = []
        dst: list[int] = []
        bs = self.runner.block_size
        for r, path in zip(reqs, paths):
            if path:  # the root (the request's last token) sits at num_tokens - 1: verify runs before update
                moves = accepted_kv_moves(self.block_ids_of(r.request_id), bs, r.num_tokens - 1, path)
                src.extend(moves[0])
                dst.extend(moves[1])
        if src:
            index = torch.tensor([src, dst], dtype=torch.int64).to(self.runner.device)
            compact_kv(self.runner.kv_caches, index[0], index[1])

    def after_step(
        self,
        sched: SchedulerOutput,
        new_tokens: list[list[int] | None],
        step: StepOutput,
        step_seconds: float,
        batch_size: int,
    ) -> None:
        """After a step's update: observe it, absorb mid-prefill rows, propose for the requests that got tokens.
        new_tokens: per scheduled entry, None where it sampled nothing; batch_size: the requests running now."""
        self.observe(sched, step_seconds)
        self._move_features(sched, step)
        self.absorb(sched, [t is not None for t in new_tokens], step)
        self.propose_for(sched, new_tokens, step, batch_size)

    @torch.inference_mode()
    def _move_features(self, sched: SchedulerOutput, step: StepOutput) -> None:
        """After a tree step, the accepted nodes' target features to the rows of their depths, where a proposer
        reading features by position finds them (as _compact does for the KV)."""
        paths, self._paths = self._paths, {}
        if not paths or not self.proposer.needs_target_hidden or step.host is None:
            return
        moves: list[tuple[int, int]] = []
        for s, end in zip(sched.scheduled, step.host.cu_query_lens[1:].tolist()):
            root = end - s.num_spec_tokens - 1
            moves += [(root + node, root + d) for d, node in enumerate(paths.get(s.request.request_id, ()), 1)]
        index = torch.tensor(moves, dtype=torch.int64).T.to(self.runner.device)
        for t in [step.all_hidden, *(step.aux_hidden or [])]:
            if t is not None:
                t.index_copy_(0, index[1], t.index_select(0, index[0]))

    def propose_for(
        self,
        sched: SchedulerOutput,
        new_tokens: list[list[int] | None],
        step: StepOutput,
        batch_size: int,
        k: int | None = None,
    ) -> None:
        """Propose for the scheduled requests that got tokens and did not finish (see propose)."""
        index = _live(sched, [t is not None for t in new_tokens])
        if index:
            self.propose([sched.scheduled[i].request for i in index], index, step, batch_size, k)

    def observe(self, sched: SchedulerOutput, step_seconds: float) -> None:
        """The step just run, to the controller (the wait for deferred drafts counts as the proposal's time)."""
        reached, accepted = self._verified
        p, wait = self._proposal or _NO_PROPOSAL, self._wait_s
        self._verified, self._proposal, self._wait_s = ((), ()), None, 0.0
        pad = (0,) * max(0, p.k - len(reached))
        reached, accepted = (reached + pad)[: p.k], (accepted + pad)[: p.k]
        busy = max(0.0, step_seconds - wait)
        record = StepRecord(
            len(sched.scheduled), p.k, reached, accepted, busy, p.seconds + wait, p.catch_up_tokens, p.num_asked
        )
        self.controller.observe(record)

    def absorb(self, sched: SchedulerOutput, samples: list[bool], step: StepOutput) -> None:
        """Mid-prefill rows (samples: per scheduled entry, whether it sampled) to a proposer reading target features."""
        if not self.proposer.needs_target_hidden:
            return
        index = _live(sched, [not x for x in samples])
        reqs = [sched.scheduled[i].request for i in index]
        if reqs:
            self.proposer.absorb(ProposeInput(reqs, [1] * len(reqs), step, index))

    def choose(self, batch_size: int) -> int:
        """Drafts per request for the next step of `batch_size` running requests."""
        if self.disable_above is not None and batch_size > self.disable_above:
            return 0
        return self.controller.choose(batch_size)

    def propose(
        self,
        reqs: list[Request],
        batch_index: list[int],
        step: StepOutput | None,
        batch_size: int,
        k: int | None = None,
    ) -> None:
        """Drafts for `reqs` (batch_index: each one's entry in step.batch). k: already chosen (None: choose now)."""
        self.resolve_drafts()  # an earlier proposal no step verified (its requests were not scheduled)
        start = time.perf_counter()
        if k is None:
            k = self.choose(batch_size)
        self.last_k = k
        self.stats.set("spec_decode_chosen_num_tokens", k)
        chosen = ProposeInput([], [], step, [])
        # Trees when configured, asked for (k > 0) and every request can take one (one proposer call per step).
        shape = self.tree if k and not self.structured.num_requests and all(map(tree_eligible, reqs)) else None
        for r, i in zip(reqs, batch_index):
            r.spec_token_ids, r.spec_draft_probs, r.spec_tree_parents = [], None, None
            budget = draft_budget(r, k if shape is None else shape.budget, self.max_model_len)  # 0: no room left
            if budget > 0:
                chosen.requests.append(r)
                chosen.num_draft_tokens.append(budget)
                chosen.batch_index.append(i)
        catch_up = 0
        if chosen.requests:
            if shape is not None:
                self.proposer.propose_tree(chosen, replace(shape, depth=min(k, shape.depth)))
            else:
                self.proposer.propose(chosen)
            self._deferred = self.proposer.take_deferred()
            catch_up = self.proposer.catch_up_tokens()
        if self.structured.num_requests:  # grammars read the drafts now; cut them, start next masks
            self.resolve_drafts()
        self.structured.prepare(reqs)
        self._proposal = _Proposal(k, time.perf_counter() - start, catch_up, len(chosen.requests))

    def skip_proposal(self) -> None:
        """The next step runs without proposing (asynchronous scheduling chose k = 0): a proposal of nothing."""
        self.last_k = 0
        self.stats.set("spec_decode_chosen_num_tokens", 0)
        self._proposal = _NO_PROPOSAL

    def on_finished(self, req: Request) -> None:
        self.proposer.on_request_finished(req)

    def on_preempted(self, req: Request) -> None:
        self.proposer.on_request_preempted(req)


def _live(sched: SchedulerOutput, keep: list[bool]) -> list[int]:
    """Scheduled entries with `keep` set whose request did not finish."""
    return [i for i, (s, x) in enumerate(zip(sched.scheduled, keep)) if x and not s.request.is_finished]


def _step_costs(cfg: SpeculativeConfig, parts: EngineParts) -> CostTable | None:
    """The target's step costs for the adaptive controller (None where not asked for): verify lengths 1..k+1."""
    if not cfg.adaptive or cfg.num_speculative_tokens_per_batch_size:
        return None
    sizes = step_cost_batch_sizes(parts.runner, parts.scheduler.max_num_seqs)
    return measure_step_costs(parts.runner, sizes, cfg.num_speculative_tokens + 1, kv=parts.kv)
