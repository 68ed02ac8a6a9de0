"""Tensor-parallel layers (Megatron layout) sliced from a loaded model's full layers: column-parallel linears need
no communication, row-parallel ones one all-reduce; the vocabulary is split in padded contiguous ranges (the
embedding all-reduces, the LM head all-gathers). `shard_model` swaps them in; norms and RoPE stay replicated."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specserve.distributed.parallel_state import TPGroup
from specserve.model.arch import ModelArch
from specserve.model.llama import CausalLM


def shard_range(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank's contiguous [start, end) of `size` items split as evenly as possible."""
    return size * rank // world_size, size * (rank + 1) // world_size


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class ParallelLinear(nn.Module):
    """Column-parallel (no group): y = x W_r^T (+ b_r), this rank's output features. Row-parallel: y =
    all_reduce(x_r W_r^T) + b, x_r [T, local in] this rank's slice of the input features (a column-parallel layer's
    output), y [T, out] the full output on every rank; the bias (whole on every rank) is added once, after the sum."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: TPGroup | None = None) -> None:
        super().__init__()
        self.weight = _param(weight)
        self.bias = None if bias is None else _param(bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.linear(x, self.weight, self.bias)
        y = self.group.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def column_parallel(linear: nn.Linear, part_sizes: Sequence[int], rank: int, world_size: int) -> ParallelLinear:
    """This rank's rows of every part of a fused projection (q | k | v, gate | up)."""
    if sum(part_sizes) != linear.out_features:
        raise ValueError(f"part sizes {list(part_sizes)} do not add up to {linear.out_features} features.")
    rows = []
    for offset, size in zip(itertools.accumulate(part_sizes, initial=0), part_sizes):
        start, end = shard_range(size, rank, world_size)
        rows.append(torch.arange(offset + start, offset + end, device=linear.weight.device))
    index = torch.cat(rows)
    bias = None if linear.bias is None else linear.bias.index_select(0, index)
    return ParallelLinear(linear.weight.index_select(0, index), bias)


def row_parallel(linear: nn.Linear, rank: int, world_size: int, group: TPGroup) -> ParallelLinear:
    start, end = shard_range(linear.in_features, rank, world_size)
    bias = None if linear.bias is None else linear.bias.clone()
    return ParallelLinear(linear.weight[:, start:end].contiguous().clone(), bias, group)  # a copy: the full one goes


def vocab_rows(weight: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, int, int]:
    """(rows, start, end): rank r owns token ids [start, end); every rank holds the same number of rows (the
    last one zero-padded) so the logit all-gather is one tensor."""
    vocab, hidden = weight.shape
    per_rank = -(-vocab // world_size)
    start = min(vocab, rank * per_rank)
    end = min(vocab, start + per_rank)
    rows = weight.new_zeros(per_rank, hidden)
    rows[: end - start] = weight[start:end]
    return rows, start, end


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding; input_ids [T] -> [T, hidden] on every rank."""

    def __init__(self, embedding: nn.Embedding, rank: int, world_size: int, group: TPGroup) -> None:
        super().__init__()
        weight, self.start, self.end = vocab_rows(embedding.weight, rank, world_size)
        self.weight = _param(weight)  # [rows per rank, hidden], zero-padded
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = (input_ids >= self.start) & (input_ids < self.end)
        # Ids owned by other ranks look up row 0 and are zeroed, so the sum has exactly one term.
        rows = F.embedding(torch.where(local, input_ids - self.start, 0), self.weight)
        rows = rows * local.unsqueeze(-1).to(rows.dtype)
        return self.group.all_reduce(rows)


class ParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary rows, all-gathered: hidden [N, hidden] -> [N, vocab] float32."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, group: TPGroup) -> None:
        super().__init__()
        self.weight = weight  # [rows per rank, hidden]; shared with the embedding when tied
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight)  # [N, rows per rank]
        gathered = self.group.all_gather(local)  # [world, N, rows per rank]
        logits = gathered.permute(1, 0, 2).reshape(hidden.shape[0], -1)
        return logits[:, : self.vocab_size].float()


def check_tp_size(arch: ModelArch, tensor_parallel_size: int) -> None:
    """ValueError unless the attention heads and the KV heads split evenly over the ranks."""
    tp, a, b = tensor_parallel_size, arch.num_heads, arch.num_kv_heads
    for n, what in ((a, "attention heads"), (b, "KV heads")):
        if n % tp:
            fits = [d for d in range(1, min(a, b) + 1) if a % d == 0 and b % d == 0]
            raise ValueError(f"tensor_parallel_size {tp} must divide the model's {n} {what} (try one of {fits}).")


def shard_model(model: CausalLM, rank: int, world_size: int, group: TPGroup) -> CausalLM:
    """Replace `model`'s layers by this rank's shards (in place; returns the model)."""
    arch = model.arch
    check_tp_size(arch, world_size)
    q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    for layer in model.layers:
        attn = layer.self_attn
        attn.qkv_proj = column_parallel(attn.qkv_proj, (q_size, kv_size, kv_size), rank, world_size)
        attn.o_proj = row_parallel(attn.o_proj, rank, world_size, group)
        # Per-rank head counts: Attention.forward splits the fused projection with these.
        attn.num_heads, attn.num_kv_heads = arch.num_heads // world_size, arch.num_kv_heads // world_size
        attn.q_size, attn.kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        mlp = layer.mlp
        inter = arch.intermediate_size
        mlp.gate_up_proj = column_parallel(mlp.gate_up_proj, (inter, inter), rank, world_size)
        # shard_range gives down_proj's input columns the same slice as gate's and up's rows.
        mlp.down_proj = row_parallel(mlp.down_proj, rank, world_size, group)
    embed = VocabParallelEmbedding(model.embed_tokens, rank, world_size, group)
    # Tied: the head shares the embedding's (identically sliced) rows.
    rows = embed.weight if model.lm_head is None else _param(vocab_rows(model.lm_head.weight, rank, world_size)[0])
    model.embed_tokens, model.lm_head, model.logits_head = embed, None, ParallelLMHead(rows, arch.vocab_size, group)
    return model
