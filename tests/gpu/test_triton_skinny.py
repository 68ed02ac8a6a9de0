"""The skinny tensor-core GEMM (model/layers/triton_skinny.py) against F.linear in fp32 math:
2..16 rows, ragged N and K tiles, bias, split-K 1 and > 1 (bitwise repeatable, counters back at
zero), the fused gate_up + silu_and_mul, and CUDA-graph replay with PDL on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.model.layers import ops

# The kernel accumulates in fp32 and rounds once; the oracle is fp32 math rounded once: they differ
# by the output's rounding (1 ulp) and the sum order.
TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _randn(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: torch.Generator, scale: float = 1.0
) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def _problem(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = _randn((m, k), dtype, device, gen)
    w = _randn((n, k), dtype, device, gen, k**-0.5)
    b = _randn((n,), dtype, device, gen)
    return x, w, b


def _want(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), w.float(), None if b is None else b.float())


def _sizes(interpreting: bool) -> tuple[int, int]:
    """(N, K): N not a multiple of the tests' BLOCK_N (32), K not of BLOCK_K (64), 5 K tiles."""
    return (80, 300) if interpreting else (1000, 1100)


def _counters_zero(device: torch.device) -> bool:
    from specserve.model.layers import triton_skinny

    scratch = triton_skinny._SCRATCH.get(device)  # a tensor's device: "cuda:<index>" or "cpu"
    return scratch is None or int(scratch.counters.abs().sum()) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("split_k", [1, 3])
def test_matches_fp32_linear(
    dtype: torch.dtype, m: int, with_bias: bool, split_k: int, device: torch.device, interpreting: bool
) -> None:
    from specserve.model.layers import triton_skinny as sk

    n, k = _sizes(interpreting)
    x, w, b = _problem(m, n, k, dtype, device, seed=m * 10 + split_k)
    b = b if with_bias else None
    cfg = sk.SkinnyConfig(block_n=32, block_k=64, split_k=split_k, num_warps=4, num_stages=2)
    assert sk.effective_split(k, 64, split_k)[0] == split_k
    got = sk.skinny_linear(x, w, b, config=cfg)
    assert got.shape == (m, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), _want(x, w, b), rtol=TOL[dtype], atol=TOL[dtype])
    again = sk.skinny_linear(x, w, b, config=cfg)
    assert torch.equal(got, again), "repeated calls differ"
    assert _counters_zero(x.device), "split-K counters were not reset to zero"


@pytest.mark.parametrize("m", [2, 7])
def test_split_k_bitwise_repeatable_over_stale_workspace(m: int, device: torch.device, interpreting: bool) -> None:
    """Every split overwrites its partial before anyone reads it and the sum runs in split order:
    NaN-poisoned scratch between calls changes nothing, to the bit."""
    from specserve.model.layers import triton_skinny as sk

    n, k = _sizes(interpreting)
    x, w, b = _problem(m, n, k, torch.bfloat16, device, seed=m)
    cfg = sk.SkinnyConfig(block_n=32, block_k=64, split_k=5, num_warps=4, num_stages=2)
    first = sk.skinny_linear(x, w, b, config=cfg)
    torch.testing.assert_close(first.float(), _want(x, w, b), rtol=TOL[torch.bfloat16], atol=TOL[torch.bfloat16])
    for _ in range(3):
        sk._SCRATCH[x.device].workspace.fill_(float("nan"))
        assert torch.equal(sk.skinny_linear(x, w, b, config=cfg), first)
        assert int(sk._SCRATCH[x.device].counters.abs().sum()) == 0


def test_row_strided_x_and_small_k(device: torch.device) -> None:
    """x a row-strided view; K shorter than one BLOCK_K tile."""
    from specserve.model.layers import triton_skinny as sk

    gen = torch.Generator().manual_seed(4)
    wide = _randn((4, 96), torch.bfloat16, device, gen)
    x = wide[:, :40]
    w = _randn((50, 40), torch.bfloat16, device, gen, 40**-0.5)
    got = sk.skinny_linear(x, w, None, sk.SkinnyConfig(16, 64, 1, 4, 2))
    torch.testing.assert_close(got.float(), _want(x, w, None), rtol=TOL[torch.bfloat16], atol=TOL[torch.bfloat16])


@pytest.mark.parametrize("m", [2, 5, 16])
@pytest.mark.parametrize("split_k", [1, 3])
def test_silu_and_mul_matches_unfused(m: int, split_k: int, device: torch.device, interpreting: bool) -> None:
    from specserve.model.layers import triton_skinny as sk

    dtype = torch.bfloat16
    inter, k = (48, 300) if interpreting else (700, 1100)
    gen = torch.Generator().manual_seed(m + split_k)
    x = _randn((m, k), dtype, device, gen)
    w = _randn((2 * inter, k), dtype, device, gen, k**-0.5)
    cfg = sk.SkinnyConfig(block_n=32, block_k=64, split_k=split_k, num_warps=4, num_stages=2)
    got = sk.skinny_linear(x, w, None, cfg, silu_out=True)
    # F.linear (fp32 accumulation, one rounding) followed by the unfused activation.
    want = ops.silu_and_mul(F.linear(x.float(), w.float()).to(dtype))
    assert got.shape == (m, inter) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=TOL[dtype], atol=TOL[dtype])
    assert torch.equal(sk.skinny_linear(x, w, None, cfg, silu_out=True), got)
    assert _counters_zero(x.device)


