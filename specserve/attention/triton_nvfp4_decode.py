"""e2m1 decoders and scaled tiles for triton_quant_nvfp4.py; both decoders are exact:
0 (plain Triton): nibble (s, e1, e0, m) -> float16 bits (15, 11, 10, 9), i.e. e2m1 * 2^-14.
1 (inline PTX): nibble -> e4m3 byte (s, 0, 0, e1, e0, m, 0, 0) = e2m1 * 2^-6, two per cvt.
"""

from __future__ import annotations

import triton
import triton.language as tl

E4M3_DECODE = 64.0  # 2^6: decoder 1 yields e2m1 * 2^-6
# $4 = two 16-bit units; output j = nibble j of u0 (low half) and u1 (high half) as float16.
_DECODE_PTX = tl.constexpr("""
{
.reg .b32 x, t, u, l, h;
.reg .b16 l02, l13, h02, h13;
prmt.b32 x, $4, 0, 0x3120;
shl.b32 t, x, 4;
and.b32 t, t, 0x80808080;
shl.b32 u, x, 2;
and.b32 u, u, 0x1C1C1C1C;
or.b32 l, t, u;
shr.b32 u, x, 2;
and.b32 u, u, 0x1C1C1C1C;
and.b32 t, x, 0x80808080;
or.b32 h, t, u;
mov.b32 {l02, l13}, l;
mov.b32 {h02, h13}, h;
cvt.rn.f16x2.e4m3x2 $0, l02;
cvt.rn.f16x2.e4m3x2 $1, h02;
cvt.rn.f16x2.e4m3x2 $2, l13;
cvt.rn.f16x2.e4m3x2 $3, h13;
}
""")

# K_PAIRS: $4 = word a of the row; outputs: elements 8a + {0, 2}, 8a + {1, 3}, 8a + {4, 6}, 8a + {5, 7}.
_DECODE_PAIRS_PTX = tl.constexpr("""
{
.reg .b32 t, u, l, h;
.reg .b16 l0, l1, h0, h1;
shl.b32 t, $4, 4;
and.b32 t, t, 0x80808080;
shl.b32 u, $4, 2;
and.b32 u, u, 0x1C1C1C1C;
or.b32 l, t, u;
shr.b32 u, $4, 2;
and.b32 u, u, 0x1C1C1C1C;
and.b32 t, $4, 0x80808080;
or.b32 h, t, u;
mov.b32 {l0, l1}, l;
mov.b32 {h0, h1}, h;
cvt.rn.f16x2.e4m3x2 $0, l0;
cvt.rn.f16x2.e4m3x2 $1, h0;
cvt.rn.f16x2.e4m3x2 $2, l1;
cvt.rn.f16x2.e4m3x2 $3, h1;
}
""")


@triton.jit
def _nibble16(u, J: tl.constexpr):
    """uint16 units -> float16 code * 2^-14 of nibble J: bits (s, e1, e0, m) -> (15, 11, 10, 9)."""
    n = u >> (4 * J)
    return (((n << 12) & 0x8000) | ((n << 9) & 0x0E00)).to(tl.float16, bitcast=True)


@triton.jit
def _decode(units, DECODER: tl.constexpr):
    """uint16 -> the four nibbles of every unit as float16: code * 2^-6 (DECODER 1), else * 2^-14."""
    if DECODER == 1:
        e0, e1, e2, e3 = tl.inline_asm_elementwise(
            _DECODE_PTX,
            "=r,=r,=r,=r,r",
            [units],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True,
            pack=2,
        )
    else:
        e0 = _nibble16(units, 0)
        e1 = _nibble16(units, 1)
        e2 = _nibble16(units, 2)
        e3 = _nibble16(units, 3)
    return e0, e1, e2, e3


