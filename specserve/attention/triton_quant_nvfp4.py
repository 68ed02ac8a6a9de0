"""nvfp4 paged attention (variants "v4" and "v7"), structured like triton_paged's kernel.

A cache row is head_dim / 2 bytes of e2m1 pairs plus head_dim / 16 e4m3 scales, read as 16-bit units
(unit c: elements 4c + j in nibble j; ldmatrix needs 16-bit tiles for P.V). Nibble j of every unit
decodes to a scaled float16 tile E_j: Q.K^T = sum_j Q_j.E_j^T, P.V into four accumulators. v7 adds
the `kernel_flags` FUSED_SCALE, OFFS32, ROWSUM_MMA, HALF_ROWS and K_PAIRS. The decoders' constant
(2^14 or 2^6) * global_scale goes into the score scale (K) and the output (V).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention import triton_dot_layout
from specserve.attention.triton_nvfp4_decode import E4M3_DECODE, _scaled_tiles
from specserve.attention.triton_quant_common import (
    NVFP4_DECODE,
    _load_q16,
    _locate,
    _pv4,
    _qk4,
    _softmax_init,
    _softmax_probs_scaled,
    _softmax_step,
    _tile_rows,
)
from specserve.kv.spec import KVFormat, LayerKVCache

LEAN_VARIANT = "v7"  # the variant with FUSED_SCALE, OFFS32, ROWSUM_MMA, HALF_ROWS and K_PAIRS
_INT32_MAX = 2**31 - 1


def offsets_fit_int32(*tensors: torch.Tensor) -> bool:
    """Whether every element offset into each tensor fits in int32 (OFFS32)."""
    return all(sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) <= _INT32_MAX for t in tensors)


def half_rows_apply(max_query_len: int, group: int, block_m: int) -> bool:
    """Whether no query row can sit in a q block's second half."""
    return max_query_len * group <= block_m // 2


def kernel_flags(
    variant: str, on_gpu: bool, offs32: bool, max_query_len: int, group: int, block_m: int, words_aligned: bool = True
) -> dict:
    """The nvfp4 kernel's variant constexprs (on_gpu False: the interpreter's plain Triton decoder)."""
    if variant not in ("v4", LEAN_VARIANT):
        raise ValueError(f"nvfp4 variant must be v4 or v7, got {variant!r}")
    lean = variant == LEAN_VARIANT
    return dict(
        DECODER=1 if on_gpu else 0,
        DOT_KWIDTH2=on_gpu,
        FUSED_SCALE=lean,
        OFFS32=lean and offs32,
        ROWSUM_MMA=lean,
        HALF_ROWS=lean and half_rows_apply(max_query_len, group, block_m),
        K_PAIRS=lean and words_aligned,
    )


triton_dot_layout.install()  # before the first compile of an opted-in kernel


@triton.jit
def _first_half_rows(p, alpha, m_new, first):
    """(p, alpha, m_new) with the rows outside `first` made constants, so LLVM drops their softmax."""
    return tl.where(first[:, None], p, 0.0), tl.where(first, alpha, 1.0), tl.where(first, m_new, 0.0)


def _kernel_name(specialization) -> str:
    """Kernels with DOT_KWIDTH2 get the name triton_dot_layout's hook retargets."""
    kw2 = specialization.constants.get("DOT_KWIDTH2")
    return "_paged_attention_nvfp4_kernel" + (triton_dot_layout.KWIDTH2_SUFFIX if kw2 else "")


