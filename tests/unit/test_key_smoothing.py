"""Per-channel key smoothing of the rotated nvfp4 KV cache (kv/smoothing.py, runner/key_smoothing.py):
the factors, the exact q.k identity of the folded query rotation, the torch path's writes and reads,
its lower score error on keys with outlier channels, and the start-up calibration."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from specserve.attention.torch_ref import TorchRefBackend, gather_padded
from specserve.config import ModelConfig
from specserve.kv.quant import dequantize, hadamard_rotate, quantize, query_rotation, smooth_keys, write_kv
from specserve.kv.smoothing import smoothing_factors, smoothing_tag, with_key_smoothing
from specserve.kv.spec import KVCacheSpec, kv_format
from specserve.model.loader import load_model
from specserve.runner.key_smoothing import calibrate_key_smoothing, install_key_smoothing
from specserve.runner.model_runner import ModelRunner
from tests.helpers.attention_meta import paged_metadata
from tests.helpers.tiny_models import make_tiny_model_dir

NVFP4 = kv_format("nvfp4", torch.float32)


def outlier_qk(seed: int, num_kv_heads: int = 2, group: int = 2, head_dim: int = 64, n: int = 128):
    """Keys with a few large channels where the queries are small (and one where both are large), as
    post-RoPE keys of real models: q [n, Hkv * group, D], k [n, Hkv, D] float32."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(n, num_kv_heads * group, head_dim, generator=gen)
    k[..., [3, 21, 40]] *= 30
    q[..., [3, 21, 40]] *= 0.2
    k[..., 50] *= 8
    q[..., 50] *= 8
    return q, k


def absmax(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = k.shape[1]
    return k.abs().amax(0), q.abs().view(q.shape[0], h, -1, q.shape[2]).amax(dim=(0, 2))


def test_factors_are_centred_powers_of_two() -> None:
    q, k = outlier_qk(1)
    s = smoothing_factors(*absmax(q, k))
    assert s.shape == k.shape[1:] and s.dtype == torch.float32
    assert torch.equal(s, torch.exp2(s.log2().round()))
    assert s.log2().mean(-1).abs().max() < 0.5  # geometric mean 1 before rounding
    assert (s[:, [3, 21, 40]] >= 8).all()  # sqrt(30 / 0.2) ~ 12 times the others'
    assert (s[:, 50] <= 2).all()  # large on both sides: no reason to move it
    # A dead channel (zeros on both sides) stays finite; one of them alone saturates at the clamp.
    key_absmax, query_absmax = absmax(q, k)
    key_absmax[0, 5] = query_absmax[0, 5] = 0.0
    key_absmax[0, 6] = 0.0
    s = smoothing_factors(key_absmax, query_absmax)
    assert torch.isfinite(s).all() and s[0, 6] == 2.0**-8


def test_folded_query_rotation_keeps_q_dot_k_exact() -> None:
    """rotate(q diag(s)) . rotate(k / s) = q . k (float64; s powers of two)."""
    q, k = outlier_qk(2)
    s = smoothing_factors(*absmax(q, k))
    rot = query_rotation(NVFP4, s, q.shape[1], q.shape[2], torch.float64, q.device)  # [Hq, D, D]
    assert rot is not None and rot.shape == (q.shape[1], q.shape[2], q.shape[2])
    q_rot = torch.einsum("thd,hde->the", q.double(), rot)
    k_rot = hadamard_rotate(smooth_keys(k, s))  # [n, Hkv, D]
    got = torch.einsum("thd,shd->hts", q_rot, k_rot.repeat_interleave(2, dim=1))
    want = torch.einsum("thd,shd->hts", q.double(), k.double().repeat_interleave(2, dim=1))
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-9)
    # Without smoothing it is the plain rotation; without either, nothing.
    assert torch.equal(
        query_rotation(NVFP4, None, 4, 64, torch.float32, q.device), hadamard_rotate(torch.eye(64)).float()
    )
    assert query_rotation(kv_format("float32", torch.float32), None, 4, 64, torch.float32, q.device) is None


def _cache(head_dim: int = 64, num_kv_heads: int = 2, num_blocks: int = 8, key_smooth: torch.Tensor | None = None):
    spec = KVCacheSpec(num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16, fmt=NVFP4)
    return spec.allocate(num_blocks, torch.device("cpu"))[0]._replace(key_smooth=key_smooth)


