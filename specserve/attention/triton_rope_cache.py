"""RoPE and the KV-cache write in one Triton launch (unquantized caches): one program per token rotates
q and k in place (exactly what kernels/rope.apply_rope leaves) and stores k and v at the token's slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention.triton_kv_write import _check_cache
from specserve.kernels.pdl import pdl_prologue, use_pdl
from specserve.kernels.rope import rope_cos_sin


@triton.jit
def _rope_and_cache_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    positions_ptr,
    cos_sin_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_cs,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    # Batch metadata and the cos/sin table before the PDL wait; q, k, v and the cache after it.
    tok = tl.program_id(0).to(tl.int64)
    cos, sin = rope_cos_sin(positions_ptr, cos_sin_ptr, tok, stride_cs, HALF, HALF_PAD)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    pdl_prologue(USE_PDL)
    j = tl.arange(0, HALF_PAD)
    j_ok = j < HALF
    cos, sin = cos[None, :], sin[None, :]
    # q, k, v are views of one buffer (no load may pass a store): every load first, one round trip.
    hq = tl.arange(0, BLOCK_HQ)
    q_mask = (hq[:, None] < num_heads) & j_ok[None, :]
    q1_ptr = q_ptr + tok * stride_q_tok + hq[:, None] * stride_q_head + j[None, :]
    hk = tl.arange(0, BLOCK_HK)
    k_mask = (hk[:, None] < num_kv_heads) & j_ok[None, :]
    k1_ptr = k_ptr + tok * stride_k_tok + hk[:, None] * stride_k_head + j[None, :]
    v1_ptr = v_ptr + tok * stride_v_tok + hk[:, None] * stride_v_head + j[None, :]
    q1 = tl.load(q1_ptr, mask=q_mask, other=0.0)
    q2 = tl.load(q1_ptr + HALF, mask=q_mask, other=0.0)
    k1 = tl.load(k1_ptr, mask=k_mask, other=0.0)
    k2 = tl.load(k1_ptr + HALF, mask=k_mask, other=0.0)
    v1 = tl.load(v1_ptr, mask=k_mask, other=0.0)
    v2 = tl.load(v1_ptr + HALF, mask=k_mask, other=0.0)

    # Rotations in fp32, rounded to the activation dtype as apply_rope does.
    q1f, q2f = q1.to(tl.float32), q2.to(tl.float32)
    tl.store(q1_ptr, (q1f * cos - q2f * sin).to(q1.dtype), mask=q_mask)
    tl.store(q1_ptr + HALF, (q2f * cos + q1f * sin).to(q1.dtype), mask=q_mask)
    k1f, k2f = k1.to(tl.float32), k2.to(tl.float32)
    r1 = (k1f * cos - k2f * sin).to(k1.dtype)
    r2 = (k2f * cos + k1f * sin).to(k1.dtype)
    tl.store(k1_ptr, r1, mask=k_mask)
    tl.store(k1_ptr + HALF, r2, mask=k_mask)

    if slot >= 0:  # a negative slot is a padding token (CUDA-graph batches): nothing to store
        dst = (
            (slot // BLOCK_SIZE) * stride_c_block
            + (slot % BLOCK_SIZE) * stride_c_slot
            + hk[:, None] * stride_c_head
            + j[None, :]
        )
        tl.store(key_cache_ptr + dst, r1.to(key_cache_ptr.dtype.element_ty), mask=k_mask)
        tl.store(key_cache_ptr + dst + HALF, r2.to(key_cache_ptr.dtype.element_ty), mask=k_mask)
        tl.store(value_cache_ptr + dst, v1.to(value_cache_ptr.dtype.element_ty), mask=k_mask)
        tl.store(value_cache_ptr + dst + HALF, v2.to(value_cache_ptr.dtype.element_ty), mask=k_mask)


def rope_and_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Neox RoPE on q [T, Hq, D] and k [T, Hk, D] in place, then k, v into their slots of the caches
    [num_blocks, block_size, Hk, D]. cos_sin_cache [P, D] float32; a negative slot is not stored."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    _check_cache(key_cache, value_cache, num_kv_heads, head_dim)
    if k.shape != v.shape or k.shape[0] != num_tokens or k.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree")
    if cos_sin_cache.shape[1] != head_dim:
        raise ValueError(f"cos_sin_cache width {cos_sin_cache.shape[1]} must equal head_dim {head_dim}")
    if min(q.stride(-1), k.stride(-1), v.stride(-1), cos_sin_cache.stride(-1)) != 1:
        raise ValueError("q, k, v and cos_sin_cache need a contiguous last dim")
    if num_tokens == 0:
        return
    half = head_dim // 2
    pdl = use_pdl(q)
    _rope_and_cache_kernel[(num_tokens,)](
        *(q, k, v, positions, cos_sin_cache, key_cache, value_cache, slot_mapping),
        *(*q.stride()[:2], *k.stride()[:2], *v.stride()[:2], cos_sin_cache.stride(0), *key_cache.stride()[:3]),
        *(num_heads, num_kv_heads),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        BLOCK_SIZE=key_cache.shape[1],
        num_warps=4,
        USE_PDL=pdl,
        launch_pdl=pdl,
    )
