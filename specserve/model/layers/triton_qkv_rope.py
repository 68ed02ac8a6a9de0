"""The input RMSNorm, the qkv projection, RoPE and the KV-cache write in one launch (decode sizes).

Why: at batch 1 a decoder layer otherwise runs the norm + qkv GEMV (triton_gemv.rms_norm_linear,
~3.4 us on the H200 for the 1.5B shape) and then `_rope_and_cache_kernel` (triton_rope_cache.py,
~2.5 us of one program that is all latency: rotate q and k, copy k and v into the paged cache).
Here the GEMV's epilogue does the second kernel's work, so the qkv output is never stored and
attention (`TritonBackend.forward_cached`) reads k and v from the cache.

Feature-to-program mapping: the fused weight is [(Hq + 2 * Hkv) * D, K] (q heads, then k, then v),
and neox RoPE rotates feature j of a head with feature j + D/2. Program p owns head
h = p // cdiv(D/2, BLOCK_J) and the half-offsets j in one BLOCK_J-wide range of it: W rows h*D + j
and h*D + D/2 + j, loaded as two row groups, the way `_gemv_kernel`'s SILU_OUT owns gate and up
rows (it runs triton_gemv's `_single_tile` with that pairing). Every program thus holds both
halves of the pairs it rotates, and which kind of head it has (q, k or v) is uniform over it.

Tiles: one tile covers the whole reduction (BLOCK_K = next power of two >= K, K <= MAX_K), so
every weight load of a program is issued at once (before the PDL wait where triton_gemv prefetches)
and the norm's 1/rms comes from the x row the program already holds. Programs hold 2 * BLOCK_J
rows of W: where the unfused norm + qkv GEMV would run one tile (`triton_gemv._norm_tiles`: the
tuned table's norm_fuse tiles or its plain entry, else the GEMV heuristic) its tiles are taken with
BLOCK_J = BLOCK_N / 2, the same rows and bytes per program as the GEMV it replaces; else BLOCK_K
covers K and BLOCK_N is the GEMV's heuristic (>= 2 programs per SM). K > MAX_K (8B-class models)
keeps the unfused path. Any M <= GEMV_UNTUNED_MAX_M takes it, also where the table picks cuBLAS for the
plain qkv (M = 4 on the H200): whether that pays is for the H200 to say (the switch is off).

Rounding, as `rms_norm_linear` (the Triton GEMV) and then `_rope_and_cache_kernel` round: the norm
as `ops.rms_norm` (x + residual to the activation dtype, the normalized row, then the weight's
product), fp32 accumulation, + bias in fp32, the projection rounded to the activation dtype; then
RoPE in fp32 from those rounded values, rounded to the activation dtype, then to the cache's
dtype for k; v rounded to the activation dtype, then to the cache's. With the same rows per
program and BLOCK_K as the unfused GEMV each feature's sum runs in the same order, so q, the cache
and the residual are bitwise the unfused Triton path's (tests/gpu/test_qkv_rope.py checks it).

PDL (model/layers/pdl.py): batch metadata (positions, slot_mapping), the cos/sin table, the bias
and (PREFETCH) the weights are read before the wait, as no kernel of a forward writes them; x,
the residual and every store come after it (inside `_single_tile`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.model.layers import triton_gemv
from specserve.model.layers.gemv_kernel import _single_tile
from specserve.model.layers.pdl import use_pdl

# The longest reduction one tile covers (the tuned table's single tiles reach K = 2048; beyond,
# a [2 * BLOCK_J, BLOCK_K] fp32 tile would not fit in registers).
MAX_K = 2048


@triton.jit
def _store_slots(cache_ptr, v1, v2, kv_head, slot, j, mask, stride_c_block, stride_c_slot, stride_c_head,
                 HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Both halves [BLOCK_M, BLOCK_J] of one KV head into each row's slot; negative slots (padding
    tokens of a CUDA-graph batch) store nothing."""
    ok = mask & (slot >= 0)[:, None]
    slot = tl.maximum(slot, 0)  # no negative address is formed, even masked
    dst = (slot // BLOCK_SIZE)[:, None] * stride_c_block + (slot % BLOCK_SIZE)[:, None] * stride_c_slot \
        + kv_head * stride_c_head + j[None, :]
    ty = cache_ptr.dtype.element_ty
    tl.store(cache_ptr + dst, v1.to(ty), mask=ok)
    tl.store(cache_ptr + dst + HALF, v2.to(ty), mask=ok)


@triton.jit
def _qkv_rope_cache_kernel(
    x_ptr, res_ptr, res_out_ptr, norm_w_ptr, w_ptr, bias_ptr, q_out_ptr,
    positions_ptr, cos_sin_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    M, K, num_heads, num_kv_heads, stride_xm, stride_rm, stride_rom, stride_wn, stride_qm, stride_cs,
    stride_c_block, stride_c_slot, stride_c_head, eps,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, J_BLOCKS: tl.constexpr, BLOCK_J: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False,
):
    pid = tl.program_id(0)
    head = pid // J_BLOCKS  # 0..Hq-1: q, then Hkv k heads, then Hkv v heads
    j = (pid % J_BLOCKS) * BLOCK_J + tl.arange(0, BLOCK_J)
    j_ok = j < HALF
    rows = head * HEAD_DIM + j  # first halves; second halves are HALF rows further
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    up_rows = w_rows + HALF * stride_wn
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    mask = m_ok[:, None] & j_ok[None, :]
    rotated = head < num_heads + num_kv_heads
    # Batch metadata and the bias before the PDL wait (inside _single_tile): no kernel of the step
    # writes them.
    pos = tl.load(positions_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
    cs = cos_sin_ptr + pos[:, None] * stride_cs + j[None, :]
    cos = tl.load(cs, mask=mask & rotated, other=0.0).to(tl.float32)
    sin = tl.load(cs + HALF, mask=mask & rotated, other=0.0).to(tl.float32)
    slot = tl.load(slot_mapping_ptr + offs_m, mask=m_ok, other=-1).to(tl.int64)
    if HAS_BIAS:
        b1 = tl.load(bias_ptr + rows, mask=j_ok, other=0.0).to(tl.float32)
        b2 = tl.load(bias_ptr + rows + HALF, mask=j_ok, other=0.0).to(tl.float32)
    # acc: features h*D + j, acc2: h*D + HALF + j ([BLOCK_M, BLOCK_J] fp32); program 0 writes the
    # new residual.
    acc, acc2 = _single_tile(
        x_ptr, res_ptr, res_out_ptr, norm_w_ptr, w_rows, up_rows, j_ok, pid, M, K, stride_xm, stride_rm,
        stride_rom, eps, True, True, HAS_RESIDUAL, BLOCK_M, BLOCK_J, BLOCK_K, USE_PDL, PREFETCH)
    if HAS_BIAS:
        acc += b1[None, :]
        acc2 += b2[None, :]
    dtype = q_out_ptr.dtype.element_ty
    # The projection's output as the unfused GEMV stores it (activation dtype), then RoPE in fp32
    # from it and rounded back, as _rope_and_cache_kernel computes it (same expression).
    x1 = acc.to(dtype).to(tl.float32)
    x2 = acc2.to(dtype).to(tl.float32)
    if rotated:
        r1 = (x1 * cos - x2 * sin).to(dtype)
        r2 = (x2 * cos + x1 * sin).to(dtype)
        if head < num_heads:
            q = q_out_ptr + offs_m[:, None] * stride_qm + head * HEAD_DIM + j[None, :]
            tl.store(q, r1, mask=mask)
            tl.store(q + HALF, r2, mask=mask)
        else:
            _store_slots(key_cache_ptr, r1, r2, head - num_heads, slot, j, mask, stride_c_block, stride_c_slot,
                         stride_c_head, HALF, BLOCK_SIZE)
    else:
        _store_slots(value_cache_ptr, x1.to(dtype), x2.to(dtype), head - num_heads - num_kv_heads, slot, j, mask,
                     stride_c_block, stride_c_slot, stride_c_head, HALF, BLOCK_SIZE)


def _applicable(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, key_cache: torch.Tensor, value_cache: torch.Tensor, num_heads: int,
                num_kv_heads: int, head_dim: int) -> bool:
    """Whether the fused launch takes this layer and batch: the GEMV's rows, dtypes and device
    (`triton_gemv._gemv_ok`), K in one tile, a weight of exactly the heads given, an even head_dim,
    and an unquantized cache [blocks, block_size, Hkv, D] (a float dtype of >= 16 bits)."""
    k = x.shape[-1]
    return triton_gemv._gemv_ok(x, weight, k) and x.shape[0] <= triton_gemv.GEMV_UNTUNED_MAX_M and k <= MAX_K \
        and head_dim % 2 == 0 \
        and weight.shape[0] == (num_heads + 2 * num_kv_heads) * head_dim \
        and norm_weight.dtype == x.dtype and norm_weight.is_contiguous() and norm_weight.numel() == k \
        and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape
                                  and residual.stride(-1) == 1)) \
        and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous())) \
        and key_cache.dim() == 4 and key_cache.shape[2:] == (num_kv_heads, head_dim) \
        and key_cache.shape == value_cache.shape and key_cache.stride() == value_cache.stride() \
        and key_cache.stride(3) == 1 and key_cache.dtype == value_cache.dtype \
        and key_cache.dtype.is_floating_point and key_cache.dtype.itemsize >= 2


