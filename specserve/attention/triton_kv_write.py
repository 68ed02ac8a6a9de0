"""The KV write into the paged cache as a Triton kernel (torch twin: torch_ref.write_kv), and the
cache-layout check the attention kernels share."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.pdl import pdl_prologue, use_pdl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)  # batch metadata: safe before the PDL wait
    pdl_prologue(USE_PDL)  # k, v only after it; every program waits before it may return
    if slot < 0:  # a padding token (CUDA-graph batches): nothing to store
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < num_kv_heads) & (d[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + tok * stride_k_tok + h[:, None] * stride_k_head + d[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_v_tok + h[:, None] * stride_v_head + d[None, :], mask=mask)
    dst = block * stride_c_block + offset * stride_c_slot + h[:, None] * stride_c_head + d[None, :]
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at their slots of the caches
    [num_blocks, block_size, num_kv_heads, head_dim]; a negative slot (padding token) is skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    _check_cache(key_cache, value_cache, num_kv_heads, head_dim)
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value need a contiguous last (head_dim) dimension")
    if num_tokens == 0:
        return
    block_h, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    pdl = use_pdl(key)
    _reshape_and_cache_kernel[(num_tokens,)](
        *(key, value, key_cache, value_cache, slot_mapping),
        *(*key.stride()[:2], *value.stride()[:2], *key_cache.stride()[:3], num_kv_heads),
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_SIZE=key_cache.shape[1],
        num_warps=4 if block_h * block_d >= 2048 else 1,
        USE_PDL=pdl,
        launch_pdl=pdl,
    )


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must have the same shape and strides")
    if key_cache.shape[2] != num_kv_heads or key_cache.shape[3] != head_dim:
        raise ValueError(
            f"cache is [blocks, block_size, {key_cache.shape[2]}, {key_cache.shape[3]}], "
            f"expected {num_kv_heads} kv heads of head_dim {head_dim} (unquantized layout)"
        )
    if key_cache.stride(3) != 1:
        raise ValueError("cache head_dim must be contiguous")
