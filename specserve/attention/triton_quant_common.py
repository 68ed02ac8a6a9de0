"""Jit helpers shared by the quantized-KV attention kernels (fp8, nvfp4), following triton_paged's
kernel (q-block / GQA row packing, split-KV ranges and partials); plus the host-side cache check."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention.triton_paged import _find_seq
from specserve.kv.quant import E2M1_MAX, FP8_MAX
from specserve.kv.spec import KVFormat, LayerKVCache

NVFP4_DECODE = 16384.0  # 2^14: the bit-trick decode yields e2m1 * 2^-14
_FP16_MAX = tl.constexpr(65504.0)
_FP8_MAX = tl.constexpr(FP8_MAX)
_E2M1_MAX = tl.constexpr(E2M1_MAX)


@triton.jit
def _locate(
    cu_query_lens_ptr,
    seq_lens_ptr,
    num_seqs,
    num_splits,
    GROUP: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """This program's KV head, split, rows and KV tile range (as triton_paged's kernel). HEADS_FIRST:
    the grid is (kv heads, q blocks, splits), else (q blocks, kv heads, splits)."""
    if HEADS_FIRST:
        kv_head = tl.program_id(0)
        q_block_idx = tl.program_id(1)
        num_heads = tl.num_programs(0) * GROUP
    else:
        q_block_idx = tl.program_id(0)
        kv_head = tl.program_id(1)
        num_heads = tl.num_programs(1) * GROUP
    split = tl.program_id(2)
    seq = _find_seq(cu_query_lens_ptr, num_seqs, q_block_idx, BLOCK_Q)
    q_start = tl.load(cu_query_lens_ptr + seq)
    q_len = tl.load(cu_query_lens_ptr + seq + 1) - q_start
    q_block_local = q_block_idx - (q_start // BLOCK_Q + seq)
    spare = q_block_local * BLOCK_Q >= q_len  # a spare q block (the grid is an upper bound)
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_block_local * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    tok = (q_start + q_idx).to(tl.int64)
    kv_end = tl.minimum(seq_len, context_len + (q_block_local + 1) * BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    if SPLIT:
        tiles_per_split = tl.cdiv(num_tiles, num_splits)
        tile_lo = split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    else:
        tile_lo = num_tiles * 0
        tile_hi = num_tiles
    return kv_head, split, num_heads, spare, seq, tok, head, row_ok, context_len + q_idx, kv_end, tile_lo, tile_hi


@triton.jit
def _tile_rows(table, tile, kv_end, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """KV tile `tile`: key positions, in-range mask, cache block ids and slots."""
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < kv_end
    block_ids = tl.load(table + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    return offs_n, n_ok, block_ids, offs_n % BLOCK_SIZE


@triton.jit
def _load_q16(q_ptr, tok, head, row_ok, cols, col_ok, stride_q_tok, stride_q_head):
    """Q rows at the given head_dim columns as float16 (clamped to its finite range)."""
    q = tl.load(
        q_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + cols[None, :],
        mask=row_ok[:, None] & col_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    return tl.minimum(tl.maximum(q, -_FP16_MAX), _FP16_MAX).to(tl.float16)


@triton.jit
def _softmax_init(BLOCK_M: tl.constexpr):
    """Running max and denominator of the online softmax."""
    return tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32)


@triton.jit
def _qk4(q0, q1, q2, q3, k0, k1, k2, k3, s):
    """s + sum_j Q_j.K_j^T (s None: no accumulator)."""
    s = tl.dot(q0, tl.trans(k0), s)
    s = tl.dot(q1, tl.trans(k1), s)
    s = tl.dot(q2, tl.trans(k2), s)
    return tl.dot(q3, tl.trans(k3), s)


@triton.jit
def _pv4(p16, v0, v1, v2, v3, a0, a1, a2, a3, alpha):
    """a_j * alpha + P.V_j for j = 0..3."""
    a0 = tl.dot(p16, v0, a0 * alpha[:, None])
    a1 = tl.dot(p16, v1, a1 * alpha[:, None])
    a2 = tl.dot(p16, v2, a2 * alpha[:, None])
    a3 = tl.dot(p16, v3, a3 * alpha[:, None])
    return a0, a1, a2, a3


@triton.jit
def _softmax_step(s, offs_n, n_ok, q_pos, m_i, l_i, FULL: tl.constexpr = False):
    """Online softmax over one tile of base-2 scores: returns (p, alpha, m_new, l_new). FULL: every row
    sees the whole tile (in range, causally visible): no masks."""
    if not FULL:
        s = tl.where((offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = m_new  # FULL: m_i = -inf before the first tile gives alpha 0
    if not FULL:  # a row may see no key of this tile: keep exp2 away from -inf - -inf
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _softmax_probs_scaled(raw, c, offs_n, n_ok, q_pos, m_i, FULL: tl.constexpr):
    """(p, alpha, m_new) of the online softmax over scores raw * c (c > 0) without forming them: the
    row max on raw, scaled once per row; exp2's argument one fma per score. FULL: every row sees the tile."""
    if not FULL:
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        raw = tl.where(visible, raw, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(raw, 1) * c)
    if FULL:
        m_safe = m_new
    else:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(tl.fma(raw, c, -m_safe[:, None]))
    return p, tl.exp2(m_i - m_safe), m_new


def cache_strides(prefix: str, t: torch.Tensor) -> dict[str, int]:
    """A cache tensor's block / slot / head strides as the kernels' constexprs ({prefix}_BLOCK, ...)."""
    return {f"{prefix}_{name}": t.stride(i) for i, name in enumerate(("BLOCK", "SLOT", "HEAD"))}


def check_quant_cache(fmt: KVFormat, cache: LayerKVCache, num_kv_heads: int, head_dim: int) -> None:
    """Refuse formats and cache layouts the quantized kernels cannot read or write."""
    if fmt.name not in ("fp8", "nvfp4"):
        raise NotImplementedError(f"no Triton kernel reads kv_cache_dtype {fmt.name!r}")
    if fmt.name == "nvfp4" and (head_dim % 16 or fmt.scale_group != 16):
        raise NotImplementedError(f"the Triton nvfp4 kernels need head_dim % 16 == 0, got {head_dim}")
    if cache.key_scale is None or cache.value_scale is None:
        raise ValueError(f"KV format {fmt.name!r} needs a cache with scale tensors")
    want = (num_kv_heads, fmt.packed_dim(head_dim))
    for data, scale in ((cache.key, cache.key_scale), (cache.value, cache.value_scale)):
        if data.dtype != fmt.storage_dtype or scale.dtype != fmt.scale_dtype:
            raise ValueError(f"cache dtypes {data.dtype}/{scale.dtype} do not match KV format {fmt.name!r}")
        if tuple(data.shape[2:]) != want or scale.shape[:3] != data.shape[:3]:
            raise ValueError(f"cache is {tuple(data.shape)}, expected [blocks, block_size, {want[0]}, {want[1]}]")
        if data.stride(3) != 1 or scale.stride(3) != 1:
            raise ValueError("cache head_dim must be contiguous")
    if cache.key.stride() != cache.value.stride() or cache.key_scale.stride() != cache.value_scale.stride():
        raise ValueError("key and value caches (and their scales) must have the same strides")
