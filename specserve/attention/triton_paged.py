"""Triton paged attention over the paged KV cache (the KV write: triton_kv_write.py).

The torch twin and test oracle is `attention/torch_ref.py`. Imported only when the Triton
backend is selected on CUDA (or under TRITON_INTERPRET=1 for debugging on the CPU).

Paged attention runs one kernel over the flat varlen batch (prefill chunks, prefix-hit prefill,
decode, k+1 verification all at once). A program owns one "q block" of one sequence and one KV
head: BLOCK_Q query tokens times the GROUP query heads that share that KV head, i.e. BLOCK_M =
BLOCK_Q * GROUP rows, so every K/V tile is loaded once per group (GQA) and fed to the tensor cores
as one [BLOCK_M, D] x [D, BLOCK_N] product. Sequence b owns the q blocks starting at
`cu_query_lens[b] // BLOCK_Q + b`; a program finds its sequence by binary search, so the grid
(`num_tokens // BLOCK_Q + num_seqs` q blocks) depends on host shapes only and no host sync or
per-sequence launch is needed: the launch is CUDA-graph capturable.

Split-KV (flash-decoding): when the batch alone gives too few programs to fill the SMs (decode at
batch 1 over a long context), each program also takes one of `num_splits` contiguous ranges of its
sequence's KV tiles and writes an unnormalized partial (acc, running max m, denominator l) in fp32;
`_reduce_splits_kernel`, a second launch, combines them. num_splits is a host upper bound (a CUDA
graph's is sized for max_model_len). Split programs with no KV tile store (m=-inf, l=0) but not
their acc, which the reduce reads only where m > -inf. Softmax statistics are fp32, in base 2.
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


# The block table's row stride (the widest table of the batch) is not specialized: Triton would compile
# a variant per stride class, and eager forwards with tables as wide as the prompt would meet a new
# one mid-serving.
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
    USE_PDL: tl.constexpr = False,
):
    # Before the PDL wait: only batch metadata (no kernel of the forward writes it; model/layers/
    # pdl.py): the sequence search, its query range and length, and the block ids of this program's
    # first KV tile, so that chain of dependent loads overlaps the previous kernel's tail. q, the
    # KV cache (the previous kernel just wrote the new tokens' K/V) and the partials only after it.
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

    # Keys any row of this q block can see: [0, kv_end).
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
    # The first tile's block ids (none for a spare block or a split with no tile: offs_n >= kv_end).
    first_n = tile_lo * BLOCK_N + tl.arange(0, BLOCK_N)
    first_ids = tl.load(table + first_n // BLOCK_SIZE, mask=(first_n < kv_end) & live, other=0).to(tl.int64)

    # Every program waits, spare ones included, before it returns (see kernels/pdl.py).
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

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    k_base = key_cache_ptr + kv_head * stride_c_head
    v_base = value_cache_ptr + kv_head * stride_c_head
    for tile in range(tile_lo, tile_hi):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_end
        # The first tile's ids were loaded before the wait; later tiles' here.
        block_ids = tl.load(table + offs_n // BLOCK_SIZE, mask=n_ok & (tile != tile_lo), other=0).to(tl.int64)
        block_ids = tl.where(tile == tile_lo, first_ids, block_ids)
        kv_off = block_ids * stride_c_block + (offs_n % BLOCK_SIZE) * stride_c_slot
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * sm_scale_log2
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_ok[None, :]
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
        # A split with no KV tile leaves its acc unwritten: the reduce reads acc only where m > -inf.
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


def attention_config(
    max_query_len: int, group: int, head_dim: int, dtype: torch.dtype, block_n: int | None = None
) -> tuple[int, int, int, int]:
    """Tile shape for the launch: (BLOCK_M, BLOCK_N, num_warps, num_stages).

    Decode and verify (a few tokens per sequence) put a whole sequence's query in one q block so its
    KV is streamed once; prefill uses 64-row q blocks. fp32 (tests) gets smaller K/V tiles for shared memory.
    """
    min_m = max(16, triton.next_power_of_2(group))
    head_dim_pad = triton.next_power_of_2(head_dim)
    if max_query_len <= SMALL_QUERY_MAX and max_query_len * group <= 128:
        block_m = max(min_m, triton.next_power_of_2(max_query_len * group))
        num_stages = 3
    else:
        block_m = max(min_m, 64)
        num_stages = 2
    bn = 64
    if dtype == torch.float32 or head_dim_pad > 128:
        bn, num_stages = 32, min(num_stages, 2)
    num_warps = 8 if block_m >= 128 else 4
    return block_m, block_n or bn, num_warps, num_stages


def choose_num_splits(
    num_seqs: int, max_query_len: int, max_seq_len: int, num_kv_heads: int, block_q: int, num_sms: int
) -> int:
    """How many KV ranges each (q block, kv head) is cut into: enough programs for ~2 waves of SMs.

    Host ints only, so a CUDA graph captured with fixed upper bounds always replays the same launch.
    """
    programs = num_seqs * triton.cdiv(max(max_query_len, 1), block_q) * num_kv_heads
    if programs >= num_sms:
        return 1
    by_length = max_seq_len // MIN_KEYS_PER_SPLIT
    return max(1, min(triton.cdiv(2 * num_sms, programs), by_length, MAX_SPLITS))


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
    block_n: int | None = None,
) -> torch.Tensor:
    """Causal attention of the batch's new queries over their sequences' paged KV (already written).

    q: [num_tokens, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
    cu_query_lens: [num_seqs + 1] int32; seq_lens: [num_seqs] int32 (cached + new tokens);
    block_tables: [num_seqs, max_blocks] int32. max_query_len / max_seq_len are host upper bounds
    (they size the grid and pick split-KV; nothing is read back from the device). Rows of padding
    tokens past cu_query_lens[-1] are left unwritten. Returns out [num_tokens, num_heads, head_dim].
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[2]
    _check_cache(key_cache, value_cache, num_kv_heads, head_dim)
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
    block_m, bn, num_warps, num_stages = attention_config(max_query_len, group, head_dim, q.dtype, block_n)
    block_q = block_m // group
    head_dim_pad = triton.next_power_of_2(head_dim)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, max_query_len, max_seq_len, num_kv_heads, block_q, num_sms(q.device))
    split = num_splits > 1
    if split:
        part_m = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_tokens, num_heads, num_splits, head_dim_pad), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    pdl = use_pdl(q)
    _paged_attention_kernel[grid](
        out,
        q,
        key_cache,
        value_cache,
        part_acc,
        part_m,
        part_l,
        cu_query_lens,
        seq_lens,
        block_tables,
        scale * LOG2E,
        num_seqs,
        num_splits,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=bn,
        SPLIT=split,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
        USE_PDL=pdl,
        launch_pdl=pdl,
    )
    if split:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            out,
            part_acc,
            part_m,
            part_l,
            cu_query_lens,
            num_seqs,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            num_warps=4,
            USE_PDL=pdl,
            launch_pdl=pdl,
        )
    return out
