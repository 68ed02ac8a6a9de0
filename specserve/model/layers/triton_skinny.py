"""Skinny GEMM on the tensor cores: y [M, N] = x [M, K] @ W [N, K]^T (+ bias) for 1 <= M <= 16 rows.

For the linear layers of a speculative verify (batch 1, k + 1 rows) and of batch 2-16 decode. These
products are bound by reading W, so their cost should be the weight bytes over the bandwidth
whatever M is: the GEMV (triton_gemv.py) slows down with every row, cuBLAS at small M leaves
bandwidth unused. Each program owns BLOCK_N output features (whole rows of W, K-chunk by K-chunk)
for all M rows, padded to BLOCK_M = 16 so `tl.dot` runs on the tensor cores with fp32 accumulation;
the bias is added in the epilogue and the result rounded once. `skinny_linear_silu_and_mul` is
gate_up with its activation fused (the roundings of F.linear then `ops.silu_and_mul`).

Filling the GPU: programs = ceil(N / BLOCK_N) * SPLIT_K. `default_config` picks tiles and split
from a small cost model (`estimate_us`); a benchmark passes its own `SkinnyConfig`.

Split-K is deterministic (greedy decoding must give the same tokens run to run): split s writes its
fp32 partial to a workspace [S, M, N], passes a CTA barrier and increments the N tile's int32 counter
with an acq_rel atomic; the program that sees S - 1 sums the S partials in the fixed order 0..S-1
(`.cg` loads), adds the bias, stores, and resets the counter to 0, so a CUDA graph replays from a
clean state. Workspace and counters are persistent per-device buffers (zeroed once, grown only
outside CUDA-graph capture, never freed): launches that use them must be ordered on one stream.

PDL (kernels/pdl.py): each program issues its first weight tile load before the wait; x, the
workspace and the counters only after it.

Only bf16 / fp16 on CUDA (or Triton's CPU interpreter) take this path (`supports`); the reference is
`ops.linear` / `ops.linear_silu_and_mul`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from specserve import envs
from specserve.kernels.device import num_sms
from specserve.kernels.pdl import pdl_prologue, use_pdl

SKINNY_MIN_M = 1  # one row works too (x is padded to 16 rows); the engine picks it per shape where it beats the GEMV
SKINNY_MAX_M = 16  # rows are padded to one 16-row MMA tile
_BLOCK_M = 16

# First allocation of the split-K scratch (later growth doubles): 4 MiB of fp32 partials, S * M * N
# up to 16 x 16 x 4096 (any split of an 8B model's 4096-wide projections); more grows it, which
# must happen before a CUDA graph is captured (a warm-up pass with the same shapes).
_MIN_WORKSPACE_FLOATS = 1 << 20
_MIN_COUNTERS = 1 << 14

# The default config's cost model (H200-like; only the ranking of configs matters).
_HBM_BYTES_PER_US = 4.0e6  # achievable streaming bandwidth, bytes per microsecond (4 TB/s)
_SM_BYTES_PER_US = 0.04e6  # what one SM takes in from HBM at most (a guess, ~40 GB/s: HBM needs 100+ SMs busy)
_DRAM_LATENCY_US = 1.0  # a load's round trip under load: a program keeps (stages - 1) tiles coming per latency
_PROGRAM_US = 0.5  # fixed cost of a program: start, first load's latency not hidden, epilogue
_REDUCE_US = 1.0  # split-K: the counter's atomic round trip and the last program's reduction
_SMEM_PER_SM = 228 * 1024  # shared memory per SM (H100/H200; 1 KB of it reserved per block)
_MAX_SPLIT_K = 16
_DEFAULT_BLOCK_K = 128
_DEFAULT_STAGES = 4


class SkinnyConfig(NamedTuple):
    """Tile parameters of one launch. block_n: output features per program (>= 16, a power of
    two); block_k: K per loop step (>= 16, a power of two); split_k: programs per N tile (the
    launch uses ceil(k_tiles / ceil(k_tiles / split_k)) so that no split is empty)."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = _DEFAULT_STAGES


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
        # Rounding as F.linear then ops.silu_and_mul: gate and up to the activation dtype, silu(gate)
        # to it, then the product (exact in fp32 for bf16/fp16 inputs, so rounded once).
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
    # The first weight tile(s) before the PDL wait: no kernel writes weights, so these bytes come in
    # while the previous kernel finishes. Nothing an earlier kernel wrote is read before the wait.
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
    # The rest of this split's K range; Triton pipelines it (num_stages). Fresh names for the
    # tiles: a name assigned before the loop and in it would be carried from step to step.
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
        # Deterministic split-K: partial tile to the workspace [S, M, NW] (NW = 2N with gate | up),
        # then the tile's counter; the last of the S programs sums them in split order.
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


