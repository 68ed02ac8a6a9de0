"""Lossless speculative verification (Leviathan et al. 2023 / Chen et al. 2023).

Random rows accept draft x_j with probability min(1, p_j[x_j] / q_j[x_j]) (p = `compute_target_probs`,
q = draft_probs, one-hot when None); at the first rejection they emit a token from
normalize(max(0, p_j - q_j)), else a bonus token from p_k. Greedy and seeded rows emit at every position
the plain sampler's token t_j there (argmax, or a race on noise keyed by (seed, position)) and accept x_j
iff x_j == t_j: t_j ~ p_j whatever the drafts (lossless), and the output is the same for any k or batch."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from specserve.sample.h2d import h2d_packed
from specserve.sample.metadata import SamplingMetadata
from specserve.sample.sampler import (
    check_vocab,
    compute_target_probs,
    draw_exponential,
    penalized_logits,
    random_sample,
    seeded_tokens,
)


class RejectionOutput(NamedTuple):
    output_token_ids: list[list[int]]  # per sequence: accepted drafts + one recovered/bonus token
    num_accepted: list[int]  # per sequence: accepted draft tokens, 0..k_i


class _Layout(NamedTuple):
    """Where drafts and positions live in the flat tensors; read-only, cached by the numbers of drafts."""

    num_drafts: tuple[int, ...]  # [num_seqs] k_i
    total: int  # sum of k_i
    max_k: int
    uniform: bool  # every sequence drafted max_k tokens
    draft_seq: np.ndarray  # [total] the draft's sequence
    draft_offset: np.ndarray  # [total] j, its position within the sequence's drafts
    draft_target_row: np.ndarray  # [total] its row in target_logits
    seq_target_start: np.ndarray  # [num_seqs] row of position 0 in target_logits
    seq_draft_start: np.ndarray  # [num_seqs] index of draft 0 in draft_ids


@functools.lru_cache(maxsize=128)
def layout(num_drafts: tuple[int, ...]) -> _Layout:
    k = np.asarray(num_drafts, dtype=np.int64).reshape(-1)
    draft_start = np.cumsum(k) - k
    target_start = draft_start + np.arange(len(k))  # each sequence adds k_i + 1 rows
    draft_seq = np.repeat(np.arange(len(k)), k)
    draft_offset = np.arange(len(draft_seq)) - draft_start[draft_seq]
    arrays = [draft_seq, draft_offset, target_start[draft_seq] + draft_offset, target_start, draft_start]
    for a in arrays:
        a.flags.writeable = False
    max_k = int(k.max(initial=0))
    return _Layout(num_drafts, int(k.sum()), max_k, bool((k == max_k).all()), *arrays)


class _DeviceLayout(NamedTuple):
    """The random path's indices on the device, sent in one packed copy."""

    draft_ids: Tensor  # [total] int64
    target_index: Tensor  # [total] flat index of (draft_target_row, draft id) in target_probs
    draft_index: Tensor  # [total] flat index of (draft, draft id) in draft_probs
    pad_index: Tensor  # [total] draft_seq * max_k + draft_offset
    seq_num_drafts: Tensor  # [num_seqs] k_i
    seq_target_start: Tensor  # [num_seqs]
    seq_draft_start: Tensor  # [num_seqs]


def _send(lay: _Layout, draft_ids: np.ndarray, vocab: int, device: torch.device) -> _DeviceLayout:
    per_draft = [draft_ids, lay.draft_target_row * vocab + draft_ids, np.arange(lay.total) * vocab + draft_ids]
    arrays = [*per_draft, lay.draft_seq * lay.max_k + lay.draft_offset, lay.num_drafts, *lay[-2:]]
    return _DeviceLayout(*h2d_packed(arrays, device))


