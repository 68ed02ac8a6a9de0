"""Skinny GEMM on the tensor cores: y [M, N] = x [M, K] @ W [N, K]^T (+ bias) for 1 <= M <= 16 rows.
Split-K is deterministic: splits write fp32 partials to a workspace [S, M, N] and bump the N tile's
counter; the last sums them in split order and resets the counter to 0. Workspace and counters are
persistent per-device buffers (grown outside graph capture only): their launches share one stream.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from specserve import envs
from specserve.kernels.pdl import pdl_prologue, use_pdl

SKINNY_MIN_M, SKINNY_MAX_M = 1, 16  # rows are padded to one 16-row MMA tile
_BLOCK_M = 16
_MIN_WORKSPACE_FLOATS = 1 << 20
_MIN_COUNTERS = 1 << 14


class SkinnyConfig(NamedTuple):
    """Tiles of one launch: block_n, block_k powers of two >= 16; split_k programs per N tile."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _load_k(ptrs, k_offs, K, EVEN_K: tl.constexpr):
    """A [rows, BLOCK_K] tile of a K-contiguous matrix whose rows all exist; zero past K."""
    if EVEN_K:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=(k_offs < K)[None, :], other=0.0)
    return tile


@triton.jit
def _store_out(
    acc, acc_up, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS: tl.constexpr, SILU_OUT: tl.constexpr
):
    """Epilogue: bias, (silu(gate) * up,) one rounding to the output dtype, masked store."""
    n_ok = offs_n < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    if SILU_OUT:
        # Rounding as F.linear then ops.silu_and_mul (the product is exact in fp32 for bf16/fp16 inputs).
        gate = acc.to(dtype).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        acc = act * acc_up.to(dtype).to(tl.float32)
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(dtype), mask=(offs_m < M)[:, None] & n_ok[None, :])


@triton.jit
def _skinny_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    ws_ptr,
    counter_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    SILU_OUT: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past N re-read row 0 (their outputs are masked at the store): W's loads need no N mask.
    rows = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    k_lo = pid_k * k_per_split  # a multiple of BLOCK_K: only the last tile of all crosses K
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + (k_lo + offs_k)[None, :]
    # SILU_OUT: W is [2N, K] = [gate | up]; this program also owns up's rows N + offs_n.
    up_ptrs = w_ptr + (rows + N)[:, None] * stride_wn + (k_lo + offs_k)[None, :]
    # The first weight tile(s) before the PDL wait (no kernel writes weights); nothing else before it.
    w = _load_k(w_ptrs, k_lo + offs_k, K, EVEN_K)
    w_up = w
    if SILU_OUT:
        w_up = _load_k(up_ptrs, k_lo + offs_k, K, EVEN_K)
    pdl_prologue(USE_PDL)
    m_ok = (offs_m < M)[:, None]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    if EVEN_K:
        x = tl.load(x_ptrs, mask=m_ok, other=0.0)
    else:
        x = tl.load(x_ptrs, mask=m_ok & (k_lo + offs_k < K)[None, :], other=0.0)
    acc = tl.dot(x, tl.trans(w))  # [BLOCK_M, BLOCK_N] fp32
    acc_up = acc
    if SILU_OUT:
        acc_up = tl.dot(x, tl.trans(w_up))
    # Fresh names in the loop: a name assigned before it and in it would be loop-carried.
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        k_offs = k0 + offs_k
        w_k = _load_k(w_ptrs + (k0 - k_lo), k_offs, K, EVEN_K)
        if EVEN_K:
            x_k = tl.load(x_ptrs + (k0 - k_lo), mask=m_ok, other=0.0)
        else:
            x_k = tl.load(x_ptrs + (k0 - k_lo), mask=m_ok & (k_offs < K)[None, :], other=0.0)
        acc = tl.dot(x_k, tl.trans(w_k), acc)
        if SILU_OUT:
            up_k = _load_k(up_ptrs + (k0 - k_lo), k_offs, K, EVEN_K)
            acc_up = tl.dot(x_k, tl.trans(up_k), acc_up)
    if SPLIT:
        # Workspace [S, M, NW] (NW = 2N with gate | up); the last of the S programs sums in split order.
        NW = 2 * N if SILU_OUT else N
        num_splits = tl.num_programs(1)
        tile = offs_m[:, None] * NW + offs_n[None, :]
        ok = m_ok & (offs_n < N)[None, :]
        tl.store(ws_ptr + pid_k * M * NW + tile, acc, mask=ok)
        if SILU_OUT:
            tl.store(ws_ptr + pid_k * M * NW + N + tile, acc_up, mask=ok)
        tl.debug_barrier()  # every thread's partial stores precede the release below
        arrived = tl.atomic_add(counter_ptr + pid_n, 1)  # acq_rel, gpu scope
        if arrived == num_splits - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            total_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(num_splits):
                part = ws_ptr + s * M * NW + tile
                total += tl.load(part, mask=ok, other=0.0, cache_modifier=".cg")
                if SILU_OUT:
                    total_up += tl.load(part + N, mask=ok, other=0.0, cache_modifier=".cg")
            _store_out(total, total_up, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS, SILU_OUT)
            tl.store(counter_ptr + pid_n, 0)  # CUDA-graph replays (and the next launch) start at zero
    else:
        _store_out(acc, acc_up, bias_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS, SILU_OUT)


