"""Triton attention backend, the GPU twin of `torch_ref.TorchRefBackend`. No host reads, so a forward
can be graph-captured: fixed upper bounds, zero-length padding sequences, padding tokens at slot -1."""

from __future__ import annotations

import torch

from specserve.attention.base import AttentionMetadata
from specserve.attention.triton_kv_write import reshape_and_cache
from specserve.attention.triton_paged import paged_attention
from specserve.attention.triton_rope_cache import rope_and_cache
from specserve.kernels.rope import apply_rope
from specserve.kv.spec import KVFormat, LayerKVCache


def _batch(meta: AttentionMetadata) -> tuple:
    return meta.cu_query_lens, meta.seq_lens, meta.block_tables, meta.max_query_len, meta.max_seq_len


class TritonBackend:
    """Paged attention for flat varlen batches with GQA. `num_splits` fixes the split-KV factor (None:
    from the batch's host-side sizes), so a token's result does not depend on the rest of the batch."""

    name = "triton"

    def __init__(self, num_splits: int | None = None) -> None:
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1 or None, got {num_splits}.")
        self.num_splits = num_splits

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        fmt: KVFormat,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if fmt.quantized:
            from specserve.attention.triton_quant import paged_attention_quant, reshape_and_cache_quant

            reshape_and_cache_quant(k, v, cache, fmt, meta.slot_mapping)
            return paged_attention_quant(q, cache, fmt, *_batch(meta), scale, num_splits=self.num_splits)
        reshape_and_cache(k, v, cache.key, cache.value, meta.slot_mapping)
        return paged_attention(
            q, cache.key, cache.value, *_batch(meta), scale, num_splits=self.num_splits, tree_mask=meta.tree_mask
        )

    def forward_rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        cache: LayerKVCache,
        fmt: KVFormat,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """`forward` with q and k not yet rotated (unquantized caches: RoPE and the KV write in one kernel)."""
        if fmt.quantized:
            q, k = apply_rope(q, k, positions, cos_sin_cache)
            return self.forward(q, k, v, cache, fmt, meta, scale)
        rope_and_cache(q, k, v, positions, cos_sin_cache, cache.key, cache.value, meta.slot_mapping)
        return paged_attention(
            q, cache.key, cache.value, *_batch(meta), scale, num_splits=self.num_splits, tree_mask=meta.tree_mask
        )
