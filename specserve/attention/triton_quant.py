"""Triton kernels over a quantized paged KV cache (fp8, nvfp4): the KV write and paged attention.

The layouts and rounding rules are `specserve/kv/spec.py` and `specserve/kv/quant.py` (the torch
oracle). Public entry points, all here: `reshape_and_cache_quant` (the write; kernel in
`triton_quant_write.py`, bit-identical to `quant.write_kv`) and `paged_attention_quant`, which
follows `triton_paged.paged_attention` (same grid of q blocks x KV heads x splits, GQA row packing,
split-KV partials reduced by its `_reduce_splits_kernel`) and picks one of the kernel variants:

  "v1" (`triton_quant_v1.py`): the first kernels. Correct, but latency-bound on the H200: per-token
       scale loads are 1-2 byte gathers that stay synchronous in the loop (fp8 1.4-2.2x, nvfp4 2.7x
       the bf16 kernel's time at batch 32 / 32k).
  "v2" (nvfp4, `triton_quant_nvfp4.py`): shaped like the bf16 kernel. Every load in the loop is a
       vector the pipeliner issues as cp.async a tile ahead (scales included: checked in the sm_90
       TTGIR, no synchronous load left in the loop), cache strides are compile-time constants
       (provably aligned rows), KV heads of a q block run side by side (L2 sharing of the scale
       sectors), and it reads 16-bit units into four dots of depth head_dim/4 (v1: eight of depth
       head_dim/8, 32-bit words). Tiles every row sees in full take a loop without masks.
  "v3" (nvfp4): v2 with the nibble decode in inline PTX (SIMD-within-a-register shifts and the
       hardware e4m3x2 -> f16x2 conversion): ~35% fewer instructions per tile than v2 in the
       sm_90 SASS, which matters because nvfp4 decode is about as long as its memory traffic. A
       decoder of integer instructions only (no conversions) measured 3% slower (2026-11-30).
  "v4" (nvfp4): v3 with its float16 dot operands in the 16-bit register layout (Triton gives them
       the 8-bit one because of the scale loads; `triton_dot_layout.py`): 996 against 1,130 sm_90
       instructions per 128-key tile, the difference register moves (961 against 1,110 with
       the decoder's single byte permute): 534 against 591 us at batch 32 / 32k on the H200.
  "v5" (nvfp4): v4 with the score scale in exp2's fma (no multiply per score) and int32 cache
       offsets where the cache allows (checked on the host): 917 instructions per tile.
  "v6" (nvfp4): v5 with the softmax denominator from a dot of P with ones instead of a row sum, which
       crossed the warps through shared memory: 900 instructions and 6 barriers per tile against 9.
       B = 32 / 32k on the H200: 524-528 us against v4's 532-533 in the same processes (sixteenth
       session). The default where the launch was bound by throughput until the twenty-third session.
  "v7" (nvfp4): v6 that, where no q block can hold a query row in its second half (plain decode at
       up to 8 query heads per KV head, `triton_quant_nvfp4.half_rows_apply`), computes the online
       softmax of the first 8 of the tile's 16 rows only: the tensor cores' minimum M pads a decode's
       4 rows to 16, and rows r + 8 of the accumulator sit in registers of their own, so their exp2s,
       row max, P conversions and rescales drop out at compile time. And K read as 32-bit words and
       decoded without a byte permute (Q in the matching column order). sm_90 SASS of the unmasked loop:
       796 instructions per tile against v6's 882 (bench/kernel_sass.py). B = 32 / 32k on the H200
       (twenty-third session, 3 processes, every launch timed twice): 517-521 us = 0.4446-0.4491x of
       bf16 against v6's 523-526 us = 0.4507-0.4522x in the same processes. The default where the
       launch is bound by throughput (`default_variant`).
  "v3" (fp8, `triton_quant_fp8.py`): the same structure, capped at 128 registers (4 programs per
       SM), with V read as 16-bit units so that P.V's operand comes from a transposing ldmatrix
       instead of one shared-memory byte load per value. Its byte-tile predecessor (v2, removed:
       1,449 us at batch 32 / 32k) had 64 LDS.U8 per thread per 64-key tile and spilled under the
       cap; v3 has neither, 740 against 1,107 instructions per tile.

`default_variant` says which one a call without `variant=` gets; bench/kv_quant_gpu.py checks and
times all of them. On the H200 (2026-11-30, batch 32, 32k context, 32 / 8 heads, head_dim 128):
bf16 1,167 us; fp8 v1 1,596, v3 588 (0.50x bf16, 3.7 TB/s); nvfp4 v1 3,224, v2 1,159, v3 594
(0.51x, 2.0 TB/s: bound by its instruction count), v4 534 (0.46x, 2.3 TB/s; fifteenth session), v6
524-528 (0.448-0.452x of bf16's 1,164-1,169 in the same processes; sixteenth session), v7 517-521
(0.445-0.449x of bf16's 1,160-1,163; twenty-third session). The
PTX decoders are checked exhaustively on the GPU (test_nvfp4_decoders_are_exact,
test_fp8_unit_decode_is_exact); the interpreter runs the plain-Triton decoders.

Both formats run their dots in float16 with float32 accumulation. Q is bf16 in the models, so it is
clamped to float16's finite range first (|q| > 65504 does not occur in practice; bf16 -> fp16 is
otherwise exact down to 2^-14).
"""
from __future__ import annotations