@triton.jit
def _halves_tile(w, BLOCK_N: tl.constexpr, QUADS_PAD: tl.constexpr):
    """int32 words -> float16 [BLOCK_N, QUADS_PAD]: bits 0-15 at the even columns, 16-31 at the odd."""
    lo, hi = w.to(tl.int16).to(tl.float16, bitcast=True), (w >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return _pair_tile(lo, hi, BLOCK_N, QUADS_PAD)


@triton.jit
def _pair_tile(lo, hi, BLOCK_N: tl.constexpr, QUADS_PAD: tl.constexpr):
    """float16 [BLOCK_N, QUADS_PAD / 2] x 2 -> [BLOCK_N, QUADS_PAD], lo at the even columns."""
    return tl.reshape(tl.join(lo, hi), [BLOCK_N, QUADS_PAD])


@triton.jit
def _decode_pairs(words, BLOCK_N: tl.constexpr, QUADS_PAD: tl.constexpr, DECODER: tl.constexpr):
    """int32 words [BLOCK_N, QUADS_PAD / 2] -> four float16 tiles [BLOCK_N, QUADS_PAD]; column c = 2a + b
    of tile k holds element 8a + 4 (k // 2) + 2b + k % 2 (v7's K order; Q's columns follow it)."""
    if DECODER == 1:
        o0, o1, o2, o3 = tl.inline_asm_elementwise(
            _DECODE_PAIRS_PTX,
            "=r,=r,=r,=r,r",
            [words],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=True,
            pack=1,
        )
        e0 = _halves_tile(o0, BLOCK_N, QUADS_PAD)
        e1 = _halves_tile(o1, BLOCK_N, QUADS_PAD)
        e2 = _halves_tile(o2, BLOCK_N, QUADS_PAD)
        e3 = _halves_tile(o3, BLOCK_N, QUADS_PAD)
    else:
        lo = words.to(tl.uint16)  # unit 2a
        hi = (words >> 16).to(tl.uint16)  # unit 2a + 1
        e0 = _pair_tile(_nibble16(lo, 0), _nibble16(lo, 2), BLOCK_N, QUADS_PAD)
        e1 = _pair_tile(_nibble16(lo, 1), _nibble16(lo, 3), BLOCK_N, QUADS_PAD)
        e2 = _pair_tile(_nibble16(hi, 0), _nibble16(hi, 2), BLOCK_N, QUADS_PAD)
        e3 = _pair_tile(_nibble16(hi, 1), _nibble16(hi, 3), BLOCK_N, QUADS_PAD)
    return e0, e1, e2, e3


@triton.jit
def _group_scales(
    scale_ptrs, scale_mask, BLOCK_N: tl.constexpr, QUADS_PAD: tl.constexpr, G_PAD: tl.constexpr, MASKED: tl.constexpr
):
    """A tile's group scales as float16 [BLOCK_N, QUADS_PAD]: column c holds group c // 4's."""
    if MASKED:
        sc = tl.load(scale_ptrs, mask=scale_mask, other=0.0).to(tl.float16)
    else:
        sc = tl.load(scale_ptrs).to(tl.float16)
    return tl.reshape(tl.broadcast_to(sc[:, :, None], [BLOCK_N, G_PAD, 4]), [BLOCK_N, QUADS_PAD])


@triton.jit
def _scaled_tiles(
    ptrs,
    scale_ptrs,
    mask,
    scale_mask,
    BLOCK_N: tl.constexpr,
    QUADS_PAD: tl.constexpr,
    G_PAD: tl.constexpr,
    DECODER: tl.constexpr,
    MASKED: tl.constexpr,
    PAIRS: tl.constexpr,
):
    """One cache tile -> E_0..E_3, float16 [BLOCK_N, QUADS_PAD] (elements 4c + j), times group scales.
    PAIRS: read as 32-bit words, in _decode_pairs's column order. MASKED False: all in range."""
    if MASKED:
        units = tl.load(ptrs, mask=mask, other=0)
    else:
        units = tl.load(ptrs)
    sc = _group_scales(scale_ptrs, scale_mask, BLOCK_N, QUADS_PAD, G_PAD, MASKED)  # unit c: group c // 4
    if PAIRS:
        e0, e1, e2, e3 = _decode_pairs(units, BLOCK_N, QUADS_PAD, DECODER)
    else:
        e0, e1, e2, e3 = _decode(units.to(tl.uint16, bitcast=True), DECODER)
    return e0 * sc, e1 * sc, e2 * sc, e3 * sc
