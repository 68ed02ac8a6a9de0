"""Lossless speculative verification (Leviathan et al. 2023 / Chen et al. 2023).

Per sequence i with drafts x_0..x_{k_i-1} and target distributions target_probs_0..target_probs_k
(`compute_target_probs` on the target's logits, so exactly what the plain sampler would use):
- random rows accept x_j with probability min(1, target_probs_j[x_j] / draft_probs_j[x_j]);
  at the first rejection emit a recovered token from normalize(max(0, target_probs_j -
  draft_probs_j)) and stop; if all k_i are accepted emit a bonus token from target_probs_k.
  The emitted sequence is then distributed exactly as sampling the target token by token.
  draft_probs None means one-hot drafts (n-gram, argmax drafters): draft_probs_j[x_j] = 1 and the
  residual is target_probs_j with x_j removed. This is lossless for ANY draft choice made
  without looking at the target's random numbers.
- greedy rows accept while x_j == argmax target_probs_j, then emit that argmax (recovered or bonus),
  so they equal non-speculative greedy decoding exactly.

Random numbers: per random row and step, k_i uniforms (float64, the accept test) then `vocab`
Exp(1) draws (the recovered/bonus token), from the row's generator when seeded: a fixed amount,
whatever is accepted, so seeded rows reproduce independently of the batch.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from specserve.sample.h2d import h2d
from specserve.sample.metadata import SamplingMetadata
from specserve.sample.sampler import compute_target_probs, draw_exponential, random_sample


class RejectionOutput(NamedTuple):
    output_token_ids: list[list[int]]  # per sequence: accepted drafts + one recovered/bonus token
    num_accepted: list[int]  # per sequence: accepted draft tokens, 0..k_i


class _Layout(NamedTuple):
    """Where each draft and each sequence's positions live in the flat tensors."""
    num_drafts: list[int]  # [num_seqs] k_i, on the host
    draft_ids_host: Tensor  # [total_drafts] int64 on the CPU, for validation without a sync
    draft_ids: Tensor  # [total_drafts] int64
    draft_seq: Tensor  # [total_drafts] the draft's sequence
    draft_offset: Tensor  # [total_drafts] j, its position within the sequence's drafts
    draft_target_row: Tensor  # [total_drafts] its row in target_logits
    seq_num_drafts: Tensor  # [num_seqs] k_i
    seq_target_start: Tensor  # [num_seqs] row of position 0 in target_logits
    seq_draft_start: Tensor  # [num_seqs] index of draft 0 in draft_ids

    @classmethod
    def build(cls, draft_token_ids: Sequence[Sequence[int]], device: torch.device) -> _Layout:
        num_drafts = [len(d) for d in draft_token_ids]
        # Index arithmetic on the host (cheap, no sync), then two host->device copies in all.
        k = torch.tensor(num_drafts, dtype=torch.int64)
        draft_start = torch.cumsum(k, 0) - k
        target_start = draft_start + torch.arange(len(num_drafts))  # each sequence adds k_i + 1 rows
        draft_seq = torch.repeat_interleave(torch.arange(len(num_drafts)), k)
        draft_offset = torch.arange(draft_seq.shape[0]) - draft_start[draft_seq]
        draft_ids = torch.tensor(list(itertools.chain.from_iterable(draft_token_ids)), dtype=torch.int64)
        per_draft = h2d(torch.stack([draft_ids, draft_seq, draft_offset,
                                     target_start[draft_seq] + draft_offset]), device)  # [4, total_drafts]
        per_seq = h2d(torch.stack([k, target_start, draft_start]), device)  # [3, num_seqs]
        return cls(num_drafts, draft_ids, *per_draft.unbind(0), *per_seq.unbind(0))


def _check_shapes(layout: _Layout, draft_probs: Tensor | None, target_logits: Tensor,
                  meta: SamplingMetadata) -> None:
    num_seqs, total, vocab = len(layout.num_drafts), sum(layout.num_drafts), target_logits.shape[-1]
    if meta.num_seqs != num_seqs:
        raise ValueError(f"metadata has {meta.num_seqs} rows, draft_token_ids has {num_seqs}.")
    if target_logits.dim() != 2 or target_logits.shape[0] != total + num_seqs:
        raise ValueError(f"target_logits must be [total_draft_tokens + num_seqs = {total + num_seqs}, "
                         f"vocab], got {tuple(target_logits.shape)}.")
    if draft_probs is not None and tuple(draft_probs.shape) != (total, target_logits.shape[1]):
        raise ValueError(f"draft_probs must be [total_draft_tokens = {total}, vocab], "
                         f"got {tuple(draft_probs.shape)}.")
    if total and not 0 <= int(layout.draft_ids_host.min()) <= int(layout.draft_ids_host.max()) < vocab:
        # Out-of-range ids would be a device-side assert on GPU, which kills the process.
        raise ValueError(f"draft_token_ids must be in [0, {vocab}).")


