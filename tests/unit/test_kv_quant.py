"""Quantized KV (fp8, nvfp4): error bounds against a float64 reference, special values, paged
write / gather round trips, and the capacity gain per byte.

The bounds are the codecs' (nvfp4 without its Hadamard rotation, `codec`); the rotated nvfp4 format
stores the codec of the rotated vector, checked separately.

Bounds checked (x one element, amax over its scale group, s the dequantized scale):
  fp8:   |x_hat - x| <= 2^-4 |x| + 2^-10 s, s <= amax/448 (1 + 2^-10) + 2^-24, so <= 2^-4 amax.
  nvfp4: |x_hat - x| <= max(|x|, s) / 4, s = e4m3 block scale * global scale,
         s <= 1.125 amax / 6 when the block scale is a normal e4m3 (else s <= amax/6 + 2^-9 g).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specserve.kv.quant import dequantize, hadamard, hadamard_rotate, quantize, write_kv
from specserve.kv.spec import KVCacheSpec, KVFormat, kv_format
from tests.helpers.kv_gather import gather_kv

FP32_SLACK = 1e-6  # relative float32 arithmetic slack on top of the format's own bound


def codec(name: str) -> KVFormat:
    """The format without the Hadamard rotation (the plain fp8 / nvfp4 codec)."""
    return dataclasses.replace(kv_format(name, torch.float32), rotate=False)


def _round_trip(x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    fmt = codec(name)
    data, scale = quantize(x, fmt)
    return dequantize(data, scale, fmt, torch.float32).double(), scale


def _check_fp8(x: torch.Tensor) -> None:
    x_hat, scale = _round_trip(x, "fp8")
    ref = x.double()
    amax = ref.abs().amax(-1, keepdim=True)
    s = scale.double()  # [N, H, 1]
    assert torch.all(s <= amax / 448 * (1 + 2**-10) + 2**-24)
    err = (x_hat - ref).abs()
    bound = 2**-4 * ref.abs() + 2**-10 * s
    assert torch.all(err <= bound * (1 + FP32_SLACK) + 1e-30)
    assert torch.all(err <= 2**-4 * amax * (1 + FP32_SLACK) + 2**-30)
    assert torch.isfinite(x_hat).all()


def _check_nvfp4(x: torch.Tensor, global_scale: float = 4.0) -> None:
    fmt = dataclasses.replace(codec("nvfp4"), global_scale=global_scale)
    data, scale = quantize(x, fmt)
    x_hat = dequantize(data, scale, fmt, torch.float32).double()
    n, h, d = x.shape
    groups = scale.shape[-1]
    ref = x.double().reshape(n, h, groups, -1)
    s = (scale.double() * global_scale).unsqueeze(-1)  # [N, H, G, 1]
    amax = ref.abs().amax(-1, keepdim=True)
    assert torch.all(ref.abs() <= 6 * s * (1 + FP32_SLACK)), "a block scale was rounded down"
    normal = scale.double().unsqueeze(-1) >= 2**-6
    assert torch.all(~normal | (s <= 1.125 * amax / 6 * (1 + FP32_SLACK)))
    assert torch.all(s <= amax / 6 * 1.125 + 2**-9 * global_scale)
    err = (x_hat.reshape(ref.shape) - ref).abs()
    assert torch.all(err <= torch.maximum(ref.abs(), s) / 4 * (1 + FP32_SLACK))
    assert torch.isfinite(x_hat).all()


@pytest.mark.parametrize("magnitude", [1e-3, 0.1, 1.0, 30.0, 1e3])
def test_fp8_error_bound(magnitude: float) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 128, generator=g) * magnitude
    x[::7, :, 5] *= 50  # outlier channel, as real keys have
    _check_fp8(x)


@pytest.mark.parametrize("magnitude", [0.05, 0.5, 1.0, 30.0, 200.0])  # amax stays <= 10752
def test_nvfp4_error_bound(magnitude: float) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, 128, generator=g) * magnitude
    x[::5, :, 17] *= 8
    _check_nvfp4(x)


@pytest.mark.parametrize("sigma", [0.01, 1.0, 2000.0])
def test_nvfp4_typical_error_is_small(sigma: float) -> None:
    """Across the range the default global scale is built for (group amax ~0.03 .. 10752)."""
    x = torch.randn(256, 8, 64, generator=torch.Generator().manual_seed(2)) * sigma
    x_hat, _ = _round_trip(x, "nvfp4")
    rel_rms = ((x_hat - x.double()).pow(2).mean().sqrt() / x.double().pow(2).mean().sqrt()).item()
    assert rel_rms < 0.14  # e2m1 with a per-16 scale: about 0.10 on Gaussian data


@pytest.mark.parametrize("name", ["fp8", "nvfp4"])
def test_special_values(name: str) -> None:
    check = _check_fp8 if name == "fp8" else _check_nvfp4
    zeros = torch.zeros(3, 2, 64)
    x_hat, _ = _round_trip(zeros, name)
    assert torch.equal(x_hat, zeros.double())

    x = torch.randn(8, 2, 64, generator=torch.Generator().manual_seed(3))
    x[2] = 0  # a whole zero token
    x[3, 0] = 1e4  # large constant vector
    x[4, 1, ::2] = -1e4  # large negatives next to small values
    x[5] = 1e-30  # far below every scale's range
    x[6] = -x[6].abs()  # all negative
    x[:, :, :16] = 0  # a whole zero scale group inside a non-zero head vector
    check(x)
    x_hat, _ = _round_trip(x, name)
    assert torch.all(x_hat[:, :, :16] == 0) and torch.all(x_hat[2] == 0)
    assert torch.all(x_hat[6] <= 0)
    rel = 2**-4 if name == "fp8" else 2**-2
    assert (x_hat[3, 0, 16:] - 1e4).abs().max() <= 1e4 * rel


@pytest.mark.parametrize("name", ["fp8", "nvfp4"])
def test_sign_symmetry(name: str) -> None:
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(4))
    pos, _ = _round_trip(x, name)
    neg, _ = _round_trip(-x, name)
    assert torch.equal(pos, -neg)


def test_out_of_range_saturates_finite() -> None:
    x = torch.tensor([3e4, -1e6, 1e9, 0.5] * 16).reshape(1, 1, 64)
    for name in ("fp8", "nvfp4"):
        x_hat, _ = _round_trip(x, name)
        assert torch.isfinite(x_hat).all()
        assert torch.all(x_hat * x.double() >= 0)  # small values may flush to 0, never flip sign
        assert torch.all(x_hat[..., :3].abs() >= 1e4)
    x_hat, _ = _round_trip(torch.tensor([1e30, -1.0]).repeat(32).reshape(1, 1, 64), "fp8")
    assert torch.isfinite(x_hat).all()


def test_nvfp4_packing_and_ties() -> None:
    fmt = codec("nvfp4")
    g = fmt.global_scale
    # amax 6 g makes the block scale exactly 1; each value then sits on or between e2m1 codes.
    v = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.5, -6.0, 0.1, -0.1, 1.0, 0, 0, 0])
    data, scale = quantize((v * g).reshape(1, 1, 16), fmt)
    assert scale.float().item() == 1.0
    expected = torch.tensor([6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.5, -6.0, 0, 0, 1.0, 0, 0, 0])
    assert torch.equal(dequantize(data, scale, fmt, torch.float32).flatten(), expected * g)
    # element 0 (6 -> index 7) in the low nibble, element 1 (0) in the high nibble; -0.1 stores +0.
    assert data[0, 0, 0].item() == 0x07 and data[0, 0, 4].item() == 0xF9 and data[0, 0, 5].item() == 0


@pytest.mark.parametrize("head_dim", [16, 64, 80, 96, 128])
def test_hadamard_rotation_is_orthonormal_and_self_inverse(head_dim: int) -> None:
    h = hadamard(head_dim, torch.device("cpu"), torch.float64)
    assert torch.equal(h, h.T) and torch.allclose(h @ h, torch.eye(head_dim, dtype=torch.float64), atol=1e-12)
    assert (h != 0).sum() >= 16 * head_dim  # every block mixes at least 16 channels
    assert torch.equal(hadamard(head_dim, torch.device("cpu"), torch.bfloat16).double(), h)  # exact entries
    x = torch.randn(5, 3, head_dim, dtype=torch.float64)
    assert torch.allclose(hadamard_rotate(hadamard_rotate(x)), x, atol=1e-12)


def test_rotated_nvfp4_stores_the_codec_of_the_rotated_vector() -> None:
    fmt = kv_format("nvfp4", torch.bfloat16)
    assert fmt.rotate and not kv_format("fp8", torch.bfloat16).rotate
    x = torch.randn(7, 2, 128, generator=torch.Generator().manual_seed(7))
    data, scale = quantize(x, fmt)
    want_data, want_scale = quantize(hadamard_rotate(x).float(), codec("nvfp4"))
    assert torch.equal(data, want_data) and torch.equal(scale.view(torch.uint8), want_scale.view(torch.uint8))
    got = dequantize(data, scale, fmt, torch.float64)
    assert torch.allclose(got, hadamard_rotate(dequantize(data, scale, codec("nvfp4"), torch.float64)), atol=1e-12)


def test_rotation_lowers_the_score_error_of_keys_with_outlier_channels() -> None:
    """Real keys have a few large channels, which dominate q.k (queries share them); rotated, their
    error spreads over the head (on SmolLM2's keys: 0.04 -> 0.023 relative score error)."""
    k = torch.randn(256, 4, 64, generator=torch.Generator().manual_seed(8)).double()
    k[..., [3, 21, 40, 58]] *= 20
    errors = []
    for fmt in (codec("nvfp4"), kv_format("nvfp4", torch.float32)):
        k_hat = dequantize(*quantize(k, fmt), fmt, torch.float64)
        scores = torch.einsum("qhd,khd->hqk", k, k)  # the keys as queries
        errors.append(((torch.einsum("qhd,khd->hqk", k, k_hat) - scores).norm() / scores.norm()).item())
    assert errors[1] < 0.75 * errors[0], errors  # about 0.054 -> 0.031


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32"])
def test_plain_formats_are_casts(name: str) -> None:
    fmt = kv_format(name, torch.bfloat16)
    x = torch.randn(4, 2, 8)
    data, scale = quantize(x, fmt)
    assert scale is None and data.dtype == fmt.storage_dtype
    assert torch.equal(dequantize(data, None, fmt, torch.float32), x.to(fmt.storage_dtype).float())


@pytest.mark.parametrize("name", ["fp8", "nvfp4", "bfloat16"])
def test_write_gather_round_trip(name: str) -> None:
    gen = torch.Generator().manual_seed(6)
    fmt = kv_format(name, torch.bfloat16)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=32, block_size=4, fmt=fmt)
    cache = spec.allocate(num_blocks=12, device=torch.device("cpu"))[0]
    num_tokens = 13
    block_ids = torch.randperm(12, generator=gen)[:4].to(torch.int32)  # int32, like block tables
    slots = (block_ids.long()[:, None] * 4 + torch.arange(4)).flatten()[:num_tokens]
    key = torch.randn(num_tokens, 2, 32, generator=gen)
    value = torch.randn(num_tokens, 2, 32, generator=gen)
    order = torch.randperm(num_tokens, generator=gen)  # write in a scrambled order, in two steps
    for part in (order[:6], order[6:]):
        write_kv(cache, fmt, slots[part], key[part], value[part])
    got_k, got_v = gather_kv(cache, fmt, block_ids, num_tokens, torch.float32)
    assert got_k.shape == (num_tokens, 2, 32) and got_v.dtype == torch.float32
    want_k = dequantize(*quantize(key, fmt), fmt, torch.float32)
    want_v = dequantize(*quantize(value, fmt), fmt, torch.float32)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    # A shorter read returns the same prefix; other blocks were untouched.
    short_k, _ = gather_kv(cache, fmt, block_ids, 5, torch.bfloat16)
    assert torch.equal(short_k, want_k[:5].bfloat16())
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[block_ids.long()] = False
    assert not cache.key[untouched].view(torch.uint8).any()