class _Scratch(NamedTuple):
    workspace: torch.Tensor  # [>= S * M * N] fp32 partials
    counters: torch.Tensor  # [>= N tiles] int32, zero between launches


# Per-device split-K buffers. Replaced ones stay referenced: graphs captured before a growth use them.
_SCRATCH: dict[torch.device, _Scratch] = {}
_RETIRED: list[_Scratch] = []


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _scratch(device: torch.device, workspace_floats: int, num_counters: int) -> _Scratch:
    """The device's buffers, grown (outside graph capture only) to at least the sizes asked for."""
    have = _SCRATCH.get(device)
    if have is not None and have.workspace.numel() >= workspace_floats and have.counters.numel() >= num_counters:
        return have
    if _capturing(device):
        raise RuntimeError(
            f"skinny_linear: the split-K workspace ({workspace_floats} floats) or counters ({num_counters}) "
            f"of {device} would have to grow during CUDA graph capture; run each shape once before "
            "capturing (a warm-up pass), so the buffers are allocated outside the graph"
        )
    old_ws, old_cnt = (0, 0) if have is None else (have.workspace.numel(), have.counters.numel())
    _RETIRED.extend([have] if have is not None else [])
    _SCRATCH[device] = _Scratch(
        torch.zeros(max(workspace_floats, 2 * old_ws, _MIN_WORKSPACE_FLOATS), dtype=torch.float32, device=device),
        torch.zeros(max(num_counters, 2 * old_cnt, _MIN_COUNTERS), dtype=torch.int32, device=device),
    )
    return _SCRATCH[device]


def effective_split(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(splits launched, K per split): K tiles dealt evenly, no split empty."""
    k_tiles = triton.cdiv(k, block_k)
    per = triton.cdiv(k_tiles, max(1, min(split_k, k_tiles)))
    return triton.cdiv(k_tiles, per), per * block_k


def supports(x: torch.Tensor, weight: torch.Tensor, max_m: int = SKINNY_MAX_M) -> bool:
    """Whether skinny_linear (or, with its max_m, the GEMV) takes x [M, K] @ weight [N, K]^T."""
    return (
        (x.is_cuda or envs.triton_interpret())
        and x.dim() == 2
        and weight.dim() == 2
        and SKINNY_MIN_M <= x.shape[0] <= max_m
        and weight.shape[1] == x.shape[1]
        and x.shape[1] > 0
        and weight.shape[0] > 0
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.device == weight.device
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: SkinnyConfig, silu_out: bool = False
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype; ValueError unless `supports`.
    silu_out: silu_and_mul of the product (weight [2 * inter, K] = gate | up) -> [M, inter]."""
    if not supports(x, weight):
        raise ValueError(
            f"skinny_linear does not take x {tuple(x.shape)} {x.dtype} on {x.device} with weight "
            f"{tuple(weight.shape)} {weight.dtype} (see supports())"
        )
    if silu_out and weight.shape[0] % 2:
        raise ValueError(f"skinny_linear (silu_out): weight must be [2 * inter, K], got {tuple(weight.shape)}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype or bias.stride(0) != 1):
        raise ValueError(f"skinny_linear: bias must be [{weight.shape[0]}] {x.dtype} contiguous, got {bias.dtype}")
    if any(b < 16 or b & (b - 1) for b in config[:2]) or min(config[2:]) < 1:
        raise ValueError(f"SkinnyConfig: block_n, block_k must be powers of two >= 16, the rest >= 1, got {config}")
    m, k = x.shape
    n = weight.shape[0] // 2 if silu_out else weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    n_tiles = triton.cdiv(n, config.block_n)
    splits, k_split = effective_split(k, config.block_k, config.split_k)
    workspace = counters = out  # not read without a split
    if splits > 1:
        workspace, counters = _scratch(x.device, splits * m * (2 * n if silu_out else n), n_tiles)
    pdl = use_pdl(x)
    args = (x, weight, weight if bias is None else bias, out, workspace, counters, m, n, k, k_split, x.stride(0))
    flags = dict(HAS_BIAS=bias is not None, SILU_OUT=silu_out, SPLIT=splits > 1, EVEN_K=k % config.block_k == 0)
    flags.update(BLOCK_M=_BLOCK_M, BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps)
    flags.update(num_stages=config.num_stages, USE_PDL=pdl, launch_pdl=pdl)
    _skinny_kernel[(n_tiles, splits)](*args, weight.stride(0), out.stride(0), **flags)
    return out
