"""Neox-style RoPE in Triton, in place (torch twin: model/layers/ops.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.pdl import pdl_prologue, use_pdl


@triton.jit
def _rope_rotate(
    base_ptr, stride_head, num_heads, cos, sin, HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr
):
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, HALF_PAD)
    mask = (h[:, None] < num_heads) & (j[None, :] < HALF)
    ptr1 = base_ptr + h[:, None] * stride_head + j[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(ptr1, (x1f * cos[None, :] - x2f * sin[None, :]).to(x1.dtype), mask=mask)
    tl.store(ptr1 + HALF, (x2f * cos[None, :] + x1f * sin[None, :]).to(x1.dtype), mask=mask)


@triton.jit
def rope_cos_sin(positions_ptr, cos_sin_ptr, tok, stride_cs, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """Token `tok`'s cos and sin halves ([HALF_PAD] float32, 0 past HALF) from the cos | sin cache."""
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    j_ok = j < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + j, mask=j_ok, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + j, mask=j_ok, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_sin_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_cs,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_prologue(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    cos, sin = rope_cos_sin(positions_ptr, cos_sin_ptr, tok, stride_cs, HALF, HALF_PAD)
    _rope_rotate(q_ptr + tok * stride_q_tok, stride_q_head, num_heads, cos, sin, HALF, HALF_PAD, BLOCK_HQ)
    _rope_rotate(k_ptr + tok * stride_k_tok, stride_k_head, num_kv_heads, cos, sin, HALF, HALF_PAD, BLOCK_HK)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE (as HF Llama/Qwen2) IN PLACE on q [T, Hq, D] and k [T, Hk, D] (last dim
    contiguous); positions [T] int; cos_sin_cache [max_positions, D] float32 (cos | sin). Returns (q, k)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens:
        half = head_dim // 2
        pdl = use_pdl(q)
        _rope_kernel[(num_tokens,)](
            *(q, k, positions, cos_sin_cache, *q.stride()[:2], *k.stride()[:2], cos_sin_cache.stride(0)),
            *(num_heads, num_kv_heads),
            HALF=half,
            HALF_PAD=triton.next_power_of_2(half),
            BLOCK_HQ=triton.next_power_of_2(num_heads),
            BLOCK_HK=triton.next_power_of_2(num_kv_heads),
            num_warps=4,
            USE_PDL=pdl,
            launch_pdl=pdl,
        )
    return q, k
