"""Attention backend interface and its per-forward metadata. Query token j of sequence b sits at
position `seq_len[b] - query_len[b] + j` and attends causally (draft-tree rows: to their ancestors only)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from specserve.kv.spec import KVFormat, LayerKVCache


@dataclass
class AttentionMetadata:
    cu_query_lens: torch.Tensor  # [num_seqs + 1] int32, query_start_loc: cumulative new tokens
    seq_lens: torch.Tensor  # [num_seqs] int32, total tokens (cached + new) per sequence
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, KV slot each new token's K/V is written to
    max_query_len: int
    max_seq_len: int
    num_seqs: int
    num_tokens: int
    # Host copies for the torch reference path (avoid device syncs); lists of ints.
    query_lens_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # Draft trees: [num_tokens] int64, bit j = the token may see its query's j-th token (j < 63; the
    # causal rule still applies); -1 for causal rows. None: every row causal.
    tree_mask: torch.Tensor | None = None


class AttentionBackend(Protocol):
    """Writes this step's K/V into the paged cache and attends over the cache.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
    returns [num_tokens, num_heads, head_dim] in q's dtype.
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        fmt: KVFormat,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


@dataclass
class ForwardContext:
    meta: AttentionMetadata
    kv_caches: list[LayerKVCache]
    fmt: KVFormat
    backend: AttentionBackend


_forward_context: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar(
    "specserve_forward_context", default=None
)


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """The model's attention layers read the batch layout from here during one forward."""
    token = _forward_context.set(ctx)
    try:
        yield ctx
    finally:
        _forward_context.reset(token)


def get_forward_context() -> ForwardContext:
    ctx = _forward_context.get()
    if ctx is None:
        raise RuntimeError("attention called outside a forward_context block")
    return ctx
