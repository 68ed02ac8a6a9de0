"""Pure-torch paged attention: the CPU path and the oracle every GPU kernel is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.attention.base import AttentionMetadata
from specserve.kv.spec import KVFormat, LayerKVCache


def write_kv(
    cache: LayerKVCache, fmt: KVFormat, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at their slots; slot -1 stores nothing."""
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:
        keep = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    if fmt.quantized:
        from specserve.kv import quant

        quant.write_kv(cache, fmt, slot_mapping, key, value)
        return
    num_kv_heads, dim = cache.key.shape[2], cache.key.shape[3]
    cache.key.view(-1, num_kv_heads, dim).index_copy_(0, slot_mapping, key.to(cache.key.dtype))
    cache.value.view(-1, num_kv_heads, dim).index_copy_(0, slot_mapping, value.to(cache.value.dtype))


def gather_padded(
    cache: LayerKVCache, fmt: KVFormat, block_tables: torch.Tensor, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's blocks: ([B, max_blocks * block_size, H, D], same for value); keys as written
    (times cache.key_smooth where they were cached divided by it)."""
    num_seqs, max_blocks = block_tables.shape
    ids = block_tables.reshape(-1).long()

    def read(data: torch.Tensor, scale: torch.Tensor | None, smooth: torch.Tensor | None) -> torch.Tensor:
        rows = data.index_select(0, ids).flatten(0, 1)  # [B * max_blocks * bs, H, packed]
        if fmt.quantized:
            from specserve.kv import quant

            srows = scale.index_select(0, ids).flatten(0, 1)
            rows = quant.dequantize(rows, srows, fmt, out_dtype, smooth)
        return rows.to(out_dtype).view(num_seqs, -1, rows.shape[-2], rows.shape[-1])

    return read(cache.key, cache.key_scale, cache.key_smooth), read(cache.value, cache.value_scale, None)


class TorchRefBackend:
    """Reference backend: decode-only batches in one batched call, others one sequence at a time."""

    name = "torch_ref"

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
        write_kv(cache, fmt, meta.slot_mapping, k, v)
        if meta.max_query_len == 1:
            return _decode_attention(q, cache, fmt, meta, scale)
        query_lens = meta.query_lens_cpu or (meta.cu_query_lens[1:] - meta.cu_query_lens[:-1]).tolist()
        seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
        out = torch.empty_like(q)
        num_heads, num_kv_heads = q.shape[1], k.shape[1]
        group = num_heads // num_kv_heads
        start = 0
        for b, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
            if q_len == 0:
                continue
            qb = q[start : start + q_len]  # [q_len, Hq, D]
            table = meta.block_tables[b : b + 1, : -(-s_len // cache.key.shape[1])]
            kb, vb = (t[0, :s_len] for t in gather_padded(cache, fmt, table, q.dtype))  # [s_len, Hkv, D]
            tree = None if meta.tree_mask is None else meta.tree_mask[start : start + q_len]
            out[start : start + q_len] = _causal_attention(qb, kb, vb, s_len - q_len, group, scale, tree)
            start += q_len
        return out


def _decode_attention(
    q: torch.Tensor, cache: LayerKVCache, fmt: KVFormat, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q [B, Hq, D], one token per sequence, over each sequence's seq_len cached tokens."""
    key, value = gather_padded(cache, fmt, meta.block_tables, q.dtype)  # [B, L, Hkv, D]
    valid = torch.arange(key.shape[1], device=q.device)[None, :] < meta.seq_lens[:, None].long()  # [B, L]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)


def _causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_len: int,
    group: int,
    scale: float,
    tree: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [Q, Hq, D] at positions context_len..context_len+Q-1 over k/v [S, Hkv, D]; tree [Q] int64: the
    rows' bitmasks over the query's tokens (AttentionMetadata.tree_mask)."""
    q_len, s_len = q.shape[0], k.shape[0]
    q_pos = torch.arange(context_len, context_len + q_len, device=q.device)
    k_pos = torch.arange(s_len, device=q.device)
    mask = k_pos[None, :] <= q_pos[:, None]  # [Q, S]
    if tree is not None:
        rel = (k_pos - context_len).clamp(0, 62)  # bit of each key within the query; keys before it: causal
        bit = (tree[:, None] >> rel[None, :]) & 1
        mask &= (k_pos[None, :] < context_len) | (bit != 0)
    # SDPA wants [H, L, D]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=group > 1
    )
    return out.transpose(0, 1)
