"""Triton kernels over a quantized paged KV cache (fp8, nvfp4): the KV write and paged attention.

The layouts and rounding rules are `specserve/kv/spec.py` and `specserve/kv/quant.py`; the write
kernels reproduce quant.py bit for bit (scales rounded UP, true IEEE divisions via div_rn, since
Triton's `/` is an approximate division on NVIDIA), so a cache written here reads back exactly
as the torch oracle's. Attention follows `triton_paged.py` (same grid, GQA row packing, split-KV
and its reduction kernel) and differs only in how a K/V tile becomes dot operands:

fp8:   the e4m3 tile is widened to float16 (one cvt per two values; e4m3 -> bf16 would cost three)
       and the per-(token, head) scales are folded outside the dots: scores are scaled per key
       column after Q.K^T, and P is scaled per key row before P.V. Before P.V the row scale is
       divided by the tile's largest one (multiplied back into the fp32 product) so P stays in
       [0, 1] and never underflows float16.
nvfp4: the packed codes are read as 32-bit words (8 codes each) and turned into float16 with
       word-wide bit operations, no table and no conversion instruction: nibble e2m1 (s, e, m)
       placed at float16 bits (15, 11..10, 9) *is* the float16 number e2m1 * 2^-14, subnormal
       0.5 included. Nibbles k and k+4 of a word land in one 32-bit word as two float16 halves.
       A dot is a sum over head_dim, so head_dim is consumed in any order as long as Q follows
       the same order: the kernel runs 8 dots of depth head_dim/8, one per nibble position k,
       against Q's columns 8j + k. Per-16 scales multiply the decoded values in float16 (exact:
       products of a 2-bit and a 4-bit significand, >= 2^-24); the constant 2^14 * global_scale
       goes into the score scale (K) and the output (V).

Both formats run their dots in float16 with float32 accumulation. Q is bf16 in the models, so it
is clamped to float16's finite range first (|q| > 65504 does not occur in practice; bf16 -> fp16
is otherwise exact down to 2^-14).

Status (H200, bench/kv_quant_gpu.py, batch 32 / 32k decode): correct but slower than bf16 (fp8
1.6 ms with the tuned tiles, nvfp4 3.2 ms, bf16 1.17 ms). The loops are latency-bound, not
bandwidth-bound (0.8 and 0.4 TB/s): scale loads are 1-2 byte gathers that Triton does not turn
into cp.async, so each tile waits on block id -> scale loads, and register use (186-239 per
thread) leaves fewer CTAs per SM than bf16's 128. Next: contiguous (cp.async-able) scale loads
or a one-tile-ahead prefetch, and fewer, larger nvfp4 dots.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention.triton_paged import (
    LOG2E,
    MAX_SPLITS,
    MIN_KEYS_PER_SPLIT,
    _find_seq,
    _num_sms,
    _reduce_splits_kernel,
    attention_config,
)
from specserve.kv.quant import E2M1_MAX, FP8_MAX
from specserve.kv.spec import KVFormat, LayerKVCache

NVFP4_DECODE = 16384.0  # 2^14: decoded nibbles are e2m1 * 2^-14
# Constants the kernels read (Triton only lets jit code see constexpr globals).
_FP16_MAX = tl.constexpr(65504.0)
_FP8_MAX = tl.constexpr(FP8_MAX)
_E2M1_MAX = tl.constexpr(E2M1_MAX)


# ----------------------------------------------------------------------------- write (quantize)

@triton.jit
def _div(x, y):
    """IEEE x / y (torch's division; Triton's `/` is approximate on NVIDIA), y a tensor."""
    x, y = tl.broadcast(x, y)
    return tl.math.div_rn(x, y)


@triton.jit
def _round_up_fp16(x):
    """float32 x (positive, <= 65504) -> float16, rounded up (quant._round_up_to)."""
    q = x.to(tl.float16)
    bump = (q.to(tl.float32) < x).to(tl.int16)
    return (q.to(tl.int16, bitcast=True) + bump).to(tl.float16, bitcast=True)


@triton.jit
def _round_up_e4m3(x):
    """float32 x (positive, <= 448) -> float8_e4m3fn, rounded up."""
    q = x.to(tl.float8e4nv)
    bump = (q.to(tl.float32) < x).to(tl.uint8)
    return (q.to(tl.uint8, bitcast=True) + bump).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _e2m1_code(v):
    """Nearest e2m1 nibble of float32 v in [-6, 6]; ties to the even index (quant._E2M1_BOUNDS)."""
    mag = tl.abs(v)
    idx = ((mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
           + (mag >= 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag >= 3.5).to(tl.int32)
           + (mag > 5.0).to(tl.int32))
    negative = ((v < 0) & (idx > 0)).to(tl.int32)
    return idx | (negative << 3)


@triton.jit
def _quantize_fp8_row(src_ptrs, dst_ptrs, scale_ptrs, mask, h_ok):
    """One token's [H, D] values -> e4m3 data + one float16 scale per head."""
    x = tl.load(src_ptrs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    target = tl.minimum(tl.maximum(_div(amax, tl.full(amax.shape, _FP8_MAX, tl.float32)), 2.0 ** -24), _FP16_MAX)
    scale = _round_up_fp16(target)  # [H]
    data = tl.minimum(tl.maximum(_div(x, scale.to(tl.float32)[:, None]), -_FP8_MAX), _FP8_MAX)
    tl.store(dst_ptrs, data.to(tl.float8e4nv), mask=mask)
    tl.store(scale_ptrs, scale, mask=h_ok)


@triton.jit
def _quantize_nvfp4_row(src_ptrs, dst_ptrs, scale_ptrs, mask, g_ok, amax_div, global_scale):
    """One (token, head)'s values as [G, 8] even/odd pairs -> packed e2m1 codes + e4m3 group scales.

    src_ptrs point at the even elements 16 g + 2 t; the odd ones are the next element.
    """
    lo = tl.load(src_ptrs, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(src_ptrs + 1, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(lo), axis=1), tl.max(tl.abs(hi), axis=1))  # [G]
    target = tl.minimum(tl.maximum(_div(amax, tl.full(amax.shape, amax_div, tl.float32)), 2.0 ** -9), _FP8_MAX)
    scale = _round_up_e4m3(target)
    step = (scale.to(tl.float32) * global_scale)[:, None]
    code_lo = _e2m1_code(tl.minimum(tl.maximum(_div(lo, step), -_E2M1_MAX), _E2M1_MAX))
    code_hi = _e2m1_code(tl.minimum(tl.maximum(_div(hi, step), -_E2M1_MAX), _E2M1_MAX))
    tl.store(dst_ptrs, (code_lo | (code_hi << 4)).to(tl.uint8), mask=mask)
    tl.store(scale_ptrs, scale, mask=g_ok)


@triton.jit
def _write_kv_quant_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, key_scale_ptr, value_scale_ptr, slot_mapping_ptr,
    amax_div, global_scale,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_c_block, stride_c_slot, stride_c_head, stride_s_block, stride_s_slot, stride_s_head,
    num_kv_heads,
    NVFP4: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr,
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
        _quantize_nvfp4_row(key_ptr + tok * stride_k_tok + h * stride_k_head + src,
                            key_cache_ptr + dst, key_scale_ptr + sdst, mask, g_ok, amax_div, global_scale)
        _quantize_nvfp4_row(value_ptr + tok * stride_v_tok + h * stride_v_head + src,
                            value_cache_ptr + dst, value_scale_ptr + sdst, mask, g_ok, amax_div, global_scale)
    else:
        h = tl.arange(0, BLOCK_H)
        h_ok = h < num_kv_heads
        d = tl.arange(0, BLOCK_D)
        mask = h_ok[:, None] & (d[None, :] < HEAD_DIM)
        dst = c_row + h[:, None] * stride_c_head + d[None, :]
        sdst = s_row + h * stride_s_head
        _quantize_fp8_row(key_ptr + tok * stride_k_tok + h[:, None] * stride_k_head + d[None, :],
                          key_cache_ptr + dst, key_scale_ptr + sdst, mask, h_ok)
        _quantize_fp8_row(value_ptr + tok * stride_v_tok + h[:, None] * stride_v_head + d[None, :],
                          value_cache_ptr + dst, value_scale_ptr + sdst, mask, h_ok)


# ----------------------------------------------------------------------------- attention

@triton.jit
def _locate(cu_query_lens_ptr, seq_lens_ptr, num_seqs, num_splits,
            GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
            SPLIT: tl.constexpr):
    """This program's rows and KV tile range (the prologue of triton_paged's kernel)."""
    q_block_idx = tl.program_id(0)
    seq = _find_seq(cu_query_lens_ptr, num_seqs, q_block_idx, BLOCK_Q)
    q_start = tl.load(cu_query_lens_ptr + seq)
    q_len = tl.load(cu_query_lens_ptr + seq + 1) - q_start
    q_block_local = q_block_idx - (q_start // BLOCK_Q + seq)
    spare = q_block_local * BLOCK_Q >= q_len  # a spare q block (the grid is an upper bound)
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_block_local * BLOCK_Q + offs_m // GROUP
    head = tl.program_id(1) * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    tok = (q_start + q_idx).to(tl.int64)
    kv_end = tl.minimum(seq_len, context_len + (q_block_local + 1) * BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    if SPLIT:
        tiles_per_split = tl.cdiv(num_tiles, num_splits)
        tile_lo = tl.program_id(2) * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    else:
        tile_lo = num_tiles * 0
        tile_hi = num_tiles
    return spare, seq, tok, head, row_ok, context_len + q_idx, kv_end, tile_lo, tile_hi


@triton.jit
def _load_q16(q_ptr, tok, head, row_ok, cols, col_ok, stride_q_tok, stride_q_head):
    """Q rows at the given head_dim columns as float16 (clamped to its finite range)."""
    q = tl.load(q_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    return tl.minimum(tl.maximum(q, -_FP16_MAX), _FP16_MAX).to(tl.float16)


@triton.jit
def _softmax_step(s, offs_n, n_ok, q_pos, m_i, l_i):
    """Online softmax over one tile of base-2 scores: returns (p, alpha, m_new, l_new)."""
    visible = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row may see no key of this tile (split ranges, causal edge): keep exp2 away from -inf - -inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _store_rows(acc, cols, col_ok, factor, l_i, m_i, tok, head, row_ok, num_heads, out_ptr, part_acc_ptr,
                part_m_ptr, part_l_ptr, num_splits, stride_o_tok, stride_o_head,
                HEAD_DIM_PAD: tl.constexpr, SPLIT: tl.constexpr, STORE_ML: tl.constexpr):
    """Columns `cols` of the rows' result times `factor`: the normalized output, or this split's
    unnormalized partial (acc, and with STORE_ML the running max and denominator)."""
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT:
        ml = (tok * num_heads + head) * num_splits + tl.program_id(2)  # partials: [T, Hq, S(, D_PAD)]
        if STORE_ML:
            tl.store(part_m_ptr + ml, m_i, mask=row_ok)
            tl.store(part_l_ptr + ml, l_i, mask=row_ok)
        tl.store(part_acc_ptr + ml[:, None] * HEAD_DIM_PAD + cols[None, :], acc * factor, mask=mask)
    else:
        out = acc * (factor / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
        tl.store(out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + cols[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["sm_scale_log2", "num_seqs", "num_splits"])
def _paged_attention_fp8_kernel(
    out_ptr, q_ptr, key_cache_ptr, value_cache_ptr, key_scale_ptr, value_scale_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr, cu_query_lens_ptr, seq_lens_ptr, block_tables_ptr,
    sm_scale_log2, num_seqs, num_splits,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_c_block, stride_c_slot, stride_c_head, stride_s_block, stride_s_slot, stride_s_head, stride_bt_seq,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
):
    spare, seq, tok, head, row_ok, q_pos, kv_end, tile_lo, tile_hi = _locate(
        cu_query_lens_ptr, seq_lens_ptr, num_seqs, num_splits, GROUP, BLOCK_M, BLOCK_Q, BLOCK_N, SPLIT)
    if spare:
        return
    kv_head = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    q = _load_q16(q_ptr, tok, head, row_ok, offs_d, d_ok, stride_q_tok, stride_q_head)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_base = key_cache_ptr + kv_head * stride_c_head
    v_base = value_cache_ptr + kv_head * stride_c_head
    ks_base = key_scale_ptr + kv_head * stride_s_head
    vs_base = value_scale_ptr + kv_head * stride_s_head
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        block_ids = tl.load(table + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        kv_off = block_ids * stride_c_block + (offs_n % BLOCK_SIZE) * stride_c_slot
        s_off = block_ids * stride_s_block + (offs_n % BLOCK_SIZE) * stride_s_slot
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float16)
        k_scale = tl.load(ks_base + s_off, mask=n_ok, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * (k_scale * sm_scale_log2)[None, :]
        p, alpha, m_i, l_i = _softmax_step(s, offs_n, n_ok, q_pos, m_i, l_i)
        v = tl.load(v_base + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float16)
        v_scale = tl.load(vs_base + s_off, mask=n_ok, other=0.0).to(tl.float32)
        # Fold V's row scales into P, relative to the tile's largest so P * scale stays in [0, 1].
        v_max = tl.maximum(tl.max(v_scale, 0), 1e-30)
        pv = (p * (v_scale / v_max)[None, :]).to(tl.float16)
        acc = acc * alpha[:, None] + tl.dot(pv, v) * v_max
    _store_rows(acc, offs_d, d_ok, 1.0, l_i, m_i, tok, head, row_ok, tl.num_programs(1) * GROUP, out_ptr,
                part_acc_ptr, part_m_ptr, part_l_ptr, num_splits, stride_o_tok, stride_o_head,
                HEAD_DIM_PAD, SPLIT, True)


@triton.jit
def _nibble_pair(w, K: tl.constexpr):
    """uint32 words of 8 e2m1 codes -> float16 (code * 2^-14) of nibbles K and K + 4 of each word.

    Nibble (s, e1, e0, m) goes to float16 bits 15 (sign), 11..10 (exponent) and 9 (mantissa):
    exponent e >= 1 reads 2^(e - 15) (1 + m/2) = e2m1 * 2^-14, e == 0 the subnormal m * 2^-15.
    """
    if K == 3:
        o = ((w >> 3) & 0x0E000E00) | (w & 0x80008000)
    else:
        o = ((w << (9 - 4 * K)) & 0x0E000E00) | ((w << (12 - 4 * K)) & 0x80008000)
    lo = (o & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    hi = (o >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def _nvfp4_tile(word_ptrs, scale_ptrs, mask, scale_mask):
    """[N, W] words and their group scales (gathered per word) -> 8 float16 [N, W] tiles; tile k
    holds elements 8 j + k, each value * 2^-14 / global_scale (exact: see the module docstring)."""
    w = tl.load(word_ptrs, mask=mask, other=0).to(tl.uint32, bitcast=True)
    sc = tl.load(scale_ptrs, mask=scale_mask, other=0.0).to(tl.float16)
    e0, e4 = _nibble_pair(w, 0)
    e1, e5 = _nibble_pair(w, 1)
    e2, e6 = _nibble_pair(w, 2)
    e3, e7 = _nibble_pair(w, 3)
    return e0 * sc, e1 * sc, e2 * sc, e3 * sc, e4 * sc, e5 * sc, e6 * sc, e7 * sc


@triton.jit(do_not_specialize=["sm_scale_log2", "v_factor", "num_seqs", "num_splits"])
def _paged_attention_nvfp4_kernel(
    out_ptr, q_ptr, key_words_ptr, value_words_ptr, key_scale_ptr, value_scale_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr, cu_query_lens_ptr, seq_lens_ptr, block_tables_ptr,
    sm_scale_log2, v_factor, num_seqs, num_splits,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_c_block, stride_c_slot, stride_c_head, stride_s_block, stride_s_slot, stride_s_head, stride_bt_seq,
    GROUP: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, WORDS: tl.constexpr, WORDS_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
):
    spare, seq, tok, head, row_ok, q_pos, kv_end, tile_lo, tile_hi = _locate(
        cu_query_lens_ptr, seq_lens_ptr, num_seqs, num_splits, GROUP, BLOCK_M, BLOCK_Q, BLOCK_N, SPLIT)
    if spare:
        return
    kv_head = tl.program_id(1)
    j = tl.arange(0, WORDS_PAD)  # word j of a (token, head) holds elements 8 j .. 8 j + 7
    j_ok = j < WORDS
    q0 = _load_q16(q_ptr, tok, head, row_ok, 8 * j + 0, j_ok, stride_q_tok, stride_q_head)
    q1 = _load_q16(q_ptr, tok, head, row_ok, 8 * j + 1, j_ok, stride_q_tok, stride_q_head)
    q2 = _load_q16(q_ptr, tok, head, row_ok, 8 * j + 2, j_ok, stride_q_tok, stride_q_head)
    q3 = _load_q16(q_ptr, tok, head, row_ok, 8 * j + 3, j_ok, stride_q_tok, stride_q_head)
    q4 = _load_q16(q_ptr, tok, head, row_ok, 8 * j + 4, j_ok, stride_q_tok, stride_q_head)
    q5 = _load_q16(q_ptr, tok, head, row_ok, 8 * j + 5, j_ok, stride_q_tok, stride_q_head)
    q6 = _load_q16(q_ptr, tok, head, row_ok, 8 * j + 6, j_ok, stride_q_tok, stride_q_head)
    q7 = _load_q16(q_ptr, tok, head, row_ok, 8 * j + 7, j_ok, stride_q_tok, stride_q_head)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    a0 = tl.zeros([BLOCK_M, WORDS_PAD], tl.float32)
    a1 = tl.zeros([BLOCK_M, WORDS_PAD], tl.float32)
    a2 = tl.zeros([BLOCK_M, WORDS_PAD], tl.float32)
    a3 = tl.zeros([BLOCK_M, WORDS_PAD], tl.float32)
    a4 = tl.zeros([BLOCK_M, WORDS_PAD], tl.float32)
    a5 = tl.zeros([BLOCK_M, WORDS_PAD], tl.float32)
    a6 = tl.zeros([BLOCK_M, WORDS_PAD], tl.float32)
    a7 = tl.zeros([BLOCK_M, WORDS_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_base = key_words_ptr + kv_head * stride_c_head
    v_base = value_words_ptr + kv_head * stride_c_head
    ks_base = key_scale_ptr + kv_head * stride_s_head + j // 2  # a scale group covers 2 words
    vs_base = value_scale_ptr + kv_head * stride_s_head + j // 2
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        block_ids = tl.load(table + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        kv_off = (block_ids * stride_c_block + (offs_n % BLOCK_SIZE) * stride_c_slot)[:, None] + j[None, :]
        s_off = (block_ids * stride_s_block + (offs_n % BLOCK_SIZE) * stride_s_slot)[:, None]
        w_mask = n_ok[:, None] & j_ok[None, :]
        k0, k1, k2, k3, k4, k5, k6, k7 = _nvfp4_tile(k_base + kv_off, ks_base[None, :] + s_off, w_mask, w_mask)
        s = tl.dot(q0, tl.trans(k0))
        s = tl.dot(q1, tl.trans(k1), s)
        s = tl.dot(q2, tl.trans(k2), s)
        s = tl.dot(q3, tl.trans(k3), s)
        s = tl.dot(q4, tl.trans(k4), s)
        s = tl.dot(q5, tl.trans(k5), s)
        s = tl.dot(q6, tl.trans(k6), s)
        s = tl.dot(q7, tl.trans(k7), s) * sm_scale_log2
        p, alpha, m_i, l_i = _softmax_step(s, offs_n, n_ok, q_pos, m_i, l_i)
        p16 = p.to(tl.float16)
        v0, v1, v2, v3, v4, v5, v6, v7 = _nvfp4_tile(v_base + kv_off, vs_base[None, :] + s_off, w_mask, w_mask)
        a0 = tl.dot(p16, v0, a0 * alpha[:, None])
        a1 = tl.dot(p16, v1, a1 * alpha[:, None])
        a2 = tl.dot(p16, v2, a2 * alpha[:, None])
        a3 = tl.dot(p16, v3, a3 * alpha[:, None])
        a4 = tl.dot(p16, v4, a4 * alpha[:, None])
        a5 = tl.dot(p16, v5, a5 * alpha[:, None])
        a6 = tl.dot(p16, v6, a6 * alpha[:, None])
        a7 = tl.dot(p16, v7, a7 * alpha[:, None])
    num_heads = tl.num_programs(1) * GROUP
    _store_rows(a0, 8 * j + 0, j_ok, v_factor, l_i, m_i, tok, head, row_ok, num_heads, out_ptr, part_acc_ptr,
                part_m_ptr, part_l_ptr, num_splits, stride_o_tok, stride_o_head, HEAD_DIM_PAD, SPLIT, True)
    _store_rows(a1, 8 * j + 1, j_ok, v_factor, l_i, m_i, tok, head, row_ok, num_heads, out_ptr, part_acc_ptr,
                part_m_ptr, part_l_ptr, num_splits, stride_o_tok, stride_o_head, HEAD_DIM_PAD, SPLIT, False)
    _store_rows(a2, 8 * j + 2, j_ok, v_factor, l_i, m_i, tok, head, row_ok, num_heads, out_ptr, part_acc_ptr,
                part_m_ptr, part_l_ptr, num_splits, stride_o_tok, stride_o_head, HEAD_DIM_PAD, SPLIT, False)
    _store_rows(a3, 8 * j + 3, j_ok, v_factor, l_i, m_i, tok, head, row_ok, num_heads, out_ptr, part_acc_ptr,
                part_m_ptr, part_l_ptr, num_splits, stride_o_tok, stride_o_head, HEAD_DIM_PAD, SPLIT, False)
    _store_rows(a4, 8 * j + 4, j_ok, v_factor, l_i, m_i, tok, head, row_ok, num_heads, out_ptr, part_acc_ptr,
                part_m_ptr, part_l_ptr, num_splits, stride_o_tok, stride_o_head, HEAD_DIM_PAD, SPLIT, False)
    _store_rows(a5, 8 * j + 5, j_ok, v_factor, l_i, m_i, tok, head, row_ok, num_heads, out_ptr, part_acc_ptr,
                part_m_ptr, part_l_ptr, num_splits, stride_o_tok, stride_o_head, HEAD_DIM_PAD, SPLIT, False)
    _store_rows(a6, 8 * j + 6, j_ok, v_factor, l_i, m_i, tok, head, row_ok, num_heads, out_ptr, part_acc_ptr,
                part_m_ptr, part_l_ptr, num_splits, stride_o_tok, stride_o_head, HEAD_DIM_PAD, SPLIT, False)
    _store_rows(a7, 8 * j + 7, j_ok, v_factor, l_i, m_i, tok, head, row_ok, num_heads, out_ptr, part_acc_ptr,
                part_m_ptr, part_l_ptr, num_splits, stride_o_tok, stride_o_head, HEAD_DIM_PAD, SPLIT, False)


# ----------------------------------------------------------------------------- host side

def _check(fmt: KVFormat, cache: LayerKVCache, num_kv_heads: int, head_dim: int) -> None:
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


def reshape_and_cache_quant(key: torch.Tensor, value: torch.Tensor, cache: LayerKVCache, fmt: KVFormat,
                            slot_mapping: torch.Tensor) -> None:
    """Quantize key/value [num_tokens, num_kv_heads, head_dim] and store them (and their scales) at
    their slots; bit-identical to `kv.quant.write_kv`. A negative slot (padding token) is skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    _check(fmt, cache, num_kv_heads, head_dim)
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value need a contiguous last (head_dim) dimension")
    if num_tokens == 0:
        return
    nvfp4 = fmt.name == "nvfp4"
    groups = fmt.num_scale_groups(head_dim)
    kc, vc, ks, vs = cache.key, cache.value, cache.key_scale, cache.value_scale
    block_h = triton.next_power_of_2(num_kv_heads)
    # nvfp4: one program per (token, head) on 2-D [groups, 8] tiles. A first version took all heads
    # at once on 3-D [heads, groups, 8] tiles; it was exact in the interpreter and bit-exact on the
    # H200 with 2 and 4 heads, but the H200 tests that write 8 heads failed (suspected, unconfirmed).
    _write_kv_quant_kernel[(num_tokens, num_kv_heads if nvfp4 else 1)](
        key, value, kc, vc, ks, vs, slot_mapping,
        E2M1_MAX * fmt.global_scale, fmt.global_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
        num_kv_heads,
        NVFP4=nvfp4, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(head_dim),
        NUM_GROUPS=groups, BLOCK_G=triton.next_power_of_2(groups), BLOCK_SIZE=kc.shape[1],
        num_warps=1 if nvfp4 or block_h * head_dim < 2048 else 4,
    )


def choose_num_splits_quant(num_seqs: int, max_query_len: int, max_seq_len: int, num_kv_heads: int,
                            block_q: int, num_sms: int) -> int:
    """Split-KV factor for the quantized kernels: about 4 waves of programs.

    A quantized tile carries 2-3.5x fewer bytes than a bf16 one, so each program has less memory
    in flight; more programs per SM keep the loads coming. Host ints only (CUDA-graph safe).
    """
    programs = num_seqs * triton.cdiv(max(max_query_len, 1), block_q) * num_kv_heads
    by_length = max_seq_len // MIN_KEYS_PER_SPLIT
    return max(1, min(triton.cdiv(4 * num_sms, programs), by_length, MAX_SPLITS))


def quant_attention_config(max_query_len: int, group: int, head_dim: int, name: str) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): triton_paged's tiles, measured on the H200.

    Decode (Hq/Hkv/D = 32/8/128, batch 32, 32k context; bench/kv_quant_gpu.py's sweep): fp8 with
    4 warps 1.60 ms, 8 warps 2.61 ms; nvfp4 3.15 ms with 2 stages, 3.23 ms with 3. The 64-row
    prefill tiles spill registers with 4 warps in both formats (ptxas, sm_90), so they take 8.
    """
    block_m, block_n, num_warps, num_stages = attention_config(max_query_len, group, head_dim, torch.float16)
    if block_m >= 64:
        num_warps = 8
    elif name == "nvfp4":
        num_stages = 2
    return block_m, block_n, num_warps, num_stages


def paged_attention_quant(q: torch.Tensor, cache: LayerKVCache, fmt: KVFormat, cu_query_lens: torch.Tensor,
                          seq_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int,
                          max_seq_len: int, scale: float, out: torch.Tensor | None = None,
                          num_splits: int | None = None, block_n: int | None = None,
                          num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """`triton_paged.paged_attention` over a quantized cache (fp8 or nvfp4, already written).

    q: [num_tokens, num_heads, head_dim]; cache: LayerKVCache in `fmt`'s layout (spec.py).
    Returns out [num_tokens, num_heads, head_dim] in q's dtype; padding rows are left unwritten.
    block_n / num_warps / num_stages override the tile configuration (benchmarks).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = cache.key.shape[2]
    _check(fmt, cache, num_kv_heads, head_dim)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if q.stride(-1) != 1:
        raise ValueError("q needs a contiguous last (head_dim) dimension")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = cu_query_lens.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_m, bn, warps, stages = quant_attention_config(max_query_len, group, head_dim, fmt.name)
    bn, num_warps, num_stages = block_n or bn, num_warps or warps, num_stages or stages
    block_q = block_m // group
    head_dim_pad = triton.next_power_of_2(head_dim)
    if num_splits is None:
        num_splits = choose_num_splits_quant(num_seqs, max_query_len, max_seq_len, num_kv_heads, block_q,
                                             _num_sms(q.device))
    split = num_splits > 1
    if split:
        part_m = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_tokens, num_heads, num_splits, head_dim_pad), dtype=torch.float32,
                               device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    kc, vc, ks = cache.key, cache.value, cache.key_scale
    common = (part_acc, part_m, part_l, cu_query_lens, seq_lens, block_tables)
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1))
    meta = dict(GROUP=group, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=kc.shape[1], BLOCK_M=block_m, BLOCK_Q=block_q,
                BLOCK_N=bn, SPLIT=split, num_warps=num_warps, num_stages=num_stages)
    if fmt.name == "fp8":
        _paged_attention_fp8_kernel[grid](
            out, q, kc, vc, ks, cache.value_scale, *common, scale * LOG2E, num_seqs, num_splits, *strides,
            kc.stride(0), kc.stride(1), kc.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
            block_tables.stride(0), HEAD_DIM=head_dim, **meta)
    else:
        # Words of 8 codes: the byte rows are 16-byte multiples (head_dim % 16 == 0), so the view is exact.
        kw, vw = kc.view(torch.int32), vc.view(torch.int32)
        words = head_dim // 8
        const = NVFP4_DECODE * fmt.global_scale
        _paged_attention_nvfp4_kernel[grid](
            out, q, kw, vw, ks, cache.value_scale, *common, scale * LOG2E * const, const, num_seqs, num_splits,
            *strides, kw.stride(0), kw.stride(1), kw.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
            block_tables.stride(0), WORDS=words, WORDS_PAD=max(16, triton.next_power_of_2(words)), **meta)
    if split:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            out, part_acc, part_m, part_l, cu_query_lens, num_seqs, num_splits,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, SPLITS_PAD=triton.next_power_of_2(num_splits),
            num_warps=4,
        )
    return out
