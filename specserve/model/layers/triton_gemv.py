"""Small-batch linear layers (GEMV) in Triton: y = act(x) W^T (+ b) for 1 to GEMV_MAX_M rows.

At batch 1 a decode step is bound by reading the weights. This kernel streams W once: each program
owns BLOCK_N output features (whole rows of W) for every row of x, accumulates in fp32 and adds the
bias in the epilogue; no split-K, so one launch. Where BLOCK_K >= K one tile covers the reduction
and, with PREFETCH, every weight load is issued before the PDL wait (no kernel writes weights).

Tiles come from a per-GPU table written by bench/gemv_tune.py (`gemv_configs/<device name>.json`):
"N,K,M" (M rounded up to a power of two) -> [BLOCK_N, BLOCK_K, num_warps], [0, 0, 0] where cuBLAS
won; "prefetch", "norm_fuse" and "skinny" say per shape where the early loads, a fused norm and the
tensor-core skinny GEMM (triton_skinny.py) won. Untuned shapes use a heuristic up to
GEMV_UNTUNED_MAX_M rows. A fixed table (no autotuning at start) keeps the kernels, hence the bf16
rounding and greedy output, the same from one start to the next.

Fusions, one launch fewer each: `rms_norm_linear` (residual add + RMSNorm, rounded as
`ops.rms_norm`, as the qkv projection's prologue), `linear_silu_and_mul` (the MLP's activation as
gate_up's epilogue: a program owns the same features of gate and up), and both for the
post-attention norm. Only bfloat16 / float16 with M <= GEMV_MAX_M on CUDA take this path; the rest
goes to `torch.nn.functional.linear`, the reference (twin: `ops.linear`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton

from specserve import envs
from specserve.kernels.device import num_sms
from specserve.kernels.pdl import use_pdl
from specserve.model.layers import triton_skinny
from specserve.model.layers.gemv_kernel import _gemv_kernel
from specserve.model.layers.triton_skinny import SkinnyConfig

# Rows of x up to which the GEMV may run (batch 1-8 decode, a batch-1 verify of k <= 7): every row
# costs CUDA-core FMAs, so past GEMV_UNTUNED_MAX_M rows only shapes the tuned table picks take it.
GEMV_MAX_M = 8
GEMV_UNTUNED_MAX_M = 4
_BLOCK_K = 512  # 1 KB of bf16 per weight row per step: 16-byte loads across 4 warps
_MAX_BLOCK_N = 16
# Without a tuned "norm_fuse" entry, the norm is fused only into projections with N <= this * K
# (qkv, not gate_up): see `_norm_tiles`.
NORM_FUSE_MAX_WIDTH = 4
# Without a tuned "prefetch" entry, the one-step-ahead weight loads only where K is at most this:
# longer loops Triton pipelines better by itself.
PREFETCH_MAX_K = 2048


CONFIG_DIR = Path(__file__).resolve().parent / "gemv_configs"


class NormFuse(NamedTuple):
    """A tuned table's word on one norm + projection: whether the fused launch measured faster than
    the norm kernel and the projection apart, and the tiles it was measured with (None: the
    projection's own entry, halved for a silu epilogue)."""

    fuse: bool
    tiles: tuple[int, int, int] | None


def _table_file(device_name: str) -> dict:
    path = CONFIG_DIR / f"{device_name.replace(' ', '_')}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


@functools.lru_cache(maxsize=8)
def config_table(device_name: str) -> dict[str, tuple[int, int, int]]:
    """The tuned tiles for a GPU (its `torch.cuda.get_device_name()`), {} when none were measured."""
    return {key: tuple(value) for key, value in _table_file(device_name).get("configs", {}).items()}


@functools.lru_cache(maxsize=8)
def norm_fuse_table(device_name: str) -> dict[str, NormFuse]:
    """The tuned norm fusions for a GPU, {} when none were measured (older tables have none).
    In the JSON: "norm_fuse" {"N,K,M": true | false} (weight [N, K]: for gate_up N = 2 * inter) and
    "norm_fuse_tiles" {"N,K,M": [BLOCK_N, BLOCK_K, num_warps]} for the true ones, as `_launch` takes
    them (with a silu epilogue BLOCK_N counts the gate's rows, as in `linear_silu_and_mul`)."""
    table = _table_file(device_name)
    tiles = table.get("norm_fuse_tiles", {})
    return {
        key: NormFuse(bool(fuse), tuple(tiles[key]) if key in tiles else None)
        for key, fuse in table.get("norm_fuse", {}).items()
    }


@functools.lru_cache(maxsize=8)
def skinny_table(device_name: str) -> dict[str, dict[str, SkinnyConfig]]:
    """Where the tensor-core skinny GEMM (triton_skinny.py) measured faster than both the GEMV and
    cuBLAS: {"plain": {"N,K,M": SkinnyConfig}, "silu": {...}}, from the JSON's "skinny" and
    "skinny_silu" objects ("N,K,M" -> [block_n, block_k, split_k, num_warps, num_stages]; for silu N is
    the [gate | up] weight's rows and block_n counts each half's features). Written by
    bench/skinny_bench.py --write; {} each without one."""
    table = _table_file(device_name)
    return {
        kind: {key: SkinnyConfig(*value) for key, value in table.get(name, {}).items()}
        for kind, name in (("plain", "skinny"), ("silu", "skinny_silu"))
    }


@functools.lru_cache(maxsize=8)
def prefetch_table(device_name: str) -> dict[str, bool]:
    """Where the tuner measured the early weight loads (PREFETCH) on or off for a shape's tuned tiles:
    "prefetch" {"N,K,M": true | false} in the JSON (weight [N, K]); {} without one (older tables)."""
    return {key: bool(value) for key, value in _table_file(device_name).get("prefetch", {}).items()}


def clear_tables() -> None:
    """Forget the tables read so far (bench/gemv_tune.py after writing one)."""
    prefetch_table.cache_clear()
    config_table.cache_clear()
    norm_fuse_table.cache_clear()
    skinny_table.cache_clear()


def config_key(n: int, k: int, m: int) -> str:
    return f"{n},{k},{triton.next_power_of_2(m)}"


@functools.lru_cache(maxsize=8)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "interpreter"


def tile_config(n: int, k: int, m: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an [m, k] x [n, k]^T product; BLOCK_N 0 means use cuBLAS."""
    tuned = config_table(_device_name(device)).get(config_key(n, k, m))
    if tuned is not None:
        return tuned
    if m > GEMV_UNTUNED_MAX_M:
        return 0, 0, 0
    return block_n_for(n, num_sms(device)), _BLOCK_K, 4


def block_n_for(n: int, num_sms: int) -> int:
    """Output features per program: the largest power of two <= 16 that still gives >= 2 programs
    per SM (so no SM idles on a short matrix), at least 1."""
    block = _MAX_BLOCK_N
    while block > 1 and triton.cdiv(n, block) < 2 * num_sms:
        block //= 2
    return block


def gemv_max_m() -> int:
    """GEMV_MAX_M, or SPECSERVE_GEMV_MAX_M (0 turns the GEMV off: benchmarks compare with cuBLAS)."""
    override = envs.gemv_max_m()
    return GEMV_MAX_M if override is None else override


def _gemv_ok(x: torch.Tensor, weight: torch.Tensor, k: int) -> bool:
    """Whether the GEMV may take x [M, k] @ weight^T at all: at most gemv_max_m() rows, bf16/fp16 on
    CUDA (or the interpreter), both with a contiguous last dim."""
    return (
        (x.is_cuda or envs.triton_interpret())
        and x.dim() == 2
        and 0 < x.shape[0] <= gemv_max_m()
        and weight.dim() == 2
        and weight.shape[1] == k
        and x.dtype == weight.dtype
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
    )


def _tiles(x: torch.Tensor, weight: torch.Tensor, k: int) -> tuple[int, int, int] | None:
    """The GEMV's (BLOCK_N, BLOCK_K, num_warps) for x [M, k] @ weight^T, or None where cuBLAS runs:
    not `_gemv_ok`, or a table entry saying cuBLAS won."""
    if not _gemv_ok(x, weight, k):
        return None
    tiles = tile_config(weight.shape[0], k, x.shape[0], x.device)
    return tiles if tiles[0] > 0 else None


def _silu_tiles(tiles: tuple[int, int, int]) -> tuple[int, int, int]:
    """Tiles tuned for the plain [2N, K] product, for its silu epilogue: a program then reads BLOCK_N
    rows of gate and BLOCK_N of up, so BLOCK_N is halved to match."""
    block_n, block_k, num_warps = tiles
    return max(1, block_n // 2), block_k, num_warps


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tiles: tuple[int, int, int],
    silu_out: bool = False,
    norm: tuple[torch.Tensor, float, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (out [M, N], the new residual [M, K] when `norm` = (weight, eps, residual) has one).
    tiles: (BLOCK_N, BLOCK_K, num_warps), from `_tiles` (or bench/gemv_tune.py's sweep); BLOCK_K >= K
    takes the single-tile path (the norm from the same tile, no pre-pass over x).
    silu_out: weight is [2N, K] (gate | up) and out is silu(gate) * up; it combines with `norm`."""
    m = x.shape[0]
    n, k = weight.shape
    if silu_out:
        n //= 2
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    norm_w, eps, residual = norm if norm is not None else (None, 0.0, None)
    res_out = None if residual is None else torch.empty((m, k), dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps = tiles
    pdl = use_pdl(x)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        weight,
        weight if bias is None else bias,
        out,
        x if residual is None else residual,
        x if res_out is None else res_out,
        weight if norm_w is None else norm_w,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        0 if residual is None else residual.stride(0),
        0 if res_out is None else res_out.stride(0),
        eps,
        HAS_BIAS=bias is not None,
        SILU_OUT=silu_out,
        RMS_NORM=norm is not None,
        HAS_RESIDUAL=residual is not None,
        BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        USE_PDL=pdl,
        launch_pdl=pdl,
        PREFETCH=_prefetch(weight.shape[0], k, m, x.device),
        SINGLE_TILE=block_k >= k,
    )
    return out, res_out


def _prefetch(n: int, k: int, m: int, device: torch.device) -> bool:
    """Whether the GEMV requests its weights early (the next tile one loop step ahead; a single tile
    all before the PDL wait) for weight [n, k] and m rows: the tuned table's word for this shape
    (`prefetch_table`), else for short reductions (K <= PREFETCH_MAX_K)."""
    tuned = prefetch_table(_device_name(device)).get(config_key(n, k, m))
    return tuned if tuned is not None else k <= PREFETCH_MAX_K


def _skinny(x: torch.Tensor, weight: torch.Tensor, kind: str) -> SkinnyConfig | None:
    """The skinny GEMM's tiles for x [M, K] @ weight^T where the tuned table picks it ("plain" or
    "silu"), else None. Speculative verification (k + 1 rows) and batch 2-16 decode take it."""
    if x.dim() != 2 or not (x.is_cuda or envs.triton_interpret()):
        return None
    # The table first: every linear of a step asks, and a GPU without skinny entries answers here.
    entries = skinny_table(_device_name(x.device))[kind]
    if not entries or not triton_skinny.supports(x, weight):
        return None
    return entries.get(config_key(weight.shape[0], x.shape[1], x.shape[0]))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N]: the skinny GEMM where the table picks it,
    else the GEMV for small M, else cuBLAS."""
    skinny = _skinny(x, weight, "plain")
    if skinny is not None and (bias is None or bias.dtype == x.dtype):
        return triton_skinny.skinny_linear(x, weight, bias, config=skinny)
    tiles = _tiles(x, weight, x.shape[-1])
    if tiles is None or (bias is not None and bias.dtype != x.dtype):
        return F.linear(x, weight, bias)
    return _launch(x, weight, bias, tiles)[0]


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, silu_and_mul) -> torch.Tensor:
    """silu_and_mul(x @ weight^T): weight [2 * inter, K] (gate | up), x [M, K] -> [M, inter].
    `silu_and_mul` is the unfused activation for shapes the GEMV does not take."""
    even = weight.dim() == 2 and weight.shape[0] % 2 == 0
    skinny = _skinny(x, weight, "silu") if even else None
    if skinny is not None:
        return triton_skinny.skinny_linear_silu_and_mul(x, weight, config=skinny)
    tiles = _tiles(x, weight, x.shape[-1]) if even else None
    if tiles is None:
        return silu_and_mul(F.linear(x, weight))
    return _launch(x, weight, None, _silu_tiles(tiles), silu_out=True)[0]


def _norm_tiles(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, weight: torch.Tensor, silu_out: bool
) -> tuple[int, int, int] | None:
    """The fused norm + projection's tiles for x [M, K] @ weight^T, or None where the norm runs as its
    own kernel. The tuned table's "norm_fuse" entry decides where it has one. Without one: only
    projections with N <= NORM_FUSE_MAX_WIDTH * K, since every program of the multi-tile path re-reads
    x for its norm (cheap for qkv, more bytes than the weight for the many narrow programs of gate_up)."""
    ok = (
        _gemv_ok(x, weight, x.shape[-1])
        and norm_weight.dtype == x.dtype
        and norm_weight.is_contiguous()
        and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape and residual.stride(-1) == 1))
    )
    if not ok or (silu_out and weight.shape[0] % 2):
        return None
    n, k = weight.shape
    entry = norm_fuse_table(_device_name(x.device)).get(config_key(n, k, x.shape[0]))
    if (entry is None and n > NORM_FUSE_MAX_WIDTH * k) or (entry is not None and not entry.fuse):
        return None
    if entry is not None and entry.tiles is not None:
        return entry.tiles
    tiles = _tiles(x, weight, k)
    return None if tiles is None else (_silu_tiles(tiles) if silu_out else tiles)


def _unfused_norm(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, rms_norm
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x (+ residual)), the new residual: x + residual, or x itself without one)."""
    if residual is None:
        return rms_norm(x, norm_weight, eps), x
    return rms_norm(x, norm_weight, eps, residual)


def rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rms_norm,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's norm and the projection after it in one launch for a few rows:
    h = rms_norm(x (+ residual)) [M, K]; returns (h @ weight^T (+ bias) [M, N], the new residual:
    x + residual, or x itself without one). `rms_norm` is the unfused norm for other shapes, and
    for those where the norm does not pay (`_norm_tiles`)."""
    tiles = _norm_tiles(x, residual, norm_weight, weight, silu_out=False)
    if tiles is None or (bias is not None and bias.dtype != x.dtype):
        h, residual = _unfused_norm(x, residual, norm_weight, eps, rms_norm)
        return linear(h, weight, bias), residual
    out, res_out = _launch(x, weight, bias, tiles, norm=(norm_weight, eps, residual))
    return out, (x if res_out is None else res_out)


def rms_norm_linear_silu_and_mul(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    rms_norm,
    silu_and_mul,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The post-attention norm, gate_up and the MLP's activation in one launch for a few rows:
    h = rms_norm(x (+ residual)) [M, K]; returns (silu_and_mul(h @ weight^T) [M, inter], the new
    residual [M, K]), weight [2 * inter, K] (gate | up). Where the fusion is not possible or the
    tuned table does not say it pays (`_norm_tiles`), the norm runs apart (`rms_norm`) and then
    `linear_silu_and_mul` (`silu_and_mul` being its unfused activation)."""
    tiles = _norm_tiles(x, residual, norm_weight, weight, silu_out=True)
    if tiles is None:
        h, residual = _unfused_norm(x, residual, norm_weight, eps, rms_norm)
        return linear_silu_and_mul(h, weight, silu_and_mul), residual
    out, res_out = _launch(x, weight, None, tiles, silu_out=True, norm=(norm_weight, eps, residual))
    return out, (x if res_out is None else res_out)
