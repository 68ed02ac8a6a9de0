"""Triton kernels that run the quantized-KV decoders over a flat tensor, for exhaustive checks
(tests/gpu/test_triton_quant_kv.py). A module of its own: Triton resolves a kernel's callees from
its module's globals, and importing it needs triton (the test imports it lazily)."""

from __future__ import annotations

import triton
import triton.language as tl

from specserve.attention.triton_nvfp4_decode import _decode, _decode_pairs
from specserve.attention.triton_quant_fp8 import _unit_halves


@triton.jit
def fp8_units_kernel(units_ptr, out_ptr, PTX: tl.constexpr, BLOCK: tl.constexpr):
    """out[2i], out[2i + 1] = the float16 values of unit i's low and high e4m3 byte."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e0, e1 = _unit_halves(tl.load(units_ptr + offs).to(tl.uint16, bitcast=True), PTX)
    tl.store(out_ptr + 2 * offs, e0)
    tl.store(out_ptr + 2 * offs + 1, e1)


@triton.jit
def nvfp4_units_kernel(units_ptr, out_ptr, DECODER: tl.constexpr, BLOCK: tl.constexpr):
    """out[4i + j] = nibble j of unit i as float16 (scaled as the decoder DECODER leaves it)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e0, e1, e2, e3 = _decode(tl.load(units_ptr + offs).to(tl.uint16, bitcast=True), DECODER)
    tl.store(out_ptr + 4 * offs, e0)
    tl.store(out_ptr + 4 * offs + 1, e1)
    tl.store(out_ptr + 4 * offs + 2, e2)
    tl.store(out_ptr + 4 * offs + 3, e3)


@triton.jit
def nvfp4_pairs_kernel(words_ptr, out_ptr, DECODER: tl.constexpr, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """v7's K decoder (_decode_pairs) over rows of WORDS int32 words (word a: units 2a, 2a + 1), each
    value written back at its element index: out[row, 4u + j] = nibble j of unit u, as _decode."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    a = tl.arange(0, WORDS)
    e0, e1, e2, e3 = _decode_pairs(tl.load(words_ptr + r[:, None] * WORDS + a[None, :]), ROWS, 2 * WORDS, DECODER)
    c = tl.arange(0, 2 * WORDS)
    d = r[:, None] * (8 * WORDS) + (8 * (c // 2) + 2 * (c % 2))[None, :]  # tile k: + (0, 1, 4, 5)[k]
    tl.store(out_ptr + d, e0)
    tl.store(out_ptr + d + 1, e1)
    tl.store(out_ptr + d + 4, e2)
    tl.store(out_ptr + d + 5, e3)