def qkv_rope_tiles(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                   weight: torch.Tensor, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_J, BLOCK_K, num_warps) for the fused launch. Where the unfused norm + qkv GEMV would
    run one tile (`triton_gemv._norm_tiles`: the tuned norm_fuse tiles or the GEMV's) its tiles are
    taken, BLOCK_J = BLOCK_N / 2 (the same rows of W per program), so the two paths reduce alike;
    else BLOCK_K covers K and BLOCK_N is the GEMV's heuristic (>= 2 programs per SM)."""
    n, k = weight.shape
    tiles = triton_gemv._norm_tiles(x, residual, norm_weight, weight, silu_out=False)
    if tiles is None or tiles[1] < k:
        tiles = (triton_gemv.block_n_for(n, triton_gemv._num_sms(x.device)), triton.next_power_of_2(k), 4)
    block_n, block_k, num_warps = tiles
    return max(1, min(block_n // 2, triton.next_power_of_2(head_dim // 2))), block_k, num_warps


def rms_norm_qkv_rope_cache(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    bias: torch.Tensor | None, positions: torch.Tensor, cos_sin_cache: torch.Tensor, key_cache: torch.Tensor,
    value_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
    tiles: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A decoder layer's input norm, qkv projection, neox RoPE and KV-cache write in one launch.

    x, residual: [M, K] (residual None in a model's first layer); norm_weight [K]; weight
    [(num_heads + 2 * num_kv_heads) * head_dim, K] (q | k | v), bias [N] or None; positions and
    slot_mapping [M] int (a negative slot: padding token, nothing stored); cos_sin_cache
    [max_positions, head_dim] (cos | sin halves); key_cache, value_cache [num_blocks, block_size,
    num_kv_heads, head_dim] unquantized. Rotated k and v go into the caches at the rows' slots.
    Returns (q [M, num_heads, head_dim] rotated, the new residual [M, K]: x + residual, or x itself
    without one), or None where the fused launch does not apply (`_applicable`): the caller then runs
    `rms_norm_linear` and the RoPE + cache write apart. tiles: (BLOCK_J, BLOCK_K >= K, num_warps),
    by default `qkv_rope_tiles` (tests pin them)."""
    if not _applicable(x, residual, norm_weight, weight, bias, key_cache, value_cache, num_heads, num_kv_heads,
                       head_dim):
        return None
    m, k = x.shape
    if positions.shape != (m,) or slot_mapping.shape != (m,) or positions.stride(0) != 1 \
            or slot_mapping.stride(0) != 1:
        raise ValueError(f"positions {tuple(positions.shape)} and slot_mapping {tuple(slot_mapping.shape)} "
                         f"must both be contiguous [{m}]")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or cos_sin_cache.stride(-1) != 1:
        raise ValueError(f"cos_sin_cache {tuple(cos_sin_cache.shape)} must be [max_positions, {head_dim}], "
                         "contiguous in its last dim")
    block_j, block_k, num_warps = tiles or qkv_rope_tiles(x, residual, norm_weight, weight, head_dim)
    if block_k < k:
        raise ValueError(f"BLOCK_K {block_k} must cover K {k} (one tile)")
    half = head_dim // 2
    j_blocks = triton.cdiv(half, block_j)
    q = torch.empty((m, num_heads, head_dim), dtype=x.dtype, device=x.device)
    res_out = None if residual is None else torch.empty((m, k), dtype=x.dtype, device=x.device)
    pdl = use_pdl(x)
    _qkv_rope_cache_kernel[((num_heads + 2 * num_kv_heads) * j_blocks,)](
        x, x if residual is None else residual, x if res_out is None else res_out, norm_weight, weight,
        weight if bias is None else bias, q, positions, cos_sin_cache, key_cache, value_cache, slot_mapping,
        m, k, num_heads, num_kv_heads, x.stride(0), 0 if residual is None else residual.stride(0),
        0 if res_out is None else res_out.stride(0), weight.stride(0), q.stride(0), cos_sin_cache.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), eps,
        HEAD_DIM=head_dim, HALF=half, J_BLOCKS=j_blocks, BLOCK_J=block_j, BLOCK_SIZE=key_cache.shape[1],
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, BLOCK_M=triton.next_power_of_2(m),
        BLOCK_K=block_k, num_warps=num_warps, USE_PDL=pdl, launch_pdl=pdl,
        PREFETCH=triton_gemv._prefetch(weight.shape[0], k, m, x.device),
    )
    return q, (x if res_out is None else res_out)