def _check_shapes(
    lay: _Layout, draft_ids: np.ndarray, draft_probs: Tensor | None, target_logits: Tensor, meta: SamplingMetadata
) -> None:
    num_seqs, total, vocab, shape = len(lay.num_drafts), lay.total, target_logits.shape[-1], tuple(target_logits.shape)
    if meta.num_seqs != num_seqs:
        raise ValueError(f"metadata has {meta.num_seqs} rows, draft_token_ids has {num_seqs}.")
    if target_logits.dim() != 2 or target_logits.shape[0] != total + num_seqs:
        raise ValueError(f"target_logits must be [total_drafts + num_seqs = {total + num_seqs}, vocab], got {shape}.")
    check_vocab(vocab, meta)
    if draft_probs is not None and tuple(draft_probs.shape) != (total, vocab):
        raise ValueError(f"draft_probs must be [total_draft_tokens = {total}, vocab], got {tuple(draft_probs.shape)}.")
    if total and int(draft_ids.view(np.uint64).max()) >= vocab:  # negative ids view as >= 2**63
        # Out-of-range ids would be a device-side assert on GPU, which kills the process.
        raise ValueError(f"draft_token_ids must be in [0, {vocab}).")


class RejectionSampler:
    """Verifies drafts against the target."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(
        self,
        draft_token_ids: Sequence[Sequence[int]],
        draft_probs: Tensor | None,
        target_logits: Tensor,
        meta: SamplingMetadata,
    ) -> RejectionOutput:
        """draft_token_ids: per sequence, k_i >= 0 drafts. draft_probs: [total_drafts, vocab], what the drafts
        were sampled from, or None for one-hot drafts. target_logits: [total_drafts + num_seqs, vocab], each
        sequence's k_i + 1 positions in order. meta: one row per sequence (expanded with expand_for_drafts)."""
        lay = layout(tuple(len(d) for d in draft_token_ids))
        draft_ids = np.fromiter(itertools.chain.from_iterable(draft_token_ids), np.int64, lay.total)
        _check_shapes(lay, draft_ids, draft_probs, target_logits, meta)
        if meta.num_seqs == 0:
            return RejectionOutput([], [])
        if meta.all_greedy:
            counts, tokens = _greedy(lay, draft_ids, draft_token_ids, target_logits, meta)
        else:
            counts, tokens = self._random(lay, draft_ids, draft_token_ids, draft_probs, target_logits, meta)
        outputs = [list(drafts[:n]) + [t] for drafts, n, t in zip(draft_token_ids, counts, tokens)]
        return RejectionOutput(outputs, counts)

    def _random(
        self,
        lay: _Layout,
        draft_ids: np.ndarray,
        draft_token_ids: Sequence[Sequence[int]],
        draft_probs: Tensor | None,
        target_logits: Tensor,
        meta: SamplingMetadata,
    ) -> tuple[list[int], list[int]]:
        """Batches with a random row, on the device: (accepted counts, final tokens), one read-back."""
        device, vocab = target_logits.device, target_logits.shape[1]
        expanded = meta.expand_for_drafts(draft_token_ids)
        target_probs = compute_target_probs(target_logits, expanded)  # [total_drafts + num_seqs, vocab]
        dev = _send(lay, draft_ids, vocab, device)
        fixed = _fixed_tokens(target_probs, expanded)  # [total_drafts + num_seqs] or None
        num_accepted = torch.zeros(meta.num_seqs, dtype=torch.int64, device=device)
        if lay.total:
            # u < target/draft without dividing; strict so a zero target prob never accepts. float64: float32
            # steps of 2**-24 bias the acceptance of small probabilities.
            scaled_u = torch.empty(lay.total, dtype=torch.float64, device=device).uniform_(generator=self.generator)
            if draft_probs is not None:
                scaled_u = scaled_u * draft_probs.take(dev.draft_index).double()
            accepted = (scaled_u < target_probs.take(dev.target_index).double()).long()  # [total_drafts]
            if fixed is not None:
                draft_fixed = fixed.index_select(0, dev.target_index.div(vocab, rounding_mode="floor"))
                accepted = torch.where(draft_fixed < 0, accepted, (draft_fixed == dev.draft_ids).long())
            if lay.uniform:
                padded = accepted.view(meta.num_seqs, lay.max_k)
            else:  # padding (0) ends short rows
                padded = accepted.new_zeros(meta.num_seqs * lay.max_k).index_copy_(0, dev.pad_index, accepted)
            num_accepted = padded.view(meta.num_seqs, lay.max_k).cumprod(dim=1).sum(dim=1)
        final_rows = dev.seq_target_start + num_accepted
        final_probs = target_probs.index_select(0, final_rows)  # [num_seqs, vocab]
        residual = final_probs if lay.total == 0 else _residual(lay, dev, num_accepted, draft_probs, final_probs)
        final = random_sample(residual, draw_exponential(meta.num_seqs, vocab, self.generator, device))
        if fixed is not None:
            fixed_final = fixed.index_select(0, final_rows)
            final = torch.where(fixed_final < 0, final, fixed_final)
        counts, tokens = torch.stack([num_accepted, final]).tolist()
        return counts, tokens


