"""Shared pieces of the quantized-KV kernel tests (tests/gpu/test_triton_quant_kv.py,
test_quant_kv_bounds.py): batches over a NaN-poisoned paged cache, the float64 oracle, the kernels'
launch, and the interpreter's float8 patch.

A test module takes the float8 patch by importing `fp8_interpreter` (an autouse fixture).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch

from specserve.attention.base import AttentionMetadata
from specserve.attention.torch_ref import TorchRefBackend
from specserve.kv import quant
from specserve.kv.spec import KVFormat, LayerKVCache
from tests.helpers.attention_meta import paged_metadata

F64 = KVFormat("float64", torch.float64, 1, None, None)
try:
    from specserve.attention.triton_quant import VARIANTS
except ImportError:  # no triton: tests/gpu/conftest.py skips these tests, collection must still work
    VARIANTS = {}
# Every attention kernel variant of every format (triton_quant.VARIANTS), as (format, variant).
KERNELS = [(name, variant) for name, variants in VARIANTS.items() for variant in variants]
KERNEL_IDS = [f"{n}-{v}" for n, v in KERNELS]
# (relative norm error, max abs error) against the float64 reference, by q / output dtype
TOL = {torch.float32: (3e-3, 1e-2), torch.bfloat16: (1e-2, 5e-2)}


def patch_fp8_interpreter():
    """Make the interpreter do float8 conversions with torch (round to nearest even, as the GPU).

    Returns a function that undoes it.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    original = interp._convert_float
    as_torch = {
        tl.float8e4nv: torch.float8_e4m3fn,
        tl.float16: torch.float16,
        tl.bfloat16: torch.bfloat16,
        tl.float32: torch.float32,
    }
    bits = {
        8: (np.uint8, np.uint8, torch.uint8),
        16: (np.uint16, np.int16, torch.int16),
        32: (np.uint32, np.int32, torch.int32),
    }

    def convert_float(data, src, dst, rounding):
        if tl.float8e4nv not in (src, dst) or src not in as_torch or dst not in as_torch:
            return original(data, src, dst, rounding)
        _, signed, tint = bits[src.primitive_bitwidth]
        raw = torch.from_numpy(np.ascontiguousarray(data).view(signed).copy()).view(tint)
        unsigned, _, out_int = bits[dst.primitive_bitwidth]
        return raw.view(as_torch[src]).to(as_torch[dst]).view(out_int).numpy().view(unsigned)

    interp._convert_float = convert_float

    def undo() -> None:
        interp._convert_float = original

    return undo


