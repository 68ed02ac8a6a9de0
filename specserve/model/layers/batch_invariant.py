"""Batch-invariant layer ops (`--batch-invariant`): a token row's result never depends on how many other
rows share its forward. Every projection runs as torch.mm over fixed-size row chunks (the last one
zero-padded), so each row meets the same GEMM shape, kernel and reduction order at any batch size;
the M-dependent kernel choices of triton_gemv (GEMV / skinny / fused norm+GEMM) are never taken.
Norms, RoPE and the activation are per-row already (ops.py, triton_ops.py) and are reused."""

from __future__ import annotations

import types
from types import ModuleType

import torch

from specserve.model.layers import ops as torch_ops

T = torch.Tensor

# Rows per GEMM. CUDA: a 256-row bf16 GEMM is still bandwidth-bound on H100/H200, so a decode step
# costs about one weight read as before; CPU GEMMs are compute-bound, so padding is kept small there.
CHUNK_ROWS = {"cuda": 256, "cpu": 8}


def chunk_rows(device: torch.device) -> int:
    return CHUNK_ROWS.get(device.type, CHUNK_ROWS["cpu"])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ weight [out, in]^T (+ bias [out]) -> [T, out], T rows in fixed chunks of chunk_rows."""
    num_rows, rows = x.shape[0], chunk_rows(x.device)
    padded = -(-num_rows // rows) * rows
    # A fresh buffer: every chunk starts at the same alignment (some BLAS paths depend on it).
    xp = x.new_zeros((padded, x.shape[1]))
    xp[:num_rows] = x
    out = x.new_empty((padded, weight.shape[0]))
    wt = weight.t()
    for start in range(0, padded, rows):
        torch.mm(xp[start : start + rows], wt, out=out[start : start + rows])
    out = out[:num_rows]
    return out if bias is None else out + bias


def make_ops(base: ModuleType) -> ModuleType:
    """The ops interface of `base` (ops.py or triton_ops.py) with every projection through `linear`."""
    silu_and_mul, rms_norm = base.silu_and_mul, base.rms_norm

    def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(linear(x, weight))

    def rms_norm_linear(x: T, residual: T | None, norm_weight: T, eps: float, weight: T, bias: T | None) -> tuple[T, T]:
        h, residual = torch_ops.unfused_norm(x, residual, norm_weight, eps, rms_norm=rms_norm)
        return linear(h, weight, bias), residual

    def rms_norm_linear_silu_and_mul(x: T, residual: T | None, norm_weight: T, eps: float, weight: T) -> tuple[T, T]:
        h, residual = torch_ops.unfused_norm(x, residual, norm_weight, eps, rms_norm=rms_norm)
        return silu_and_mul(linear(h, weight)), residual

    ops = types.ModuleType(f"{base.__name__}.batch_invariant")
    ops.__dict__.update(rms_norm=rms_norm, apply_rope=base.apply_rope, silu_and_mul=silu_and_mul, linear=linear)
    ops.__dict__.update(linear_silu_and_mul=linear_silu_and_mul, unfused_norm=torch_ops.unfused_norm)
    ops.rms_norm_linear, ops.rms_norm_linear_silu_and_mul = rms_norm_linear, rms_norm_linear_silu_and_mul
    return ops
