"""Lossless speculative verification (Leviathan et al. 2023 / Chen et al. 2023).

Random rows accept draft x_j with probability min(1, p_j[x_j] / q_j[x_j]) (p = `compute_target_probs`,
q = draft_probs, one-hot when None); at the first rejection they emit a token from
normalize(max(0, p_j - q_j)), else a bonus token from p_k. Greedy rows accept while x_j == argmax p_j.
Seeded rows emit at every position t the plain sampler's token there (`seeded_tokens`: a race on noise
keyed by (seed, position)) and accept x_j iff it equals t: t ~ p_j whatever the drafts (lossless), and the
output is the same for any k, batch, or no speculation."""

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
    """Where each draft and each sequence's positions live in the flat tensors: host arrays that
    depend only on the numbers of drafts (`layout`, cached by them; read-only)."""

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
    """The random path's indices on the device (one packed copy); None where not needed."""

    draft_ids: Tensor  # [total] int64
    target_index: Tensor  # [total] flat index of (draft_target_row, draft id) in target_probs
    draft_index: Tensor | None  # [total] flat index of (draft, draft id) in draft_probs
    random_draft: Tensor | None  # [total] 1 for drafts of random rows, 0 of greedy ones (mixed batches)
    pad_index: Tensor | None  # [total] draft_seq * max_k + draft_offset (when k_i differ)
    seq_num_drafts: Tensor  # [num_seqs] k_i
    seq_target_start: Tensor  # [num_seqs]
    seq_draft_start: Tensor  # [num_seqs]

    @classmethod
    def send(
        cls,
        lay: _Layout,
        draft_ids: np.ndarray,
        vocab: int,
        with_draft_probs: bool,
        meta: SamplingMetadata,
        device: torch.device,
    ) -> _DeviceLayout:
        per_draft = [draft_ids, lay.draft_target_row * vocab + draft_ids]
        if with_draft_probs:
            per_draft.append(np.arange(lay.total) * vocab + draft_ids)
        if meta.greedy_mask is not None:
            per_draft.append(np.logical_not(meta.is_greedy)[lay.draft_seq])
        if not lay.uniform:
            per_draft.append(lay.draft_seq * lay.max_k + lay.draft_offset)
        per_seq = [lay.num_drafts, lay.seq_target_start, lay.seq_draft_start]
        sent = iter(h2d_packed(per_draft + per_seq, device))
        ids, target_index = next(sent), next(sent)
        draft_index, random_draft, pad_index = (
            next(sent) if use else None for use in (with_draft_probs, meta.greedy_mask is not None, not lay.uniform)
        )
        return cls(ids, target_index, draft_index, random_draft, pad_index, *sent)


def _check_shapes(
    lay: _Layout, draft_ids: np.ndarray, draft_probs: Tensor | None, target_logits: Tensor, meta: SamplingMetadata
) -> None:
    num_seqs, total, vocab = len(lay.num_drafts), lay.total, target_logits.shape[-1]
    if meta.num_seqs != num_seqs:
        raise ValueError(f"metadata has {meta.num_seqs} rows, draft_token_ids has {num_seqs}.")
    if target_logits.dim() != 2 or target_logits.shape[0] != total + num_seqs:
        raise ValueError(
            f"target_logits must be [total_draft_tokens + num_seqs = {total + num_seqs}, "
            f"vocab], got {tuple(target_logits.shape)}."
        )
    if vocab != meta.vocab_size:
        raise ValueError(
            f"logits have {vocab} columns, metadata was built for vocab_size="
            f"{meta.vocab_size}; slice padded vocab columns off before sampling."
        )
    if draft_probs is not None and tuple(draft_probs.shape) != (total, vocab):
        raise ValueError(f"draft_probs must be [total_draft_tokens = {total}, vocab], got {tuple(draft_probs.shape)}.")
    if total and int(draft_ids.view(np.uint64).max()) >= vocab:  # negative ids view as >= 2**63
        # Out-of-range ids would be a device-side assert on GPU, which kills the process.
        raise ValueError(f"draft_token_ids must be in [0, {vocab}).")


