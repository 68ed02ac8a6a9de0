"""Attention metadata for kernel tests: a flat batch of (context, new tokens) sequences over given
block tables, optionally padded the way CUDA-graph replays pad (tokens with slot -1, empty sequences)."""

from __future__ import annotations

import torch

from specserve.attention.base import AttentionMetadata


def paged_metadata(
    specs: list[tuple[int, int]],
    tables: list[list[int]],
    block_size: int,
    device: torch.device,
    pad_tokens: int = 0,
    pad_seqs: int = 0,
) -> AttentionMetadata:
    query_lens = [n for _, n in specs] + [0] * pad_seqs
    seq_lens = [c + n for c, n in specs] + [0] * pad_seqs
    width = max(len(t) for t in tables) + 1
    block_tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for b, t in enumerate(tables):
        block_tables[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
    slots = [
        tables[b][p // block_size] * block_size + p % block_size
        for b, (c, n) in enumerate(specs)
        for p in range(c, c + n)
    ] + [-1] * pad_tokens
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    return AttentionMetadata(
        cu_query_lens=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        num_seqs=len(seq_lens),
        num_tokens=len(slots),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