import torch
import triton

from specserve.attention.triton_paged import (
    LOG2E,
    MAX_SPLITS,
    MIN_KEYS_PER_SPLIT,
    _num_sms,
    _reduce_splits_kernel,
    attention_config,
)
from specserve.attention.triton_quant_common import NVFP4_DECODE, check_quant_cache
from specserve.attention.triton_quant_fp8 import launch_fp8_v3
from specserve.attention.triton_quant_nvfp4 import launch_nvfp4_v2
from specserve.attention.triton_quant_v1 import launch_v1
from specserve.attention.triton_quant_write import reshape_and_cache_quant
from specserve.kv.spec import KVFormat, LayerKVCache

__all__ = [
    "DEFAULT_VARIANT",
    "default_variant",
    "NVFP4_DECODE",
    "VARIANTS",
    "choose_num_splits_quant",
    "paged_attention_quant",
    "quant_attention_config",
    "reshape_and_cache_quant",
]

VARIANTS = {"fp8": ("v1", "v3"), "nvfp4": ("v1", "v2", "v3", "v4", "v5", "v6", "v7")}
DEFAULT_VARIANT = {"fp8": "v3", "nvfp4": "v7"}
# nvfp4 v6 has fewer instructions and barriers per tile than v4 and a longer critical path (the row sums
# are a dot). On the H200 (sixteenth session, decode, 4 processes) it was 1-1.5% faster at B = 32 / 32k
# and 1.7-2.5% at 128k (in two of three), but 4-11% slower at B = 1 (few programs, each bound by its
# latency) and level at B = 32 / 4k. v7 (v6 without the padding rows' softmax and the K byte permute) was
# 0.6-1.4% faster than v6 at B = 32 / 32k in three processes (twenty-third session). Only plain decode
# launches were timed: launches with query rows beyond one token (prefill chunks, verify steps), fewer
# (sequence, KV head) programs than SMs, or short contexts keep v4.
NVFP4_LATENCY_VARIANT = "v4"
NVFP4_THROUGHPUT_MIN_CONTEXT = 16384
_MAX_GRID_YZ = 65535  # CUDA's limit on grid dimensions y and z
V2_PROGRAMS_PER_SM = 4  # v2 / v3 decode programs resident per SM (4 warps, <= 128 registers each)
# nvfp4 v4 splits into at least this many (where the context allows): on the H200 at batch 32 (one wave
# at 2 splits), 8 splits took 528 / 531 us against 537 / 542 at 2 (32k), 2,062 against 2,104 (128k),
# 150 against 154 (4k); its programs are bound by instructions more than by memory, and shorter ones
# balance better over the SMs (2026-11-30, fifteenth session).
V4_MIN_SPLITS = 8