def _accepted_prefix(lay: _Layout, accepted: np.ndarray) -> np.ndarray:
    """[total] bool -> [num_seqs] int64: each sequence's drafts before its first rejection."""
    if lay.max_k == 0:
        return np.zeros(len(lay.num_drafts), dtype=np.int64)
    if lay.uniform:
        padded = accepted.reshape(-1, lay.max_k)
    else:
        padded = np.zeros((len(lay.num_drafts), lay.max_k), dtype=bool)  # padding ends short rows
        padded[lay.draft_seq, lay.draft_offset] = accepted
    return np.logical_and.accumulate(padded, axis=1).sum(axis=1)


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
        target_probs = compute_target_probs(target_logits, expanded)
        dev = _DeviceLayout.send(lay, draft_ids, vocab, draft_probs is not None, meta, device)
        seeded = seeded_tokens(target_probs, expanded)
        if seeded is not None:  # the seeded rows' tokens, -1 elsewhere: [total_drafts + num_seqs]
            token_at = torch.full((target_probs.shape[0],), -1, dtype=torch.int64, device=device)
            token_at.index_copy_(0, *seeded)
        num_accepted = torch.zeros(meta.num_seqs, dtype=torch.int64, device=device)
        if lay.total:
            accepted = self._accepted(lay, dev, draft_probs, target_probs, meta)  # [total_drafts]
            if seeded is not None:
                draft_token_at = token_at.index_select(0, dev.target_index.div(vocab, rounding_mode="floor"))
                accepted = torch.where(draft_token_at < 0, accepted, (draft_token_at == dev.draft_ids).long())
            num_accepted = _prefix_len(lay, dev, accepted, meta.num_seqs)
        final = self._final_tokens(lay, dev, num_accepted, draft_probs, target_probs, meta)  # [num_seqs]
        if seeded is not None:
            seeded_final = token_at.index_select(0, dev.seq_target_start + num_accepted)
            final = torch.where(seeded_final < 0, final, seeded_final)
        counts, tokens = torch.stack([num_accepted, final]).tolist()
        return counts, tokens

    def _accepted(
        self, lay: _Layout, dev: _DeviceLayout, draft_probs: Tensor | None, target_probs: Tensor, meta: SamplingMetadata
    ) -> Tensor:
        """[total_drafts] int64: 1 where the draft is accepted (given its predecessors were)."""
        device = target_probs.device
        target_p = target_probs.take(dev.target_index).double()  # [total_drafts]
        # u < target/draft without dividing; strict so a zero target prob never accepts.
        # float64: float32 steps of 2**-24 bias the acceptance of small probabilities.
        scaled_u = torch.empty(lay.total, dtype=torch.float64, device=device).uniform_(generator=self.generator)
        if draft_probs is not None and dev.draft_index is not None:
            scaled_u = scaled_u * draft_probs.take(dev.draft_index).double()
        if dev.random_draft is not None:
            # Greedy rows' target_probs are one-hot at the target argmax: with u scaled to 0 a draft
            # is accepted iff it is that argmax (target_p 1, else 0).
            scaled_u = scaled_u * dev.random_draft
        return (scaled_u < target_p).long()

    def _final_tokens(
        self,
        lay: _Layout,
        dev: _DeviceLayout,
        num_accepted: Tensor,
        draft_probs: Tensor | None,
        target_probs: Tensor,
        meta: SamplingMetadata,
    ) -> Tensor:
        """[num_seqs] int64: the recovered token at the first rejection, else the bonus token."""
        final_probs = target_probs.index_select(0, dev.seq_target_start + num_accepted)  # [num_seqs, vocab]
        residual = final_probs
        if lay.total > 0:
            residual = _residual(lay, dev, num_accepted, draft_probs, final_probs)
        noise = draw_exponential(meta.num_seqs, final_probs.shape[1], (), self.generator, final_probs.device)
        tokens = random_sample(residual, noise)
        if meta.greedy_mask is not None:
            # Greedy rows: one-hot at the target argmax, which differs from a rejected draft.
            tokens = torch.where(meta.greedy_mask, final_probs.argmax(dim=-1), tokens)
        return tokens


def _prefix_len(lay: _Layout, dev: _DeviceLayout, accepted: Tensor, num_seqs: int) -> Tensor:
    """accepted [total_drafts] int64 (0/1) -> [num_seqs]: the drafts before each sequence's first rejection."""
    if dev.pad_index is None:  # lay.uniform
        padded = accepted.view(num_seqs, lay.max_k)
    else:  # padding (0) ends short rows
        padded = accepted.new_zeros(num_seqs * lay.max_k).index_copy_(0, dev.pad_index, accepted)
        padded = padded.view(num_seqs, lay.max_k)
    return padded.cumprod(dim=1).sum(dim=1)


def _greedy(
    lay: _Layout,
    draft_ids: np.ndarray,
    draft_token_ids: Sequence[Sequence[int]],
    target_logits: Tensor,
    meta: SamplingMetadata,
) -> tuple[list[int], list[int]]:
    """All rows greedy: every position's target token is the argmax of its (penalized) logits;
    one argmax on the device, one read-back, the comparison on the host."""
    logits = target_logits
    if meta.penalties is not None or meta.min_tokens_mask is not None:
        # Nothing to expand otherwise: without penalties or a min_tokens mask on the sequences,
        # no position has one (expand_for_drafts only counts drafts into those two).
        logits = penalized_logits(target_logits, meta.expand_for_drafts(draft_token_ids))
    targets = logits.argmax(dim=-1).cpu().numpy()  # [total + num_seqs]
    counts = _accepted_prefix(lay, draft_ids == targets[lay.draft_target_row])
    return counts.tolist(), targets[lay.seq_target_start + counts].tolist()


def _residual(
    lay: _Layout, dev: _DeviceLayout, num_accepted: Tensor, draft_probs: Tensor | None, final_probs: Tensor
) -> Tensor:
    """max(0, target_probs - draft_probs) at the first rejected position, unnormalized (the
    exponential race does not need it); the target itself for rows that accepted everything."""
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
    # Rounding can leave nothing when target and draft nearly coincide; the target itself is then
    # the closest distribution to the (vanishing) residual.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, final_probs, residual)
