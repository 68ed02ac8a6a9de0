"""Fused RMSNorm (+ residual) and RoPE kernels against their torch twins (model/layers/ops.py)."""
from __future__ import annotations

import pytest
import torch

from specserve.model.layers import ops

# Outputs may differ from the twin by rounding of fp32 intermediates (sum order, rsqrt): ~1 ulp.
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: torch.Generator,
           scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def cos_sin_cache(max_positions: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()  # [max_positions, head_dim]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [576, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, hidden: int, with_residual: bool, device: torch.device) -> None:
    from specserve.model.layers import triton_ops

    gen = torch.Generator().manual_seed(hidden + with_residual)
    num_tokens = 37
    wide = _randn((num_tokens, hidden + 64), dtype, device, gen, 3.0)
    x = wide[:, :hidden]  # a row-strided view
    residual = _randn((num_tokens, hidden), dtype, device, gen, 3.0) if with_residual else None
    weight = _randn((hidden,), dtype, device, gen) + 1.0
    eps = 1e-6
    got = triton_ops.rms_norm(x, weight, eps, residual)
    want = ops.rms_norm(x, weight, eps, residual)
    if with_residual:
        (got, got_res), (want, want_res) = got, want
        torch.testing.assert_close(got_res, want_res, rtol=0, atol=0)  # the same single rounding
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=RTOL[dtype], atol=RTOL[dtype])


def test_rms_norm_fp32_weight_bf16_activations(device: torch.device) -> None:
    from specserve.model.layers import triton_ops

    gen = torch.Generator().manual_seed(5)
    x = _randn((9, 896), torch.bfloat16, device, gen)
    weight = _randn((896,), torch.float32, device, gen)
    got, want = triton_ops.rms_norm(x, weight, 1e-5), ops.rms_norm(x, weight, 1e-5)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 8, 128), (9, 3, 64), (12, 2, 128)])
def test_apply_rope_in_place(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                             device: torch.device) -> None:
    from specserve.model.layers import triton_ops

    gen = torch.Generator().manual_seed(num_heads * head_dim)
    num_tokens, max_positions = 45, 40000
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = _randn((num_tokens, q_size + 2 * kv_size), dtype, device, gen)
    positions = torch.randint(0, max_positions, (num_tokens,), generator=gen).to(device)
    cache = cos_sin_cache(max_positions, head_dim).to(device)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v_before = v.clone()
    want_q, want_k = ops.apply_rope(q.clone(), k.clone(), positions, cache)
    got_q, got_k = triton_ops.apply_rope(q, k, positions, cache)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(qkv[:, q_size:q_size + kv_size].view_as(k), want_k, rtol=RTOL[dtype], atol=RTOL[dtype])
    torch.testing.assert_close(got_q, want_q, rtol=RTOL[dtype], atol=RTOL[dtype])
    assert torch.equal(v, v_before), "RoPE wrote outside q and k"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inter", [1536, 8960, 100])
def test_silu_and_mul(dtype: torch.dtype, inter: int, device: torch.device) -> None:
    from specserve.model.layers import triton_ops

    x = torch.randn(37, 2 * inter, dtype=dtype, device=device)
    got = triton_ops.silu_and_mul(x)
    ref = ops.silu_and_mul(x)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert got.shape == ref.shape
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
