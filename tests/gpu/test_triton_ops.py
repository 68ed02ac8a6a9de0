"""Fused RMSNorm (+ residual) and RoPE kernels against their torch twins (model/layers/ops.py)."""

from __future__ import annotations

import pytest
import torch

from specserve.model.layers import ops

# Outputs may differ from the twin by rounding of fp32 intermediates (sum order, rsqrt): ~1 ulp.
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _randn(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: torch.Generator, scale: float = 1.0
) -> torch.Tensor:
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
def test_apply_rope_in_place(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device
) -> None:
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
    torch.testing.assert_close(qkv[:, q_size : q_size + kv_size].view_as(k), want_k, rtol=RTOL[dtype], atol=RTOL[dtype])
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


def _linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp64 product rounded once to the activation dtype: what an fp32-accumulating kernel approaches."""
    out = x.double() @ weight.double().T
    return (out if bias is None else out + bias.double()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize(
    "n,k,with_bias", [(2048, 1536, True), (1536, 1536, False), (100, 200, True), (37, 1100, False)]
)
def test_gemv_linear(
    dtype: torch.dtype, m: int, n: int, k: int, with_bias: bool, device: torch.device, interpreting: bool
) -> None:
    """The GEMV (rows <= GEMV_MAX_M) against an fp64 reference and cuBLAS; ragged N and K are masked."""
    from specserve.model.layers import triton_ops

    if interpreting and n * k > 2048 * 1536 // 4:
        n, k = n // 4, k // 4
    gen = torch.Generator().manual_seed(m * n + k)
    x = _randn((m, k + 8), dtype, device, gen)[:, :k]  # a row-strided view
    weight = _randn((n, k), dtype, device, gen, k**-0.5)
    bias = _randn((n,), dtype, device, gen) if with_bias else None
    got = triton_ops.linear(x, weight, bias)
    want = _linear_ref(x, weight, bias)
    assert got.shape == (m, n) and got.dtype == dtype
    # One rounding of an fp32 sum: within a unit of the output dtype's last place, as cuBLAS is.
    torch.testing.assert_close(got, want, rtol=RTOL[dtype], atol=RTOL[dtype])
    if device.type == "cuda":
        torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), rtol=RTOL[dtype], atol=RTOL[dtype])


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("inter,k", [(1000, 384), (8960 // 4, 1536 // 4), (37, 100)])
def test_gemv_linear_silu_and_mul(m: int, inter: int, k: int, device: torch.device) -> None:
    """gate_up with the activation as its epilogue: the unfused pair's roundings (gate and up to bf16,
    silu to bf16, the product), so the result matches it to one rounding of the projection."""
    from specserve.model.layers import triton_ops

    gen = torch.Generator().manual_seed(inter + m)
    x = _randn((m, k), torch.bfloat16, device, gen, 2.0)
    weight = _randn((2 * inter, k), torch.bfloat16, device, gen, k**-0.5)
    got = triton_ops.linear_silu_and_mul(x, weight)
    want = ops.silu_and_mul(_linear_ref(x, weight, None))
    assert got.shape == (m, inter)
    torch.testing.assert_close(got, want, rtol=RTOL[torch.bfloat16], atol=RTOL[torch.bfloat16])


def test_gemv_block_n_fills_the_sms() -> None:
    """Without a tuned entry: the widest BLOCK_N (<= 16) that still gives >= 2 programs per SM."""
    from specserve.model.layers import triton_gemv

    assert triton_gemv.block_n_for(2048, 132) == 4  # 2048 / 8 = 256 programs would be < 264
    assert triton_gemv.block_n_for(28672, 132) == 16
    assert triton_gemv.block_n_for(100, 132) == 1


def test_gemv_falls_back_past_max_m(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows past GEMV_MAX_M, fp32, and SPECSERVE_GEMV_MAX_M=0 all take F.linear (bitwise its output)."""
    from specserve.model.layers import triton_gemv

    gen = torch.Generator().manual_seed(3)
    weight = _randn((64, 96), torch.bfloat16, device, gen)
    many = _randn((triton_gemv.GEMV_MAX_M + 1, 96), torch.bfloat16, device, gen)
    assert torch.equal(triton_gemv.linear(many, weight), torch.nn.functional.linear(many, weight))
    x32 = _randn((1, 96), torch.float32, device, gen)
    w32 = weight.float()
    assert torch.equal(triton_gemv.linear(x32, w32), torch.nn.functional.linear(x32, w32))
    one = many[:1]
    monkeypatch.setenv("SPECSERVE_GEMV_MAX_M", "0")
    assert torch.equal(triton_gemv.linear(one, weight), torch.nn.functional.linear(one, weight))


