"""The input norm + qkv GEMV with RoPE and the KV write in its epilogue (model/layers/triton_qkv_rope.py).

Against the unfused Triton path it replaces (the norm-fused GEMV `triton_gemv._launch` with the same
rows of W per program, then `_rope_and_cache_kernel`): q, the new residual and every cache slot
bitwise. Against the torch twins (ops.rms_norm_linear, ops.apply_rope, the cache written by hand):
within bf16 rounding. Caches start as NaN, so a slot written that should not be (a padding token's,
another token's) or one left unwritten shows up. A tiny Qwen2 (qkv bias, GQA) decodes greedily the
same tokens with SPECSERVE_QKV_ROPE_FUSED=1 as without.
"""
from __future__ import annotations

import random
from typing import NamedTuple

import pytest
import torch

from specserve.model.layers import ops

RTOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
EPS = 1e-6
BLOCK_SIZE = 4
NUM_BLOCKS = 6
MAX_POSITIONS = 64


class Case(NamedTuple):
    num_heads: int
    num_kv_heads: int
    head_dim: int
    k: int  # hidden size (the reduction)
    with_residual: bool
    with_bias: bool
    tiles: tuple[int, int, int]  # (BLOCK_J, BLOCK_K, num_warps), pinned
    dtype: torch.dtype = torch.bfloat16
    cache_dtype: torch.dtype | None = None  # None: the activation dtype


CASES = [
    Case(4, 2, 64, 200, True, True, (8, 256, 4)),  # ragged K: the tile masks 56 columns
    Case(4, 2, 64, 256, False, False, (32, 256, 4)),  # BLOCK_J = D/2: one whole head per program
    Case(12, 2, 128, 256, True, False, (16, 256, 4)),
    Case(2, 1, 96, 128, False, True, (32, 128, 4)),  # D/2 = 48: the second j block is half masked
    Case(4, 2, 64, 128, True, True, (4, 128, 4), torch.float16),
    Case(4, 2, 64, 128, True, False, (8, 128, 4), torch.bfloat16, torch.float32),  # fp32 cache, bf16 model
]


def cos_sin_cache(max_positions: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()  # [max_positions, head_dim]


class Inputs(NamedTuple):
    x: torch.Tensor
    residual: torch.Tensor | None
    norm_w: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    positions: torch.Tensor
    cos_sin: torch.Tensor
    slots: torch.Tensor  # [m], the last row is padding (-1) when m is even
    key_cache: torch.Tensor  # NaN-filled
    value_cache: torch.Tensor


def make_inputs(case: Case, m: int, device: torch.device, seed: int) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    dtype, k = case.dtype, case.k
    n = (case.num_heads + 2 * case.num_kv_heads) * case.head_dim

    def randn(shape, scale=1.0):
        return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)

    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:m]
    if m % 2 == 0:
        slots[-1] = -1  # a CUDA-graph padding token
    cache_shape = (NUM_BLOCKS, BLOCK_SIZE, case.num_kv_heads, case.head_dim)
    cache_dtype = case.cache_dtype or dtype
    return Inputs(
        x=randn((m, k), 3.0), residual=randn((m, k), 3.0) if case.with_residual else None,
        norm_w=randn((k,)) + 1.0, weight=randn((n, k), k ** -0.5), bias=randn((n,)) if case.with_bias else None,
        positions=torch.randint(0, MAX_POSITIONS, (m,), generator=gen).to(device),
        cos_sin=cos_sin_cache(MAX_POSITIONS, case.head_dim).to(device), slots=slots.to(device),
        key_cache=torch.full(cache_shape, float("nan"), dtype=cache_dtype, device=device),
        value_cache=torch.full(cache_shape, float("nan"), dtype=cache_dtype, device=device),
    )


