"""Quantized KV: fp8 and nvfp4 pack / unpack, and the paged-cache writer / reader built on them.

fp8 (per (token, head)): scale = amax / 448 rounded UP to float16 (nothing saturates);
    data = e4m3fn(x / scale). Error <= 2^-4 |x| + 2^-10 * scale.
nvfp4 (per 16 values of one (token, head)), as NVIDIA's NVFP4: g = fmt.global_scale (static);
    block scale s = e4m3(amax / (6 g)) rounded UP; codes = e2m1(x / (s g)), nearest, ties to even
    code. Error <= max(|x|, s g) / 4. Two codes per byte, element 2i in the low nibble; a nibble
    is sign << 3 | magnitude index (zero is +0).
g is static (a token's scales are written once); g = 4 covers group amax up to 10752 (larger
saturates, finite). Inputs must be finite.
fmt.rotate (nvfp4): each head vector x is stored as x Hn, Hn = hadamard() a block Hadamard rotation
(QuaRot): it spreads outlier channels over the head, which makes q.k's error smaller. Attention is
unchanged if q is rotated alike (q.k = (q Hn).(k Hn)) and the output back (P (V Hn) Hn = P V).
cache.key_smooth s [H, D] (kv/smoothing.py): keys are quantized as k / s and met by q * s (powers of
two: both exact), before the rotation: q' = q diag(s) Hn per head (query_rotation()).
"""

from __future__ import annotations

import functools
import math
import weakref

import torch

from specserve.kv.spec import KVFormat, LayerKVCache

