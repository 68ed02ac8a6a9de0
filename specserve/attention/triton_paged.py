"""Triton paged attention (oracle: torch_ref.py). A program owns one q block (BLOCK_Q tokens x the
GROUP query heads of one KV head) of one sequence; sequence b owns the q blocks from
`cu_query_lens[b] // BLOCK_Q + b`, found by binary search, so the grid depends on host shapes only.
Split-KV: each program takes one of `num_splits` KV ranges and writes an fp32 partial (acc, m, l); a
split with no tile stores (m=-inf, l=0) but not its acc. Softmax statistics are fp32, in base 2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.attention.launch_sizes import MAX_SPLITS, MIN_KEYS_PER_SPLIT, SMALL_QUERY_MAX
from specserve.attention.triton_kv_write import _check_cache
from specserve.kernels.device import num_sms
from specserve.kernels.pdl import pdl_prologue, use_pdl

LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(cu_query_lens_ptr, num_seqs, q_block_idx, BLOCK_Q: tl.constexpr):
    """Largest b with cu_query_lens[b] // BLOCK_Q + b <= q_block_idx (starts strictly increase)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_query_lens_ptr + mid) // BLOCK_Q + mid
        if start <= q_block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# stride_bt_seq is not specialized: tables as wide as the prompt would compile a variant mid-serving.