@pytest.fixture(autouse=True, scope="module")
def fp8_interpreter():
    """Interpreter only: do float8 conversions with torch (round to nearest even, as the GPU)."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    undo = patch_fp8_interpreter()
    yield
    undo()


def poisoned_cache(fmt: KVFormat, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> LayerKVCache:
    """A CPU cache whose every slot reads back as NaN (fp8: NaN bytes; both: NaN scales)."""
    data_shape = (num_blocks, block_size, num_kv_heads, fmt.packed_dim(head_dim))
    scale_shape = data_shape[:3] + (fmt.num_scale_groups(head_dim),)

    def data() -> torch.Tensor:
        return torch.full(data_shape, 0x7F, dtype=torch.uint8).view(fmt.storage_dtype)

    def scale() -> torch.Tensor:
        return torch.full(scale_shape, float("nan")).to(fmt.scale_dtype)

    return LayerKVCache(data(), data(), scale(), scale())


def to_device(cache: LayerKVCache, device: torch.device) -> LayerKVCache:
    return LayerKVCache(*(None if t is None else t.to(device) for t in cache))


def clone_cache(cache: LayerKVCache) -> LayerKVCache:
    """A copy of the written tensors (data and scales); key_smooth is shared."""
    return cache._replace(**{n: getattr(cache, n).clone() for n in STORED})


def restore_cache(dst: LayerKVCache, src: LayerKVCache) -> None:
    """Copy src's data and scales back into dst's tensors."""
    for n in STORED:
        getattr(dst, n).copy_(getattr(src, n))


STORED = ("key", "value", "key_scale", "value_scale")


def assert_same_bytes(got: LayerKVCache, want: LayerKVCache) -> None:
    for name in STORED:
        g, w = getattr(got, name), getattr(want, name)
        bits = torch.int16 if g.element_size() == 2 else torch.uint8
        g_bits, w_bits = g.cpu().view(bits), w.view(bits)
        bad = (g_bits != w_bits).sum().item()
        assert bad == 0, f"{name}: {bad} of {g.numel()} elements differ from quant.write_kv"


class Batch(NamedTuple):
    q: torch.Tensor  # [num_tokens (+ padding), num_heads, head_dim]
    k: torch.Tensor  # [num_tokens (+ padding), num_kv_heads, head_dim]
    v: torch.Tensor
    cache: LayerKVCache  # on the device, context already written (by the oracle)
    cpu_cache: LayerKVCache  # the same, on the CPU, for the reference
    meta: AttentionMetadata  # what the kernel sees (may hold padding tokens / empty sequences)
    ref_meta: AttentionMetadata  # real tokens and sequences only
    scale: float


def make_batch(
    specs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    fmt: KVFormat,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    pad_tokens: int = 0,
    pad_seqs: int = 0,
    pool_tail: bool = False,
    key_smooth: torch.Tensor | None = None,
) -> Batch:
    """specs: (cached context_len, query_len) per sequence; block ids are shuffled over the pool.

    pool_tail: the sequences own the pool's last blocks instead (sequence 0 the very last ones, so
    with a length that is a multiple of block_size its last token is the pool's last slot and a read
    past its rows runs off the end of every cache tensor), and the kernel's block tables hold ids
    outside the pool past each sequence's blocks (padding entries must never be read).
    key_smooth [num_kv_heads, head_dim]: the cache's key smoothing factors (kv/smoothing.py).
    """
    gen = torch.Generator().manual_seed(seed)
    counts = [math.ceil((c + n) / block_size) for c, n in specs]
    num_blocks = sum(counts) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in counts:
        tables.append(list(range(num_blocks - at - n, num_blocks - at)) if pool_tail else perm[at : at + n])
        at += n
    cache = poisoned_cache(fmt, num_blocks, block_size, num_kv_heads, head_dim)._replace(key_smooth=key_smooth)
    for (c, _), t in zip(specs, tables):  # the cached context of every sequence, written by the oracle
        slots = torch.tensor([t[p // block_size] * block_size + p % block_size for p in range(c)], dtype=torch.long)
        quant.write_kv(
            cache,
            fmt,
            slots,
            torch.randn(c, num_kv_heads, head_dim, generator=gen),
            torch.randn(c, num_kv_heads, head_dim, generator=gen) * 3,
        )
    num_tokens = sum(n for _, n in specs) + pad_tokens
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype).to(device)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    meta = paged_metadata(specs, tables, block_size, device, pad_tokens, pad_seqs)
    if pool_tail:
        for b, t in enumerate(tables + [[]] * pad_seqs):
            meta.block_tables[b, len(t) :] = num_blocks + 1000
    return Batch(
        q.view(num_tokens, num_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
        to_device(cache, device),
        cache,
        meta,
        paged_metadata(specs, tables, block_size, device),
        head_dim**-0.5,
    )


def reference(batch: Batch, fmt: KVFormat) -> tuple[torch.Tensor, LayerKVCache]:
    """float64 output for the real tokens over the dequantized cache, and the oracle-written cache."""
    n = batch.ref_meta.num_tokens
    written = clone_cache(batch.cpu_cache)
    slots = batch.ref_meta.slot_mapping.cpu()
    quant.write_kv(written, fmt, slots, batch.k[:n].cpu(), batch.v[:n].cpu())

    def dequantized(data: torch.Tensor, scale: torch.Tensor, smooth: torch.Tensor | None = None) -> torch.Tensor:
        nb, bs, h, p = data.shape
        flat_scale = scale.reshape(-1, h, scale.shape[-1])
        full = quant.dequantize(data.reshape(-1, h, p), flat_scale, fmt, torch.float64, smooth)
        return full.view(nb, bs, h, -1).nan_to_num(0.0)  # the oracle may read padded slots under a mask

    key = dequantized(written.key, written.key_scale, written.key_smooth)
    value = dequantized(written.value, written.value_scale)
    clean = LayerKVCache(key, value, None, None)
    h, d = key.shape[2], key.shape[3]
    k_new, v_new = key.view(-1, h, d)[slots], value.view(-1, h, d)[slots]  # re-storing them is a no-op
    meta = batch.ref_meta
    cpu_meta = AttentionMetadata(
        meta.cu_query_lens.cpu(),
        meta.seq_lens.cpu(),
        meta.block_tables.cpu(),
        slots,
        meta.max_query_len,
        meta.max_seq_len,
        meta.num_seqs,
        meta.num_tokens,
        meta.query_lens_cpu,
        meta.seq_lens_cpu,
    )
    out = TorchRefBackend().forward(batch.q[:n].cpu().double(), k_new, v_new, clean, F64, cpu_meta, batch.scale)
    return out, written


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    out = out.cpu()
    assert not torch.isnan(out).any(), "unwritten or NaN-contaminated output rows"
    diff = out.double() - ref
    rel = (diff.norm() / ref.norm()).item()
    max_abs = diff.abs().max().item()
    rel_tol, abs_tol = TOL[dtype]
    assert rel < rel_tol and max_abs < abs_tol, f"rel {rel:.2e} (tol {rel_tol}), max abs {max_abs:.2e} (tol {abs_tol})"


def run_kernels(
    batch: Batch, fmt: KVFormat, num_splits: int | None = None, variant: str | None = None, **launch
) -> torch.Tensor:
    from specserve.attention.triton_quant import (
        paged_attention_quant,
        reshape_and_cache_quant,
    )

    meta = batch.meta
    reshape_and_cache_quant(batch.k, batch.v, batch.cache, fmt, meta.slot_mapping)
    out = torch.full(batch.q.shape, float("nan"), dtype=batch.q.dtype, device=batch.q.device)
    return paged_attention_quant(
        batch.q,
        batch.cache,
        fmt,
        meta.cu_query_lens,
        meta.seq_lens,
        meta.block_tables,
        meta.max_query_len,
        meta.max_seq_len,
        batch.scale,
        out=out,
        num_splits=num_splits,
        variant=variant,
        **launch,
    )
