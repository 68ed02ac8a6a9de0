"""Structured output: every sampled or verified logits row of a structured request is masked with its xgrammar
matcher's token bitmask, so both samplers draw only grammar-valid tokens. A worker thread fills the masks during
the forward; invariant: a matcher is used by one thread at a time (the main thread `_wait`s)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from specserve.sample.grammar_cache import FIELD, GrammarCache, build_grammar, load_xgrammar, parse_structured_outputs
from specserve.sample.h2d import h2d
from specserve.sampling_params import SamplingParams
from specserve.scheduler.request import Request

logger = logging.getLogger(__name__)

# vLLM's pre-`structured_outputs` extra fields (still sent by many clients) -> our kinds.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def validate_structured_outputs(
    spec: dict[str, Any] | None, field: str = FIELD, value_label: str | None = None
) -> None:
    """Shape and syntax check of a `structured_outputs` dict, without a tokenizer; ValueError names the field."""
    parsed = parse_structured_outputs(spec, field, value_label)
    if parsed is not None:
        build_grammar(parsed, field, value_label)


def structured_from_openai(
    response_format: dict[str, Any] | None, extra: dict[str, Any] | None
) -> dict[str, Any] | None:
    """Map an OpenAI `response_format` and vLLM extra-body fields (`structured_outputs`, `guided_*`) to a
    `structured_outputs` dict (None = unconstrained). At most one source; ValueError names the field."""
    extra = extra or {}
    found: list[tuple[str, dict[str, Any], str | None]] = []  # (field, structured_outputs, label)
    if response_format is not None:
        mapped = _from_response_format(response_format)
        if mapped is not None:
            found.append(mapped)
    so = extra.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(so).__name__}.")
        found.append(("structured_outputs", dict(so), None))
    for key, kind in _GUIDED.items():
        if extra.get(key) is not None:
            found.append((key, {kind: extra[key]}, key))
    if extra.get("guided_whitespace_pattern") is not None:
        raise ValueError("guided_whitespace_pattern is not supported.")
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(["response_format", "structured_outputs", *_GUIDED])
        raise ValueError(f"only one of {names} may be given, got {[f[0] for f in found]}.")
    field, mapped_so, label = found[0]
    validate_structured_outputs(mapped_so, field, label)
    return mapped_so


def _from_response_format(rf: Any) -> tuple[str, dict[str, Any], str | None] | None:
    if not isinstance(rf, dict):
        raise ValueError(f"response_format must be an object, got {type(rf).__name__}.")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", {"json_object": True}, "response_format"
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise ValueError("response_format.json_schema must be an object with 'name' and 'schema'.")
        if js.get("name") is not None and not isinstance(js["name"], str):
            raise ValueError("response_format.json_schema.name must be a string.")
        schema = js.get("schema")
        if schema is None:
            raise ValueError("response_format.json_schema.schema is required.")
        # `strict` is accepted and ignored: the grammar is always strict (no unlisted properties).
        return "response_format", {"json": schema}, "response_format.json_schema.schema"
    raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}.")


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, row_ids: Sequence[int]) -> Tensor:
    """A copy of logits [num_rows, vocab] whose rows row_ids have disallowed tokens at -inf."""
    device, vocab = logits.device, logits.shape[1]
    words = bitmask.to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    banned = ((words.unsqueeze(-1) >> shifts) & 1).reshape(words.shape[0], -1)[:, :vocab] == 0
    if list(row_ids) == list(range(logits.shape[0])):  # every row is structured: no gather/scatter
        return logits.masked_fill(banned, float("-inf"))
    index = h2d(torch.tensor(list(row_ids), dtype=torch.int64), device)
    out = logits.clone()
    out[index] = out[index].masked_fill(banned, float("-inf"))
    return out


@dataclass
class _Masks:
    drafts: tuple[int, ...]  # the drafts the masks were computed through
    bitmask: Tensor  # [len(drafts) + 1, num_words] int32, CPU: row j = state after drafts[:j]


@dataclass
class _GrammarState:
    matcher: Any  # xgrammar.GrammarMatcher; has accepted exactly the request's output tokens
    masks: _Masks | None = None  # written by the worker; read only after `job` is done
    job: Future[None] | None = None


class StructuredOutputs:
    """Grammar state of the engine's structured requests."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.cache = GrammarCache(tokenizer, vocab_size, eos_token_ids)
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._states: dict[str, _GrammarState] = {}
        self._executor: ThreadPoolExecutor | None = None
        self.num_sync_fills = 0  # masks not ready when the logits were: computed on the critical path
        self.num_drafts_cut = 0  # draft tokens dropped because the grammar rejects them

    def compile(self, params: SamplingParams) -> Any | None:
        """The compiled grammar for params.structured_outputs (None = unconstrained)."""
        spec = parse_structured_outputs(params.structured_outputs)
        return None if spec is None else self.cache.get(spec)

    def add(self, req: Request, compiled: Any | None) -> None:
        """Start tracking a request; its first mask is filled in the background right away."""
        if compiled is None:
            return
        self._states[req.request_id] = _GrammarState(load_xgrammar().GrammarMatcher(compiled))
        self.prepare([req])

    def release(self, req: Request) -> None:
        """Forget a finished or aborted request. A job still running keeps its own references."""
        self._states.pop(req.request_id, None)

    @property
    def num_requests(self) -> int:
        return len(self._states)

    def prepare(self, reqs: Sequence[Request]) -> None:
        """Cut drafts the grammar rejects, then fill the next step's masks in the worker (idempotent)."""
        items: list[tuple[_GrammarState, tuple[int, ...]]] = []
        for req in reqs:
            st = self._states.get(req.request_id)
            if st is None or req.is_finished:
                continue
            self._wait(st)
            num_proposed = len(req.spec_token_ids)
            drafts = _cut_drafts(st.matcher, req)
            self.num_drafts_cut += num_proposed - len(drafts)
            if st.masks is None or st.masks.drafts != drafts:
                st.masks = None
                items.append((st, drafts))
        if items:
            self._executor = self._executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-grammar")
            job = self._executor.submit(self._fill_all, items)
            for st, _ in items:
                st.job = job

    def _fill_all(self, items: list[tuple[_GrammarState, tuple[int, ...]]]) -> None:
        for st, drafts in items:
            st.masks = _fill_masks(st.matcher, drafts, self.num_words)

    def apply(self, logits: Tensor, reqs: Sequence[Request], num_spec: Sequence[int]) -> Tensor:
        """Mask grammar-invalid tokens: logits [sum(num_spec) + len(reqs), vocab], request i owning num_spec[i] + 1
        consecutive rows (its draft positions, then the bonus position)."""
        if not self._states:
            return logits
        row_ids: list[int] = []
        rows: list[Tensor] = []
        start = 0
        for req, k in zip(reqs, num_spec):
            st = self._states.get(req.request_id)
            if st is not None:
                rows.append(self._masks_for(st, tuple(req.spec_token_ids[:k])).bitmask[: k + 1])
                row_ids.extend(range(start, start + k + 1))
            start += k + 1
        if not rows:
            return logits
        return apply_token_bitmask(logits, torch.cat(rows), row_ids)

    def _masks_for(self, st: _GrammarState, drafts: tuple[int, ...]) -> _Masks:
        self._wait(st)
        masks = st.masks
        # The scheduler may have dropped trailing drafts (budget, context end): a prefix still fits.
        if masks is None or masks.drafts[: len(drafts)] != drafts:
            self.num_sync_fills += 1
            masks = st.masks = _fill_masks(st.matcher, drafts, self.num_words)
        return masks

    def advance(self, req: Request, token_ids: Sequence[int]) -> bool:
        """Feed the tokens the request just emitted to its matcher."""
        st = self._states.get(req.request_id)
        if st is None or not token_ids:
            return False
        self._wait(st)
        st.masks = None
        for token in token_ids:
            if st.matcher.is_terminated() or not st.matcher.accept_token(token):
                logger.warning("request %s: token %d violates its %s; ending it.", req.request_id, token, FIELD)
                return True
        return st.matcher.is_terminated()

    @staticmethod
    def _wait(st: _GrammarState) -> None:
        if st.job is not None:
            st.job.result()  # re-raises a worker error here, on the engine's thread
            st.job = None


