"""Engine: add requests; step() = schedule -> runner forward -> sample (or verify drafts) -> scheduler
update (detokenize, stop checks) -> speculation's after-step hook -> stats (DESIGN.md's request flow)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from specserve.config import EngineConfig
from specserve.engine.async_loop import AsyncLoop
from specserve.engine.detokenizer import IncrementalDetokenizer
from specserve.engine.output_processor import (
    RequestGroup,
    StepTokenStats,
    check_token_stop,
    record_finished,
    request_output,
)
from specserve.engine.setup import build_engine_parts
from specserve.engine.validate import resolve_max_tokens, resolve_prompt
from specserve.outputs import RequestOutput
from specserve.runner.batch import PendingTokens
from specserve.runner.build import EngineParts
from specserve.runner.model_runner import StepOutput
from specserve.runner.prompt_logprobs import plan_prompt_logprobs
from specserve.sample.metadata import SamplingMetadata
from specserve.sample.sampler import LogprobsTensors, SamplerOutput
from specserve.sample.structured import StructuredOutputs
from specserve.sampling_params import SamplingParams
from specserve.scheduler.request import Request, RequestStatus
from specserve.scheduler.scheduler import SchedulerOutput
from specserve.speculative.decoder import SpecDecoder
from specserve.speculative.verify import verify_logprobs


class Engine:
    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.config = config
        parts: EngineParts = build_engine_parts(config, progress)
        loaded = parts.loaded
        self.device, self.loaded, self.tokenizer, self.model_name = parts.device, loaded, loaded.tokenizer, loaded.name
        self.max_model_len, self.vocab_size = loaded.max_model_len, loaded.arch.vocab_size
        self.runner, self.kv, self.scheduler, self.sampler = parts.runner, parts.kv, parts.scheduler, parts.sampler
        self.stats, self.eos_token_ids = parts.stats, parts.eos_token_ids
        self.groups: dict[str, RequestGroup] = {}
        self._child_to_group: dict[str, tuple[RequestGroup, int]] = {}
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (aborts)
        self._last_prefix = (0, 0)
        self.stream_outputs = True  # False: step() returns finished requests only
        # structured output: grammar matchers and masks; xgrammar loads on first use.
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.spec: SpecDecoder | None = None
        if config.speculative is not None:
            self.spec = SpecDecoder(config.speculative, parts, self.stats, self.structured)
            self.runner.model.aux_hidden_layers = self.spec.proposer.aux_hidden_layers
        # Only a tree shape lets requests carry draft trees; without one the batch build skips the tree scan.
        self.scheduler.draft_trees = self.spec is not None and self.spec.tree is not None
        # Async scheduling: on by default on CUDA, not with tensor parallelism (EngineConfig refuses asking for both).
        on = config.scheduler.async_scheduling
        on = self.device.type == "cuda" and config.parallel.tensor_parallel_size == 1 if on is None else on
        self.async_loop = AsyncLoop(self) if on else None

    @property
    def async_scheduling(self) -> bool:
        return self.async_loop is not None

    def add_request(
        self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams, arrival_time: float | None = None
    ) -> None:
        """Validate and admit; raises ValueError naming the problem and admits nothing on error."""
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams.")
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        text, token_ids = resolve_prompt(prompt, self.tokenizer, self.vocab_size)
        max_tokens = resolve_max_tokens(
            len(token_ids), params, self.max_model_len, self.kv.num_blocks, self.kv.block_size
        )
        if (params.prompt_logprobs or 0) > self.vocab_size:
            raise ValueError(f"prompt_logprobs must be at most the vocabulary size ({self.vocab_size}).")
        if params.prompt_logprobs is not None and self.config.parallel.tensor_parallel_size > 1:
            raise ValueError("prompt_logprobs is not supported with tensor_parallel_size > 1.")
        grammar = self.structured.compile(params)  # ValueError on a bad schema/regex
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        group = RequestGroup(request_id, text, token_ids, [], [], arrival, params.logprobs)
        for i in range(params.n):
            cp = params if params.n == 1 or params.seed is None else params.clone(seed=params.seed + i)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(child_id, token_ids, cp, max_tokens, self.eos_token_ids, arrival)
            if i == 0 and params.prompt_logprobs is not None:  # the prompt is shared: score it once
                req.prompt_logprobs = [None]
            group.children.append(req)
            stops = (cp.stop_strings, cp.include_stop_str_in_output, cp.skip_special_tokens)
            # No stop strings and no grammar: the text is decoded when an output is built, not each step.
            group.detoks.append(IncrementalDetokenizer(self.tokenizer, token_ids, *stops, deferred=grammar is None))
        self.groups[request_id] = group
        for i, req in enumerate(group.children):
            self._child_to_group[req.request_id] = (group, i)
            self.structured.add(req, grammar)  # its first mask fills during the prefill
            self.scheduler.add_request(req)
        self.kv.prefetch(group.children[0])

    def abort_request(self, request_ids: list[str] | str, emit_output: bool = True) -> None:
        """Free the requests' KV blocks now; their final outputs come with the next step()."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self.groups.get(rid)
            if group is None:
                continue
            for req in group.children:
                if not req.is_finished:
                    self._finish(group, req, RequestStatus.FINISHED_ABORTED)
            if emit_output:
                self._pending.append(request_output(group, self.tokenizer))
            self._drop(group)

    def take_outputs(self) -> list[RequestOutput]:
        """The outputs produced outside a step (aborts), once."""
        outputs, self._pending = self._pending, []
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups) or bool(self._pending)

    def num_unfinished_requests(self) -> int:
        return len(self.groups)

    def num_would_wait(self, num_new: int) -> int:
        """Requests left waiting if num_new more arrived now (those beyond the running batch's free slots)."""
        sched = self.scheduler
        return max(0, sched.num_waiting + len(sched.running) + num_new - sched.max_num_seqs)

    def num_blocks_in_use(self) -> int:
        return self.kv.num_blocks - self.kv.num_free_blocks()

    def encode(self, text: str) -> list[int]:
        return resolve_prompt(text, self.tokenizer, self.vocab_size)[1]

    def shutdown(self) -> None:
        """Abort what is in flight and flush pending KV writes to the offload tiers."""
        self.abort_request(list(self.groups), emit_output=False)
        if self.kv.offloader is not None:
            self.kv.offloader.close()

    def step(self) -> list[RequestOutput]:
        return self.async_loop.step() if self.async_loop is not None else self.step_sync()

    def step_sync(self) -> list[RequestOutput]:
        """One synchronous step: schedule -> execute -> sample/verify -> update -> speculation."""
        outputs = self.take_outputs()
        sched = self.scheduler.schedule()
        self.fail_unfittable(sched, outputs)
        if not sched.empty:
            start = time.perf_counter()
            drafts = self.spec.pending_drafts() if self.spec is not None else None
            step_out = self.execute(sched, drafts)
            new_tokens, accepted = self._sample(sched, step_out.logits)
            outputs.extend(self.update(sched, new_tokens, accepted))
            if self.spec is not None:
                elapsed = time.perf_counter() - start
                self.spec.after_step(sched, new_tokens, step_out, elapsed, len(self.scheduler.running))
        self.record_step_stats(sched)
        return outputs

    def execute(self, sched: SchedulerOutput, pending: PendingTokens | None) -> StepOutput:
        """The forward of a scheduled step (preempted requests leave the proposer first)."""
        if self.spec is not None:
            for req in sched.preempted:
                self.spec.on_preempted(req)
        need_hidden = self.spec is not None and self.spec.proposer.needs_target_hidden
        plan = plan_prompt_logprobs(sched)
        # (the tensor-parallel executor takes neither keyword)
        kw: dict[str, Any] = {k: v for k, v in (("prompt_plan", plan), ("pending", pending)) if v}
        step_out = self.runner.execute(sched, self.kv.block_ids, need_hidden, **kw)
        for item, entries in zip(plan, step_out.prompt_logprobs or ()):  # before update() may finish the request
            sched.scheduled[item.sched_index].request.prompt_logprobs.extend(entries)  # type: ignore[union-attr]
        self.kv.after_forward()
        return step_out

    def _sample(self, sched: SchedulerOutput, logits: torch.Tensor) -> tuple[list[list[int] | None], list[int]]:
        """Per scheduled request: its new tokens (None if mid-prefill) and accepted draft count."""
        flags = [s.samples for s in sched.scheduled]
        entries = [s for s, f in zip(sched.scheduled, flags) if f]
        if not entries:
            return [None] * len(sched.scheduled), [0] * len(sched.scheduled)
        sampling = [s.request for s in entries]
        num_drafts = [s.num_spec_tokens for s in entries]
        # grammar masks, before every sampling path (the greedy fast path too)
        logits = self.structured.apply(logits, sampling, num_drafts)
        if self.spec is not None and any(num_drafts):
            token_lists, num_accepted = self.spec.verify(sampling, num_drafts, logits, self._sampling_meta(sampling))
            found = verify_logprobs(sampling, num_drafts, token_lists, logits)
            if found is not None:
                self.store_logprobs(*found)
            flags = [s.samples for s in sched.scheduled]  # read again after the verify, as the rows are
        else:
            out = self.sample_tokens(sampling, logits)
            token_lists, num_accepted = [[t] for t in out.token_ids.tolist()], [0] * len(entries)
            if out.logprobs is not None:
                self.store_logprobs(sampling, out.logprobs)
        tokens_it, acc_it = iter(token_lists), iter(num_accepted)
        new_tokens = [next(tokens_it) if f else None for f in flags]
        accepted = [next(acc_it) if f else 0 for f in flags]
        return new_tokens, accepted

    def _sampling_meta(self, reqs: list[Request]) -> SamplingMetadata:
        # per-row stop ids matter only below min_tokens: not built when no row sets it (host time per row)
        needs_stops = any(r.params.min_tokens for r in reqs)
        stops = [list(r.eos_token_ids) + r.params.stop_ids for r in reqs] if needs_stops else None
        lists = ([r.params for r in reqs], [r.prompt_token_ids for r in reqs], [r.output_token_ids for r in reqs])
        return SamplingMetadata.build(*lists, self.vocab_size, self.device, stops)

    def sample_tokens(self, reqs: list[Request], logits: torch.Tensor) -> SamplerOutput:
        """One token per row of logits [len(reqs), vocab], on the device."""
        plain_greedy = all(  # the common serving case: argmax, no metadata to build or copy
            (p := r.params).greedy
            and p.logprobs is None
            and r.num_output_tokens >= p.min_tokens
            and (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
            for r in reqs
        )
        if plain_greedy:
            return SamplerOutput(logits.argmax(dim=-1), None)
        return self.sampler(logits, self._sampling_meta(reqs))

    @staticmethod
    def store_logprobs(reqs: Sequence[Request | None], lp: LogprobsTensors) -> None:
        """reqs: one per row of lp; None skips the row."""
        ids, values, ranks = lp.logprob_token_ids.tolist(), lp.logprobs.tolist(), lp.sampled_token_ranks.tolist()
        for row, req in enumerate(reqs):
            if req is None or req.params.logprobs is None:
                continue
            n = req.params.logprobs
            entry = {ids[row][0]: (values[row][0], ranks[row])}
            for j in range(1, n + 1):
                entry.setdefault(ids[row][j], (values[row][j], j))
            req.logprobs.append(entry)
            req.cumulative_logprob += values[row][0]

    def update(
        self, sched: SchedulerOutput, new_tokens: list[list[int] | None], accepted: list[int], advanced: bool = False
    ) -> list[RequestOutput]:
        """advanced: the async loop already counted the step computed and holds a placeholder per new token."""
        now = time.monotonic()
        step_stats = StepTokenStats()
        touched: dict[str, RequestGroup] = {}  # groups to output, in the order they were first touched
        stream, max_len, update_computed = self.stream_outputs, self.max_model_len, self.scheduler.update_computed
        for s, tokens, num_acc in zip(sched.scheduled, new_tokens, accepted):
            if not advanced:
                update_computed(s, s.num_spec_tokens - num_acc)
            if tokens is None:
                continue
            req = s.request
            if advanced and req.is_finished:  # aborted while its tokens were in flight
                continue
            group, index = self._child_to_group[req.request_id]
            if len(tokens) == 1 and group.detoks[index].deferred:
                status = self._update_one_token(req, tokens[0], advanced, max_len)
                step_stats.add(req, 1, now)
            else:
                status = self._update_tokens(req, group.detoks[index], tokens, advanced, step_stats, now)
            if status is not None:
                self._finish(group, req, status)
                touched[group.request_id] = group
            elif stream:
                touched[group.request_id] = group
        if self.spec is None and self.structured.num_requests:  # next masks now; with speculation once drafts exist
            self.structured.prepare([s.request for s, t in zip(sched.scheduled, new_tokens) if t])
        step_stats.flush(self.stats)
        outputs = []
        for group in touched.values():
            # Offline callers (LLM.generate) only read finished outputs: the rest are not built (nor touched).
            finished = group.finished
            if finished or stream:
                outputs.append(request_output(group, self.tokenizer))
            if finished:
                self._drop(group)
        return outputs

    def _update_one_token(self, req: Request, tok: int, advanced: bool, max_len: int) -> RequestStatus | None:
        """The common row: one new token, no stop strings and no grammar (its text is read later, deferred)."""
        if advanced:
            req.resolve_pending_token(tok)
            self.kv.cache_computed_blocks(req)
        else:
            req.output_token_ids.append(tok)
            req.all_token_ids.append(tok)
        if req.logprobs:
            req.trim_logprobs()
        # check_token_stop only when one of its conditions can hold (a stop or EOS id, a length limit)
        p = req.params
        if (
            tok in req.eos_token_ids
            or tok in p.stop_ids
            or len(req.output_token_ids) >= req.max_tokens
            or len(req.all_token_ids) >= max_len
        ):
            return check_token_stop(req, max_len)
        return None

    def _update_tokens(
        self,
        req: Request,
        detok: IncrementalDetokenizer,
        tokens: list[int],
        advanced: bool,
        step_stats: StepTokenStats,
        now: float,
    ) -> RequestStatus | None:
        """Any row: the step's tokens one at a time with token stops, stop strings, the grammar; the status."""
        status = None
        num_new = 0  # tokens of this step kept so far
        for tok in tokens:
            if advanced:
                req.resolve_pending_token(tok)
            else:
                req.append_output_tokens([tok])
            num_new += 1
            status = check_token_stop(req, self.max_model_len)
            if status is not None:
                break
        if advanced:
            self.kv.cache_computed_blocks(req)
        stop_str, kept = None, num_new
        if not detok.deferred:  # (a deferred detokenizer has no stop strings: its text is fed when read)
            new = req.output_token_ids[-num_new:]
            # A stop token's (or EOS's) text is not part of the output unless asked for (vLLM's rule).
            hide = status == RequestStatus.FINISHED_STOPPED and not req.params.include_stop_str_in_output
            num_before = req.num_output_tokens - num_new
            stop_str, kept = _stop_string(detok, new[:-1] if hide else new, num_before, req.params.min_tokens)
        if stop_str is not None and kept < num_new:  # a stop string ended the text before the step's end
            req.trim_output_tokens(num_new - kept)
            num_new, status = kept, None
        req.trim_logprobs()  # a verify step scored tokens past a stop
        # the grammar saw the end (or a token it rejects): nothing more may follow.
        if self.structured.advance(req, req.output_token_ids[-num_new:]) and status is None:
            status = RequestStatus.FINISHED_STOPPED
        step_stats.add(req, num_new, now)
        if stop_str is not None and status is None:
            req.stop_reason, status = stop_str, RequestStatus.FINISHED_STOPPED
        return status

    def _finish(self, group: RequestGroup, req: Request, status: RequestStatus) -> None:
        req.drop_pending_tokens()  # asynchronous scheduling: a later step's token never counts
        self.scheduler.finish(req, status)
        self.structured.release(req)
        if self.spec is not None:
            self.spec.on_finished(req)
        group.finished_ids.add(req.request_id)
        record_finished(self.stats, req, time.monotonic())

    def _drop(self, group: RequestGroup) -> None:
        self.groups.pop(group.request_id, None)
        for req in group.children:
            self._child_to_group.pop(req.request_id, None)

    def fail_unfittable(self, sched: SchedulerOutput, outputs: list[RequestOutput]) -> None:
        """A waiting request that cannot get blocks even with nothing running can never run."""
        if sched.empty and not self.scheduler.running and self.scheduler.waiting:
            req = self.scheduler.waiting[0]
            group, _ = self._child_to_group[req.request_id]
            req.stop_reason = "kv_cache_full"
            self._finish(group, req, RequestStatus.FINISHED_LENGTH)
            if group.finished:
                outputs.append(request_output(group, self.tokenizer))
                self._drop(group)

    def record_step_stats(self, sched: SchedulerOutput) -> None:
        st = self.stats
        st.set("num_requests_running", self.scheduler.num_running)
        st.set("num_requests_waiting", self.scheduler.num_waiting)
        st.set("kv_cache_usage_perc", self.kv.usage())
        if sched.preempted:
            st.inc("num_preemptions_total", len(sched.preempted))
        q, h = self.kv.prefix_queries, self.kv.prefix_hits
        if (q, h) != self._last_prefix:
            st.inc("prefix_cache_queries_total", q - self._last_prefix[0])
            st.inc("prefix_cache_hits_total", h - self._last_prefix[1])
            self._last_prefix = (q, h)


def _stop_string(detok, tokens: list[int], num_before: int, min_tokens: int) -> tuple[str | None, int]:
    """Feed the step's tokens to the detokenizer one at a time: (the stop string matched or None, tokens kept)."""
    for i, tok in enumerate(tokens):
        stop = detok.add_tokens([tok], check_stop=num_before + i + 1 > min_tokens)
        if stop is not None:
            return stop, i + 1
    return None, len(tokens)
