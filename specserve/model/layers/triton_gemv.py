"""Small-batch linear layers (GEMV) in Triton: y = act(norm(x)) W^T (+ b) for 1 to GEMV_MAX_M rows, each program
owning BLOCK_N output features of every row (fp32 accumulation). A fixed per-GPU table (`tables`) picks tiles and
where the skinny GEMM, early loads or a fused norm win, so results are the same from one start to the next; untuned
shapes use a heuristic up to GEMV_UNTUNED_MAX_M rows. Everything else goes to F.linear (twin: `ops.linear`)."""

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
from specserve.model.layers.ops import unfused_norm
from specserve.model.layers.triton_skinny import SkinnyConfig

# Rows up to which the GEMV may run; past GEMV_UNTUNED_MAX_M only shapes the tuned table picks.
GEMV_MAX_M = 8
GEMV_UNTUNED_MAX_M = 4
_BLOCK_K = 512  # 1 KB of bf16 per weight row per step: 16-byte loads across 4 warps
_MAX_BLOCK_N = 16
NORM_FUSE_MAX_WIDTH = 4  # untuned: the norm is fused only into projections with N <= this * K (`_norm_tiles`)
PREFETCH_MAX_K = 2048  # untuned: early weight loads only for K up to this (Triton pipelines longer loops)
_SKINNY_KINDS = (("plain", "skinny"), ("silu", "skinny_silu"))
CONFIG_DIR = Path(__file__).resolve().parent / "gemv_configs"


class NormFuse(NamedTuple):
    """Whether the fused norm + projection won, and its tiles (None: the projection's own)."""

    fuse: bool
    tiles: tuple[int, int, int] | None


class GemvTables(NamedTuple):
    """A GPU's `gemv_configs/<device name>.json` (each {} without one); keys "N,K,M", M rounded up to a power of 2."""

    configs: dict[str, tuple[int, int, int]]  # (BLOCK_N, BLOCK_K, num_warps), (0, 0, 0) where cuBLAS won
    norm_fuse: dict[str, NormFuse]  # "norm_fuse" {key: bool} with its "norm_fuse_tiles"
    skinny: dict[str, dict[str, SkinnyConfig]]  # {"plain" | "silu": ...} from "skinny" / "skinny_silu"
    prefetch: dict[str, bool]  # whether early weight loads won


@functools.lru_cache(maxsize=8)
def tables(device_name: str) -> GemvTables:
    path = CONFIG_DIR / f"{device_name.replace(' ', '_')}.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    get, fuse_tiles = lambda name: raw.get(name, {}).items(), raw.get("norm_fuse_tiles", {})
    return GemvTables(
        {key: tuple(value) for key, value in get("configs")},
        {k: NormFuse(bool(fuse), tuple(fuse_tiles[k]) if k in fuse_tiles else None) for k, fuse in get("norm_fuse")},
        {kind: {k: SkinnyConfig(*v) for k, v in get(name)} for kind, name in _SKINNY_KINDS},
        {key: bool(value) for key, value in get("prefetch")},
    )


def config_key(n: int, k: int, m: int) -> str:
    return f"{n},{k},{triton.next_power_of_2(m)}"


@functools.lru_cache(maxsize=8)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "interpreter"


