"""Batch-invariant attention (`--batch-invariant`): one algorithm for every query token (decode,
spec-verify and prefill alike), with the same key tiles and reduction order, so a token's output does
not depend on its query length or on the other sequences of the step.

Why it holds: keys are visited in fixed tiles of KV_TILE from position 0 with an online softmax in
fp32; a tile a row cannot see (past its causal position) gives p = 0 and a rescale of exactly 1, so
it leaves the row bit for bit as it was. No split-KV (a split count or size derived from the batch
or the query block would move the reduction boundaries)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from specserve.attention.base import AttentionBackend, AttentionMetadata
from specserve.attention.launch_sizes import SMALL_QUERY_MAX
from specserve.attention.torch_ref import gather_padded, write_kv
from specserve.kv.spec import KVFormat, LayerKVCache

KV_TILE = 64  # keys per online-softmax step (the Triton kernel's BLOCK_N for bf16/fp16, head_dim <= 128)
Q_TILE = 16  # query tokens per score matmul, zero-padded: every matmul has one shape


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, scale: float) -> torch.Tensor:
    """q [Q, Hq, D] at positions context_len.. over k, v [S, Hkv, D] (causal) -> [Q, Hq, D] in q's dtype."""
    num_q, num_heads, dim = q.shape
    s_len, num_kv_heads = k.shape[0], k.shape[1]
    group, tiles = num_heads // num_kv_heads, -(-s_len // KV_TILE)

    def by_tile(x: torch.Tensor) -> torch.Tensor:  # [tiles, Hkv, KV_TILE, D], zero past s_len
        xp = x.new_zeros((tiles * KV_TILE, num_kv_heads, dim))
        xp[:s_len] = x
        return xp.view(tiles, KV_TILE, num_kv_heads, dim).transpose(1, 2).contiguous()

    kt, vt = by_tile(k.float()).transpose(2, 3).contiguous(), by_tile(v.float())  # kt [tiles, Hkv, D, KV_TILE]
    rows = Q_TILE * group  # row r: query token r // group, head r % group of its KV head
    out = torch.empty((num_q, num_heads, dim), dtype=q.dtype, device=q.device)
    key_pos = torch.arange(KV_TILE, device=q.device)
    for q0 in range(0, num_q, Q_TILE):
        n = min(Q_TILE, num_q - q0)
        qc = q.new_zeros((Q_TILE, num_heads, dim), dtype=torch.float32)
        qc[:n] = q[q0 : q0 + n]
        qh = qc.view(Q_TILE, num_kv_heads, group, dim).transpose(0, 1).reshape(num_kv_heads, rows, dim)
        q_pos = context_len + q0 + torch.arange(rows, device=q.device) // group  # [rows]
        m = torch.full((num_kv_heads, rows), float("-inf"), device=q.device)
        l_sum = torch.zeros((num_kv_heads, rows), device=q.device)
        acc = torch.zeros((num_kv_heads, rows, dim), device=q.device)
        for t in range(min(tiles, -(-(context_len + q0 + n) // KV_TILE))):
            pos = t * KV_TILE + key_pos
            visible = (pos[None, :] <= q_pos[:, None]) & (pos < s_len)[None, :]  # [rows, KV_TILE]
            s = torch.bmm(qh, kt[t]).mul_(scale).masked_fill_(~visible, float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
            p = torch.exp(s - m_safe[..., None])
            alpha = torch.exp(m - m_safe)
            l_sum = l_sum * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.bmm(p, vt[t])
            m = m_new
        o = acc / torch.where(l_sum == 0.0, 1.0, l_sum)[..., None]
        out[q0 : q0 + n] = o.view(num_kv_heads, Q_TILE, group, dim).transpose(0, 1).reshape(Q_TILE, num_heads, dim)[:n]
    return out


class BatchInvariantTorchBackend:
    """The CPU backend of the mode: `tiled_attention` per sequence, whatever the query length."""

    name = "torch_batch_invariant"

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
        query_lens = meta.query_lens_cpu or (meta.cu_query_lens[1:] - meta.cu_query_lens[:-1]).tolist()
        seq_lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
        out = torch.zeros_like(q)
        start = 0
        for b, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
            if q_len == 0:
                continue
            table = meta.block_tables[b : b + 1, : -(-s_len // cache.key.shape[1])]
            kb, vb = (t[0, :s_len] for t in gather_padded(cache, fmt, table, q.dtype))  # [s_len, Hkv, D]
            out[start : start + q_len] = tiled_attention(q[start : start + q_len], kb, vb, s_len - q_len, scale)
            start += q_len
        return out


def invariant_meta(meta: AttentionMetadata) -> AttentionMetadata:
    """meta with a query-length bound past SMALL_QUERY_MAX: the Triton kernels then pick their one
    prefill-shaped launch (BLOCK_M, warps, stages, variant) for every step, decode included."""
    return dataclasses.replace(meta, max_query_len=max(meta.max_query_len, SMALL_QUERY_MAX + 1))


def triton_backend() -> AttentionBackend:
    """The GPU backend of the mode: the Triton paged kernels without split-KV, at one launch shape."""
    from specserve.attention.triton_backend import TritonBackend

    class BatchInvariantTritonBackend(TritonBackend):  # name "triton": graphs capture it like the default
        # TritonBackend's positional calls; meta is the second to last argument of both.
        def forward(self, *args: Any) -> Tensor:
            return super().forward(*args[:-2], invariant_meta(args[-2]), args[-1])

        def forward_rope(self, *args: Any) -> Tensor:
            return super().forward_rope(*args[:-2], invariant_meta(args[-2]), args[-1])

    return BatchInvariantTritonBackend(num_splits=1)