def test_supports(device: torch.device) -> None:
    from specserve.model.layers import triton_skinny as sk

    w = torch.zeros(64, 32, dtype=torch.bfloat16, device=device)
    cfg = sk.SkinnyConfig(32, 32)
    for m in range(sk.SKINNY_MIN_M, sk.SKINNY_MAX_M + 1):
        assert sk.supports(torch.zeros(m, 32, dtype=torch.bfloat16, device=device), w)
    assert sk.supports(torch.zeros(4, 32, dtype=torch.float16, device=device), w.half())
    assert not sk.supports(torch.zeros(0, 32, dtype=torch.bfloat16, device=device), w)
    assert not sk.supports(torch.zeros(17, 32, dtype=torch.bfloat16, device=device), w)
    assert not sk.supports(torch.zeros(4, 32, dtype=torch.float32, device=device), w.float())
    assert not sk.supports(torch.zeros(4, 32, dtype=torch.float16, device=device), w)  # dtypes differ
    assert not sk.supports(torch.zeros(4, 64, dtype=torch.bfloat16, device=device)[:, ::2], w)  # K stride 2
    assert not sk.supports(torch.zeros(4, 16, dtype=torch.bfloat16, device=device), w)  # K differs
    with pytest.raises(ValueError, match="skinny_linear"):
        sk.skinny_linear(torch.zeros(17, 32, dtype=torch.bfloat16, device=device), w, None, cfg)
    with pytest.raises(ValueError, match="bias"):
        sk.skinny_linear(
            torch.zeros(4, 32, dtype=torch.bfloat16, device=device),
            w,
            torch.zeros(64, dtype=torch.float32, device=device),
            cfg,
        )
    with pytest.raises(ValueError, match="block_n"):
        sk.skinny_linear(torch.zeros(4, 32, dtype=torch.bfloat16, device=device), w, None, sk.SkinnyConfig(24, 64))


def test_scratch_growth_refused_during_capture(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    from specserve.model.layers import triton_skinny as sk

    have = sk._scratch(device if device.type == "cpu" else torch.device("cuda", torch.cuda.current_device()), 1, 1)
    monkeypatch.setattr(sk, "_capturing", lambda dev: True)
    dev = have.workspace.device
    assert sk._scratch(dev, have.workspace.numel(), have.counters.numel()) is have  # no growth: fine
    with pytest.raises(RuntimeError, match="capture"):
        sk._scratch(dev, have.workspace.numel() + 1, 1)


def test_cuda_graph_replay_chain_with_pdl(device: torch.device) -> None:
    """Two dependent split-K launches sharing the scratch, captured in a graph (PDL launches where
    the GPU has them) and replayed: bitwise the eager results, every replay."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    from specserve.model.layers import triton_skinny as sk

    dtype = torch.bfloat16
    x, w1, b1 = _problem(5, 1536, 1536, dtype, device, seed=1)
    _, w2, _ = _problem(5, 1536, 1536, dtype, device, seed=2)
    cfg = sk.SkinnyConfig(64, 128, 4, 4, 4)

    def chain() -> torch.Tensor:
        return sk.skinny_linear(sk.skinny_linear(x, w1, b1, cfg), w2, None, cfg)

    eager = chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    assert _counters_zero(x.device)
    torch.testing.assert_close(
        out.float(), _want(_want(x, w1, b1).to(dtype), w2, None), rtol=TOL[dtype], atol=TOL[dtype]
    )


@pytest.mark.parametrize("m", [1, 3, 5])
def test_engine_linear_follows_the_skinny_table(
    m: int, device: torch.device, dtype: torch.dtype = torch.bfloat16, monkeypatch: pytest.MonkeyPatch = None
) -> None:
    """triton_ops.linear / linear_silu_and_mul take the skinny GEMM exactly where the tuned table has
    an entry for (N, K, next_power_of_2(M))."""
    from specserve.model.layers import triton_gemv, triton_ops
    from specserve.model.layers import triton_skinny as sk

    n, k = 64, 96
    x, w, b = _problem(m, n, k, dtype, device, seed=m)
    cfg = sk.SkinnyConfig(32, 32, 2)
    key = triton_gemv.config_key(n, k, m)
    calls: list[str] = []
    real, real_tables = sk.skinny_linear, triton_gemv.tables
    mp = pytest.MonkeyPatch()
    try:
        spy = lambda *a, **kw: calls.append("silu" if kw.get("silu_out") else "plain") or real(*a, **kw)
        mp.setattr(sk, "skinny_linear", spy)
        table = {"plain": {key: cfg}, "silu": {key: cfg._replace(block_n=16)}}
        mp.setattr(triton_gemv, "tables", lambda name: real_tables(name)._replace(skinny=table))
        got = triton_ops.linear(x, w, b)
        act = triton_ops.linear_silu_and_mul(x, w)
        assert calls == ["plain", "silu"]
        torch.testing.assert_close(got.float(), _want(x, w, b), rtol=TOL[dtype], atol=TOL[dtype])
        torch.testing.assert_close(
            act.float(), ops.silu_and_mul(F.linear(x, w)).float(), rtol=TOL[dtype], atol=TOL[dtype]
        )
        mp.setattr(triton_gemv, "tables", lambda name: real_tables(name)._replace(skinny={"plain": {}, "silu": {}}))
        triton_ops.linear(x, w, b)
        assert calls == ["plain", "silu"]  # no entry for this shape
    finally:
        mp.undo()
