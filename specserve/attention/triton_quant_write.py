"""Triton KV write for quantized caches (fp8, nvfp4): quantize new K/V and store them at their slots,
bit for bit as kv/quant.py (scales rounded UP, IEEE divisions via div_rn: Triton's `/` is approximate)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention.triton_quant_common import (
    _E2M1_MAX,
    _FP8_MAX,
    _FP16_MAX,
    check_quant_cache,
)
from specserve.kv.quant import E2M1_MAX, hadamard_rotate, smooth_keys
from specserve.kv.spec import KVFormat, LayerKVCache


@triton.jit
def _div(x, y):
    """IEEE x / y, y a tensor."""
    x, y = tl.broadcast(x, y)
    return tl.math.div_rn(x, y)


@triton.jit
def _round_up(x, DTYPE: tl.constexpr, BITS: tl.constexpr):
    """float32 x (positive, within DTYPE's finite range) -> DTYPE, rounded up (quant._round_up_to)."""
    q = x.to(DTYPE)
    return (q.to(BITS, bitcast=True) + (q.to(tl.float32) < x).to(BITS)).to(DTYPE, bitcast=True)


@triton.jit
def _e2m1_code(v):
    """Nearest e2m1 nibble of float32 v in [-6, 6]; ties to the even index (quant._E2M1_BOUNDS)."""
    mag = tl.abs(v)
    idx = (
        (mag > 0.25).to(tl.int32)
        + (mag >= 0.75).to(tl.int32)
        + (mag > 1.25).to(tl.int32)
        + (mag >= 1.75).to(tl.int32)
        + (mag > 2.5).to(tl.int32)
        + (mag >= 3.5).to(tl.int32)
        + (mag > 5.0).to(tl.int32)
    )
    negative = ((v < 0) & (idx > 0)).to(tl.int32)
    return idx | (negative << 3)


@triton.jit
def _quantize_fp8_row(src_ptrs, dst_ptrs, scale_ptrs, mask, h_ok):
    """One token's [H, D] values -> e4m3 data + one float16 scale per head."""
    x = tl.load(src_ptrs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    target = tl.minimum(tl.maximum(_div(amax, tl.full(amax.shape, _FP8_MAX, tl.float32)), 2.0**-24), _FP16_MAX)
    scale = _round_up(target, tl.float16, tl.int16)  # [H]
    data = tl.minimum(tl.maximum(_div(x, scale.to(tl.float32)[:, None]), -_FP8_MAX), _FP8_MAX)
    tl.store(dst_ptrs, data.to(tl.float8e4nv), mask=mask)
    tl.store(scale_ptrs, scale, mask=h_ok)


@triton.jit
def _quantize_nvfp4_row(src_ptrs, dst_ptrs, scale_ptrs, mask, g_ok, amax_div, global_scale):
    """One (token, head)'s values as [G, 8] even/odd pairs (src_ptrs: the even elements 16 g + 2 t) ->
    packed e2m1 codes + e4m3 group scales."""
    lo = tl.load(src_ptrs, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(src_ptrs + 1, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(lo), axis=1), tl.max(tl.abs(hi), axis=1))  # [G]
    target = tl.minimum(tl.maximum(_div(amax, tl.full(amax.shape, amax_div, tl.float32)), 2.0**-9), _FP8_MAX)
    scale = _round_up(target, tl.float8e4nv, tl.uint8)
    step = (scale.to(tl.float32) * global_scale)[:, None]
    code_lo = _e2m1_code(tl.minimum(tl.maximum(_div(lo, step), -_E2M1_MAX), _E2M1_MAX))
    code_hi = _e2m1_code(tl.minimum(tl.maximum(_div(hi, step), -_E2M1_MAX), _E2M1_MAX))
    tl.store(dst_ptrs, (code_lo | (code_hi << 4)).to(tl.uint8), mask=mask)
    tl.store(scale_ptrs, scale, mask=g_ok)


@triton.jit
def _write_kv_quant_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    key_scale_ptr,
    value_scale_ptr,
    slot_mapping_ptr,
    amax_div,
    global_scale,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_s_block,
    stride_s_slot,
    stride_s_head,
    num_kv_heads,
    NVFP4: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """fp8: one program per token, all heads. nvfp4: one program per (token, head), 2-D tiles."""
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:  # a padding token (CUDA-graph batches): nothing to store
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    c_row = block * stride_c_block + offset * stride_c_slot
    s_row = block * stride_s_block + offset * stride_s_slot
    if NVFP4:
        h = tl.program_id(1)
        g = tl.arange(0, BLOCK_G)
        t = tl.arange(0, 8)
        g_ok = g < NUM_GROUPS
        mask = g_ok[:, None] & (t[None, :] < 8)
        src = 16 * g[:, None] + 2 * t[None, :]  # even elements of each group
        dst = c_row + h * stride_c_head + 8 * g[:, None] + t[None, :]
        sdst = s_row + h * stride_s_head + g
        k_src = key_ptr + tok * stride_k_tok + h * stride_k_head + src
        v_src = value_ptr + tok * stride_v_tok + h * stride_v_head + src
        _quantize_nvfp4_row(k_src, key_cache_ptr + dst, key_scale_ptr + sdst, mask, g_ok, amax_div, global_scale)
        _quantize_nvfp4_row(v_src, value_cache_ptr + dst, value_scale_ptr + sdst, mask, g_ok, amax_div, global_scale)
    else:
        h = tl.arange(0, BLOCK_H)
        h_ok = h < num_kv_heads
        d = tl.arange(0, BLOCK_D)
        mask = h_ok[:, None] & (d[None, :] < HEAD_DIM)
        dst = c_row + h[:, None] * stride_c_head + d[None, :]
        sdst = s_row + h * stride_s_head
        k_src = key_ptr + tok * stride_k_tok + h[:, None] * stride_k_head + d[None, :]
        v_src = value_ptr + tok * stride_v_tok + h[:, None] * stride_v_head + d[None, :]
        _quantize_fp8_row(k_src, key_cache_ptr + dst, key_scale_ptr + sdst, mask, h_ok)
        _quantize_fp8_row(v_src, value_cache_ptr + dst, value_scale_ptr + sdst, mask, h_ok)


def reshape_and_cache_quant(
    key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, fmt: KVFormat, slot_mapping: torch.Tensor
) -> None:
    """Quantize key/value [num_tokens, num_kv_heads, head_dim] and store them (and their scales) at
    their slots (keys divided by cache.key_smooth); bit-identical to `kv.quant.write_kv`. A negative
    slot (padding token) is skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    check_quant_cache(fmt, cache, num_kv_heads, head_dim)
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value need a contiguous last (head_dim) dimension")
    if num_tokens == 0:
        return
    key = smooth_keys(key, cache.key_smooth)  # as quant.write_kv
    if fmt.rotate:  # float32 rows, as quantize() rounds them
        key, value = hadamard_rotate(key).float(), hadamard_rotate(value).float()
    nvfp4 = fmt.name == "nvfp4"
    kc, vc, ks, vs = cache.key, cache.value, cache.key_scale, cache.value_scale
    block_h = triton.next_power_of_2(num_kv_heads)
    # nvfp4: one program per (token, head) on 2-D [groups, 8] tiles.
    _write_kv_quant_kernel[(num_tokens, num_kv_heads if nvfp4 else 1)](
        *(key, value, kc, vc, ks, vs, slot_mapping, E2M1_MAX * fmt.global_scale, fmt.global_scale),
        *(*key.stride()[:2], *value.stride()[:2], *kc.stride()[:3], *ks.stride()[:3], num_kv_heads),
        NVFP4=nvfp4,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=triton.next_power_of_2(head_dim),
        NUM_GROUPS=fmt.num_scale_groups(head_dim),
        BLOCK_G=triton.next_power_of_2(fmt.num_scale_groups(head_dim)),
        BLOCK_SIZE=kc.shape[1],
        num_warps=1 if nvfp4 or block_h * head_dim < 2048 else 4,
    )