FP8_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_MAX = 6.0
_FP16_MAX = 65504.0
_FP16_MIN_SUBNORMAL = 2.0**-24
_E4M3_MIN_SUBNORMAL = 2.0**-9
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Boundaries between neighbouring indices, and whether a tie goes up (to the even index).
_E2M1_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _round_up_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast positive float32 `x` (within dtype's finite range) to float16 / float8_e4m3fn, rounding
    up: the next value up is the bit pattern plus one."""
    q, int_dtype = x.to(dtype), torch.uint8 if dtype.itemsize == 1 else torch.int16
    return (q.view(int_dtype) + (q.float() < x).to(int_dtype)).view(dtype)


@functools.cache
def hadamard(head_dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Hn [D, D]: the block-diagonal Sylvester Hadamard matrix, orthonormal and symmetric (Hn Hn = I),
    blocks of b = the largest power of 4 dividing D: its entries +-1/sqrt(b) are exact in every dtype."""
    b = 4 ** (((head_dim & -head_dim).bit_length() - 1) // 2)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return torch.block_diag(*[h / math.sqrt(b)] * (head_dim // b)).to(device=device, dtype=dtype)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> x Hn in float64, where the sums of +-2^-e x_i are exact (short of a 2^22 spread in
    a head): every device rounds them to the same float32, so Triton's write stores quantize()'s bytes."""
    return x.double() @ hadamard(x.shape[-1], x.device, torch.float64)


def smooth_keys(key: torch.Tensor, key_smooth: torch.Tensor | None) -> torch.Tensor:
    """key [N, H, D] / key_smooth [H, D] in float32 (exact: powers of two), or key as is (None)."""
    return key if key_smooth is None else key.float() / key_smooth


def query_rotation(
    fmt: KVFormat, key_smooth: torch.Tensor | None, num_heads: int, head_dim: int, dtype: torch.dtype, device
) -> torch.Tensor | None:
    """What q [T, Hq, D] is multiplied by before it meets a cache of `fmt`: Hn [D, D] (fmt.rotate), or
    diag(s) Hn [Hq, D, D] per query head (s of its KV head, or the identity without fmt.rotate) with
    key smoothing; None: q as is. Entries +-s / sqrt(b) are exact in every dtype."""
    if key_smooth is None:
        return hadamard(head_dim, device, dtype) if fmt.rotate else None
    smooth: torch.Tensor = key_smooth
    key = (fmt.rotate, num_heads, dtype)
    entry = _query_rotations.get(id(smooth))  # every step of every layer asks: built once per cache
    if entry is None or entry[0]() is not smooth:
        entry = _query_rotations[id(smooth)] = (weakref.ref(smooth), {})
        weakref.finalize(smooth, _query_rotations.pop, id(smooth), None)
    built = entry[1]
    rot = built.get(key)
    if rot is None:
        per_head = smooth.repeat_interleave(num_heads // smooth.shape[0], dim=0)  # [Hq, D]
        if fmt.rotate:
            rot = (per_head[:, :, None] * hadamard(head_dim, device, torch.float32)).to(dtype)
        else:
            rot = torch.diag_embed(per_head).to(dtype)
        # A graph capture only records the kernels: keep a matrix only once it has been computed.
        if not (rot.is_cuda and torch.cuda.is_current_stream_capturing()):
            built[key] = rot
    return rot


# id(cache.key_smooth) (fixed once calibrated) -> (a weak reference to it, its query matrices); an entry
# goes when its tensor does.
_query_rotations: dict[int, tuple[weakref.ref, dict[tuple, torch.Tensor]]] = {}


def _group_view(x: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[N, H, D] -> [N, H, G, D // G]."""
    n, h, d = x.shape
    if d % num_groups:
        raise ValueError(f"head_dim {d} is not a multiple of the {num_groups} scale groups")
    return x.reshape(n, h, num_groups, d // num_groups)


def _quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.float()  # [N, H, D]
    amax = x.abs().amax(dim=-1, keepdim=True)  # [N, H, 1]
    target = (amax / FP8_MAX).clamp(_FP16_MIN_SUBNORMAL, _FP16_MAX)
    scale = _round_up_to(target, torch.float16)  # [N, H, 1]
    data = (x / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return data, scale


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 nibble (sign << 3 | index) of each float32 value in [-6, 6]."""
    mag = v.abs()
    index = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for bound, tie_up in _E2M1_BOUNDS:
        index += (mag >= bound) if tie_up else (mag > bound)
    return index | (((v < 0) & (index > 0)).to(torch.uint8) << 3)  # -0 stores +0


def _quantize_nvfp4(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    n, h, d = x.shape
    if d % 2:
        raise ValueError(f"nvfp4 needs an even head_dim, got {d}")
    g = float(fmt.global_scale)
    groups = _group_view(x.float(), fmt.num_scale_groups(d))  # [N, H, G, D/G]
    amax = groups.abs().amax(dim=-1, keepdim=True)  # [N, H, G, 1]
    # Zero groups get the smallest scale; their codes are all zero regardless.
    target = (amax / (E2M1_MAX * g)).clamp(_E4M3_MIN_SUBNORMAL, FP8_MAX)
    scale = _round_up_to(target, torch.float8_e4m3fn)  # [N, H, G, 1]
    v = (groups / (scale.float() * g)).clamp(-E2M1_MAX, E2M1_MAX)
    codes = _e2m1_codes(v).reshape(n, h, d // 2, 2)  # [N, H, D/2, 2]
    data = codes[..., 0] | (codes[..., 1] << 4)  # [N, H, D/2]
    return data, scale.squeeze(-1)


def _dequantize_nvfp4(data: torch.Tensor, scale: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    n, h, p = data.shape
    magnitudes = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=data.device)
    lut = torch.cat([magnitudes, -magnitudes])  # [16], indexed by the nibble
    codes = torch.stack([data & 0x0F, data >> 4], dim=-1).reshape(n, h, 2 * p)  # [N, H, D]
    values = _group_view(lut[codes.long()], scale.shape[-1])  # [N, H, G, D/G]
    values = values * (scale.float() * float(fmt.global_scale)).unsqueeze(-1)
    values = values.reshape(n, h, 2 * p)
    return hadamard_rotate(values) if fmt.rotate else values


def quantize(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [N, H, D] float -> (data [N, H, packed_dim] storage dtype, scale [N, H, G] or None)."""
    if x.dim() != 3:
        raise ValueError(f"quantize expects [num_tokens, num_heads, head_dim], got {tuple(x.shape)}")
    if not fmt.quantized:
        return x.to(fmt.storage_dtype), None
    return _quantize_fp8(x) if fmt.name == "fp8" else _quantize_nvfp4(hadamard_rotate(x) if fmt.rotate else x, fmt)


def dequantize(
    data: torch.Tensor,
    scale: torch.Tensor | None,
    fmt: KVFormat,
    out_dtype: torch.dtype,
    smooth: torch.Tensor | None = None,
) -> torch.Tensor:
    """data [N, H, packed_dim], scale [N, H, G] or None -> [N, H, D] in out_dtype; smooth [H, D]: the
    values were quantized divided by it (cache.key_smooth), and come back multiplied."""
    if not fmt.quantized:
        return data.to(out_dtype)
    if scale is None:
        raise ValueError(f"KV format {fmt.name!r} needs scales to dequantize")
    values = data.float() * scale.float() if fmt.name == "fp8" else _dequantize_nvfp4(data, scale, fmt)
    return (values if smooth is None else values * smooth).to(out_dtype)


def _scatter(dst: torch.Tensor, slot_mapping: torch.Tensor, src: torch.Tensor) -> None:
    """Store src [N, H, X] at slots of dst [num_blocks, block_size, H, X] (index_copy_ has no float8
    kernel on every device; copying the bytes is exact either way)."""
    if dst.dtype.itemsize == 1 and dst.dtype != torch.uint8:
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    dst.view(-1, dst.shape[2], dst.shape[3]).index_copy_(0, slot_mapping, src.to(dst.dtype))


def write_kv(
    cache: LayerKVCache, fmt: KVFormat, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """Quantize key / value [N, H, D] (key / cache.key_smooth) and store token i at slot slot_mapping[i] ([N] int64)."""
    slots = slot_mapping.to(device=cache.key.device, dtype=torch.long)
    key = smooth_keys(key, cache.key_smooth)
    for data_cache, scale_cache, x in ((cache.key, cache.key_scale, key), (cache.value, cache.value_scale, value)):
        data, scale = quantize(x, fmt)
        _scatter(data_cache, slots, data)
        if scale is not None:
            if scale_cache is None:
                raise ValueError(f"KV format {fmt.name!r} needs a cache with scale tensors")
            _scatter(scale_cache, slots, scale)