def _fixed_tokens(probs: Tensor, meta: SamplingMetadata) -> Tensor | None:
    """[num_rows] the token a greedy (argmax) or seeded (`seeded_tokens`) row emits at its position whatever the
    drafts, -1 at the other rows; None when there are none."""
    seeded = seeded_tokens(probs, meta)
    if seeded is None and meta.greedy_mask is None:
        return None
    fixed = torch.full((probs.shape[0],), -1, dtype=torch.int64, device=probs.device)
    if meta.greedy_mask is not None:
        fixed = torch.where(meta.greedy_mask, probs.argmax(dim=-1), fixed)
    return fixed if seeded is None else fixed.index_copy_(0, *seeded)


def _greedy(
    lay: _Layout,
    draft_ids: np.ndarray,
    draft_token_ids: Sequence[Sequence[int]],
    target_logits: Tensor,
    meta: SamplingMetadata,
) -> tuple[list[int], list[int]]:
    """All rows greedy: one argmax of the (penalized) logits on the device, one read-back, compared on the host."""
    logits = target_logits
    if meta.penalties is not None or meta.min_tokens_mask is not None:  # else no position has either
        logits = penalized_logits(target_logits, meta.expand_for_drafts(draft_token_ids))
    targets = logits.argmax(dim=-1).cpu().numpy()  # [total + num_seqs]
    rejected = draft_ids != targets[lay.draft_target_row]
    counts = np.array(lay.num_drafts, dtype=np.int64).reshape(-1)  # accepted prefix: up to the first rejection
    np.minimum.at(counts, lay.draft_seq[rejected], lay.draft_offset[rejected])
    return counts.tolist(), targets[lay.seq_target_start + counts].tolist()


def _residual(
    lay: _Layout, dev: _DeviceLayout, num_accepted: Tensor, draft_probs: Tensor | None, final_probs: Tensor
) -> Tensor:
    """max(0, target - draft) at the first rejected position, unnormalized; the target where all were accepted."""
    rejected = num_accepted < dev.seq_num_drafts  # [num_seqs]
    # Index of the first rejected draft; clamped so rows without one index something valid.
    rejected_draft = (dev.seq_draft_start + num_accepted).clamp_(max=lay.total - 1)
    if draft_probs is None:
        token = dev.draft_ids.index_select(0, rejected_draft).unsqueeze(1)  # [num_seqs, 1]
        kept = final_probs.gather(1, token) * (~rejected).unsqueeze(1)
        residual = final_probs.scatter(1, token, kept)
    else:
        subtract = draft_probs.index_select(0, rejected_draft).float() * rejected.unsqueeze(1)
        residual = (final_probs - subtract).clamp_(min=0.0)
    # Rounding can leave nothing when target and draft nearly coincide: the target is then the closest.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, final_probs, residual)
