"""Fused Triton versions of `ops.py` (same signatures and roundings; ops.py is the test oracle)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from specserve.kernels.pdl import pdl_prologue, use_pdl
from specserve.kernels.rope import apply_rope  # noqa: F401  (the ops interface)
from specserve.model.layers import triton_gemv


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * hidden + offs, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, 0) / hidden
    normed = (xf * tl.rsqrt(mean_sq + eps)).to(x.dtype)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * hidden + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [num_tokens, hidden] (last dim contiguous). With a residual: (norm(x + residual), x + residual)."""
    num_tokens, hidden = x.shape
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty((num_tokens, hidden), dtype=torch.promote_types(sum_dtype, weight.dtype), device=x.device)
    new_residual = None if residual is None else torch.empty((num_tokens, hidden), dtype=sum_dtype, device=x.device)
    if num_tokens:
        block = triton.next_power_of_2(hidden)
        pdl = use_pdl(x)
        res_in = x if residual is None else residual
        res_out = x if new_residual is None else new_residual
        args = (x, res_in, weight, out, res_out, x.stride(0), res_in.stride(0))
        flags = dict(HAS_RESIDUAL=residual is not None, BLOCK=block, USE_PDL=pdl, launch_pdl=pdl)
        flags["num_warps"] = 4 if block <= 1024 else (8 if block <= 4096 else 16)
        _rms_norm_kernel[(num_tokens,)](*args, hidden, eps, **flags)
    return out if new_residual is None else (out, new_residual)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, inter, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0)
    # Rounding as the twin: silu to the activation dtype, then the product (exact in fp32: one rounding).
    act = (gate * tl.sigmoid(gate)).to(up.dtype).to(tl.float32)
    tl.store(out_ptr + row * inter + offs, (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * intermediate] (gate | up) -> silu(gate) * up in one pass."""
    num_tokens, two_inter = x.shape
    inter = two_inter // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    if num_tokens:
        block = 1024
        pdl = use_pdl(x)
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            x, out, x.stride(0), inter, BLOCK=block, num_warps=4, USE_PDL=pdl, launch_pdl=pdl
        )
    return out


linear = triton_gemv.linear
linear_silu_and_mul = functools.partial(triton_gemv.linear_silu_and_mul, silu_and_mul=silu_and_mul)
rms_norm_linear = functools.partial(triton_gemv.rms_norm_linear, rms_norm=rms_norm)
rms_norm_linear_silu_and_mul = functools.partial(
    triton_gemv.rms_norm_linear_silu_and_mul, rms_norm=rms_norm, silu_and_mul=silu_and_mul
)