def test_torch_path_stores_smoothed_keys_and_reads_them_back() -> None:
    q, k = outlier_qk(3)
    s = smoothing_factors(*absmax(q, k))
    cache = _cache(key_smooth=s)
    slots = torch.arange(k.shape[0])
    write_kv(cache, NVFP4, slots, k, k)
    data, scale = quantize(k / s, NVFP4)  # keys: the codec of k / s; values as they are
    assert torch.equal(cache.key.view(-1, 2, 32)[slots], data)
    assert torch.equal(cache.key_scale.view(-1, 2, 4)[slots].view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(cache.value.view(-1, 2, 32)[slots], quantize(k, NVFP4)[0])
    table = torch.arange(8, dtype=torch.int32)[None]
    got_k, got_v = (t[0, : k.shape[0]] for t in gather_padded(cache, NVFP4, table, torch.float32))
    assert torch.equal(got_k, dequantize(data, scale, NVFP4, torch.float32) * s)
    assert torch.equal(got_v, dequantize(*quantize(k, NVFP4), NVFP4, torch.float32))


def _scores_error(q: torch.Tensor, k: torch.Tensor, key_smooth: torch.Tensor | None) -> float:
    cache = _cache(key_smooth=key_smooth)
    write_kv(cache, NVFP4, torch.arange(k.shape[0]), k, k)
    table = torch.arange(8, dtype=torch.int32)[None]
    k_hat = gather_padded(cache, NVFP4, table, torch.float32)[0][0, : k.shape[0]].repeat_interleave(2, dim=1)
    want = torch.einsum("thd,shd->hts", q, k.repeat_interleave(2, dim=1))
    return ((torch.einsum("thd,shd->hts", q, k_hat) - want).norm() / want.norm()).item()


def test_smoothing_keeps_q_dot_k_and_lowers_its_error() -> None:
    """The smoothed nvfp4 torch path's q.k is the float q.k within the format's error, smaller than
    the rotation's alone on keys with outlier channels (on SmolLM2's keys: KL 0.039 -> 0.025)."""
    q, k = outlier_qk(4)
    s = smoothing_factors(*absmax(q, k))
    plain, smoothed = _scores_error(q, k, None), _scores_error(q, k, s)
    assert smoothed < 0.1, smoothed
    assert smoothed < 0.6 * plain, (plain, smoothed)


def test_attention_over_a_smoothed_cache_matches_float_kv() -> None:
    """TorchRefBackend (write, then attend) with smoothing: its output is float32 KV's within nvfp4's error,
    closer than without smoothing."""
    q, k = outlier_qk(5, n=40)
    v = torch.randn(k.shape, generator=torch.Generator().manual_seed(6))
    s = smoothing_factors(*absmax(q, k))
    specs, tables = [(0, 40)], [[0, 1, 2]]
    meta = paged_metadata(specs, tables, 16, torch.device("cpu"))
    scale = 1 / math.sqrt(k.shape[-1])
    fp32 = kv_format("float32", torch.float32)
    f_cache = KVCacheSpec(1, 2, 64, 16, fp32).allocate(8, torch.device("cpu"))[0]
    want = TorchRefBackend().forward(q, k, v, f_cache, fp32, meta, scale)
    errors = []
    for smooth in (None, s):
        got = TorchRefBackend().forward(q, k, v, _cache(key_smooth=smooth), NVFP4, meta, scale)
        errors.append(((got - want).norm() / want.norm()).item())
    assert errors[1] < 0.2 and errors[1] < errors[0], errors


def test_with_key_smoothing_checks_the_layer_count() -> None:
    caches = KVCacheSpec(2, 2, 64, 16, NVFP4).allocate(2, torch.device("cpu"))
    s = torch.ones(2, 2, 64)
    got = with_key_smoothing(caches, s)
    assert all(torch.equal(c.key_smooth, s[i]) and c.key is caches[i].key for i, c in enumerate(got))
    with pytest.raises(ValueError, match="layers"):
        with_key_smoothing(caches, s[:1])
    # The disk tier's namespace tells pools with other factors (or none) apart.
    assert smoothing_tag(caches) == ""
    assert smoothing_tag(got).startswith("|ks") and smoothing_tag(got) == smoothing_tag(with_key_smoothing(caches, s))
    assert smoothing_tag(got) != smoothing_tag(with_key_smoothing(caches, 2 * s))


def test_calibration_at_start_up(tmp_path: Path) -> None:
    """install_key_smoothing attaches the same factors on every build (nvfp4 only), before any KV."""
    model_dir = make_tiny_model_dir(tmp_path / "tiny", num_layers=2, num_heads=4, num_kv_heads=2)
    loaded = load_model(ModelConfig(model=str(model_dir)), torch.device("cpu"), torch.float32, progress=False)
    arch = loaded.arch
    spec = KVCacheSpec(arch.num_layers, arch.num_kv_heads, arch.head_dim, 16, NVFP4)
    runner = ModelRunner(loaded, spec, 4, torch.device("cpu"))
    assert install_key_smoothing(runner, enabled=True)
    factors = calibrate_key_smoothing(loaded, arch.num_kv_heads, torch.device("cpu"))
    assert factors.shape == (arch.num_layers, arch.num_kv_heads, arch.head_dim)
    for layer, cache in enumerate(runner.kv_caches):
        assert cache.key_smooth is not None and torch.equal(cache.key_smooth, factors[layer])
        assert not cache.key.any()  # nothing written
    assert not install_key_smoothing(runner, enabled=False)
    fp8 = ModelRunner(
        loaded,
        KVCacheSpec(arch.num_layers, arch.num_kv_heads, arch.head_dim, 16, kv_format("fp8", torch.float32)),
        4,
        torch.device("cpu"),
    )
    assert not install_key_smoothing(fp8, enabled=True) and fp8.kv_caches[0].key_smooth is None
    # A max_model_len shorter than the calibration text: the forwards are cut to it.
    short = load_model(
        ModelConfig(model=str(model_dir), max_model_len=32), torch.device("cpu"), torch.float32, progress=False
    )
    assert torch.isfinite(calibrate_key_smoothing(short, arch.num_kv_heads, torch.device("cpu"))).all()
