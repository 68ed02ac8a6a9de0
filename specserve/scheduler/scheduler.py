"""Continuous batching under a token budget, with chunked prefill, prefix hits and preemption.

There is no separate prefill or decode phase: every request has `num_computed_tokens` and a
target (`num_tokens_with_spec`: known tokens plus draft tokens to verify); each step gives
requests new tokens from the budget, running requests first (FCFS), then waiting ones. When
blocks run out, the most recently arrived running request is preempted: its blocks are freed
and it is recomputed later (its full blocks usually survive in the prefix cache).

Within one forward every layer writes the whole batch's K/V before any attention reads, so a
request may hit blocks that another request fills in the same step.

Graph-sized prefill pieces (`prefill_piece`: the longest captured prefill graph's query length, or
None): while at most `PIECE_MAX_SEQS` requests are live, a prompt of up to PIECES pieces is fed a
piece at a time, so each step replays a captured graph instead of running an eager forward, whose
host-side launch cost dwarfs a short prefill's GPU work.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from specserve.kv.manager import KVCacheManager
from specserve.scheduler.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, draft tokens included
    num_spec_tokens: int  # draft tokens among them (at the end)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the known tokens (so logits are sampled)."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens - self.num_spec_tokens >= r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_spec_tokens: int = 0  # draft tokens to verify, over every scheduled request (counted as scheduled)
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.scheduled


# A prompt (after prefix hits) of at most PIECES graph pieces goes piecewise; a longer one runs as
# before (its eager forward is then a smaller share of its compute).
PIECES = 4
PIECE_MAX_SEQS = 2  # runner/cuda_graph.py PREFILL_MAX_BATCH: prefill graphs exist up to this batch


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        num_lookahead_tokens: int = 0,
        prefill_piece: int | None = None,
    ) -> None:
        """num_lookahead_tokens: KV slots kept per request for drafts; prefill_piece: see the module doc."""
        self.kv = kv
        self.prefill_piece = prefill_piece
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.num_lookahead_tokens = num_lookahead_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- admission ---------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Finish or abort: frees its KV blocks now."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.free(req)
        self.requests.pop(req.request_id, None)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_pending_tokens and req.finishes_by_length_on_pending(self.max_model_len):
                i += 1  # asynchronous scheduling: its last token is in flight and ends it
                continue
            num_new = min(self._piece(req, req.num_tokens_with_spec - req.num_computed_tokens), budget)
            # Never go past the context window (drafts near the end are dropped).
            num_new = min(num_new, self.max_model_len - req.num_computed_tokens)
            if num_new <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req, num_new, None, self.num_lookahead_tokens):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                num_spec = max(0, req.num_computed_tokens + num_new - req.num_tokens)
                if num_spec < len(req.spec_token_ids):
                    req.spec_token_ids = req.spec_token_ids[:num_spec]
                out.scheduled.append(ScheduledRequest(req, num_new, num_spec))
                out.num_spec_tokens += num_spec
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted; everything after it too
        return budget

    def _piece(self, req: Request, num_new: int) -> int:
        """num_new, or one graph piece of it: a prefill (no drafts) of more than one piece and at most
        PIECES, while at most PIECE_MAX_SEQS requests are live and none scores its prompt."""
        piece = self.prefill_piece
        if (
            piece is None
            or not piece < num_new <= PIECES * piece
            or req.spec_token_ids
            or len(self.running) + len(self.waiting) > PIECE_MAX_SEQS
            or req.needs_prompt_logprobs
            or not self.enable_chunked_prefill
        ):
            return num_new
        return piece

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        out.scheduled = [s for s in out.scheduled if s.request is not req]
        out.num_spec_tokens = sum(s.num_spec_tokens for s in out.scheduled)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.spec_draft_probs = None
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            # Cached positions have no logits: a request still scoring its prompt recomputes it.
            hits, num_hit_tokens = ([], 0) if req.needs_prompt_logprobs else self.kv.get_computed_blocks(req)
            num_new = self._piece(req, req.num_tokens - num_hit_tokens)
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            if not self.kv.allocate_slots(req, num_new, hits, self.num_lookahead_tokens):
                break
            self._admit(req, num_hit_tokens)
            out.scheduled.append(ScheduledRequest(req, num_new, 0))
            budget -= num_new

    def _admit(self, req: Request, num_hit_tokens: int) -> None:
        """The waiting head, its slots allocated, starts running (its prefix hits count as computed)."""
        self.waiting.popleft()
        req.num_computed_tokens = num_hit_tokens
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit_tokens
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def update_computed(self, sched: ScheduledRequest, num_rejected: int) -> None:
        """After the forward: the new tokens minus rejected drafts now have valid KV."""
        req = sched.request
        req.num_computed_tokens += sched.num_new_tokens - num_rejected
        req.spec_token_ids = []
        req.spec_draft_probs = None
