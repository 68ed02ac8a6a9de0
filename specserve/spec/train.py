"""`specserve train-draft`: train an EAGLE-3, P-EAGLE or EAGLE head for a target by self-distillation.

Data (train_data.py): the target answers prompts made from the Python standard library; the head
learns on (prompt + answer) sequences. Each training step runs the frozen target once over a
padded batch (a plain causal forward of the engine's own model, no KV cache) for its features
and next-token distributions, then the head over S "blocks" of rows that mimic serving:

  block 1, row t: (embed(x[t+1]), target feature t), exactly the head's real rows at serving time;
  block s > 1, row t: a draft row s - 1 steps after the last real row p = t - s + 1. It attends
    to block-1 rows <= p and to rows p+1..t of blocks 2..s (its own earlier draft rows), as the
    paged head cache holds them when drafting. Inputs:
      eagle3 / eagle (training-time test, EAGLE-3): (embed(x[t+1]), the head's block s-1 output
        at row t-1), i.e. its own hidden state fed back as in autoregressive drafting;
      p-eagle: the learned (mask_embed, mask_hidden) pair, so all slots come out of one forward.
Every row t predicts x[t+2]; the loss is cross-entropy against the target's full next-token
distribution at t+1 (soft labels: what the rejection sampler accepts against), weighted 0.8^(s-1)
per block. EAGLE-1 heads add EAGLE's feature regression (smooth L1 to the target's next hidden
state, token loss weight 0.1). Checkpoints (head + optimizer + step) are written every
--save-every steps and at the end; --resume continues from them.

Reduced draft vocabulary (--draft-vocab-size N, by default 32768 for targets with a larger
vocabulary): the head proposes only N tokens, d2t (ascending target ids, saved with the head):
special tokens seen in the data plus the most frequent answer tokens (train_data.draft_vocab). Its
logits are [rows, N] over the target's LM-head rows d2t. The soft label is the target's
distribution restricted to d2t and renormalized: the best draft distribution q on d2t, for
sampling acceptance sum_x min(target(x), q(x)) and for cross-entropy alike, is target|d2t /
target(d2t), so renormalizing keeps the optimum and gives every row the weight of a
full-vocabulary row (unnormalized, a row would weigh target(d2t), and its mix with the hard label
would not be a distribution). The hard term applies only where the target's argmax is in d2t; a
row whose argmax is outside keeps the soft term alone (whole weight): greedy verification can
never accept a draft there, but sampling verification still accepts in-set tokens. Accuracy:
d2t[argmax of the head's logits] == the target's argmax over the whole vocabulary.
"""
from __future__ import annotations

import argparse
import functools
import gc
import itertools
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from specserve.attention.base import AttentionMetadata, ForwardContext, forward_context
from specserve.spec import train_data
from specserve.spec.eagle_head import EagleHead, head_config_for, save_head, target_lm_weight