class RejectionSampler:
    """Verifies drafts against the target. Unseeded random rows draw from `generator` (None =
    torch's default generator of the logits' device)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(self, draft_token_ids: list[list[int]], draft_probs: Tensor | None,
                 target_logits: Tensor, meta: SamplingMetadata) -> RejectionOutput:
        """draft_token_ids: per sequence, k_i >= 0 drafted tokens.
        draft_probs: [total_draft_tokens, vocab], the distributions the drafts were sampled from
            (after the drafter's own temperature/top-k/top-p), or None for one-hot drafts.
        target_logits: [total_draft_tokens + num_seqs, vocab]: each sequence's k_i + 1 positions,
            concatenated in sequence order.
        meta: one row per sequence; expanded per position with `expand_for_drafts`, so min_tokens
            and penalties count the drafts before each position as emitted.
        One host sync (reading the results back).
        """
        device = target_logits.device
        layout = _Layout.build(draft_token_ids, device)
        _check_shapes(layout, draft_probs, target_logits, meta)
        if meta.num_seqs == 0:
            return RejectionOutput([], [])
        target_probs = compute_target_probs(target_logits, meta.expand_for_drafts(draft_token_ids))
        num_accepted = self._num_accepted(layout, draft_probs, target_probs, meta)  # [num_seqs]
        final = self._final_tokens(layout, num_accepted, draft_probs, target_probs, meta)  # [num_seqs]
        counts, tokens = torch.stack([num_accepted, final]).tolist()
        outputs = [list(drafts[:n]) + [t] for drafts, n, t in zip(draft_token_ids, counts, tokens)]
        return RejectionOutput(outputs, counts)

    def _draw_uniform(self, layout: _Layout, meta: SamplingMetadata, device: torch.device) -> Tensor:
        """[total_drafts] float64 in [0, 1); float64 because float32 steps of 2**-24 bias the test."""
        total = sum(layout.num_drafts)
        uniform = torch.empty(total, dtype=torch.float64, device=device)
        seeded = [i for i, g in enumerate(meta.generators) if g is not None]
        if len(seeded) < meta.num_seqs:
            uniform.uniform_(generator=self.generator)
        starts = [0, *itertools.accumulate(layout.num_drafts)]
        for i in seeded:
            if layout.num_drafts[i]:
                uniform[starts[i]:starts[i + 1]].uniform_(generator=meta.generators[i])
        return uniform

    def _num_accepted(self, layout: _Layout, draft_probs: Tensor | None, target_probs: Tensor,
                      meta: SamplingMetadata) -> Tensor:
        """[num_seqs] int64: length of each sequence's accepted draft prefix."""
        num_seqs, max_k = meta.num_seqs, max(layout.num_drafts)
        device = target_probs.device
        if max_k == 0:
            return torch.zeros(num_seqs, dtype=torch.int64, device=device)
        if meta.all_greedy:
            accepted = self._greedy_accept(layout, target_probs)
        else:
            target_p = target_probs[layout.draft_target_row, layout.draft_ids].double()  # [total_drafts]
            if draft_probs is None:
                draft_p = torch.ones_like(target_p)
            else:
                draft_p = draft_probs[torch.arange(draft_probs.shape[0], device=device),
                                      layout.draft_ids].double()
            # u < target/draft without dividing; strict so a zero target prob never accepts.
            accepted = self._draw_uniform(layout, meta, device) * draft_p < target_p
            if meta.greedy_mask is not None:
                greedy = self._greedy_accept(layout, target_probs)
                accepted = torch.where(meta.greedy_mask[layout.draft_seq], greedy, accepted)
        padded = torch.zeros(num_seqs, max_k, dtype=torch.int64, device=device)
        padded[layout.draft_seq, layout.draft_offset] = accepted.long()
        # Accepted prefix = drafts before the first rejection; padding (False) ends short rows.
        return padded.cumprod(dim=1).sum(dim=1)

    @staticmethod
    def _greedy_accept(layout: _Layout, target_probs: Tensor) -> Tensor:
        """[total_drafts] bool. Greedy rows' target_probs are one-hot at the target argmax."""
        return layout.draft_ids == target_probs[layout.draft_target_row].argmax(dim=-1)

    def _final_tokens(self, layout: _Layout, num_accepted: Tensor, draft_probs: Tensor | None,
                      target_probs: Tensor, meta: SamplingMetadata) -> Tensor:
        """[num_seqs] int64: the recovered token at the first rejection, else the bonus token."""
        final_rows = layout.seq_target_start + num_accepted
        final_probs = target_probs.index_select(0, final_rows)  # [num_seqs, vocab]
        # Greedy rows: one-hot at the target argmax, which differs from a rejected draft.
        greedy_tokens = final_probs.argmax(dim=-1)
        if meta.all_greedy:
            return greedy_tokens
        residual = final_probs
        if sum(layout.num_drafts) > 0:
            residual = _residual(layout, num_accepted, draft_probs, final_probs)
        noise = draw_exponential(meta.num_seqs, final_probs.shape[1], meta.generators,
                                 self.generator, final_probs.device)
        tokens = random_sample(residual, noise)
        if meta.greedy_mask is not None:
            tokens = torch.where(meta.greedy_mask, greedy_tokens, tokens)
        return tokens


def _residual(layout: _Layout, num_accepted: Tensor, draft_probs: Tensor | None,
              final_probs: Tensor) -> Tensor:
    """max(0, target_probs - draft_probs) at the first rejected position, unnormalized (the
    exponential race does not need it); the target itself for rows that accepted everything."""
    rejected = num_accepted < layout.seq_num_drafts  # [num_seqs]
    total = layout.draft_ids.shape[0]
    # Index of the first rejected draft; clamped so rows without one index something valid.
    rejected_draft = (layout.seq_draft_start + num_accepted).clamp_(max=total - 1)
    if draft_probs is None:
        token = layout.draft_ids[rejected_draft].unsqueeze(1)  # [num_seqs, 1]
        kept = final_probs.gather(1, token) * (~rejected).unsqueeze(1)
        residual = final_probs.scatter(1, token, kept)
    else:
        subtract = draft_probs.index_select(0, rejected_draft).float() * rejected.unsqueeze(1)
        residual = (final_probs - subtract).clamp_(min=0.0)
    # Rounding can leave nothing when target and draft nearly coincide; the target itself is then
    # the closest distribution to the (vanishing) residual.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    return torch.where(empty, final_probs, residual)
