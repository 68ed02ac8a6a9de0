"""Repetition penalty (HF / vLLM: prompt and output tokens; negative logits * p, others / p) and
presence / frequency penalties (OpenAI: output tokens; logit -= presence * (count > 0) + frequency * count)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from specserve.sample.h2d import h2d
from specserve.sampling_params import SamplingParams


class PenaltyTensors(NamedTuple):
    repetition: Tensor  # [num_seqs] float32; 1.0 = off
    presence: Tensor  # [num_seqs] float32; 0.0 = off
    frequency: Tensor  # [num_seqs] float32; 0.0 = off
    prompt_mask: Tensor  # [num_seqs, vocab] bool: the token occurs in the prompt
    output_counts: Tensor  # [num_seqs, vocab] int32: occurrences in the output so far


def has_penalty(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def _counts(shape: tuple[int, int], pairs: list[tuple[int, int]], dtype: torch.dtype, device: torch.device) -> Tensor:
    """[rows, vocab]: how often each (row, token) occurs in pairs (bool: whether it does)."""
    out = torch.zeros(shape, dtype=dtype, device=device)
    if pairs:
        index = h2d(torch.tensor(pairs, dtype=torch.int64).T.contiguous(), device)  # one host->device copy
        out.index_put_((index[0], index[1]), torch.ones(index.shape[1], dtype=dtype, device=device), accumulate=True)
    return out


def build_penalty_tensors(
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device,
) -> PenaltyTensors | None:
    """None when no row is penalized, so the sampler's fast path does no work at all."""
    n = len(params)
    if (  # the common case first, in three list scans rather than a call per row
        [p.repetition_penalty for p in params].count(1.0) == n
        and [p.presence_penalty for p in params].count(0.0) == n
        and [p.frequency_penalty for p in params].count(0.0) == n
    ):
        return None
    active = [i for i, p in enumerate(params) if has_penalty(p)]
    shape = (len(params), vocab_size)
    rows = [[p.repetition_penalty, p.presence_penalty, p.frequency_penalty] for p in params]
    factors = h2d(torch.tensor(rows, dtype=torch.float32), device)
    # The prompt matters only to the repetition penalty: skip long prompts of the other rows.
    rep = [(i, t) for i in active if params[i].repetition_penalty != 1.0 for t in prompt_token_ids[i]]
    counts = _counts(shape, [(i, t) for i in active for t in output_token_ids[i]], torch.int32, device)
    return PenaltyTensors(factors[:, 0], factors[:, 1], factors[:, 2], _counts(shape, rep, torch.bool, device), counts)


def select_penalty_rows(penalties: PenaltyTensors, index: Tensor) -> PenaltyTensors:
    """Rows `index` ([num_rows] int64, on the device) of every tensor."""
    return PenaltyTensors(*(t.index_select(0, index) for t in penalties))


def add_output_tokens(penalties: PenaltyTensors, row_ids: Sequence[int], token_ids: Sequence[int]) -> PenaltyTensors:
    """Counts as if row_ids[i] had also emitted token_ids[i] (drafts assumed accepted)."""
    counts = penalties.output_counts
    if not row_ids:
        return penalties
    extra = _counts((counts.shape[0], counts.shape[1]), list(zip(row_ids, token_ids)), counts.dtype, counts.device)
    return penalties._replace(output_counts=counts + extra)


def apply_penalties(logits: Tensor, penalties: PenaltyTensors) -> Tensor:
    """logits: [num_seqs, vocab] float32, returned penalized (a new tensor)."""
    counts = penalties.output_counts
    in_output = counts > 0
    seen = penalties.prompt_mask | in_output
    rep = torch.where(seen, penalties.repetition.unsqueeze(1), 1.0)  # [num_seqs, vocab]
    # HF's exact rule (score < 0 -> multiply, else divide): 0 stays 0 either way.
    logits = torch.where(logits < 0, logits * rep, logits / rep)
    logits -= penalties.frequency.unsqueeze(1) * counts
    logits -= penalties.presence.unsqueeze(1) * in_output
    return logits
