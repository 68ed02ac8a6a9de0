"""Paged attention over a quantized KV cache (fp8, nvfp4; oracle: kv/quant.py), launched like
`triton_paged.paged_attention`. Variants: fp8 "v3"; nvfp4 "v4" for latency-bound launches, "v7" for
throughput-bound decode. Dots run in float16 with fp32 accumulation; Q is clamped to float16's range.
A rotated format (kv/quant.py) takes q @ hadamard() and its output goes @ hadamard() back (per call);
with key smoothing (cache.key_smooth) q's matrix is quant.query_rotation(), diag(s) Hn per head."""

from __future__ import annotations

import torch
import triton

from specserve.attention.triton_paged import (
    LOG2E,
    MAX_SPLITS,
    MIN_KEYS_PER_SPLIT,
    attention_config,
    check_q,
    reduce_splits,
    split_partials,
)
from specserve.attention.triton_quant_common import cache_strides, check_quant_cache
from specserve.attention.triton_quant_fp8 import fp8_operands
from specserve.attention.triton_quant_nvfp4 import nvfp4_operands
from specserve.attention.triton_quant_write import reshape_and_cache_quant
from specserve.kernels.device import num_sms
from specserve.kv.quant import hadamard, query_rotation
from specserve.kv.spec import KVFormat, LayerKVCache

__all__ = ["paged_attention_quant", "reshape_and_cache_quant"]

VARIANTS = {"fp8": ("v3",), "nvfp4": ("v4", "v7")}
DEFAULT_VARIANT = {"fp8": "v3", "nvfp4": "v7"}
NVFP4_THROUGHPUT_MIN_CONTEXT = 16384  # shorter contexts keep the latency variant
_MAX_GRID_YZ = 65535  # CUDA's limit on grid dimensions y and z
PROGRAMS_PER_SM = 4  # decode programs resident per SM (4 warps, <= 128 registers each)
NVFP4_MIN_SPLITS = 8  # nvfp4 programs are instruction-bound: shorter ones balance better over the SMs


def choose_num_splits_quant(
    num_seqs: int,
    max_query_len: int,
    max_seq_len: int,
    num_kv_heads: int,
    block_q: int,
    num_sms: int,
    variant: str = "v3",
) -> int:
    """Split-KV factor (host ints only): one wave of PROGRAMS_PER_SM per SM, splits >= MIN_KEYS_PER_SPLIT keys."""
    programs = num_seqs * triton.cdiv(max(max_query_len, 1), block_q) * num_kv_heads
    by_sms = (PROGRAMS_PER_SM * num_sms) // programs
    if variant in VARIANTS["nvfp4"]:
        by_sms = max(by_sms, NVFP4_MIN_SPLITS)
    return max(1, min(by_sms, max_seq_len // MIN_KEYS_PER_SPLIT, MAX_SPLITS))


def default_variant(
    name: str, num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, num_sms: int
) -> str:
    """The kernel variant a call without `variant=` gets (host ints only: CUDA-graph safe)."""
    if name == "nvfp4" and (
        max_query_len > 1 or num_seqs * num_kv_heads < num_sms or max_seq_len < NVFP4_THROUGHPUT_MIN_CONTEXT
    ):
        return "v4"
    return DEFAULT_VARIANT[name]


def quant_attention_config(
    max_query_len: int, group: int, head_dim: int, name: str, variant: str = "v3"
) -> tuple[int, int, int, int, int | None]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, maxnreg); prefill gets 8 warps, else its accumulators spill."""
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
    variant: str | None = None,
    block_n: int | None = None,
    heads_first: bool | None = None,
) -> torch.Tensor:
    """`triton_paged.paged_attention` over a quantized cache (already written); variant (None:
    default_variant()), block_n and heads_first (grid order) override the launch, for tests."""
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
    group = check_q(q, num_kv_heads)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if num_tokens == 0 or num_seqs == 0:
        return out
    final, h = out, hadamard(head_dim, q.device, q.dtype) if fmt.rotate else None
    rot = query_rotation(fmt, cache.key_smooth, num_heads, head_dim, q.dtype, q.device)  # [D, D] | [Hq, D, D]
    if rot is not None:
        # Per head: [Hq, T, D] @ [Hq, D, D], read back as [T, Hq, D] through its strides.
        q = q @ rot if rot.dim() == 2 else torch.bmm(q.transpose(0, 1), rot).transpose(0, 1)
    if h is not None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    block_m, bn, num_warps, num_stages, maxnreg = quant_attention_config(
        max_query_len, group, head_dim, fmt.name, variant
    )
    block_q = block_m // group
    if num_splits is None:
        num_splits = choose_num_splits_quant(
            num_seqs, max_query_len, max_seq_len, num_kv_heads, block_q, num_sms(q.device), variant
        )
    partials = split_partials(q, num_splits, out)
    q_blocks = num_tokens // block_q + num_seqs
    meta = dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=cache.key.shape[1],
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n or bn,
        SPLIT=num_splits > 1,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if maxnreg and q.is_cuda:  # a launch option of the compiled kernel (the interpreter has none)
        meta["maxnreg"] = maxnreg
    if heads_first is None:
        heads_first = q_blocks <= _MAX_GRID_YZ
    grid = (num_kv_heads, q_blocks, num_splits) if heads_first else (q_blocks, num_kv_heads, num_splits)
    if fmt.name == "fp8":
        kernel, caches, scalars, extra = fp8_operands(q, cache, scale * LOG2E)
    else:
        kernel, caches, scalars, extra = nvfp4_operands(q, cache, fmt, scale * LOG2E, meta, variant, max_query_len)
    kernel[grid](
        *(out, q, *caches, *partials, cu_query_lens, seq_lens, block_tables, *scalars, num_seqs, num_splits),
        *(*q.stride()[:2], *out.stride()[:2], block_tables.stride(0)),
        **cache_strides("C", caches[0]),
        **cache_strides("S", caches[2]),
        HEADS_FIRST=heads_first,
        **extra,
        **meta,
    )
    if num_splits > 1:
        reduce_splits(out, partials, cu_query_lens)
    return out if h is None else torch.matmul(out, h, out=final)
