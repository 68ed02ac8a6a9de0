"""Triton kernels over a quantized paged KV cache (fp8, nvfp4): the KV write and paged attention.

The layouts and rounding rules are `specserve/kv/spec.py` and `specserve/kv/quant.py` (the torch
oracle). Public entry points: `reshape_and_cache_quant` (the write, `triton_quant_write.py`,
bit-identical to `quant.write_kv`) and `paged_attention_quant`, which follows
`triton_paged.paged_attention` (same grid of q blocks x KV heads x splits, GQA row packing, split-KV
partials reduced by its `_reduce_splits_kernel`) and picks a kernel variant:

  fp8 "v3" (`triton_quant_fp8.py`): the only fp8 kernel.
  nvfp4 "v4" (`triton_quant_nvfp4.py`): inline-PTX nibble decode, float16 dot operands in the 16-bit
       register layout (`triton_dot_layout.py`). Taken where a launch is bound by latency: query rows
       beyond one token, fewer (sequence, KV head) programs than SMs, or short contexts.
  nvfp4 "v7": v4 plus the score scale in exp2's fma, int32 offsets where they fit, the softmax
       denominator from a dot, no softmax for the padding half of a q block, and K read as 32-bit
       words. Taken for plain decode bound by throughput (`default_variant`).

Both formats run their dots in float16 with float32 accumulation. Q (bf16 in the models) is clamped
to float16's finite range first; bf16 -> fp16 is otherwise exact down to 2^-14.
"""

from __future__ import annotations

import torch
import triton

from specserve.attention.triton_paged import (
    LOG2E,
    MAX_SPLITS,
    MIN_KEYS_PER_SPLIT,
    _reduce_splits_kernel,
    attention_config,
)
from specserve.attention.triton_quant_common import NVFP4_DECODE, check_quant_cache
from specserve.attention.triton_quant_fp8 import launch_fp8
from specserve.attention.triton_quant_nvfp4 import launch_nvfp4
from specserve.attention.triton_quant_write import reshape_and_cache_quant
from specserve.kernels.device import num_sms
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

VARIANTS = {"fp8": ("v3",), "nvfp4": ("v4", "v7")}
DEFAULT_VARIANT = {"fp8": "v3", "nvfp4": "v7"}
NVFP4_LATENCY_VARIANT = "v4"
NVFP4_THROUGHPUT_MIN_CONTEXT = 16384  # shorter contexts keep the latency variant
_MAX_GRID_YZ = 65535  # CUDA's limit on grid dimensions y and z
PROGRAMS_PER_SM = 4  # decode programs resident per SM (4 warps, <= 128 registers each)
# nvfp4 splits into at least this many where the context allows: its programs are bound by
# instructions more than by memory, and shorter ones balance better over the SMs.
NVFP4_MIN_SPLITS = 8


def choose_num_splits_quant(
    num_seqs: int,
    max_query_len: int,
    max_seq_len: int,
    num_kv_heads: int,
    block_q: int,
    num_sms: int,
    variant: str = "v3",
) -> int:
    """Split-KV factor for the quantized kernels. Host ints only (CUDA-graph safe): as many programs as
    fit at once (PROGRAMS_PER_SM per SM), rounded down so the grid is one full wave; nvfp4 at least
    NVFP4_MIN_SPLITS; never splits shorter than MIN_KEYS_PER_SPLIT keys."""
    programs = num_seqs * triton.cdiv(max(max_query_len, 1), block_q) * num_kv_heads
    by_length = max_seq_len // MIN_KEYS_PER_SPLIT
    by_sms = (PROGRAMS_PER_SM * num_sms) // programs
    if variant in VARIANTS["nvfp4"]:
        by_sms = max(by_sms, NVFP4_MIN_SPLITS)
    return max(1, min(by_sms, by_length, MAX_SPLITS))


