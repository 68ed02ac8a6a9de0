"""The first quantized-KV attention kernels (variant "v1"), kept for comparison with v2.

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

Why they are slow (H200, batch 32 / 32k decode: fp8 1.6 ms, nvfp4 3.2 ms, bf16 1.17 ms; compiled
TTGIR for sm_90): the per-(token, head) scale loads are 1-2 byte gathers the software pipeliner
cannot turn into cp.async, so they stay synchronous in the loop, and their addresses need the
block ids in another layout, which the compiler reloads synchronously too: every tile waits on two
dependent global round trips. 186-239 registers per thread. See triton_quant.py for v2.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention.triton_quant_common import (
    NVFP4_DECODE,
    _fp8_accumulate,
    _fp8_scores,
    _load_q16,
    _load_q16_x4,
    _locate,
    _program,
    _pv4,
    _qk4,
    _softmax_init,
    _softmax_step,
    _store_rows,
    _store_rows4,
    _tile_rows,
    _zeros4,
)


@triton.jit(do_not_specialize=["sm_scale_log2", "num_seqs", "num_splits", "stride_bt_seq"])
def _paged_attention_fp8_kernel(
    out_ptr, q_ptr, key_cache_ptr, value_cache_ptr, key_scale_ptr, value_scale_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr, cu_query_lens_ptr, seq_lens_ptr, block_tables_ptr,
    sm_scale_log2, num_seqs, num_splits,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_c_block, stride_c_slot, stride_c_head, stride_s_block, stride_s_slot, stride_s_head, stride_bt_seq,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
):
    q_block_idx, kv_head, split, num_heads = _program(GROUP, False)
    spare, seq, tok, head, row_ok, q_pos, kv_end, tile_lo, tile_hi = _locate(
        cu_query_lens_ptr, seq_lens_ptr, num_seqs, num_splits, q_block_idx, kv_head, split,
        GROUP, BLOCK_M, BLOCK_Q, BLOCK_N, SPLIT)
    if spare:
        return
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    q = _load_q16(q_ptr, tok, head, row_ok, offs_d, d_ok, stride_q_tok, stride_q_head)
    m_i, l_i = _softmax_init(BLOCK_M)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_base = key_cache_ptr + kv_head * stride_c_head
    v_base = value_cache_ptr + kv_head * stride_c_head
    ks_base = key_scale_ptr + kv_head * stride_s_head
    vs_base = value_scale_ptr + kv_head * stride_s_head
    for tile in range(tile_lo, tile_hi):
        offs_n, n_ok, block_ids, slot = _tile_rows(table, tile, kv_end, BLOCK_N, BLOCK_SIZE)
        kv_off = block_ids * stride_c_block + slot * stride_c_slot
        s_off = block_ids * stride_s_block + slot * stride_s_slot
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float16)
        k_scale = tl.load(ks_base + s_off, mask=n_ok, other=0.0).to(tl.float32)
        s = _fp8_scores(q, k, k_scale, sm_scale_log2)
        p, alpha, m_i, l_i = _softmax_step(s, offs_n, n_ok, q_pos, m_i, l_i)
        v = tl.load(v_base + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float16)
        v_scale = tl.load(vs_base + s_off, mask=n_ok, other=0.0).to(tl.float32)
        acc = _fp8_accumulate(acc, alpha, p, v, v_scale)
    _store_rows(acc, offs_d, d_ok, 1.0, l_i, m_i, tok, head, row_ok, num_heads, split, out_ptr, part_acc_ptr,
                part_m_ptr, part_l_ptr, num_splits, stride_o_tok, stride_o_head, HEAD_DIM_PAD, SPLIT, True)


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


@triton.jit(do_not_specialize=["sm_scale_log2", "v_factor", "num_seqs", "num_splits", "stride_bt_seq"])
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
    q_block_idx, kv_head, split, num_heads = _program(GROUP, False)
    spare, seq, tok, head, row_ok, q_pos, kv_end, tile_lo, tile_hi = _locate(
        cu_query_lens_ptr, seq_lens_ptr, num_seqs, num_splits, q_block_idx, kv_head, split,
        GROUP, BLOCK_M, BLOCK_Q, BLOCK_N, SPLIT)
    if spare:
        return
    j = tl.arange(0, WORDS_PAD)  # word j of a (token, head) holds elements 8 j .. 8 j + 7
    j_ok = j < WORDS
    q0, q1, q2, q3 = _load_q16_x4(q_ptr, tok, head, row_ok, 8 * j, j_ok, stride_q_tok, stride_q_head)
    q4, q5, q6, q7 = _load_q16_x4(q_ptr, tok, head, row_ok, 8 * j + 4, j_ok, stride_q_tok, stride_q_head)
    m_i, l_i = _softmax_init(BLOCK_M)
    a0, a1, a2, a3 = _zeros4(BLOCK_M, WORDS_PAD)
    a4, a5, a6, a7 = _zeros4(BLOCK_M, WORDS_PAD)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_base = key_words_ptr + kv_head * stride_c_head
    v_base = value_words_ptr + kv_head * stride_c_head
    ks_base = key_scale_ptr + kv_head * stride_s_head + j // 2  # a scale group covers 2 words
    vs_base = value_scale_ptr + kv_head * stride_s_head + j // 2
    for tile in range(tile_lo, tile_hi):
        offs_n, n_ok, block_ids, slot = _tile_rows(table, tile, kv_end, BLOCK_N, BLOCK_SIZE)
        kv_off = (block_ids * stride_c_block + slot * stride_c_slot)[:, None] + j[None, :]
        s_off = (block_ids * stride_s_block + slot * stride_s_slot)[:, None]
        w_mask = n_ok[:, None] & j_ok[None, :]
        k0, k1, k2, k3, k4, k5, k6, k7 = _nvfp4_tile(k_base + kv_off, ks_base[None, :] + s_off, w_mask, w_mask)
        s = _qk4(q0, q1, q2, q3, k0, k1, k2, k3, None)
        s = _qk4(q4, q5, q6, q7, k4, k5, k6, k7, s) * sm_scale_log2
        p, alpha, m_i, l_i = _softmax_step(s, offs_n, n_ok, q_pos, m_i, l_i)
        p16 = p.to(tl.float16)
        v0, v1, v2, v3, v4, v5, v6, v7 = _nvfp4_tile(v_base + kv_off, vs_base[None, :] + s_off, w_mask, w_mask)
        a0, a1, a2, a3 = _pv4(p16, v0, v1, v2, v3, a0, a1, a2, a3, alpha)
        a4, a5, a6, a7 = _pv4(p16, v4, v5, v6, v7, a4, a5, a6, a7, alpha)
    _store_rows4(a0, a1, a2, a3, 8 * j, j_ok, v_factor, l_i, m_i, tok, head, row_ok, num_heads, split, out_ptr,
                 part_acc_ptr, part_m_ptr, part_l_ptr, num_splits, stride_o_tok, stride_o_head, HEAD_DIM_PAD, SPLIT,
                 True)
    _store_rows4(a4, a5, a6, a7, 8 * j + 4, j_ok, v_factor, l_i, m_i, tok, head, row_ok, num_heads, split, out_ptr,
                 part_acc_ptr, part_m_ptr, part_l_ptr, num_splits, stride_o_tok, stride_o_head, HEAD_DIM_PAD, SPLIT,
                 False)


def launch_v1(q: torch.Tensor, cache, fmt, out: torch.Tensor, common: tuple, grid_qblocks: int, num_splits: int,
              scale_log2: float, meta: dict) -> None:
    """The v1 kernel of fmt over the launch that `triton_quant.paged_attention_quant` prepared.

    common: (part_acc, part_m, part_l, cu_query_lens, seq_lens, block_tables); meta: GROUP, HEAD_DIM,
    HEAD_DIM_PAD, BLOCK_SIZE, BLOCK_M, BLOCK_Q, BLOCK_N, SPLIT, num_warps, num_stages.
    """
    num_seqs = common[3].shape[0] - 1
    block_tables = common[5]
    head_dim = meta.pop("HEAD_DIM")
    grid = (grid_qblocks, cache.key.shape[2], num_splits)
    kc, vc, ks = cache.key, cache.value, cache.key_scale
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1))
    if fmt.name == "fp8":
        _paged_attention_fp8_kernel[grid](
            out, q, kc, vc, ks, cache.value_scale, *common, scale_log2, num_seqs, num_splits, *strides,
            kc.stride(0), kc.stride(1), kc.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
            block_tables.stride(0), HEAD_DIM=head_dim, **meta)
    else:
        # Words of 8 codes: the byte rows are 16-byte multiples (head_dim % 16 == 0), so the view is exact.
        kw, vw = kc.view(torch.int32), vc.view(torch.int32)
        words = head_dim // 8
        const = NVFP4_DECODE * fmt.global_scale
        _paged_attention_nvfp4_kernel[grid](
            out, q, kw, vw, ks, cache.value_scale, *common, scale_log2 * const, const, num_seqs, num_splits,
            *strides, kw.stride(0), kw.stride(1), kw.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
            block_tables.stride(0), WORDS=words, WORDS_PAD=max(16, triton.next_power_of_2(words)), **meta)