def _clone_caches(inp: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    return inp.key_cache.clone(), inp.value_cache.clone()


def run_fused(case: Case, inp: Inputs, tiles: tuple[int, int, int] | None):
    """(q, new residual, key cache, value cache) of the fused launch."""
    from specserve.model.layers.triton_qkv_rope import rms_norm_qkv_rope_cache

    key_cache, value_cache = _clone_caches(inp)
    out = rms_norm_qkv_rope_cache(inp.x, inp.residual, inp.norm_w, EPS, inp.weight, inp.bias, inp.positions,
                                  inp.cos_sin, key_cache, value_cache, inp.slots, case.num_heads,
                                  case.num_kv_heads, case.head_dim, tiles=tiles)
    assert out is not None, "the fused launch should take this case"
    q, residual = out
    return q, residual, key_cache, value_cache


def _rope_cache_after(case: Case, inp: Inputs, qkv: torch.Tensor):
    """The unfused second half: split qkv, then `rope_and_cache` (the Triton kernel)."""
    from specserve.attention.triton_rope_cache import rope_and_cache

    q, k, v = _split(case, qkv)
    key_cache, value_cache = _clone_caches(inp)
    rope_and_cache(q, k, v, inp.positions, inp.cos_sin, key_cache, value_cache, inp.slots)
    return q, key_cache, value_cache


def run_unfused_triton(case: Case, inp: Inputs, gemv_tiles: tuple[int, int, int] | None):
    """The path the fusion replaces: the norm-fused GEMV (pinned tiles, or `rms_norm_linear`'s own
    choice when None), then `rope_and_cache` on views of its output."""
    from specserve.model.layers import triton_gemv, triton_ops

    if gemv_tiles is None:
        qkv, residual = triton_ops.rms_norm_linear(inp.x, inp.residual, inp.norm_w, EPS, inp.weight, inp.bias)
    else:
        qkv, residual = triton_gemv._launch(inp.x, inp.weight, inp.bias, gemv_tiles,
                                            norm=(inp.norm_w, EPS, inp.residual))
        residual = inp.x if residual is None else residual
    q, key_cache, value_cache = _rope_cache_after(case, inp, qkv)
    return q, residual, key_cache, value_cache


def run_twins(case: Case, inp: Inputs):
    """The torch twins: ops.rms_norm_linear, ops.apply_rope, and k / v copied into their slots."""
    qkv, residual = ops.rms_norm_linear(inp.x, inp.residual, inp.norm_w, EPS, inp.weight, inp.bias)
    q, k, v = _split(case, qkv)
    q, k = ops.apply_rope(q, k, inp.positions, inp.cos_sin)
    key_cache, value_cache = _clone_caches(inp)
    for row, slot in enumerate(inp.slots.tolist()):
        if slot >= 0:
            key_cache.view(-1, case.num_kv_heads, case.head_dim)[slot] = k[row].to(key_cache.dtype)
            value_cache.view(-1, case.num_kv_heads, case.head_dim)[slot] = v[row].to(value_cache.dtype)
    return q, residual, key_cache, value_cache


def _split(case: Case, qkv: torch.Tensor):
    q_size, kv_size = case.num_heads * case.head_dim, case.num_kv_heads * case.head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (q.view(-1, case.num_heads, case.head_dim), k.view(-1, case.num_kv_heads, case.head_dim),
            v.view(-1, case.num_kv_heads, case.head_dim))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bitwise(got, want) -> None:
    """(q, residual, key cache, value cache) identical bit for bit (NaN slots included)."""
    for name, a, b in zip(("q", "residual", "key_cache", "value_cache"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        diff = (_bits(a) != _bits(b)).nonzero()
        assert diff.numel() == 0, f"{name} differs at {diff[:8].tolist()}"


def assert_close(got, want, dtype: torch.dtype) -> None:
    """q and the caches within rounding (NaN exactly where the oracle has NaN); residual bitwise."""
    q, residual, key_cache, value_cache = got
    assert torch.equal(residual, want[1])
    for name, a, b in (("q", q, want[0]), ("key_cache", key_cache, want[2]), ("value_cache", value_cache, want[3])):
        torch.testing.assert_close(a, b, rtol=RTOL[dtype], atol=RTOL[dtype], equal_nan=True, msg=name)


def _written_slots(key_cache: torch.Tensor) -> set[int]:
    flat = key_cache.view(NUM_BLOCKS * BLOCK_SIZE, -1)
    return set((~flat.isnan()).all(1).nonzero().flatten().tolist())


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.num_heads}q{c.num_kv_heads}kv-d{c.head_dim}-k{c.k}"
                         f"{'-res' if c.with_residual else ''}{'-bias' if c.with_bias else ''}"
                         f"-{str(c.dtype)[6:]}-{str(c.cache_dtype or c.dtype)[6:]}")
def test_fused_matches_unfused_and_twins(case: Case, m: int, device: torch.device) -> None:
    """Pinned tiles: bitwise the unfused Triton path with the same rows of W per program (BLOCK_N =
    2 * BLOCK_J); within rounding the torch twins. Padding rows (even m) store nothing."""
    inp = make_inputs(case, m, device, seed=m * 100 + case.head_dim + case.k)
    got = run_fused(case, inp, case.tiles)
    assert got[0].shape == (m, case.num_heads, case.head_dim) and got[0].dtype == case.dtype
    block_j, block_k, num_warps = case.tiles
    assert_bitwise(got, run_unfused_triton(case, inp, (2 * block_j, block_k, num_warps)))
    assert_close(got, run_twins(case, inp), case.dtype)
    real = {s for s in inp.slots.tolist() if s >= 0}
    assert _written_slots(got[2]) == real and _written_slots(got[3]) == real
    assert len(real) == m - (m % 2 == 0)


@pytest.mark.parametrize("m", [1, 4])
# K = 384: the GEMV's default BLOCK_K (512) covers it, one tile; K = 640: the GEMV loops, the fused launch not.
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,k", [(12, 2, 128, 384), (2, 1, 64, 640)])
def test_default_tiles(num_heads: int, num_kv_heads: int, head_dim: int, k: int, m: int,
                       device: torch.device) -> None:
    """The tiles `qkv_rope_tiles` picks, against `rms_norm_linear` (with its own tiles) + rope_and_cache:
    bitwise where that GEMV runs one tile (the fused launch then takes its rows per program), else
    within rounding."""
    from specserve.model.layers import triton_gemv, triton_qkv_rope

    case = Case(num_heads, num_kv_heads, head_dim, k, True, True, (0, 0, 0))
    inp = make_inputs(case, m, device, seed=7 * m + k)
    tiles = triton_qkv_rope.qkv_rope_tiles(inp.x, inp.residual, inp.norm_w, inp.weight, head_dim)
    assert tiles[1] >= k
    got = run_fused(case, inp, None)
    want = run_unfused_triton(case, inp, None)
    gemv = triton_gemv._norm_tiles(inp.x, inp.residual, inp.norm_w, inp.weight, silu_out=False)
    if gemv is not None and gemv[1] >= k:
        assert tiles == (max(1, gemv[0] // 2), gemv[1], gemv[2])
        assert_bitwise(got, want)
    else:
        assert_close(got, want, case.dtype)


def test_not_applicable_returns_none(device: torch.device) -> None:
    """Shapes the fused launch does not take answer None (the caller runs the unfused path)."""
    from specserve.model.layers.triton_qkv_rope import rms_norm_qkv_rope_cache

    case = Case(4, 2, 64, 128, True, True, (8, 128, 4))
    inp = make_inputs(case, 2, device, seed=1)
    args = {"x": inp.x, "residual": inp.residual, "norm_weight": inp.norm_w, "eps": EPS, "weight": inp.weight,
            "bias": inp.bias, "positions": inp.positions, "cos_sin_cache": inp.cos_sin,
            "key_cache": inp.key_cache, "value_cache": inp.value_cache, "slot_mapping": inp.slots,
            "num_heads": 4, "num_kv_heads": 2, "head_dim": 64}
    big = make_inputs(case, 5, device, seed=2)  # more rows than the GEMV takes
    fp8 = torch.zeros(inp.key_cache.shape, dtype=torch.uint8, device=device)  # quantized storage
    k_wide = 4096  # K past one tile
    wide = {"x": torch.zeros((2, k_wide), dtype=case.dtype, device=device), "residual": None, "bias": None,
            "norm_weight": torch.ones(k_wide, dtype=case.dtype, device=device),
            "weight": torch.zeros((512, k_wide), dtype=case.dtype, device=device)}
    fp32 = {"x": inp.x.float(), "residual": inp.residual.float(), "norm_weight": inp.norm_w.float(),
            "weight": inp.weight.float(), "bias": inp.bias.float()}
    for change in ({"x": big.x, "residual": big.residual, "positions": big.positions, "slot_mapping": big.slots},
                   {"key_cache": fp8, "value_cache": fp8}, {"num_heads": 2}, fp32, wide):
        assert rms_norm_qkv_rope_cache(**{**args, **change}) is None, sorted(change)
    assert torch.isnan(inp.key_cache).all() and torch.isnan(inp.value_cache).all()
    assert rms_norm_qkv_rope_cache(**args) is not None


def test_forward_cached_refuses_quantized_caches() -> None:
    from specserve.attention.triton_backend import TritonBackend
    from specserve.kv.spec import kv_format

    with pytest.raises(ValueError, match="unquantized"):
        TritonBackend().forward_cached(None, None, kv_format("fp8", torch.bfloat16), None, 1.0)


def _greedy(path, monkeypatch: pytest.MonkeyPatch, device: torch.device, fused: str) -> tuple[list, int]:
    """(greedy tokens, their logprobs) of a few prompts (batch 3 decode, then batch 1) and how many
    launches of the fused op took a layer."""
    from specserve import LLM, SamplingParams
    from specserve.model.layers import triton_qkv_rope

    monkeypatch.setenv("SPECSERVE_QKV_ROPE_FUSED", fused)
    taken, op = [0], triton_qkv_rope.rms_norm_qkv_rope_cache

    def spy(*args, **kwargs):
        out = op(*args, **kwargs)
        taken[0] += out is not None
        return out

    monkeypatch.setattr(triton_qkv_rope, "rms_norm_qkv_rope_cache", spy)
    interpreting = device.type == "cpu"
    if interpreting:  # the engine's CPU path with the Triton ops and backend, kernels interpreted
        from specserve.attention import triton_paged
        from specserve.attention.triton_backend import TritonBackend
        from specserve.engine import setup
        from specserve.model.layers import triton_gemv, triton_ops

        monkeypatch.setattr(setup, "_ops_for", lambda _device: triton_ops)
        monkeypatch.setattr(setup, "select_backend", lambda _device, name=None: TritonBackend())
        # One "SM": wide GEMV tiles and no split-KV, so the interpreter runs a few programs per launch.
        monkeypatch.setattr(triton_gemv, "_num_sms", lambda _device: 1)
        monkeypatch.setattr(triton_paged, "_num_sms", lambda _device: 1)
    # block_size 4: decode steps write across block boundaries.
    llm = LLM(model=str(path), progress=False, device=device.type, dtype="bfloat16", max_num_seqs=4, block_size=4,
              kv_cache_memory_bytes=(1 if interpreting else 16) << 20, enable_prefix_caching=False)
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 300) for _ in range(n)] for n in ((3, 6, 2) if interpreting else (3, 40, 17, 9))]
    params = SamplingParams(temperature=0.0, max_tokens=4 if interpreting else 32, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    outs.append(llm.generate([{"prompt_token_ids": prompts[0]}], params)[0])  # batch 1: a 3-token prefill fused
    return [(o.outputs[0].token_ids, _chosen_logprobs(o.outputs[0])) for o in outs], taken[0]


def _chosen_logprobs(completion) -> list[float]:
    return [step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs)]


def test_model_greedy_fused_equals_unfused(tiny_qwen2_dir, monkeypatch: pytest.MonkeyPatch,
                                           device: torch.device) -> None:
    """A tiny Qwen2 (qkv bias, 4 q heads on 1 KV head) decodes the same tokens, with the same
    logprobs (the paths are bitwise alike), with the fused launch as without; the fused op must have
    taken layers (decode steps and short prefills)."""
    fused, taken = _greedy(tiny_qwen2_dir, monkeypatch, device, "1")
    unfused, not_taken = _greedy(tiny_qwen2_dir, monkeypatch, device, "0")
    assert taken > 0 and not_taken == 0
    assert fused == unfused
