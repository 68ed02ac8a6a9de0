"""Tensor-parallel layers (Megatron layout), built by slicing (cloning) the full layers of a loaded model:
column-parallel linears need no communication, row-parallel ones one all-reduce; the vocabulary is split
in padded contiguous ranges (the embedding all-reduces, the LM head all-gathers)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specserve.distributed.parallel_state import TPGroup


def shard_range(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank's contiguous [start, end) of `size` items split as evenly as possible."""
    return size * rank // world_size, size * (rank + 1) // world_size


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A compact copy of a slice, so the full tensor it views can be freed."""
    return t.contiguous().clone()


class ColumnParallelLinear(nn.Module):
    """y = x W_r^T (+ b_r): this rank's output features."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = _param(weight)
        self.bias = None if bias is None else _param(bias)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, part_sizes: Sequence[int], rank: int, world_size: int
    ) -> ColumnParallelLinear:
        if sum(part_sizes) != linear.out_features:
            raise ValueError(f"part sizes {list(part_sizes)} do not add up to {linear.out_features} features.")
        rows: list[torch.Tensor] = []
        offset = 0
        for size in part_sizes:
            start, end = shard_range(size, rank, world_size)
            rows.append(torch.arange(offset + start, offset + end, device=linear.weight.device))
            offset += size
        index = torch.cat(rows)
        bias = None if linear.bias is None else linear.bias.index_select(0, index)
        return cls(linear.weight.index_select(0, index), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_r^T) + b: x_r [T, local in] is this rank's slice of the input features (the output of a
    column-parallel layer); y [T, out] is the full output on every rank."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: TPGroup) -> None:
        super().__init__()
        self.weight = _param(weight)
        # The bias is added once, after the sum (every rank holds all of it).
        self.bias = None if bias is None else _param(bias)
        self.group = group

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, world_size: int, group: TPGroup) -> RowParallelLinear:
        start, end = shard_range(linear.in_features, rank, world_size)
        bias = None if linear.bias is None else _copy(linear.bias)
        return cls(_copy(linear.weight[:, start:end]), bias, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int, int]:
    """(start, end, padded rows per rank): rank r owns token ids [start, end); every rank holds
    the same number of rows (the last one zero-padded) so the logit all-gather is one tensor."""
    per_rank = -(-vocab_size // world_size)
    start = min(vocab_size, rank * per_rank)
    return start, min(vocab_size, start + per_rank), per_rank


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding; input_ids [T] -> [T, hidden] on every rank."""

    def __init__(self, weight: torch.Tensor, start: int, end: int, group: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [rows per rank, hidden], zero-padded
        self.start, self.end = start, end
        self.group = group

    @classmethod
    def from_embedding(
        cls, embedding: nn.Embedding, rank: int, world_size: int, group: TPGroup
    ) -> VocabParallelEmbedding:
        vocab, hidden = embedding.weight.shape
        start, end, per_rank = vocab_range(vocab, rank, world_size)
        weight = embedding.weight.new_zeros(per_rank, hidden)
        weight[: end - start] = embedding.weight[start:end]
        return cls(weight, start, end, group)

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

    @classmethod
    def from_weight(cls, weight: torch.Tensor, rank: int, world_size: int, group: TPGroup) -> ParallelLMHead:
        vocab, hidden = weight.shape
        start, end, per_rank = vocab_range(vocab, rank, world_size)
        local = weight.new_zeros(per_rank, hidden)
        local[: end - start] = weight[start:end]
        return cls(nn.Parameter(local, requires_grad=False), vocab, group)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight)  # [N, rows per rank]
        gathered = self.group.all_gather(local)  # [world, N, rows per rank]
        logits = gathered.permute(1, 0, 2).reshape(hidden.shape[0], -1)
        return logits[:, : self.vocab_size].float()