def tile_config(n: int, k: int, m: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an [m, k] x [n, k]^T product; BLOCK_N 0 means use cuBLAS."""
    if (tuned := tables(_device_name(device)).configs.get(config_key(n, k, m))) is not None:
        return tuned
    return (0, 0, 0) if m > GEMV_UNTUNED_MAX_M else (block_n_for(n, num_sms(device)), _BLOCK_K, 4)


def block_n_for(n: int, num_sms: int) -> int:
    """Output features per program: the largest power of two <= 16 giving >= 2 programs per SM, or 1."""
    block = _MAX_BLOCK_N
    while block > 1 and triton.cdiv(n, block) < 2 * num_sms:
        block //= 2
    return block


def gemv_max_m() -> int:
    """GEMV_MAX_M, or SPECSERVE_GEMV_MAX_M (0 turns the GEMV off: benchmarks compare with cuBLAS)."""
    return GEMV_MAX_M if (override := envs.gemv_max_m()) is None else override


def _tiles(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int, int] | None:
    """The GEMV's (BLOCK_N, BLOCK_K, num_warps) for x [M, K] @ weight^T, or None where cuBLAS runs."""
    if not triton_skinny.supports(x, weight, gemv_max_m()):
        return None
    tiles = tile_config(weight.shape[0], x.shape[1], x.shape[0], x.device)
    return tiles if tiles[0] > 0 else None


def _silu_tiles(tiles: tuple[int, int, int]) -> tuple[int, int, int]:
    """Tiles tuned for the plain [2N, K] product, BLOCK_N halved for a silu epilogue (gate and up rows)."""
    return max(1, tiles[0] // 2), tiles[1], tiles[2]


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tiles: tuple[int, int, int],
    silu_out: bool = False,
    norm: tuple[torch.Tensor, float, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out [M, N], the new residual [M, K] when `norm` = (weight, eps, residual) has one)."""
    (m, k), n = x.shape, weight.shape[0] // (2 if silu_out else 1)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    norm_w, eps, residual = norm if norm is not None else (None, 0.0, None)
    res_out = None if residual is None else torch.empty((m, k), dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps = tiles
    pdl = use_pdl(x)
    args = (x, weight, weight if bias is None else bias, out, x if residual is None else residual)
    args += (x if res_out is None else res_out, weight if norm_w is None else norm_w, m, n, k)
    args += (x.stride(0), weight.stride(0), out.stride(0), 0 if residual is None else residual.stride(0))
    args += (0 if res_out is None else res_out.stride(0), eps)
    flags = dict(HAS_BIAS=bias is not None, SILU_OUT=silu_out, RMS_NORM=norm is not None)
    flags.update(HAS_RESIDUAL=residual is not None, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n)
    flags.update(BLOCK_K=block_k, PREFETCH=_prefetch(weight.shape[0], k, m, x.device), SINGLE_TILE=block_k >= k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](*args, **flags, num_warps=num_warps, USE_PDL=pdl, launch_pdl=pdl)
    return out, res_out


def _prefetch(n: int, k: int, m: int, device: torch.device) -> bool:
    """Whether the GEMV loads weights early: the table's word, else K <= PREFETCH_MAX_K."""
    tuned = tables(_device_name(device)).prefetch.get(config_key(n, k, m))
    return k <= PREFETCH_MAX_K if tuned is None else tuned


def _skinny(x: torch.Tensor, weight: torch.Tensor, kind: str) -> SkinnyConfig | None:
    """The skinny GEMM's tiles where the tuned table picks it."""
    if x.dim() != 2 or not (x.is_cuda or envs.triton_interpret()):
        return None
    entries = tables(_device_name(x.device)).skinny[kind]
    if not entries or not triton_skinny.supports(x, weight):
        return None
    return entries.get(config_key(weight.shape[0], x.shape[1], x.shape[0]))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N]: the skinny GEMM, the GEMV or cuBLAS."""
    skinny = _skinny(x, weight, "plain")
    if skinny is not None and (bias is None or bias.dtype == x.dtype):
        return triton_skinny.skinny_linear(x, weight, bias, config=skinny)
    tiles = _tiles(x, weight)
    if tiles is None or (bias is not None and bias.dtype != x.dtype):
        return F.linear(x, weight, bias)
    return _launch(x, weight, bias, tiles)[0]


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, silu_and_mul) -> torch.Tensor:
    """silu_and_mul(x @ weight^T): weight [2 * inter, K] (gate | up), x [M, K] -> [M, inter]."""
    even = weight.dim() == 2 and weight.shape[0] % 2 == 0
    skinny = _skinny(x, weight, "silu") if even else None
    if skinny is not None:
        return triton_skinny.skinny_linear(x, weight, None, skinny, silu_out=True)
    tiles = _tiles(x, weight) if even else None
    if tiles is None:
        return silu_and_mul(F.linear(x, weight))
    return _launch(x, weight, None, _silu_tiles(tiles), silu_out=True)[0]


def _norm_tiles(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, weight: torch.Tensor, silu_out: bool
) -> tuple[int, int, int] | None:
    """The fused norm + projection's tiles, or None where the norm runs apart: the table decides, else
    N <= NORM_FUSE_MAX_WIDTH * K (every program re-reads x for its norm)."""
    ok = (
        triton_skinny.supports(x, weight, gemv_max_m())
        and norm_weight.dtype == x.dtype
        and norm_weight.is_contiguous()
        and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape and residual.stride(-1) == 1))
    )
    if not ok or (silu_out and weight.shape[0] % 2):
        return None
    n, k = weight.shape
    entry = tables(_device_name(x.device)).norm_fuse.get(config_key(n, k, x.shape[0]))
    if (entry is None and n > NORM_FUSE_MAX_WIDTH * k) or (entry is not None and not entry.fuse):
        return None
    if entry is not None and entry.tiles is not None:
        return entry.tiles
    tiles = _tiles(x, weight)
    return None if tiles is None else (_silu_tiles(tiles) if silu_out else tiles)


def rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rms_norm,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x (+ residual)) @ weight^T (+ bias) [M, N], the new residual [M, K]), fused where it pays."""
    tiles = _norm_tiles(x, residual, norm_weight, weight, silu_out=False)
    if tiles is None or (bias is not None and bias.dtype != x.dtype):
        h, residual = unfused_norm(x, residual, norm_weight, eps, rms_norm)
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
    """(silu_and_mul(rms_norm(x (+ residual)) @ weight^T) [M, inter], the new residual [M, K])."""
    tiles = _norm_tiles(x, residual, norm_weight, weight, silu_out=True)
    if tiles is None:
        h, residual = unfused_norm(x, residual, norm_weight, eps, rms_norm)
        return linear_silu_and_mul(h, weight, silu_and_mul), residual
    out, res_out = _launch(x, weight, None, tiles, silu_out=True, norm=(norm_weight, eps, residual))
    return out, (x if res_out is None else res_out)
