"""Continuous batching under a token budget, with chunked prefill, prefix hits and preemption.

Each step gives requests new tokens toward `num_tokens_with_spec` (known tokens plus drafts),
running requests first (FCFS), then waiting ones; when blocks run out, the latest running request
is preempted and later recomputed. While at most PIECE_MAX_SEQS requests are live, a prompt of up to
PIECES `prefill_piece`s (the longest prefill graph's query length) is fed a piece a step, so each
step replays a graph.
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
        """Whether this step reaches the end of the known tokens (logits are sampled)."""
        return self.request.num_computed_tokens + self.num_new_tokens - self.num_spec_tokens >= self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    num_spec_tokens: int = 0  # draft tokens to verify, over every scheduled request (counted as scheduled)
    preempted: list[Request] = field(default_factory=list)
    # False: no request can carry a draft tree (none configured); the batch build skips its tree scan.
    draft_trees: bool = True

    @property
    def empty(self) -> bool:
        return not self.scheduled


PIECES = 4
PIECE_MAX_SEQS = 2  # runner/cuda_graph.py PREFILL_MAX_BATCH: prefill graphs exist up to this batch


@dataclass(eq=False)
class Scheduler:
    kv: KVCacheManager
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    num_lookahead_tokens: int = 0  # KV slots kept per request for drafts
    prefill_piece: int | None = None
    draft_trees: bool = True  # whether drafts may be trees (the engine clears it when no tree shape is set)
    waiting: deque[Request] = field(default_factory=deque, init=False)
    running: list[Request] = field(default_factory=list, init=False)
    requests: dict[str, Request] = field(default_factory=dict, init=False)
    num_preemptions: int = field(default=0, init=False)

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Finish or abort: frees its KV blocks now."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        self.requests.pop(req.request_id, None)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(draft_trees=self.draft_trees)
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            budget = self._schedule_waiting(out, budget)
            # every scheduled entry took its tokens from the budget (a preemption drops entries: count them)
            out.num_batched_tokens = self.max_num_batched_tokens - budget
        else:
            out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # Per running request every step: attribute reads are hoisted, and a decode (one new token, no
        # drafts) skips the piece rule, which only splits queries longer than a piece.
        running, scheduled, max_len, allocate = self.running, out.scheduled, self.max_model_len, self.kv.allocate_slots
        lookahead, i = self.num_lookahead_tokens, 0
        while i < len(running) and budget > 0:
            req = running[i]
            i += 1
            if req.num_pending_tokens and req.finishes_by_length_on_pending(max_len):
                continue  # asynchronous scheduling: its last token is in flight and ends it
            computed, num_tokens = req.num_computed_tokens, len(req.all_token_ids)
            num_new = num_tokens + len(req.spec_token_ids) - computed
            if num_new > 1:
                num_new = self._piece(req, num_new)
            # Never past the context window (drafts near the end are dropped).
            num_new = min(num_new, budget, max_len - computed)
            if num_new <= 0:
                continue
            while not allocate(req, num_new, None, lookahead):
                victim = running[-1]
                self._preempt(victim, out)
                scheduled = out.scheduled  # _preempt rebuilds the list
                if victim is req:
                    return budget  # the request itself was preempted; everything after it too
            num_spec = computed + num_new - num_tokens
            if num_spec > 0 or req.spec_token_ids:
                num_spec = max(0, num_spec)
                if num_spec < len(req.spec_token_ids):
                    req.spec_token_ids = req.spec_token_ids[:num_spec]
                out.num_spec_tokens += num_spec
            else:
                num_spec = 0
            scheduled.append(ScheduledRequest(req, num_new, num_spec))
            budget -= num_new
        return budget

    def _piece(self, req: Request, num_new: int) -> int:
        """num_new, or one graph piece of it (not for drafts or prompt scoring)."""
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
        req.status, req.num_computed_tokens = RequestStatus.PREEMPTED, 0
        req.spec_token_ids, req.spec_draft_probs = [], None
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
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
        return budget

    def _admit(self, req: Request, num_hit_tokens: int) -> None:
        self.waiting.popleft()  # its slots are allocated; its prefix hits count as computed
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
        req.spec_token_ids, req.spec_draft_probs = [], None
