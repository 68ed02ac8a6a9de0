"""The frozen target's side of `specserve train-draft`: features and next-token distributions of a batch."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from specserve.attention.base import AttentionMetadata, ForwardContext, forward_context

# F.scaled_dot_product_attention(enable_gqa=...) exists from torch 2.5 on.
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


class _DenseLayout(NamedTuple):
    """A batch of whole sequences, flat (the model's layout) and padded ([B, L], for attention)."""

    flat_ids: torch.Tensor  # [T] int64, the sequences back to back
    positions: torch.Tensor  # [T] int64, 0.. per sequence
    pad_index: torch.Tensor  # [T] int64, flat token -> row b * L + t of the padded layout
    cu: torch.Tensor  # [B + 1] int32, cumulative lengths
    lengths: torch.Tensor  # [B] int64
    lengths_cpu: list[int]


def _dense_layout(seqs: list[list[int]], device: torch.device) -> _DenseLayout:
    lengths = [len(s) for s in seqs]
    L, B, T = max(lengths), len(seqs), sum(lengths)
    lens = torch.tensor(lengths, dtype=torch.int64)
    cu = torch.zeros(B + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=cu[1:])
    starts = torch.repeat_interleave(cu[:-1], lens)
    positions = torch.arange(T) - starts
    pad_index = positions + torch.repeat_interleave(torch.arange(B) * L, lens)
    flat = torch.tensor(list(itertools.chain.from_iterable(seqs)), dtype=torch.int64)
    packed = torch.cat([flat, positions, pad_index, cu, lens])
    if device.type == "cuda":
        packed = packed.pin_memory()
    packed = packed.to(device, non_blocking=True)
    flat, positions, pad_index, cu, lens = packed.split([T, T, T, B + 1, B])
    return _DenseLayout(flat, positions, pad_index, cu.to(torch.int32), lens, lengths)


class _DenseCausal:
    """Attention backend for training batches: plain causal attention over whole sequences, no KV cache."""

    name = "dense_causal"

    def __init__(self, pad_index: torch.Tensor, num_seqs: int, max_len: int) -> None:
        self.pad_index, self.num_seqs, self.max_len = pad_index, num_seqs, max_len  # pad_index [T]

    def forward(self, q, k, v, cache, fmt, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        B, L, H, Hkv = self.num_seqs, self.max_len, q.shape[1], k.shape[1]
        # One zero-filled padded buffer for q, k and v (zeros: no NaN from stale memory in padded keys).
        qkv = torch.cat([q, k, v], dim=1)  # [T, H + 2 Hkv, D]
        padded = qkv.new_zeros(B * L, *qkv.shape[1:]).index_copy_(0, self.pad_index, qkv)
        qp, kp, vp = padded.view(B, L, -1, qkv.shape[2]).transpose(1, 2).split([H, Hkv, Hkv], dim=1)
        out = _causal_sdpa(qp, kp, vp, scale)  # [B, H, L, D]
        return out.transpose(1, 2).reshape(B * L, H, -1).index_select(0, self.pad_index)


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, L, D], k/v [B, Hkv, L, D] -> [B, H, L, D]; GQA in the kernel where it has it."""
    group = q.shape[1] // k.shape[1]
    native = _SDPA_HAS_GQA and (q.device.type != "cuda" or q.dtype in (torch.float16, torch.bfloat16))
    if group > 1 and native:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def _dense_run(model, layout: _DenseLayout, aux_layers: tuple[int, ...]):
    lengths = layout.lengths_cpu
    L, B, T = max(lengths), len(lengths), len(layout.flat_ids)
    none = torch.zeros(1, dtype=torch.int32, device=layout.cu.device)  # no paged cache: tables and slots unused
    meta = AttentionMetadata(
        layout.cu, layout.cu[1:] - layout.cu[:-1], none.view(1, 1), none.long(), L, L, B, T, lengths, lengths
    )
    saved = model.aux_hidden_layers
    model.aux_hidden_layers = aux_layers
    try:
        backend = _DenseCausal(layout.pad_index, B, L)
        with forward_context(ForwardContext(meta, [None] * len(model.layers), None, backend)):
            out = model(layout.flat_ids, layout.positions)
    finally:
        model.aux_hidden_layers = saved
    return out if isinstance(out, tuple) else (out, [])


@torch.no_grad()
def dense_forward(model, seqs: list[list[int]], aux_layers: tuple[int, ...], device: torch.device):
    """The target over whole sequences: flat ids [T], final hidden [T, hidden], aux layers' inputs [T, hidden]."""
    layout = _dense_layout(seqs, device)
    hidden, aux = _dense_run(model, layout, aux_layers)
    return layout.flat_ids, hidden, aux


class TargetBatch(NamedTuple):
    ids: torch.Tensor  # [B, L] int64, right-padded with 0
    lengths: torch.Tensor  # [B] int64
    feats: torch.Tensor  # [B, L, F]: eagle3: concatenated aux layer inputs; eagle: final hidden
    probs: torch.Tensor  # [B, L, vocab], or [B, L, draft_vocab]: the full softmax's columns d2t (bf16 on GPU)
    last: torch.Tensor  # [B, L, hidden] final hidden
    top: torch.Tensor | None  # [B, L] int64 target argmax over the whole vocabulary; reduced vocab only


# Rows per chunk of the reduced-vocabulary labels: [rows, vocab] float32 logits of about 512 MiB.
_LABEL_CHUNK_BYTES = 1 << 29


def _reduced_labels(model, hidden: torch.Tensor, d2t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [T, hidden] -> (probabilities of the tokens d2t [T, N] over the whole vocabulary, argmax [T]), in
    chunks of rows so that only [chunk, vocab] float32 logits exist at once."""
    chunk = max(1, _LABEL_CHUNK_BYTES // (4 * model.arch.vocab_size))
    probs, top = [], []
    # Equal chunks: a tiny remainder would compile a GEMV variant mid-training.
    for h in hidden.tensor_split(max(1, -(-hidden.shape[0] // chunk))):
        logits = model.compute_logits(h)  # [chunk, vocab] float32
        top.append(logits.argmax(dim=-1))
        lse = logits.logsumexp(dim=-1, keepdim=True)
        probs.append(logits.index_select(1, d2t).sub_(lse).exp_())
        del logits
    return torch.cat(probs), torch.cat(top)


@torch.no_grad()
def target_batch(
    model, seqs: list[list[int]], aux_layers: tuple[int, ...], device: torch.device, d2t: torch.Tensor | None = None
) -> TargetBatch:
    """The frozen target over a padded batch; d2t [N]: keep only those tokens' probabilities, and the argmax."""
    layout = _dense_layout(seqs, device)
    L, B = max(layout.lengths_cpu), len(seqs)
    hidden, aux = _dense_run(model, layout, aux_layers)
    top = None
    if d2t is None:
        probs = model.compute_logits(hidden).softmax(dim=-1)
    else:
        probs, top = _reduced_labels(model, hidden, d2t.to(device))
    if device.type == "cuda":
        probs = probs.to(torch.bfloat16)  # halves the largest tensor of the step; labels need no more
    feats = torch.cat(aux, dim=-1) if aux_layers else hidden

    def pad(x: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(B * L, x.shape[-1], dtype=x.dtype, device=device)
        return full.index_copy_(0, layout.pad_index, x).view(B, L, -1)

    ids = pad(layout.flat_ids.unsqueeze(1)).squeeze(-1)
    top = None if top is None else pad(top.unsqueeze(1)).squeeze(-1)
    return TargetBatch(ids, layout.lengths, pad(feats), pad(probs), pad(hidden), top)