@triton.jit(
    do_not_specialize=["sm_scale_log2", "v_factor", "num_seqs", "num_splits", "stride_bt_seq"], repr=_kernel_name
)
def _paged_attention_nvfp4_kernel(
    out_ptr,
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    key_scale_ptr,
    value_scale_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    cu_query_lens_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    sm_scale_log2,
    v_factor,
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
    QUADS: tl.constexpr,
    QUADS_PAD: tl.constexpr,
    GROUPS: tl.constexpr,
    G_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    DECODER: tl.constexpr,
    DOT_KWIDTH2: tl.constexpr,
    FUSED_SCALE: tl.constexpr,
    OFFS32: tl.constexpr,
    ROWSUM_MMA: tl.constexpr,
    HALF_ROWS: tl.constexpr,
    K_PAIRS: tl.constexpr,
):
    kv_head, split, num_heads, spare, seq, tok, head, row_ok, q_pos, kv_end, tile_lo, tile_hi = _locate(
        cu_query_lens_ptr, seq_lens_ptr, num_seqs, num_splits, GROUP, HEADS_FIRST, BLOCK_M, BLOCK_Q, BLOCK_N, SPLIT
    )
    if spare:
        return
    c = tl.arange(0, QUADS_PAD)  # unit c of a row: elements 4c .. 4c + 3
    c_ok = c < QUADS
    g = tl.arange(0, G_PAD)
    g_ok = g < GROUPS
    d = tl.arange(0, HEAD_DIM_PAD)
    q = _load_q16(q_ptr, tok, head, row_ok, d, d < 4 * QUADS, stride_q_tok, stride_q_head)
    if K_PAIRS:
        # K's columns in _decode_pairs's order: column c = 2a + b of Q_k is element 8a + 4 (k // 2) + 2b + k % 2.
        q = tl.permute(tl.reshape(q, [BLOCK_M, QUADS_PAD // 2, 2, 2, 2]), (0, 1, 3, 2, 4))  # [m, a, b, k // 2, k % 2]
        q_even, q_odd = tl.split(tl.reshape(q, [BLOCK_M, QUADS_PAD, 2, 2]))  # k = 0, 2 and k = 1, 3
        q0, q2 = tl.split(q_even)
        q1, q3 = tl.split(q_odd)
    else:
        q_lo, q_hi = tl.split(tl.reshape(q, [BLOCK_M, QUADS_PAD, 2, 2]))  # j = 0, 2 and j = 1, 3
        q0, q2 = tl.split(q_lo)
        q1, q3 = tl.split(q_hi)
    tl.static_assert(FUSED_SCALE or not ROWSUM_MMA, "ROWSUM_MMA needs FUSED_SCALE")
    tl.static_assert(FUSED_SCALE or not HALF_ROWS, "HALF_ROWS needs FUSED_SCALE")
    first = tl.arange(0, BLOCK_M) < BLOCK_M // 2  # HALF_ROWS: the rows that can be query rows
    m_i, l_i = _softmax_init(BLOCK_M)
    if ROWSUM_MMA:
        l_i = tl.zeros([BLOCK_M, 16], tl.float32)
    a0 = tl.zeros([BLOCK_M, QUADS_PAD], tl.float32)
    a1 = tl.zeros([BLOCK_M, QUADS_PAD], tl.float32)
    a2 = tl.zeros([BLOCK_M, QUADS_PAD], tl.float32)
    a3 = tl.zeros([BLOCK_M, QUADS_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_base = key_cache_ptr + kv_head * C_HEAD + c[None, :]
    a = tl.arange(0, QUADS_PAD // 2)  # K_PAIRS: word a of a row (units 2a, 2a + 1)
    a_ok = a < QUADS // 2
    kw_base = key_cache_ptr + kv_head * C_HEAD
    a_off = a[None, :]
    v_base = value_cache_ptr + kv_head * C_HEAD + c[None, :]
    ks_base = key_scale_ptr + kv_head * S_HEAD + g[None, :]
    vs_base = value_scale_ptr + kv_head * S_HEAD + g[None, :]
    # Tiles every row sees in full (keys <= the first row's position) take a loop without masks (pass
    # MASKED 0); only with unpadded rows (QUADS, GROUPS powers of two).
    tile_mid = tile_lo
    if QUADS == QUADS_PAD and GROUPS == G_PAD:
        tile_mid = tl.maximum(tile_lo, tl.minimum(tile_hi, (tl.min(q_pos, 0) + 1) // BLOCK_N))
    for MASKED in tl.static_range(2):
        if MASKED or (QUADS == QUADS_PAD and GROUPS == G_PAD):
            for tile in range(tile_mid if MASKED else tile_lo, tile_hi if MASKED else tile_mid):
                if MASKED:
                    offs_n, n_ok, block_ids, slot = _tile_rows(table, tile, kv_end, BLOCK_N, BLOCK_SIZE)
                else:
                    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
                    n_ok = offs_n < kv_end  # unused by the unmasked loads and softmax
                    if OFFS32 and BLOCK_N % BLOCK_SIZE == 0:
                        # The tile starts a cache block: no signed division of every position.
                        keys = tl.arange(0, BLOCK_N)
                        block_ids = tl.load(table + tile * (BLOCK_N // BLOCK_SIZE) + keys // BLOCK_SIZE)
                        slot = keys % BLOCK_SIZE
                    else:
                        block_ids = tl.load(table + offs_n // BLOCK_SIZE)
                        if not OFFS32:
                            block_ids = block_ids.to(tl.int64)
                        slot = offs_n % BLOCK_SIZE
                row = (block_ids * C_BLOCK + slot * C_SLOT)[:, None]
                srow = (block_ids * S_BLOCK + slot * S_SLOT)[:, None]
                mask = n_ok[:, None] & c_ok[None, :]
                s_mask = n_ok[:, None] & g_ok[None, :]
                if K_PAIRS:  # the same rows as 32-bit words (strides are even: rows are 4-byte aligned)
                    k_ptrs = (kw_base + row).to(tl.pointer_type(tl.int32)) + a_off
                    k_mask = n_ok[:, None] & a_ok[None, :]
                else:
                    k_ptrs = k_base + row
                    k_mask = mask
                k0, k1, k2, k3 = _scaled_tiles(
                    k_ptrs, ks_base + srow, k_mask, s_mask, BLOCK_N, QUADS_PAD, G_PAD, DECODER, MASKED, K_PAIRS
                )
                if FUSED_SCALE:
                    raw = _qk4(q0, q1, q2, q3, k0, k1, k2, k3, None)
                    if HALF_ROWS:
                        raw = tl.where(first[:, None], raw, 0.0)  # constants into the row max: its chain folds
                    p, alpha, m_i = _softmax_probs_scaled(raw, sm_scale_log2, offs_n, n_ok, q_pos, m_i, not MASKED)
                    if HALF_ROWS:
                        p, alpha, m_i = _first_half_rows(p, alpha, m_i, first)
                    if not ROWSUM_MMA:
                        l_i = l_i * alpha + tl.sum(p, 1)
                else:
                    s = _qk4(q0, q1, q2, q3, k0, k1, k2, k3, None) * sm_scale_log2
                    p, alpha, m_i, l_i = _softmax_step(s, offs_n, n_ok, q_pos, m_i, l_i, not MASKED)
                p16 = p.to(tl.float16)
                if ROWSUM_MMA:
                    # l_i [BLOCK_M, 16], every column the row sum: P.1 avoids tl.sum's cross-warp barriers.
                    l_i = tl.dot(p16, tl.full([BLOCK_N, 16], 1.0, tl.float16), l_i * alpha[:, None])
                v0, v1, v2, v3 = _scaled_tiles(
                    v_base + row, vs_base + srow, mask, s_mask, BLOCK_N, QUADS_PAD, G_PAD, DECODER, MASKED, False
                )
                a0, a1, a2, a3 = _pv4(p16, v0, v1, v2, v3, a0, a1, a2, a3, alpha)
    if ROWSUM_MMA:
        l_i = tl.max(l_i, 1)  # its columns are equal
    cols = 4 * c
    mask = row_ok[:, None] & c_ok[None, :]
    if SPLIT:
        ml = (tok * num_heads + head) * num_splits + split  # partials: [T, Hq, S(, D_PAD)]
        tl.store(part_m_ptr + ml, m_i, mask=row_ok)
        tl.store(part_l_ptr + ml, l_i, mask=row_ok)
        ptrs = part_acc_ptr + ml[:, None] * HEAD_DIM_PAD + cols[None, :]
        f = tl.full([BLOCK_M, 1], 1.0, tl.float32) * v_factor
    else:
        f = (v_factor / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
        ptrs = out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + cols[None, :]
    ty = ptrs.dtype.element_ty
    tl.store(ptrs, (a0 * f).to(ty), mask=mask)
    tl.store(ptrs + 1, (a1 * f).to(ty), mask=mask)
    tl.store(ptrs + 2, (a2 * f).to(ty), mask=mask)
    tl.store(ptrs + 3, (a3 * f).to(ty), mask=mask)


def nvfp4_operands(
    q: torch.Tensor, cache: LayerKVCache, fmt: KVFormat, scale_log2: float, meta: dict, variant: str, max_query_len: int
) -> tuple:
    """(kernel, (key, value, key_scale, value_scale), scalars, constexprs) for `triton_quant.launch`."""
    # 16-bit units: a row is head_dim / 2 bytes, an even count (head_dim % 16 == 0), so the view is exact.
    kc, vc = cache.key.view(torch.int16), cache.value.view(torch.int16)
    head_dim = meta.pop("HEAD_DIM")
    quads, groups = head_dim // 4, head_dim // 16
    offs32 = variant == LEAN_VARIANT and offsets_fit_int32(kc, cache.key_scale)
    aligned = kc.data_ptr() % 4 == 0
    flags = kernel_flags(variant, q.is_cuda, offs32, max_query_len, meta["GROUP"], meta["BLOCK_M"], aligned)
    const = (E4M3_DECODE if flags["DECODER"] == 1 else NVFP4_DECODE) * fmt.global_scale
    flags.update(QUADS=quads, QUADS_PAD=triton.next_power_of_2(quads), GROUPS=groups)
    flags.update(G_PAD=triton.next_power_of_2(groups))
    caches = (kc, vc, cache.key_scale, cache.value_scale)
    return _paged_attention_nvfp4_kernel, caches, (scale_log2 * const, const), flags