STATE_NAME, DATA_NAME = "train_state.pt", "distill.jsonl"
DEFAULT_DRAFT_VOCAB = 32768


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve train-draft", description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="target model: catalog name, HF dir or .gguf file")
    p.add_argument("--method", required=True, choices=("eagle3", "p-eagle"))
    p.add_argument("--eagle", action="store_true", help="EAGLE-1 features (last hidden state) instead of EAGLE-3's")
    p.add_argument("--out", required=True, help="output dir (config.json + model.safetensors)")
    p.add_argument("--data", help="JSONL: prompt | messages (answered by the target) | text | token_ids")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps in all (default: until the time budget)")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="wall-clock budget for answering prompts + training (after the target loads)")
    p.add_argument("--num-prompts", type=int, default=512, help="stdlib prompts to self-distill (no --data)")
    p.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-seq-len", type=int, default=1024, help="longest training sequence (prompt + answer)")
    p.add_argument("--max-model-len", type=int, default=None, help="the target engine's context (default: max-seq-len)")
    p.add_argument("--temperature", type=float, default=0.0, help="of the target's answers")
    p.add_argument("--gen-fraction", type=float, default=0.4, help="share of the time budget for answering")
    p.add_argument("--batch-tokens", type=int, default=None, help="padded tokens per step (8192 GPU, 1024 CPU)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--hard-label-weight", type=float, default=0.5,
                   help="share of the token loss on the target's argmax (the rest: its full distribution)")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="tokens the head may propose: the special tokens seen + the most frequent answer tokens "
                        f"(default {DEFAULT_DRAFT_VOCAB} when the target's vocabulary is larger; 0 = the full vocabulary)")
    p.add_argument("--ttt-steps", type=int, default=3, help="eagle3/eagle: blocks of training-time test")
    p.add_argument("--num-mask-slots", type=int, default=5, help="p-eagle: mask slots (drafts k <= slots + 1)")
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--load-format", default="auto", help="dummy: random target weights of a shape name (smoke tests)")
    p.add_argument("--no-init-from-target", action="store_true", help="random decoder layer instead of a copy")
    p.add_argument("--init-from", help="start from this head dir's weights (e.g. p-eagle from a trained eagle3 "
                                       "head: same real rows; the mask slots start fresh)")
    p.add_argument("--layer-lr-scale", type=float, default=1.0,
                   help="lr factor of the decoder layer copied from the target (the new fc/fuse/mask get --lr)")
    p.add_argument("--no-train-state", action="store_true",
                   help="write the head only (no optimizer state: not resumable)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


@dataclass
class TrainResult:
    out: Path
    steps: int
    num_sequences: int
    metrics: dict[str, float]


# -- the frozen target ------------------------------------------------------------------------
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
    """Built on the host and sent with one copy (pinned, non_blocking on CUDA): no sync in a step."""
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
    """Attention backend for training batches: plain causal attention over whole sequences, no KV
    cache. The flat tokens go into a right-padded [B, heads, L, D] layout for one attention call per
    layer: every sequence starts at position 0 and attention is causal, so no valid row ever sees a
    padded key (padded rows compute garbage that is dropped)."""

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
    """q [B, H, L, D], k/v [B, Hkv, L, D] -> [B, H, L, D]. GQA inside the kernel where it has it
    (flash on CUDA in half precision, CPU); elsewhere the kv heads are repeated first."""
    group = q.shape[1] // k.shape[1]
    native = _SDPA_HAS_GQA and (q.device.type != "cuda" or q.dtype in (torch.float16, torch.bfloat16))
    if group > 1 and native:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def _dense_run(model, layout: _DenseLayout, aux_layers: tuple[int, ...]):
    lengths = layout.lengths_cpu
    L, B = max(lengths), len(lengths)
    none = torch.zeros(1, dtype=torch.int32, device=layout.cu.device)  # no paged cache: tables and slots unused
    meta = AttentionMetadata(layout.cu, layout.cu[1:] - layout.cu[:-1], none.view(1, 1), none.long(), L, L, B,
                             len(layout.flat_ids), lengths, lengths)
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
    """The target over whole sequences (plain causal attention, no KV cache). Returns flat ids
    [T], final hidden [T, hidden] and the aux layers' inputs (each [T, hidden]), T = sum of lengths."""
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
    """hidden [T, hidden] -> (target probabilities of the tokens d2t [T, N], normalized over the
    whole vocabulary; target argmax [T] int64), a chunk of rows at a time: only [chunk, vocab] float32
    logits exist at once instead of [T, vocab] logits + probs (~5 GB each for 8192 x 151936)."""
    chunk = max(1, _LABEL_CHUNK_BYTES // (4 * model.arch.vocab_size))
    probs, top = [], []
    for h in hidden.split(chunk):
        logits = model.compute_logits(h)  # [chunk, vocab] float32
        top.append(logits.argmax(dim=-1))
        lse = logits.logsumexp(dim=-1, keepdim=True)
        probs.append(logits.index_select(1, d2t).sub_(lse).exp_())
        del logits
    return torch.cat(probs), torch.cat(top)


@torch.no_grad()
def target_batch(model, seqs: list[list[int]], aux_layers: tuple[int, ...], device: torch.device,
                 d2t: torch.Tensor | None = None) -> TargetBatch:
    """The frozen target over a padded batch (TargetBatch). d2t [N] (a reduced draft vocabulary):
    keep only the probabilities of those tokens (the softmax still runs over the whole vocabulary,
    which their normalization needs) and the target's argmax."""
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


# -- the head's loss ----------------------------------------------------------------------------
def _block_mask(rows: int, s: int, device: torch.device) -> torch.Tensor:
    """[rows, s * rows] bool: which keys row t of block s sees (block 1: t' <= t - s + 1; block j:
    t' == t - (s - j)). Cut from a cached mask of a size bucket (a step builds no mask of its own)."""
    size = -(-rows // 256) * 256
    return _block_mask_of_size(size, s, device)[:rows, :, :rows].reshape(rows, s * rows)


@functools.lru_cache(maxsize=64)
def _block_mask_of_size(rows: int, s: int, device: torch.device) -> torch.Tensor:
    """[rows, s, rows]: _block_mask with the key blocks as their own dim (its top-left corner of any
    size is the smaller mask)."""
    q = torch.arange(rows, device=device)[:, None]
    k = torch.arange(rows, device=device)[None, :]
    parts = [k <= q - (s - 1)] + [k == q - (s - j) for j in range(2, s + 1)]
    return torch.stack(parts, dim=1)


def loss_rows(lengths: list[int], loss_start: list[int], max_len: int, num_blocks: int) -> list[torch.Tensor]:
    """Host (CPU) int64 row indices into [B * (L - 1)] of each block's rows in the loss: row t of
    sequence b needs x[t+1] and the label at t+1, learns only where the answer is (t >= loss_start),
    and block s starts at row s - 1 (its last real row must exist). Computed on the host from the
    lengths the caller has, so the loss needs no device sync to find its rows."""
    R = max_len - 1
    pos = torch.arange(R)
    lens, starts = torch.tensor(lengths), torch.tensor(loss_start)
    valid = (pos[None, :] < (lens[:, None] - 1)) & (pos[None, :] >= starts[:, None])
    return [(valid & (pos[None, :] >= s - 1)).reshape(-1).nonzero().squeeze(1) for s in range(1, num_blocks + 1)]


def _to_device_rows(rows: list[torch.Tensor], R: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per block (rows into [B * R], the same rows into [B * (R + 1)] shifted by one token: the
    labels' rows in the unsliced padded tensors), all sent in one copy."""
    both = [x for r in rows for x in (r, r + r // R + 1)]  # b * R + t -> b * (R + 1) + t + 1
    packed = torch.cat(both)
    if device.type == "cuda":
        packed = packed.pin_memory()
    parts = packed.to(device, non_blocking=True).split([x.numel() for x in both])
    return list(zip(parts[0::2], parts[1::2]))


def head_block_outputs(head: EagleHead, target, ids: torch.Tensor, feats: torch.Tensor, num_blocks: int,
                       parallel: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(out, logits_input) of every block, each [B * (L - 1), hidden]: row t of block s is the head's
    draft s - 1 steps after its last real row t - s + 1 (see the module docstring)."""
    B, L = ids.shape
    R, dev = L - 1, ids.device
    arch = head.layer
    embeds = target.embed_tokens(ids[:, 1:]).reshape(B * R, -1)
    hidden = head.fuse_target(feats[:, :R].reshape(B * R, -1))
    positions = torch.arange(R, device=dev).repeat(B)
    keys: list[tuple[torch.Tensor, torch.Tensor]] = []
    outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for s in range(1, num_blocks + 1):
        if s > 1:
            if parallel:
                embeds, hidden = head.mask_inputs(B * R)
            else:  # row t continues from the head's own output at row t - 1 of the previous block
                prev = outputs[-1][0].view(B, R, -1)
                hidden = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1).reshape(B * R, -1)
        mask = _block_mask(R, s, dev)

        def attend(q, k, v, mask=mask):
            q, k, v = (t.view(B, R, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
            keys.append((k, v))
            ks, vs = torch.cat([kv[0] for kv in keys], 2), torch.cat([kv[1] for kv in keys], 2)
            group = arch.num_heads // arch.num_kv_heads
            if group > 1:
                ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
            o = F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask, scale=arch.head_dim ** -0.5)
            return o.transpose(1, 2).reshape(B * R, arch.num_heads, arch.head_dim)

        outputs.append(head(embeds, hidden, positions, target.cos_sin_cache, attend))
    return outputs


def reduced_vocab_labels(lab: torch.Tensor, target_top: torch.Tensor, d2t: torch.Tensor,
                         hard_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft-target labels over a reduced draft vocabulary (module docstring). lab [rows, N]: the
    target's probabilities of the tokens d2t (normalized over the whole vocabulary; overwritten);
    target_top [rows]: the target's argmax ids. Returns (labels [rows, N], each row summing to 1:
    (1 - w) * renormalized lab + w * onehot(argmax) where the target's argmax is in d2t, else the
    renormalized lab alone; in_set [rows] bool)."""
    lab = lab.div_(lab.sum(-1, keepdim=True).clamp_(min=torch.finfo(lab.dtype).tiny))
    # The argmax's column in the draft vocabulary (d2t is ascending), exact even where bfloat16
    # labels tie: the in-set argmax of `lab` could pick another token there.
    col = torch.searchsorted(d2t, target_top).clamp_(max=d2t.numel() - 1)
    in_set = d2t.index_select(0, col) == target_top
    hard = in_set.unsqueeze(1).to(lab.dtype) * hard_weight  # [rows, 1]
    return lab.mul_(1 - hard).scatter_add_(1, col.unsqueeze(1), hard), in_set


def _token_loss(logits: torch.Tensor, lab: torch.Tensor, hard_weight: float, d2t: torch.Tensor | None,
                target_top: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy, top-1 agreement with the target) of logits [rows, width] against the
    target's probabilities lab [rows, width] (overwritten)."""
    if d2t is not None:
        mixed, _ = reduced_vocab_labels(lab, target_top, d2t, hard_weight)
        agree = d2t.index_select(0, logits.detach().argmax(-1)) == target_top
        return F.cross_entropy(logits, mixed), agree.float().mean()
    # Soft labels match the target's whole distribution (what sampling verification accepts
    # against); the hard argmax term sharpens top-1 agreement, which greedy verification needs
    # and which soft labels teach slowly where the target is unsure. Both in one soft-target
    # cross-entropy: (1 - w) * soft CE + w * hard CE == CE against (1 - w) * probs + w * onehot,
    # which keeps one [rows, vocab] activation for backward instead of several (P-EAGLE's 6
    # blocks x 4096 rows x 151936 entries add up on the GPU).
    top = lab.argmax(-1, keepdim=True)
    mixed = lab.mul_(1 - hard_weight).scatter_add_(1, top, torch.full_like(top, hard_weight, dtype=lab.dtype))
    return F.cross_entropy(logits, mixed), (logits.detach().argmax(-1) == top.squeeze(1)).float().mean()


def head_loss(head: EagleHead, target, ids: torch.Tensor, lengths: list[int], loss_start: list[int],
              feats: torch.Tensor, probs: torch.Tensor, last_hidden: torch.Tensor, num_blocks: int, parallel: bool,
              hard_weight: float = 0.5, target_top: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Returns (loss, per-block top-1 agreement with the target: 0-d tensors on ids' device, one per
    block that has rows), with no device sync. Shapes as `target_batch`; lengths and loss_start (the
    first row of each sequence in the loss; row t predicts token t + 2) are host lists. A head with a
    reduced vocabulary (head.d2t) takes probs [B, L, N] (target_batch's columns d2t) and target_top."""
    B, L = ids.shape
    R = L - 1
    d2t = head.d2t
    if d2t is not None and (target_top is None or probs.shape[-1] != d2t.numel()):
        raise ValueError(f"a head with a {d2t.numel()}-token draft vocabulary needs probs [B, L, {d2t.numel()}] "
                         f"and target_top (got probs {tuple(probs.shape)}, target_top {target_top is not None}).")
    block_rows = _to_device_rows(loss_rows(lengths, loss_start, L, num_blocks), R, ids.device)
    # Rows of the padded [B, L] tensors, unsliced: row t of [B, R] is row t + 1 of its sequence there.
    labels = probs.reshape(B * L, -1)
    tops = None if d2t is None else target_top.reshape(B * L)
    lm_weight = target_lm_weight(target)
    if d2t is not None:  # the target's LM-head rows of the draft vocabulary, once per step (frozen)
        lm_weight = lm_weight.index_select(0, d2t.to(lm_weight.device))
    loss, accs = torch.zeros((), device=ids.device), []
    outputs = head_block_outputs(head, target, ids, feats, num_blocks, parallel)
    for s, ((out, normed), (rows, label_rows)) in enumerate(zip(outputs, block_rows), 1):
        if rows.numel() == 0:  # sequences too short for this depth (a host-known size: no sync)
            continue
        logits = F.linear(normed.index_select(0, rows), lm_weight).float()
        ce, acc = _token_loss(logits, labels.index_select(0, label_rows).float(), hard_weight, d2t,
                              None if tops is None else tops.index_select(0, label_rows))
        block_loss = ce
        if head.norm is None:  # EAGLE-1: regress the target's next hidden state as well
            goal = last_hidden.reshape(B * L, -1).index_select(0, label_rows).float()
            block_loss = F.smooth_l1_loss(out.index_select(0, rows).float(), goal) + 0.1 * ce
        loss = loss + (0.8 ** (s - 1)) * block_loss
        accs.append(acc)
    return loss, accs


# -- the run --------------------------------------------------------------------------------------
def _device(name: str) -> torch.device:
    from specserve.engine.setup import resolve_device

    return resolve_device(name)


def _needs_generation(args) -> bool:
    if args.resume and (Path(args.out) / DATA_NAME).is_file():
        return False
    if args.data:
        return any(e.messages is not None for e in train_data.load_jsonl(args.data))
    return True


def _load_target(args, device: torch.device, generate: bool):
    """A specserve LLM of the target: its engine answers the distillation prompts (when there are
    any; otherwise it is built small, only for its model and tokenizer)."""
    from specserve import LLM

    kw = dict(model=args.target, device=device.type, max_model_len=args.max_model_len or args.max_seq_len,
              progress=not args.quiet, load_format=getattr(args, "load_format", "auto"))
    if not generate:
        kw.update(kv_cache_memory_bytes=1 << 22, max_num_seqs=1, enforce_eager=True)
    elif device.type == "cuda":
        kw.update(gpu_memory_utilization=0.45, max_num_seqs=256)  # the rest is for training after
    else:
        kw.update(max_num_seqs=32)
    return LLM(**kw)


def prepare_data(args, llm, deadline: float) -> list[train_data.TrainSeq]:
    out = Path(args.out)
    cached = out / DATA_NAME
    if args.resume and cached.is_file():
        return [train_data.TrainSeq(e.token_ids, e.num_prompt_tokens) for e in train_data.load_jsonl(cached)]
    examples = (train_data.load_jsonl(args.data) if args.data
                else train_data.stdlib_examples(args.num_prompts, args.seed))
    seqs = train_data.build_sequences(llm, examples, args.max_new_tokens, args.max_seq_len, args.temperature,
                                      deadline, args.seed, progress=not args.quiet)
    if not seqs:
        raise ValueError("no training sequences: the data was empty or the time budget ran out first.")
    out.mkdir(parents=True, exist_ok=True)
    train_data.save_sequences(cached, seqs)
    return seqs


def _draft_vocab_size(args, vocab_size: int) -> int | None:
    """--draft-vocab-size resolved: None = the full vocabulary."""
    n = getattr(args, "draft_vocab_size", None)
    if n is None:
        n = DEFAULT_DRAFT_VOCAB
    if n < 0:
        raise ValueError(f"--draft-vocab-size must be >= 0 (0 = the full vocabulary), got {n}.")
    return None if n == 0 or n >= vocab_size else n


def _special_ids(tokenizer) -> set[int]:
    """The tokenizer's special tokens (EOS, chat-template markers), which a draft vocabulary keeps."""
    if tokenizer is None:
        return set()
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, t in added.items() if getattr(t, "special", False))
    return {int(i) for i in ids}


def build_draft_vocab(args, loaded, seqs: list[train_data.TrainSeq]) -> train_data.DraftVocab | None:
    """The head's d2t from the training data, or None for a full-vocabulary head."""
    size = _draft_vocab_size(args, loaded.arch.vocab_size)
    if size is None:
        return None
    vocab = train_data.draft_vocab(seqs, loaded.arch.vocab_size, size, _special_ids(loaded.tokenizer))
    if not args.quiet:
        print(f"draft vocabulary: {size} of {loaded.arch.vocab_size} tokens, covering "
              f"{100 * vocab.answer_coverage:.2f}% of the answer tokens", file=sys.stderr)
    return vocab


def _new_head(args, loaded, device: torch.device, d2t: list[int] | None = None) -> EagleHead:
    method = "eagle" if args.eagle else "eagle3"
    slots = args.num_mask_slots if args.method == "p-eagle" else 0
    cfg = head_config_for(loaded.arch, loaded.hf_config, loaded.name, loaded.identity, method, slots,
                          None if d2t is None else len(d2t))
    torch.manual_seed(args.seed)
    head = EagleHead(cfg)
    if d2t is not None:
        head.set_draft_vocab(torch.tensor(d2t, dtype=torch.int64))
    if not args.no_init_from_target:
        head.init_from_target(loaded.model)
    if args.init_from:
        _init_from_head(head, args.init_from)
    return head.to(device=device, dtype=torch.float32)


def _init_from_head(head: EagleHead, path: str) -> None:
    """Copy every tensor of another head of the same shape (a P-EAGLE head from a trained EAGLE-3
    head: their real rows are the same function); tensors only this head has keep their init, and so
    does the draft vocabulary (d2t: this run's data and --draft-vocab-size choose it)."""
    from safetensors.torch import load_file

    from specserve.spec.eagle_head import WEIGHTS_NAME

    state = load_file(str(Path(path) / WEIGHTS_NAME))
    own = head.state_dict()
    same = {k: v for k, v in state.items() if k in own and k != "d2t" and tuple(v.shape) == tuple(own[k].shape)}
    if not same:
        raise ValueError(f"--init-from {path}: no tensor matches this head.")
    head.load_state_dict(same, strict=False)


def _param_groups(args, head: EagleHead) -> list[dict]:
    layer = [p for n, p in head.named_parameters() if n.startswith("layer.")]
    rest = [p for n, p in head.named_parameters() if not n.startswith("layer.")]
    return [{"params": layer, "lr_scale": args.layer_lr_scale}, {"params": rest, "lr_scale": 1.0}]


def _lr_factor(progress: float, step: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def run_training(args, llm=None) -> TrainResult:
    """The whole command. `llm`: a specserve LLM of the target to use (the caller must not keep a
    reference: its KV pool is released before training)."""
    budget = args.time_budget_s if args.time_budget_s is not None else float("inf")
    if args.steps is None and args.time_budget_s is None:
        raise ValueError("give --steps, --time-budget-s or both.")
    device = _device(args.device)
    if args.data:
        train_data.refuse_humaneval(args.data)
    if llm is None:
        llm = _load_target(args, device, _needs_generation(args))
    loaded = llm.engine.loaded
    start = time.monotonic()  # the budget covers answering + training, not loading the target
    seqs = prepare_data(args, llm, start + budget * args.gen_fraction)
    del llm  # the engine's KV pool goes; the model stays (held by `loaded`)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    vocab = build_draft_vocab(args, loaded, seqs)
    head = _new_head(args, loaded, device, None if vocab is None else vocab.token_ids)
    opt = torch.optim.AdamW(_param_groups(args, head), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step = _maybe_resume(args, head, opt, device)
    deadline = start + budget - 5.0  # leave time for the final checkpoint
    progress = {"step": step, "metrics": {}}
    try:
        _train_loop(args, head, opt, loaded.model, seqs, progress, device, deadline)
    except BaseException:
        if progress["step"] > step:  # keep what was trained (a GPU run must not end with nothing)
            _save(args, head, opt, progress["step"], progress["metrics"])
        raise
    _save(args, head, opt, progress["step"], progress["metrics"])
    return TrainResult(Path(args.out), progress["step"], len(seqs), progress["metrics"])


def _train_loop(args, head: EagleHead, opt, target, seqs: list[train_data.TrainSeq], progress: dict,
                device: torch.device, deadline: float) -> None:
    """Trains until --steps or the deadline; progress["step"] follows every step, progress["metrics"]
    every REPORT_EVERY steps, at checkpoints and at the end (reading them syncs the device; a step
    itself never waits for the GPU)."""
    step = progress["step"]
    parallel = args.method == "p-eagle"
    num_blocks = 1 + (args.num_mask_slots if parallel else args.ttt_steps - 1)
    batch_tokens = args.batch_tokens or (8192 if device.type == "cuda" else 1024)
    base_batches = train_data.make_batches([len(s.token_ids) for s in seqs], batch_tokens, random.Random(args.seed))
    warmup = 30 if args.steps is None else max(1, min(30, args.steps // 10))
    train_start = time.monotonic()
    recent: list[tuple[list[str], torch.Tensor]] = []  # the last METRIC_WINDOW steps' (names, values)
    bar = tqdm(total=args.steps, initial=step, desc=f"train {args.method}", disable=args.quiet)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    while (args.steps is None or step < args.steps) and time.monotonic() < deadline:
        # Epoch e visits the same batches in its own seeded order, so a resumed run sees what the
        # uninterrupted one would have.
        epoch, index = divmod(step, len(base_batches))
        order = list(range(len(base_batches)))
        random.Random(args.seed * 1000 + epoch).shuffle(order)
        batch = [seqs[i] for i in base_batches[order[index]]]
        starts = [max(0, s.num_prompt_tokens - 2) for s in batch]
        frac = (step / args.steps if args.steps else
                (time.monotonic() - train_start) / max(1.0, deadline - train_start))
        for g in opt.param_groups:
            g["lr"] = args.lr * g.get("lr_scale", 1.0) * _lr_factor(frac, step, warmup)
        tb = target_batch(target, [s.token_ids for s in batch], head.cfg.aux_hidden_layers, device, head.d2t)
        with autocast:
            loss, accs = head_loss(head, target, tb.ids, [len(s.token_ids) for s in batch], starts, tb.feats,
                                   tb.probs, tb.last, num_blocks, parallel, args.hard_label_weight, tb.top)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        del tb  # the next step's target forward need not share memory with it
        step += 1
        recent.append((["loss", *(f"acc{i + 1}" for i in range(len(accs)))],
                       torch.stack([loss.detach().float(), *accs])))
        del recent[:-METRIC_WINDOW]
        progress["step"] = step
        bar.update(1)
        if step % REPORT_EVERY == 0 or step % args.save_every == 0:
            progress["metrics"] = _metrics(recent)
            bar.set_postfix(progress["metrics"])
        if step % args.save_every == 0:
            _save(args, head, opt, step, progress["metrics"])
    if recent:
        progress["metrics"] = _metrics(recent)
    bar.close()


REPORT_EVERY, METRIC_WINDOW = 10, 20


def _metrics(recent: list[tuple[list[str], torch.Tensor]]) -> dict[str, float]:
    """Means over the recent steps (one batch says little), read from the device in one copy; a
    block a step had no rows for counts as 0, and the names are the last step's."""
    values = torch.cat([v for _, v in recent]).tolist()
    sums: dict[str, float] = {}
    i = 0
    for names, v in recent:
        for name, x in zip(names, values[i:i + len(names)]):
            sums[name] = sums.get(name, 0.0) + x
        i += len(names)
    return {k: round(sums[k] / len(recent), 4) for k in recent[-1][0]}


def _save(args, head: EagleHead, opt, step: int, metrics: dict) -> None:
    save_head(head, args.out)
    if getattr(args, "no_train_state", False):
        return
    tmp = Path(args.out) / (STATE_NAME + ".tmp")
    torch.save({"step": step, "optimizer": opt.state_dict(), "metrics": metrics, "method": args.method,
                "eagle": args.eagle, "draft_vocab_size": head.cfg.draft_vocab_size}, tmp)
    tmp.replace(Path(args.out) / STATE_NAME)


def _maybe_resume(args, head: EagleHead, opt, device: torch.device) -> int:
    state_path = Path(args.out) / STATE_NAME
    if not args.resume or not state_path.is_file():
        return 0
    from safetensors.torch import load_file

    state = torch.load(state_path, map_location=device, weights_only=False)
    if state.get("method") != args.method or state.get("eagle") != args.eagle:
        raise ValueError(f"{args.out} holds a {state.get('method')} run; cannot resume it as {args.method}.")
    if state.get("draft_vocab_size") != head.cfg.draft_vocab_size:
        def name(n: int | None) -> str:
            return "the full vocabulary" if n is None else f"a {n}-token draft vocabulary"
        raise ValueError(f"{args.out} holds a run with {name(state.get('draft_vocab_size'))}, this one has "
                         f"{name(head.cfg.draft_vocab_size)}: resume with the same --draft-vocab-size (0 = full).")
    head.load_state_dict({k: v.to(device) for k, v in load_file(str(Path(args.out) / "model.safetensors")).items()})
    opt.load_state_dict(state["optimizer"])
    return int(state["step"])


def train_main(argv: list[str]) -> int:
    """Entry point of `specserve train-draft`; returns the exit status."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        result = run_training(args)
    except ValueError as e:
        print(f"specserve train-draft: {e}", file=sys.stderr)
        return 2
    print(f"wrote {result.out} after {result.steps} steps on {result.num_sequences} sequences: {result.metrics}")
    return 0


if __name__ == "__main__":
    sys.exit(train_main(sys.argv[1:]))
