"""Torch twins of the fused GPU ops (triton_ops.py, same signatures): the CPU path and the test oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [num_tokens, hidden]. With a residual: returns (norm(x + residual), x + residual)."""
    if residual is not None:
        x = residual = x + residual
    x32 = x.float()
    out = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return out if residual is None else (out, residual)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE: q [T, Hq, D], k [T, Hk, D], positions [T], cos_sin_cache [P, D] float32 (cos | sin)."""
    cos, sin = cos_sin_cache.index_select(0, positions)[:, None, :].chunk(2, dim=-1)  # [T, 1, D/2] each

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * intermediate] (gate | up) -> silu(gate) * up, [num_tokens, intermediate]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ weight [out, in]^T (+ bias [out]) -> [T, out]."""
    return F.linear(x, weight, bias)


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The MLP's gate_up projection and activation: silu_and_mul(x @ weight^T), weight [2 * inter, in]."""
    return silu_and_mul(F.linear(x, weight))


def unfused_norm(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, rms_norm=rms_norm
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x (+ residual)), the new residual: x + residual, or x itself without one)."""
    return (rms_norm(x, norm_weight, eps), x) if residual is None else rms_norm(x, norm_weight, eps, residual)


def rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A norm and the projection after it: (rms_norm(x (+ residual)) @ weight^T (+ bias), new residual)."""
    h, residual = unfused_norm(x, residual, norm_weight, eps)
    return F.linear(h, weight, bias), residual


def rms_norm_linear_silu_and_mul(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu_and_mul(rms_norm(x (+ residual)) @ weight^T) [T, inter], new residual); weight (gate | up)."""
    h, residual = unfused_norm(x, residual, norm_weight, eps)
    return silu_and_mul(F.linear(h, weight)), residual