# Per-device split-K buffers. Replaced ones stay referenced: a CUDA graph captured before the growth
# still points at them, and replaying it must not write into memory torch has handed out again.
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
    old_ws = 0 if have is None else have.workspace.numel()
    old_cnt = 0 if have is None else have.counters.numel()
    grown = _Scratch(
        torch.zeros(max(workspace_floats, 2 * old_ws, _MIN_WORKSPACE_FLOATS), dtype=torch.float32, device=device),
        torch.zeros(max(num_counters, 2 * old_cnt, _MIN_COUNTERS), dtype=torch.int32, device=device),
    )
    if have is not None:
        _RETIRED.append(have)
    _SCRATCH[device] = grown
    return grown


def effective_split(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(splits launched, K per split): K tiles dealt evenly, no split empty."""
    k_tiles = triton.cdiv(k, block_k)
    per = triton.cdiv(k_tiles, max(1, min(split_k, k_tiles)))
    return triton.cdiv(k_tiles, per), per * block_k


def estimate_us(n: int, k: int, m: int, cfg: SkinnyConfig, num_sms: int) -> float:
    """A rough time model of one launch, to rank configs (not to predict): programs run in waves of
    `slots` (SMs x the programs that fit one by shared memory); a wave lasts as long as the slower
    of HBM moving all its bytes and its busiest SM moving its programs' bytes, at what one SM takes
    in or what those programs' pipelines keep in flight ((stages - 1) tiles per DRAM latency);
    each wave pays a fixed cost, split-K a reduction."""
    splits, k_split = effective_split(k, cfg.block_k, cfg.split_k)
    programs = triton.cdiv(n, cfg.block_n) * splits
    # Triton's pipeline keeps num_stages - 1 buffers of the W and x tiles in shared memory.
    smem = max(1, cfg.num_stages - 1) * (cfg.block_n + _BLOCK_M) * cfg.block_k * 2
    slots = num_sms * max(1, min(4, _SMEM_PER_SM // (smem + 1024)))
    prog_bytes = (cfg.block_n + m) * k_split * 2  # its W rows + the x rows (those from L2)
    in_flight = max(1, cfg.num_stages - 1) * cfg.block_n * cfg.block_k * 2
    us = 0.0
    while programs > 0:
        active = min(programs, slots)
        per_sm = triton.cdiv(active, num_sms)  # the busiest SM's programs
        sm_rate = min(_SM_BYTES_PER_US, per_sm * in_flight / _DRAM_LATENCY_US)
        us += max(active * prog_bytes / _HBM_BYTES_PER_US, per_sm * prog_bytes / sm_rate) + _PROGRAM_US
        programs -= active
    if splits > 1:
        us += _REDUCE_US + splits * m * cfg.block_n * 4 / _SM_BYTES_PER_US
    return us


@functools.lru_cache(maxsize=1024)
def default_config(n: int, k: int, m: int, num_sms: int) -> SkinnyConfig:
    """The tiles for an [m, k] x [n, k]^T product: of BLOCK_N in 32 / 64 / 128 and every split of
    K (up to 16), the one `estimate_us` ranks fastest (ties: the fewer splits, the wider tile)."""
    best: tuple[float, SkinnyConfig] | None = None
    k_tiles = triton.cdiv(k, _DEFAULT_BLOCK_K)
    for block_n in (128, 64, 32):
        seen = set()
        for split in range(1, min(_MAX_SPLIT_K, k_tiles) + 1):
            splits = effective_split(k, _DEFAULT_BLOCK_K, split)[0]
            if splits in seen:
                continue
            seen.add(splits)
            cfg = SkinnyConfig(block_n, _DEFAULT_BLOCK_K, splits)
            us = estimate_us(n, k, m, cfg, num_sms)
            if best is None or us < best[0] * 0.98:  # a clear win only: fewer splits, wider tiles
                best = (us, cfg)
    return best[1]


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether skinny_linear takes x [M, K] @ weight [N, K]^T: CUDA (or the Triton interpreter),
    bf16 / fp16 alike, SKINNY_MIN_M <= M <= SKINNY_MAX_M, unit last strides."""
    return (
        (x.is_cuda or envs.triton_interpret())
        and x.dim() == 2
        and weight.dim() == 2
        and SKINNY_MIN_M <= x.shape[0] <= SKINNY_MAX_M
        and weight.shape[1] == x.shape[1]
        and x.shape[1] > 0
        and weight.shape[0] > 0
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.device == weight.device
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )


def _check_config(cfg: SkinnyConfig) -> None:
    for name in ("block_n", "block_k"):
        value = getattr(cfg, name)
        if value < 16 or value & (value - 1):
            raise ValueError(f"SkinnyConfig.{name} must be a power of two >= 16, got {value}")
    if cfg.split_k < 1 or cfg.num_warps < 1 or cfg.num_stages < 1:
        raise ValueError(f"SkinnyConfig: split_k, num_warps and num_stages must be >= 1, got {cfg}")


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if not supports(x, weight):
        raise ValueError(
            f"skinny_linear does not take x {tuple(x.shape)} {x.dtype} on {x.device} with weight "
            f"{tuple(weight.shape)} {weight.dtype} (see supports(): {SKINNY_MIN_M} <= M <= {SKINNY_MAX_M}, "
            "bf16/fp16 alike, unit last strides, CUDA)"
        )
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype or bias.stride(0) != 1):
        raise ValueError(
            f"skinny_linear: bias must be [{weight.shape[0]}] {x.dtype} contiguous, "
            f"got {tuple(bias.shape)} {bias.dtype}"
        )


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: SkinnyConfig, silu_out: bool
) -> torch.Tensor:
    _check_config(cfg)
    m, k = x.shape
    n = weight.shape[0] // 2 if silu_out else weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    n_tiles = triton.cdiv(n, cfg.block_n)
    splits, k_split = effective_split(k, cfg.block_k, cfg.split_k)
    if splits > 1:
        scratch = _scratch(x.device, splits * m * (2 * n if silu_out else n), n_tiles)
        workspace, counters = scratch.workspace, scratch.counters
    else:
        workspace = counters = out  # not read
    pdl = use_pdl(x)
    _skinny_kernel[(n_tiles, splits)](
        x,
        weight,
        weight if bias is None else bias,
        out,
        workspace,
        counters,
        m,
        n,
        k,
        k_split,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        SILU_OUT=silu_out,
        SPLIT=splits > 1,
        EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=_BLOCK_M,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        USE_PDL=pdl,
        launch_pdl=pdl,
    )
    return out


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: SkinnyConfig | None = None
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, 1 <= M <= 16 (`supports`;
    ValueError otherwise; 1 <= M since SKINNY_MIN_M = 1). config: explicit tiles, else `default_config`."""
    _check_inputs(x, weight, bias)
    if config is None:
        config = default_config(weight.shape[0], x.shape[1], x.shape[0], num_sms(x.device))
    return _launch(x, weight, bias, config, silu_out=False)


def skinny_linear_silu_and_mul(
    x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig | None = None
) -> torch.Tensor:
    """silu_and_mul(x @ weight^T): weight [2 * inter, K] (gate | up), x [M, K] -> [M, inter].
    config.block_n counts features of each half (a program reads 2 * block_n rows of W)."""
    if weight.dim() != 2 or weight.shape[0] % 2:
        raise ValueError(f"skinny_linear_silu_and_mul: weight must be [2 * inter, K], got {tuple(weight.shape)}")
    _check_inputs(x, weight, None)
    if config is None:
        # Tuned as the plain [2 * inter, K] product; a program here reads block_n rows of gate and
        # block_n of up, so halve it to keep the same programs and bytes per program.
        plain = default_config(weight.shape[0], x.shape[1], x.shape[0], num_sms(x.device))
        config = plain._replace(block_n=max(16, plain.block_n // 2))
    return _launch(x, weight, None, config, silu_out=True)