def choose_num_splits_quant(num_seqs: int, max_query_len: int, max_seq_len: int, num_kv_heads: int,
                            block_q: int, num_sms: int, variant: str = "v1") -> int:
    """Split-KV factor for the quantized kernels. Host ints only (CUDA-graph safe).

    A quantized tile carries 2-3.5x fewer bytes than a bf16 one, so each program has less memory
    in flight and more programs per SM keep the loads coming. v1: about 4 waves of programs
    (rounded up). v2 / v3: as many programs as fit at once (4 per SM at <= 128 registers per
    thread), rounded down, so the grid is one full wave instead of one wave and a partial one.
    v4: the same, but at least V4_MIN_SPLITS.
    """
    programs = num_seqs * triton.cdiv(max(max_query_len, 1), block_q) * num_kv_heads
    by_length = max_seq_len // MIN_KEYS_PER_SPLIT
    if variant == "v1":
        by_sms = triton.cdiv(4 * num_sms, programs)
    else:
        by_sms = (V2_PROGRAMS_PER_SM * num_sms) // programs
        if variant in ("v4", "v5", "v6", "v7"):
            by_sms = max(by_sms, V4_MIN_SPLITS)
    return max(1, min(by_sms, by_length, MAX_SPLITS))


def default_variant(name: str, num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                    num_sms: int) -> str:
    """The kernel variant a call without `variant=` gets (host ints only: CUDA-graph safe)."""
    if name == "nvfp4" and (max_query_len > 1 or num_seqs * num_kv_heads < num_sms
                            or max_seq_len < NVFP4_THROUGHPUT_MIN_CONTEXT):
        return NVFP4_LATENCY_VARIANT
    return DEFAULT_VARIANT[name]