def test_write_overwrites_only_its_slots() -> None:
    fmt = kv_format("nvfp4", torch.bfloat16)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=16, block_size=2, fmt=fmt)
    cache = spec.allocate(num_blocks=2, device=torch.device("cpu"))[0]
    a, b = torch.full((1, 1, 16), 1.0), torch.full((1, 1, 16), 100.0)
    write_kv(cache, fmt, torch.tensor([1]), a, a)
    write_kv(cache, fmt, torch.tensor([2]), b, b)
    k, _ = gather_kv(cache, fmt, torch.tensor([0, 1]), 3, torch.float32)
    for got, x in ((k[1], a), (k[2], b)):
        assert torch.equal(got, dequantize(*quantize(x, fmt), fmt, torch.float32)[0])


@pytest.mark.parametrize("head_dim", [64, 128])
def test_capacity_gain_per_byte(head_dim: int) -> None:
    def blocks(name: str) -> int:
        spec = KVCacheSpec(
            num_layers=24, num_kv_heads=8, head_dim=head_dim, block_size=16, fmt=kv_format(name, torch.bfloat16)
        )
        return spec.num_blocks_for(8 << 30)

    assert blocks("fp8") >= 1.9 * blocks("bfloat16")
    assert blocks("nvfp4") >= 3.4 * blocks("bfloat16")