def default_variant(
    name: str, num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, num_sms: int
) -> str:
    """The kernel variant a call without `variant=` gets (host ints only: CUDA-graph safe)."""
    if name == "nvfp4" and (
        max_query_len > 1 or num_seqs * num_kv_heads < num_sms or max_seq_len < NVFP4_THROUGHPUT_MIN_CONTEXT
    ):
        return NVFP4_LATENCY_VARIANT
    return DEFAULT_VARIANT[name]


def quant_attention_config(
    max_query_len: int, group: int, head_dim: int, name: str, variant: str = "v3"
) -> tuple[int, int, int, int, int | None]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, maxnreg): triton_paged's tiles, adjusted per format.

    Decode: 4 warps, 3 stages (block ids, then K/V and scales, one tile ahead), 128-key tiles under a
    128-register cap for 4 programs per SM. Prefill (64-row q blocks) takes 8 warps: with 4 its fp32
    accumulators spill.
    """
    block_m, block_n, num_warps, num_stages = attention_config(max_query_len, group, head_dim, torch.float16)
    maxnreg = None
    if block_m >= 64:
        num_warps = 8
    elif block_m <= 32 and block_n == 64:
        block_n, maxnreg = 128, 128
    elif name == "fp8":
        maxnreg = 128
    return block_m, block_n, num_warps, num_stages, maxnreg


def paged_attention_quant(
    q: torch.Tensor,
    cache: LayerKVCache,
    fmt: KVFormat,
    cu_query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    variant: str | None = None,
    heads_first: bool | None = None,
    maxnreg: int | None = None,
) -> torch.Tensor:
    """`triton_paged.paged_attention` over a quantized cache (fp8 or nvfp4, already written).

    q: [num_tokens, num_heads, head_dim]; cache: LayerKVCache in `fmt`'s layout (spec.py).
    Returns out [num_tokens, num_heads, head_dim] in q's dtype; padding rows are left unwritten.
    block_n / num_warps / num_stages / maxnreg (a register cap per thread; 0: none) override the tile
    configuration, variant the kernel (VARIANTS[fmt.name]; None: default_variant()), heads_first the
    grid order (None: KV heads fastest whenever the grid allows it) -- for benchmarks and tests.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = cache.key.shape[2]
    check_quant_cache(fmt, cache, num_kv_heads, head_dim)
    num_seqs = cu_query_lens.shape[0] - 1
    variant = variant or default_variant(
        fmt.name, num_seqs, num_kv_heads, max_query_len, max_seq_len, num_sms(q.device)
    )
    if variant not in VARIANTS[fmt.name]:
        raise ValueError(f"{fmt.name} variant must be one of {VARIANTS[fmt.name]}, got {variant!r}")
    if fmt.name == "fp8" and head_dim % 2:
        raise ValueError(f"the fp8 kernel reads V as byte pairs and needs an even head_dim, got {head_dim}")
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
        num_splits = choose_num_splits_quant(
            num_seqs, max_query_len, max_seq_len, num_kv_heads, block_q, num_sms(q.device), variant
        )
    split = num_splits > 1
    if split:
        part_m = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_tokens, num_heads, num_splits, head_dim_pad), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # unused
    q_blocks = num_tokens // block_q + num_seqs
    common = (part_acc, part_m, part_l, cu_query_lens, seq_lens, block_tables)
    meta = dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=cache.key.shape[1],
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=bn,
        SPLIT=split,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if maxnreg and q.is_cuda:  # a launch option of the compiled kernel (the interpreter has none)
        meta["maxnreg"] = maxnreg
    scale_log2 = scale * LOG2E
    if heads_first is None:
        heads_first = q_blocks <= _MAX_GRID_YZ
    if fmt.name == "fp8":
        launch_fp8(q, cache, fmt, out, common, q_blocks, num_splits, scale_log2, meta, heads_first)
    else:
        launch_nvfp4(
            q,
            cache,
            fmt,
            out,
            common,
            q_blocks,
            num_splits,
            scale_log2,
            meta,
            heads_first,
            variant=variant,
            max_query_len=max_query_len,
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
        )
    return out