@pytest.mark.parametrize("m", [5, 8])
def test_gemv_past_untuned_rows_only_with_a_table_entry(
    m: int, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """5..GEMV_MAX_M rows (a verify of k = 4..7): cuBLAS (bitwise F.linear) unless the tuned table has
    an entry for (N, K, 8); with one, the GEMV runs those tiles, within one rounding of fp64."""
    from specserve.model.layers import triton_gemv

    gen = torch.Generator().manual_seed(m)
    n, k = 48, 96
    x = _randn((m, k), torch.bfloat16, device, gen)
    weight = _randn((n, k), torch.bfloat16, device, gen, k**-0.5)
    bias = _randn((n,), torch.bfloat16, device, gen)
    assert triton_gemv.GEMV_UNTUNED_MAX_M < m <= triton_gemv.GEMV_MAX_M
    _patch_tables(monkeypatch, configs={})
    assert torch.equal(triton_gemv.linear(x, weight, bias), torch.nn.functional.linear(x, weight, bias))
    launched: list[tuple[int, int, int]] = []
    real_launch = triton_gemv._launch
    monkeypatch.setattr(
        triton_gemv,
        "_launch",
        lambda x_, w_, b_, tiles, **kw: launched.append(tiles) or real_launch(x_, w_, b_, tiles, **kw),
    )
    _patch_tables(monkeypatch, configs={triton_gemv.config_key(n, k, m): (4, 128, 4)})
    got = triton_gemv.linear(x, weight, bias)
    assert launched == [(4, 128, 4)]
    torch.testing.assert_close(got, _linear_ref(x, weight, bias), rtol=RTOL[torch.bfloat16], atol=RTOL[torch.bfloat16])


@pytest.mark.parametrize("m", [1, 2, 4, 9])
@pytest.mark.parametrize("with_residual,with_bias", [(True, True), (False, False), (True, False)])
def test_rms_norm_linear(
    m: int, with_residual: bool, with_bias: bool, device: torch.device, interpreting: bool
) -> None:
    """The fused norm + projection: the new residual bitwise as the unfused norm's; the product within
    one rounding of an fp64 product of the twin's normalized rows. m = 9 takes the unfused path."""
    from specserve.model.layers import triton_ops

    k, n = (384, 200) if interpreting else (1536, 2048)
    gen = torch.Generator().manual_seed(m * 10 + with_residual)
    dtype = torch.bfloat16
    x = _randn((m, k), dtype, device, gen, 3.0)
    residual = _randn((m, k), dtype, device, gen, 3.0) if with_residual else None
    norm_w = _randn((k,), dtype, device, gen) + 1.0
    weight = _randn((n, k), dtype, device, gen, k**-0.5)
    bias = _randn((n,), dtype, device, gen) if with_bias else None
    got, got_res = triton_ops.rms_norm_linear(x, residual, norm_w, 1e-6, weight, bias)
    if residual is None:
        h, want_res = ops.rms_norm(x, norm_w, 1e-6), x
    else:
        h, want_res = ops.rms_norm(x, norm_w, 1e-6, residual)
    assert torch.equal(got_res, want_res)
    torch.testing.assert_close(got, _linear_ref(h, weight, bias), rtol=RTOL[dtype], atol=RTOL[dtype])


def _norm_ref(
    x: torch.Tensor, residual: torch.Tensor | None, norm_w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin's (normalized rows, new residual): rms_norm(x (+ residual)), and x + residual or x."""
    if residual is None:
        return ops.rms_norm(x, norm_w, eps), x
    return ops.rms_norm(x, norm_w, eps, residual)


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("k,block_k", [(200, 256), (256, 256), (600, 256)])  # one ragged tile, one exact, a loop
@pytest.mark.parametrize(
    "norm,with_residual,with_bias",
    [(False, False, True), (False, False, False), (True, False, False), (True, True, True)],
)
def test_gemv_single_tile(
    m: int, k: int, block_k: int, norm: bool, with_residual: bool, with_bias: bool, device: torch.device
) -> None:
    """BLOCK_K >= K takes the single-tile path (the norm from the tile it loaded, no pre-pass); K > BLOCK_K
    the loop. Both against the torch twins: the new residual bitwise, the product within one rounding."""
    from specserve.model.layers import triton_gemv

    gen = torch.Generator().manual_seed(m * 1000 + k + 10 * norm + with_residual)
    dtype, n, eps = torch.bfloat16, 37, 1e-6  # ragged N: the last program masks 3 of its 4 features
    x = _randn((m, k + 8), dtype, device, gen, 3.0)[:, :k]  # a row-strided view
    residual = _randn((m, k), dtype, device, gen, 3.0) if with_residual else None
    norm_w = _randn((k,), dtype, device, gen) + 1.0
    weight = _randn((n, k), dtype, device, gen, k**-0.5)
    bias = _randn((n,), dtype, device, gen) if with_bias else None
    got, got_res = triton_gemv._launch(x, weight, bias, (4, block_k, 4), norm=(norm_w, eps, residual) if norm else None)
    h, want_res = _norm_ref(x, residual, norm_w, eps) if norm else (x, None)
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got, _linear_ref(h, weight, bias), rtol=RTOL[dtype], atol=RTOL[dtype])
    if with_residual:
        assert torch.equal(got_res, want_res)
    else:
        assert got_res is None


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("k,block_k", [(200, 256), (512, 512), (600, 256)])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("prefetch", [True, False])  # a single tile's weight loads before / after the PDL wait
def test_gemv_norm_silu_launch(
    m: int,
    k: int,
    block_k: int,
    with_residual: bool,
    prefetch: bool,
    device: torch.device,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Norm prologue and silu epilogue in one launch = rms_norm, then gate_up, then silu_and_mul."""
    from specserve.model.layers import triton_gemv

    monkeypatch.setattr(triton_gemv, "_prefetch", lambda *args: prefetch)  # either way the tuned table says
    gen = torch.Generator().manual_seed(m * 1000 + k + with_residual)
    dtype, inter, eps = torch.bfloat16, 37, 1e-6
    x = _randn((m, k), dtype, device, gen, 3.0)
    residual = _randn((m, k), dtype, device, gen, 3.0) if with_residual else None
    norm_w = _randn((k,), dtype, device, gen) + 1.0
    weight = _randn((2 * inter, k), dtype, device, gen, k**-0.5)
    got, got_res = triton_gemv._launch(x, weight, None, (4, block_k, 4), silu_out=True, norm=(norm_w, eps, residual))
    h, want_res = _norm_ref(x, residual, norm_w, eps)
    assert got.shape == (m, inter)
    torch.testing.assert_close(got, ops.silu_and_mul(_linear_ref(h, weight, None)), rtol=RTOL[dtype], atol=RTOL[dtype])
    assert (got_res is None) if residual is None else torch.equal(got_res, want_res)


def _patch_tables(monkeypatch: pytest.MonkeyPatch, **fields) -> None:
    """The tuned tables with `fields` replaced (GemvTables field names)."""
    from specserve.model.layers import triton_gemv

    real = triton_gemv.tables
    monkeypatch.setattr(triton_gemv, "tables", lambda name: real(name)._replace(**fields))


def _spy_launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, bool]]:
    """Record (norm fused, silu fused) of every GEMV launch."""
    from specserve.model.layers import triton_gemv

    calls, launch = [], triton_gemv._launch

    def spy(x, weight, bias, tiles, silu_out=False, norm=None):
        calls.append((norm is not None, silu_out))
        return launch(x, weight, bias, tiles, silu_out=silu_out, norm=norm)

    monkeypatch.setattr(triton_gemv, "_launch", spy)
    return calls


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("entry", [None, True, False])  # no table entry: the width rule (gate_up: unfused)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_linear_silu_and_mul(
    m: int, entry: bool | None, with_residual: bool, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The post-attention norm + gate_up + silu: fused iff the tuned table's "norm_fuse" entry says true,
    else rms_norm then linear_silu_and_mul; both match the twins' rms_norm, linear, silu_and_mul."""
    from specserve.model.layers import triton_gemv, triton_ops

    k, inter, eps, dtype = 128, 300, 1e-6, torch.bfloat16  # gate_up 600 > NORM_FUSE_MAX_WIDTH * 128
    table = {} if entry is None else {triton_gemv.config_key(2 * inter, k, m): triton_gemv.NormFuse(entry, (2, 128, 4))}
    _patch_tables(monkeypatch, norm_fuse=table)
    calls = _spy_launches(monkeypatch)
    gen = torch.Generator().manual_seed(m + 10 * with_residual)
    x = _randn((m, k), dtype, device, gen, 3.0)
    residual = _randn((m, k), dtype, device, gen, 3.0) if with_residual else None
    norm_w = _randn((k,), dtype, device, gen) + 1.0
    weight = _randn((2 * inter, k), dtype, device, gen, k**-0.5)
    got, got_res = triton_gemv.rms_norm_linear_silu_and_mul(
        x, residual, norm_w, eps, weight, triton_ops.rms_norm, triton_ops.silu_and_mul
    )
    assert calls == ([(True, True)] if entry else [(False, True)])  # unfused: the norm kernel, then gate_up
    h, want_res = _norm_ref(x, residual, norm_w, eps)
    assert torch.equal(got_res, want_res)
    torch.testing.assert_close(got, ops.silu_and_mul(_linear_ref(h, weight, None)), rtol=RTOL[dtype], atol=RTOL[dtype])


def test_rms_norm_linear_silu_and_mul_falls_back(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows past GEMV_MAX_M take the unfused ops even where the table says fuse (cuBLAS for gate_up)."""
    from specserve.model.layers import triton_gemv, triton_ops

    m, k, inter = triton_gemv.GEMV_MAX_M + 1, 64, 40
    _patch_tables(monkeypatch, norm_fuse={triton_gemv.config_key(2 * inter, k, m): triton_gemv.NormFuse(True, None)})
    calls = _spy_launches(monkeypatch)
    gen = torch.Generator().manual_seed(7)
    x, residual = _randn((m, k), torch.bfloat16, device, gen), _randn((m, k), torch.bfloat16, device, gen)
    norm_w = _randn((k,), torch.bfloat16, device, gen) + 1.0
    weight = _randn((2 * inter, k), torch.bfloat16, device, gen, k**-0.5)
    got, got_res = triton_gemv.rms_norm_linear_silu_and_mul(
        x, residual, norm_w, 1e-6, weight, triton_ops.rms_norm, triton_ops.silu_and_mul
    )
    h, want_res = ops.rms_norm(x, norm_w, 1e-6, residual)
    assert calls == [] and torch.equal(got_res, want_res)
    torch.testing.assert_close(
        got, ops.silu_and_mul(ops.linear(h, weight)), rtol=RTOL[torch.bfloat16], atol=RTOL[torch.bfloat16]
    )


@pytest.mark.parametrize("entry", [None, True, False])
def test_rms_norm_linear_follows_the_table(
    entry: bool | None, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """qkv-like (N <= NORM_FUSE_MAX_WIDTH * K): fused by the width rule without an entry, and as the
    entry says with one (its tiles used: a single tile where the projection's own would loop)."""
    from specserve.model.layers import triton_gemv, triton_ops

    m, k, n = 2, 600, 80
    key = triton_gemv.config_key(n, k, m)
    table = {} if entry is None else {key: triton_gemv.NormFuse(entry, (2, 1024, 4))}
    _patch_tables(monkeypatch, norm_fuse=table)
    tiles = []
    launch = triton_gemv._launch
    monkeypatch.setattr(triton_gemv, "_launch", lambda *a, **kw: tiles.append((a[3], "norm" in kw)) or launch(*a, **kw))
    gen = torch.Generator().manual_seed(11)
    x, residual = _randn((m, k), torch.bfloat16, device, gen, 3.0), _randn((m, k), torch.bfloat16, device, gen, 3.0)
    norm_w = _randn((k,), torch.bfloat16, device, gen) + 1.0
    weight = _randn((n, k), torch.bfloat16, device, gen, k**-0.5)
    got, got_res = triton_gemv.rms_norm_linear(x, residual, norm_w, 1e-6, weight, None, triton_ops.rms_norm)
    own = triton_gemv.tile_config(n, k, m, device)
    assert tiles == {None: [(own, True)], True: [((2, 1024, 4), True)], False: [(own, False)]}[entry]
    h, want_res = ops.rms_norm(x, norm_w, 1e-6, residual)
    assert torch.equal(got_res, want_res)
    torch.testing.assert_close(got, _linear_ref(h, weight, None), rtol=RTOL[torch.bfloat16], atol=RTOL[torch.bfloat16])
