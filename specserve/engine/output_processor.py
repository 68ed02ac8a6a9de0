"""Turn accepted tokens into finished checks, text, RequestOutputs and per-request stats."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.metrics.stats import StatsCollector
from specserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from specserve.scheduler.request import Request, RequestStatus


@dataclass
class RequestGroup:
    """A user request: n sequences (children) sharing one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detoks: list[IncrementalDetokenizer]
    arrival_time: float
    num_logprobs: int | None
    finished_ids: set[str] = field(default_factory=set)
    # prompt_logprobs as returned (Logprob objects), built once the whole prompt is scored.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return len(self.finished_ids) == len(self.children)


def check_token_stop(req: Request, max_model_len: int) -> RequestStatus | None:
    """Token-level stop conditions for the last appended token."""
    token = req.output_token_ids[-1]
    p = req.params
    if req.num_output_tokens >= p.min_tokens:
        if not p.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in p.stop_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if req.num_output_tokens >= req.max_tokens or req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def completion_output(
    index: int, req: Request, detok: IncrementalDetokenizer, tokenizer: Any, with_logprobs: bool
) -> CompletionOutput:
    finished = req.is_finished
    if detok.deferred:  # the text leaves out a stop token (EOS or a stop id) unless asked for (vLLM's rule)
        hide = req.status == RequestStatus.FINISHED_STOPPED and not req.params.include_stop_str_in_output
        detok.catch_up(req.output_token_ids, req.num_output_tokens - hide)
    logprobs = None
    if with_logprobs:
        entry = lambda step: {tid: Logprob(lp, rank, _decode_one(tokenizer, tid)) for tid, (lp, rank) in step.items()}
        logprobs = [entry(step) for step in req.logprobs]
    text, ids, cum = detok.visible_text(finished), list(req.output_token_ids), req.cumulative_logprob
    reason = req.status.value if finished else None
    return CompletionOutput(index, text, ids, cum if with_logprobs else None, logprobs, reason, req.stop_reason)


def _decode_one(tokenizer: Any, token_id: int) -> str | None:
    return None if tokenizer is None else tokenizer.decode([token_id])


def request_output(group: RequestGroup, tokenizer: Any) -> RequestOutput:
    outs = [
        completion_output(i, r, d, tokenizer, group.num_logprobs is not None)
        for i, (r, d) in enumerate(zip(group.children, group.detoks))
    ]
    first, finished = group.children[0], group.finished
    times = (first.first_scheduled_time, first.first_token_time, first.last_token_time)
    metrics = RequestMetrics(group.arrival_time, *times, time.monotonic() if finished else None)
    head = (group.request_id, group.prompt, group.prompt_token_ids, outs, finished, metrics)
    return RequestOutput(*head, max(0, first.num_cached_tokens), _prompt_logprobs(group, tokenizer))


def _prompt_logprobs(group: RequestGroup, tokenizer: Any) -> list[dict[int, Logprob] | None] | None:
    """vLLM's shape: [None, {token_id: Logprob}, ...], one entry per prompt token; None until scored."""
    raw = group.children[0].prompt_logprobs
    if group.prompt_logprobs is None and raw is not None and len(raw) == len(group.prompt_token_ids):
        texts = {t: _decode_one(tokenizer, t) for e in raw if e is not None for t in e}  # each distinct token once
        group.prompt_logprobs = [
            None if e is None else {t: Logprob(lp, rank, texts[t]) for t, (lp, rank) in e.items()} for e in raw
        ]
    return group.prompt_logprobs


@dataclass
class StepTokenStats:
    """A step's token-level stats, gathered per request and written to the collector once."""

    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    generation_tokens: int = 0

    def add(self, req: Request, num_new: int, now: float) -> None:
        if req.first_token_time is None:
            req.first_token_time = now
            self.ttfts.append(now - req.arrival_time)
            self.prompt_tokens += req.num_prompt_tokens
        elif req.last_token_time is not None:
            gap = (now - req.last_token_time) / max(1, num_new)
            self.itls.extend([gap] * num_new)
        req.last_token_time = now
        self.generation_tokens += num_new

    def flush(self, stats: StatsCollector) -> None:
        stats.observe_many("time_to_first_token_seconds", self.ttfts)
        stats.observe_many("inter_token_latency_seconds", self.itls)
        if self.prompt_tokens:
            stats.inc("prompt_tokens_total", self.prompt_tokens)
        if self.generation_tokens:
            stats.inc("generation_tokens_total", self.generation_tokens)


def record_finished(stats: StatsCollector, req: Request, now: float) -> None:
    stats.inc("request_success_total", 1, {"finished_reason": req.status.value})
    stats.observe("e2e_request_latency_seconds", now - req.arrival_time)
    stats.observe("request_prompt_tokens", req.num_prompt_tokens)
    stats.observe("request_generation_tokens", req.num_output_tokens)
    if req.first_scheduled_time is not None:
        stats.observe("request_queue_time_seconds", req.first_scheduled_time - req.arrival_time)
        if req.first_token_time is not None:
            stats.observe("request_prefill_time_seconds", req.first_token_time - req.first_scheduled_time)
            stats.observe("request_decode_time_seconds", now - req.first_token_time)