def quant_attention_config(max_query_len: int, group: int, head_dim: int, name: str,
                           variant: str = "v1") -> tuple[int, int, int, int, int | None]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, maxnreg): triton_paged's tiles, adjusted per format / variant.

    v1, measured on the H200 (decode, Hq/Hkv/D = 32/8/128, batch 32, 32k context): fp8 with 4 warps
    1.60 ms, 8 warps 2.61 ms; nvfp4 3.15 ms with 2 stages, 3.23 ms with 3. The 64-row prefill tiles
    spill registers with 4 warps in both formats (ptxas, sm_90), so they take 8.
    v2 / v3 decode: 4 warps, 3 stages (block ids, then K/V and scales, one tile ahead; 2 stages would
    leave the block-id load synchronous), 128-key tiles under a 128-register cap for 4 programs per
    SM (measured on the H200, 2026-11-30: see the branches below; nvfp4 v2 keeps 64-key tiles).
    Prefill takes 8 warps (64 x 128 fp32 accumulators).
    """
    block_m, block_n, num_warps, num_stages = attention_config(max_query_len, group, head_dim, torch.float16)
    maxnreg = None
    if block_m >= 64:
        num_warps = 8
    elif variant == "v1":
        if name == "nvfp4":
            num_stages = 2
    elif name == "fp8":
        maxnreg = 128
        if block_m <= 32 and block_n == 64:
            block_n = 128  # H200, B=32 / 32k: 588 us (sm_90 SASS: 7.9 instructions per key and thread, 11.6 at 64)
    elif variant in ("v3", "v4", "v5", "v6", "v7") and block_m <= 32 and block_n == 64:
        block_n, maxnreg = 128, 128  # nvfp4 v3 on the H200, B=32 / 32k: 604 us against 719 at 64 keys, no cap
    return block_m, block_n, num_warps, num_stages, maxnreg


def paged_attention_quant(q: torch.Tensor, cache: LayerKVCache, fmt: KVFormat, cu_query_lens: torch.Tensor,
                          seq_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int,
                          max_seq_len: int, scale: float, out: torch.Tensor | None = None,
                          num_splits: int | None = None, block_n: int | None = None,
                          num_warps: int | None = None, num_stages: int | None = None,
                          variant: str | None = None, heads_first: bool | None = None,
                          maxnreg: int | None = None) -> torch.Tensor:
    """`triton_paged.paged_attention` over a quantized cache (fp8 or nvfp4, already written).

    q: [num_tokens, num_heads, head_dim]; cache: LayerKVCache in `fmt`'s layout (spec.py).
    Returns out [num_tokens, num_heads, head_dim] in q's dtype; padding rows are left unwritten.
    block_n / num_warps / num_stages / maxnreg (a register cap per thread; 0: none) override the tile
    configuration, variant the kernel (VARIANTS[fmt.name]; None: default_variant()), heads_first the
    v2 / v3 grid order (None: KV heads fastest whenever the grid allows it) -- for benchmarks and tests.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = cache.key.shape[2]
    check_quant_cache(fmt, cache, num_kv_heads, head_dim)
    num_seqs = cu_query_lens.shape[0] - 1
    variant = variant or default_variant(fmt.name, num_seqs, num_kv_heads, max_query_len, max_seq_len,
                                         _num_sms(q.device))
    if variant not in VARIANTS[fmt.name]:
        raise ValueError(f"{fmt.name} variant must be one of {VARIANTS[fmt.name]}, got {variant!r}")
    if fmt.name == "fp8" and variant == "v3" and head_dim % 2:
        raise ValueError(f"fp8 variant v3 reads V as byte pairs and needs an even head_dim, got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if q.stride(-1) != 1:
        raise ValueError("q needs a contiguous last (head_dim) dimension")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_m, bn, warps, stages, regs = quant_attention_config(max_query_len, group, head_dim, fmt.name, variant)
    bn, num_warps, num_stages = block_n or bn, num_warps or warps, num_stages or stages
    if maxnreg is None:
        maxnreg = regs
    block_q = block_m // group
    head_dim_pad = triton.next_power_of_2(head_dim)
    if num_splits is None:
        num_splits = choose_num_splits_quant(num_seqs, max_query_len, max_seq_len, num_kv_heads, block_q,
                                             _num_sms(q.device), variant)
    split = num_splits > 1
    if split:
        part_m = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_tokens, num_heads, num_splits, head_dim_pad), dtype=torch.float32,
                               device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused
    q_blocks = num_tokens // block_q + num_seqs
    common = (part_acc, part_m, part_l, cu_query_lens, seq_lens, block_tables)
    meta = dict(GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=cache.key.shape[1],
                BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=bn, SPLIT=split, num_warps=num_warps,
                num_stages=num_stages)
    if maxnreg and q.is_cuda:  # a launch option of the compiled kernel (the interpreter has none)
        meta["maxnreg"] = maxnreg
    scale_log2 = scale * LOG2E
    if variant == "v1":
        launch_v1(q, cache, fmt, out, common, q_blocks, num_splits, scale_log2, meta)
    else:
        if heads_first is None:
            heads_first = q_blocks <= _MAX_GRID_YZ
        if fmt.name == "fp8":
            launch_fp8_v3(q, cache, fmt, out, common, q_blocks, num_splits, scale_log2, meta, heads_first)
        else:
            launch_nvfp4_v2(q, cache, fmt, out, common, q_blocks, num_splits, scale_log2, meta, heads_first,
                            variant=variant, max_query_len=max_query_len)
    if split:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            out, part_acc, part_m, part_l, cu_query_lens, num_seqs, num_splits,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, SPLITS_PAD=triton.next_power_of_2(num_splits),
            num_warps=4,
        )
    return out
