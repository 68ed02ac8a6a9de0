"""fp8 (e4m3) paged attention (variant "v3"), structured like triton_paged's kernel.

A token's 2-byte scale is too small a load: the kernel loads SCALE_W adjacent heads' scales and keeps
its own (HEADS_FIRST grids share those L2 sectors). V is read as 16-bit units (the layout ldmatrix
transposes for P.V), giving two float16 tiles (columns 2c, 2c + 1). V scales multiply P per key as
v_scale / (the tile's largest), keeping P in [0, 1] in float16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention.triton_quant_common import (
    _load_q16,
    _locate,
    _softmax_init,
    _softmax_step,
    _tile_rows,
)
from specserve.kv.spec import LayerKVCache

# $2 = two units (bytes u0.lo, u0.hi, u1.lo, u1.hi); $0 = (u0.lo, u1.lo), $1 = (u0.hi, u1.hi) as float16.
_UNIT_PTX = tl.constexpr("""
{
.reg .b32 t;
.reg .b16 lo, hi;
prmt.b32 t, $2, 0, 0x3120;
mov.b32 {lo, hi}, t;
cvt.rn.f16x2.e4m3x2 $0, lo;
cvt.rn.f16x2.e4m3x2 $1, hi;
}
""")


@triton.jit
def _unit_halves(units, PTX: tl.constexpr):
    """uint16 units of two e4m3 values -> (low byte, high byte) as float16, exactly (NaN stays NaN)."""
    if PTX:
        e0, e1 = tl.inline_asm_elementwise(
            _UNIT_PTX, "=r,=r,r", [units], dtype=(tl.float16, tl.float16), is_pure=True, pack=2
        )
    else:  # Triton's interpreter runs no inline assembly
        e0 = (units & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        e1 = (units >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return e0, e1


@triton.jit
def _row_scales(scale_base, srow, pick, n_ok):
    """[N] float32 scales of this program's head: a [N, SCALE_W] vector load, one column kept."""
    sw = tl.load(scale_base[None, :] + srow[:, None], mask=n_ok[:, None], other=0.0)
    return tl.sum(tl.where(pick[None, :], sw.to(tl.float32), 0.0), 1)


@triton.jit(do_not_specialize=["sm_scale_log2", "num_seqs", "num_splits", "stride_bt_seq"])
def _paged_attention_fp8_kernel(
    out_ptr,
    q_ptr,
    key_cache_ptr,
    value_units_ptr,
    key_scale_ptr,
    value_scale_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    cu_query_lens_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    sm_scale_log2,
    num_seqs,
    num_splits,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_bt_seq,
    C_BLOCK: tl.constexpr,
    C_SLOT: tl.constexpr,
    C_HEAD: tl.constexpr,
    S_BLOCK: tl.constexpr,
    S_SLOT: tl.constexpr,
    S_HEAD: tl.constexpr,
    SCALE_W: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    PTX: tl.constexpr,
):
    kv_head, split, num_heads, spare, seq, tok, head, row_ok, q_pos, kv_end, tile_lo, tile_hi = _locate(
        cu_query_lens_ptr, seq_lens_ptr, num_seqs, num_splits, GROUP, HEADS_FIRST, BLOCK_M, BLOCK_Q, BLOCK_N, SPLIT
    )
    if spare:
        return
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    c = tl.arange(0, HEAD_DIM_PAD // 2)  # V unit c: elements 2c, 2c + 1
    c_ok = c < HEAD_DIM // 2
    q = _load_q16(q_ptr, tok, head, row_ok, offs_d, d_ok, stride_q_tok, stride_q_head)
    m_i, l_i = _softmax_init(BLOCK_M)
    a0 = tl.zeros([BLOCK_M, HEAD_DIM_PAD // 2], tl.float32)  # output columns 2c
    a1 = tl.zeros([BLOCK_M, HEAD_DIM_PAD // 2], tl.float32)  # output columns 2c + 1
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_base = key_cache_ptr + kv_head * C_HEAD
    v_base = value_units_ptr + kv_head * (C_HEAD // 2) + c[None, :]
    w = tl.arange(0, SCALE_W)
    w0 = (kv_head // SCALE_W) * SCALE_W
    pick = w == kv_head - w0
    ks_base = key_scale_ptr + (w0 + w) * S_HEAD
    vs_base = value_scale_ptr + (w0 + w) * S_HEAD
    for tile in range(tile_lo, tile_hi):
        offs_n, n_ok, block_ids, slot = _tile_rows(table, tile, kv_end, BLOCK_N, BLOCK_SIZE)
        row = block_ids * C_BLOCK + slot * C_SLOT  # bytes
        row16 = block_ids * (C_BLOCK // 2) + slot * (C_SLOT // 2)  # 16-bit units
        srow = block_ids * S_BLOCK + slot * S_SLOT
        k = tl.load(k_base + row[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        k_scale = _row_scales(ks_base, srow, pick, n_ok)
        s = tl.dot(q, tl.trans(k.to(tl.float16))) * (k_scale * sm_scale_log2)[None, :]
        p, alpha, m_i, l_i = _softmax_step(s, offs_n, n_ok, q_pos, m_i, l_i)
        units = tl.load(v_base + row16[:, None], mask=n_ok[:, None] & c_ok[None, :], other=0)
        v0, v1 = _unit_halves(units.to(tl.uint16, bitcast=True), PTX)
        v_scale = _row_scales(vs_base, srow, pick, n_ok)
        v_max = tl.maximum(tl.max(v_scale, 0), 1e-30)
        pv = (p * (v_scale / v_max)[None, :]).to(tl.float16)
        a0 = a0 * alpha[:, None] + tl.dot(pv, v0) * v_max
        a1 = a1 * alpha[:, None] + tl.dot(pv, v1) * v_max
    acc = tl.reshape(tl.join(a0, a1), [BLOCK_M, HEAD_DIM_PAD])  # (m, c, j) -> column 2c + j
    mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        ml = (tok * num_heads + head) * num_splits + split  # partials: [T, Hq, S(, D_PAD)]
        tl.store(part_m_ptr + ml, m_i, mask=row_ok)
        tl.store(part_l_ptr + ml, l_i, mask=row_ok)
        tl.store(part_acc_ptr + ml[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=mask)
    else:
        out = acc * (1.0 / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
        out_ptrs = out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


def scale_window(num_kv_heads: int, limit: int = 8) -> int:
    """Largest power of two <= limit that divides num_kv_heads: heads whose scales one load reads."""
    w = 1
    while w < limit and num_kv_heads % (2 * w) == 0:
        w *= 2
    return w


def fp8_operands(q: torch.Tensor, cache: LayerKVCache, scale_log2: float) -> tuple:
    """(kernel, (key, value, key_scale, value_scale), scalars, constexprs) for `triton_quant.launch`."""
    # head_dim is even (checked), so the int16 view of V is exact; the kernel halves its byte strides.
    caches = (cache.key, cache.value.view(torch.int16), cache.key_scale, cache.value_scale)
    extra = dict(SCALE_W=scale_window(cache.key.shape[2]) if cache.key_scale.stride(2) == 1 else 1, PTX=q.is_cuda)
    return _paged_attention_fp8_kernel, caches, (scale_log2,), extra