def _cut_drafts(matcher: Any, req: Request) -> tuple[int, ...]:
    """Drop the drafts the grammar can never emit; returns the drafts kept."""
    drafts, num_valid = req.spec_token_ids, 0
    while num_valid < len(drafts) and not matcher.is_terminated() and matcher.accept_token(drafts[num_valid]):
        num_valid += 1
    # A sampled draft the grammar rejects stays (rejection needs the drafts as sampled), unless the grammar ended.
    keep = num_valid + int(num_valid < len(drafts) and not matcher.is_terminated() and req.spec_draft_probs is not None)
    if num_valid:
        matcher.rollback(num_valid)
    if keep < len(drafts):
        req.spec_token_ids = list(drafts[:keep])
        if req.spec_draft_probs is not None:
            req.spec_draft_probs = req.spec_draft_probs[:keep]
    return tuple(req.spec_token_ids)


def _fill_masks(matcher: Any, drafts: tuple[int, ...], num_words: int) -> _Masks:
    """Masks for positions 0..len(drafts): walk the matcher through the drafts, then roll back."""
    bitmask = torch.full((len(drafts) + 1, num_words), -1, dtype=torch.int32)
    matcher.fill_next_token_bitmask(bitmask, 0)
    num_accepted = 0
    for j, token in enumerate(drafts):
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        num_accepted += 1
        if not matcher.is_terminated():
            matcher.fill_next_token_bitmask(bitmask, j + 1)
    if num_accepted:
        matcher.rollback(num_accepted)
    return _Masks(drafts, bitmask)