@triton.jit(do_not_specialize=["sm_scale_log2", "num_seqs", "num_splits", "stride_bt_seq"])
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    cu_query_lens_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    tree_mask_ptr,
    sm_scale_log2,
    num_seqs,
    num_splits,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_bt_seq,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TREE: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    # Before the PDL wait: batch metadata only.
    q_block_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP

    seq = _find_seq(cu_query_lens_ptr, num_seqs, q_block_idx, BLOCK_Q)  # in [0, num_seqs)
    q_start = tl.load(cu_query_lens_ptr + seq)
    q_len = tl.load(cu_query_lens_ptr + seq + 1) - q_start
    q_block_local = q_block_idx - (q_start // BLOCK_Q + seq)
    live = q_block_local * BLOCK_Q < q_len  # else a spare q block (the grid is an upper bound)
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    kv_end = tl.minimum(seq_len, context_len + (q_block_local + 1) * BLOCK_Q)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    if SPLIT:
        tiles_per_split = tl.cdiv(num_tiles, num_splits)
        tile_lo = split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    else:
        tile_lo = 0
        tile_hi = num_tiles
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    first_n = tile_lo * BLOCK_N + tl.arange(0, BLOCK_N)
    first_ids = tl.load(table + first_n // BLOCK_SIZE, mask=(first_n < kv_end) & live, other=0).to(tl.int64)

    pdl_prologue(USE_PDL)
    if not live:
        return

    # Row m is query token q_block_local * BLOCK_Q + m // GROUP, query head kv_head * GROUP + m % GROUP.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_idx = q_block_local * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    d_ok = offs_d < HEAD_DIM
    tok = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q_pos = context_len + q_idx  # key j is visible to this row iff j <= q_pos
    if TREE:  # and, within the query, iff its bit is set in the row's mask (-1: every bit)
        tree_bits = tl.load(tree_mask_ptr + tok, mask=row_ok, other=-1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    k_base = key_cache_ptr + kv_head * stride_c_head
    v_base = value_cache_ptr + kv_head * stride_c_head
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        block_ids = tl.load(table + offs_n // BLOCK_SIZE, mask=n_ok & (tile != tile_lo), other=0).to(tl.int64)
        block_ids = tl.where(tile == tile_lo, first_ids, block_ids)
        kv_off = block_ids * stride_c_block + (offs_n % BLOCK_SIZE) * stride_c_slot
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * sm_scale_log2
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if TREE:
            rel = tl.minimum(tl.maximum(offs_n - context_len, 0), 62).to(tl.int64)
            bit = (tree_bits[:, None] >> rel[None, :]) & 1
            visible = visible & ((offs_n[None, :] < context_len) | (bit != 0))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row may see no key of this tile (split ranges, causal edge): keep exp2 away from -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_ptrs = out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
    out_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        ml = (tok * num_heads + head) * num_splits + split  # partials are [T, Hq, S(, D_PAD)] contiguous
        tl.store(part_m_ptr + ml, m_i, mask=row_ok)
        tl.store(part_l_ptr + ml, l_i, mask=row_ok)
        tl.store(
            part_acc_ptr + ml[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=row_ok[:, None] & (tile_lo < tile_hi)
        )
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["num_seqs", "num_splits"])
def _reduce_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    cu_query_lens_ptr,
    num_seqs,
    num_splits,
    stride_o_tok,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_tokens = tl.load(cu_query_lens_ptr + num_seqs)  # batch metadata: safe before the PDL wait
    pdl_prologue(USE_PDL)  # the partials only after it; every program waits before it may return
    if tok >= num_tokens:  # padding token: no partials were written
        return
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_splits
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    base = (tok * tl.num_programs(1) + head) * num_splits
    m = tl.load(part_m_ptr + base + s, mask=s_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + base + s, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty splits weigh 0
    denom = tl.sum(w * l, 0)
    has = s_ok & (m > float("-inf"))  # an empty split's acc may be unwritten: never read it
    acc = tl.load(part_acc_ptr + (base + s)[:, None] * HEAD_DIM_PAD + offs_d[None, :], mask=has[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(
        out_ptr + tok * stride_o_tok + head * stride_o_head + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def attention_config(max_query_len: int, group: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): small queries in one q block, prefill 64-row blocks."""
    min_m = max(16, triton.next_power_of_2(group))
    if max_query_len <= SMALL_QUERY_MAX and max_query_len * group <= 128:
        block_m = max(min_m, triton.next_power_of_2(max_query_len * group))
        num_stages = 3
    else:
        block_m = max(min_m, 64)
        num_stages = 2
    bn = 64
    if dtype == torch.float32 or triton.next_power_of_2(head_dim) > 128:
        bn, num_stages = 32, min(num_stages, 2)
    return block_m, bn, 8 if block_m >= 128 else 4, num_stages


def choose_num_splits(
    num_seqs: int, max_query_len: int, max_seq_len: int, num_kv_heads: int, block_q: int, num_sms: int
) -> int:
    """KV ranges per (q block, kv head): ~2 waves of SMs. Host ints only (CUDA-graph safe)."""
    programs = num_seqs * triton.cdiv(max(max_query_len, 1), block_q) * num_kv_heads
    if programs >= num_sms:
        return 1
    by_length = max_seq_len // MIN_KEYS_PER_SPLIT
    return max(1, min(triton.cdiv(2 * num_sms, programs), by_length, MAX_SPLITS))


def check_q(q: torch.Tensor, num_kv_heads: int) -> int:
    """The GQA group size of q [num_tokens, num_heads, head_dim] over num_kv_heads."""
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")
    if q.stride(-1) != 1:
        raise ValueError("q needs a contiguous last (head_dim) dimension")
    return q.shape[1] // num_kv_heads


def split_partials(q: torch.Tensor, num_splits: int, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fp32 split-KV partials (acc [T, Hq, S, D_PAD], m, l [T, Hq, S]); (out,) * 3 when not split."""
    if num_splits == 1:
        return out, out, out
    num_tokens, num_heads, head_dim = q.shape
    part_m = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
    acc_shape = (num_tokens, num_heads, num_splits, triton.next_power_of_2(head_dim))
    return torch.empty(acc_shape, dtype=torch.float32, device=q.device), part_m, torch.empty_like(part_m)


def reduce_splits(
    out: torch.Tensor, partials: tuple[torch.Tensor, ...], cu_query_lens: torch.Tensor, pdl: bool = False
) -> None:
    """Combine the split-KV partials into out [num_tokens, num_heads, head_dim]."""
    num_tokens, num_heads, head_dim = out.shape
    num_splits = partials[1].shape[2]
    _reduce_splits_kernel[(num_tokens, num_heads)](
        *(out, *partials, cu_query_lens, cu_query_lens.shape[0] - 1, num_splits, *out.stride()[:2]),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        num_warps=4,
        USE_PDL=pdl,
        launch_pdl=pdl,
    )


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu_query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over the paged caches [blocks, block_size, Hkv, D] (already
    written); max_query_len / max_seq_len are host upper bounds. Padding rows are left unwritten.
    tree_mask: [T] int64 draft-tree rows' bitmasks (AttentionMetadata.tree_mask)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    _check_cache(key_cache, value_cache, num_kv_heads, head_dim)
    group = check_q(q, num_kv_heads)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    num_seqs = cu_query_lens.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_m, block_n, num_warps, num_stages = attention_config(max_query_len, group, head_dim, q.dtype)
    block_q = block_m // group
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, max_query_len, max_seq_len, num_kv_heads, block_q, num_sms(q.device))
    partials = split_partials(q, num_splits, out)
    pdl = use_pdl(q)
    _paged_attention_kernel[(num_tokens // block_q + num_seqs, num_kv_heads, num_splits)](
        *(out, q, key_cache, value_cache, *partials, cu_query_lens, seq_lens, block_tables, tree_mask),
        *(scale * LOG2E, num_seqs, num_splits, *q.stride()[:2], *out.stride()[:2], *key_cache.stride()[:3]),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        SPLIT=num_splits > 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        TREE=tree_mask is not None,
        num_warps=num_warps,
        num_stages=num_stages,
        USE_PDL=pdl,
        launch_pdl=pdl,
    )
    if num_splits > 1:
        reduce_splits(out, partials, cu_query_lens, pdl)
    return out
