"""Triton paged attention and KV write against the torch reference (attention/torch_ref.py).

The oracle runs TorchRefBackend in float64 on upcast copies of the same inputs; the kernels are
checked by ||out - ref|| / ||ref|| and max |out - ref|. Cache blocks (and slots) that no sequence
owns are NaN, so any read outside a sequence's context shows up as NaN; outputs are poisoned
with NaN before the kernel runs, so every row must be written.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch

from specserve.attention.base import AttentionMetadata
from specserve.attention.torch_ref import TorchRefBackend, write_kv
from specserve.kv.spec import KVFormat, LayerKVCache, kv_format
from tests.helpers.attention_meta import paged_metadata

F64 = KVFormat("float64", torch.float64, 1, None, None)
# (relative norm error, max abs error) against the float64 reference
TOL = {torch.float32: (2e-5, 2e-4), torch.float16: (3e-3, 1e-2), torch.bfloat16: (1e-2, 5e-2)}
MIXED = [(0, 37), (2, 1), (48, 20), (37, 19), (70, 1), (33, 5), (0, 1), (100, 4), (16, 16)]


class Batch(NamedTuple):
    q: torch.Tensor  # [num_tokens (+ padding), num_heads, head_dim]
    k: torch.Tensor  # [num_tokens (+ padding), num_kv_heads, head_dim]
    v: torch.Tensor
    cache: LayerKVCache
    meta: AttentionMetadata  # what the kernel sees (may hold padding tokens / empty sequences)
    ref_meta: AttentionMetadata  # real tokens and sequences only
    scale: float


def make_batch(
    specs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    pad_tokens: int = 0,
    pad_seqs: int = 0,
) -> Batch:
    """specs: (cached context_len, query_len) per sequence; block ids are shuffled over the pool."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in specs]
    counts = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(counts) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in counts:
        tables.append(perm[at : at + n])
        at += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key = torch.full(shape, float("nan"), dtype=dtype)
    value = torch.full(shape, float("nan"), dtype=dtype)
    for (c, _), t in zip(specs, tables):  # the cached context of every sequence
        slots = torch.tensor([t[p // block_size] * block_size + p % block_size for p in range(c)], dtype=torch.long)
        key.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(c, num_kv_heads, head_dim, generator=gen).to(dtype)
        value.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(c, num_kv_heads, head_dim, generator=gen).to(dtype)
    num_tokens = sum(n for _, n in specs) + pad_tokens
    # q/k/v as strided views of one fused projection, as the model hands them over.
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype).to(device)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    cache = LayerKVCache(key.to(device), value.to(device), None, None)
    meta = paged_metadata(specs, tables, block_size, device, pad_tokens, pad_seqs)
    ref_meta = paged_metadata(specs, tables, block_size, device)
    return Batch(
        q.view(num_tokens, num_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
        cache,
        meta,
        ref_meta,
        head_dim**-0.5,
    )


def reference(batch: Batch) -> tuple[torch.Tensor, LayerKVCache]:
    """float64 output for the real tokens, and the float64 cache after the write."""
    n = batch.ref_meta.num_tokens
    q, k, v = batch.q[:n].double(), batch.k[:n].double(), batch.v[:n].double()
    cache = LayerKVCache(batch.cache.key.double(), batch.cache.value.double(), None, None)
    write_kv(cache, F64, batch.ref_meta.slot_mapping, k, v)  # NaN poison kept: compared with the kernel's cache
    # The oracle may read padded slots under a mask (its batched decode path): give it no NaN to read.
    clean = LayerKVCache(cache.key.nan_to_num(0.0), cache.value.nan_to_num(0.0), None, None)
    out = TorchRefBackend().forward(q, k, v, clean, F64, batch.ref_meta, batch.scale)
    return out, cache


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(out).any(), "unwritten or NaN-contaminated output rows"
    diff = out.double() - ref
    rel = (diff.norm() / ref.norm()).item()
    max_abs = diff.abs().max().item()
    rel_tol, abs_tol = TOL[dtype]
    assert rel < rel_tol and max_abs < abs_tol, f"rel {rel:.2e} (tol {rel_tol}), max abs {max_abs:.2e} (tol {abs_tol})"


def assert_cache_written(cache: LayerKVCache, ref_cache: LayerKVCache) -> None:
    for got, want in ((cache.key, ref_cache.key), (cache.value, ref_cache.value)):
        torch.testing.assert_close(got.double(), want.to(got.dtype).double(), rtol=0, atol=0, equal_nan=True)


def run_kernels(batch: Batch, num_splits: int | None = None) -> torch.Tensor:
    write_cache(batch)
    return attend(batch, num_splits)


def write_cache(batch: Batch) -> None:
    from specserve.attention.triton_kv_write import reshape_and_cache

    reshape_and_cache(batch.k, batch.v, batch.cache.key, batch.cache.value, batch.meta.slot_mapping)


def attend(batch: Batch, num_splits: int | None = None) -> torch.Tensor:
    """paged_attention over the batch's cache as it is (K/V already written), into a NaN-poisoned output."""
    from specserve.attention.triton_paged import paged_attention

    meta, cache = batch.meta, batch.cache
    out = torch.full(batch.q.shape, float("nan"), dtype=batch.q.dtype, device=batch.q.device)
    return paged_attention(
        batch.q,
        cache.key,
        cache.value,
        meta.cu_query_lens,
        meta.seq_lens,
        meta.block_tables,
        meta.max_query_len,
        meta.max_seq_len,
        batch.scale,
        out=out,
        num_splits=num_splits,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_reshape_and_cache(dtype: torch.dtype, block_size: int, device: torch.device) -> None:
    from specserve.attention.triton_kv_write import reshape_and_cache

    batch = make_batch([(5, 7), (0, 30), (40, 1)], 8, 4, 64, block_size, dtype, device, seed=1, pad_tokens=3)
    _, ref_cache = reference(batch)
    reshape_and_cache(batch.k, batch.v, batch.cache.key, batch.cache.value, batch.meta.slot_mapping)
    assert_cache_written(batch.cache, ref_cache)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 4, 64), (12, 2, 128), (9, 3, 64)])
def test_rope_and_cache_equals_two_kernels(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device
) -> None:
    """The fused RoPE + KV write leaves q, k and the cache bitwise as apply_rope then
    reshape_and_cache do (padding tokens: rotated, not stored)."""
    from specserve.attention.triton_kv_write import reshape_and_cache
    from specserve.attention.triton_rope_cache import rope_and_cache
    from specserve.model.layers.triton_ops import apply_rope

    batch = make_batch(
        [(5, 7), (0, 30), (40, 1)], num_heads, num_kv_heads, head_dim, 16, dtype, device, seed=head_dim, pad_tokens=3
    )
    gen = torch.Generator().manual_seed(7)
    positions = torch.randint(0, 4000, (batch.q.shape[0],), generator=gen).to(device)
    inv = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freqs = torch.outer(torch.arange(4096, dtype=torch.float64), inv)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).float().to(device)
    q2, k2, v2 = batch.q.clone(), batch.k.clone(), batch.v.clone()
    cache2 = LayerKVCache(batch.cache.key.clone(), batch.cache.value.clone(), None, None)
    apply_rope(q2, k2, positions, cos_sin)
    reshape_and_cache(k2, v2, cache2.key, cache2.value, batch.meta.slot_mapping)
    rope_and_cache(
        batch.q, batch.k, batch.v, positions, cos_sin, batch.cache.key, batch.cache.value, batch.meta.slot_mapping
    )
    assert torch.equal(batch.q, q2) and torch.equal(batch.k, k2) and torch.equal(batch.v, v2)
    assert_cache_written(batch.cache, cache2)


CASES = [(dt, g, bs, 128) for dt in (torch.bfloat16, torch.float32) for g in (1, 4, 8) for bs in (16, 32)]
CASES += [
    (torch.float16, 4, 16, 128),
    (torch.bfloat16, 1, 16, 64),
    (torch.bfloat16, 8, 32, 64),
    (torch.bfloat16, 6, 16, 128),
    (torch.float32, 4, 16, 64),
]


CASE_IDS = [f"{str(dt).removeprefix('torch.')}-g{g}-bs{bs}-d{d}" for dt, g, bs, d in CASES]


@pytest.mark.parametrize("dtype,group,block_size,head_dim", CASES, ids=CASE_IDS)
def test_mixed_batch(dtype: torch.dtype, group: int, block_size: int, head_dim: int, device: torch.device) -> None:
    """Prefill, prefix-hit prefill, chunk continuation, decode and k+1 verify in one flat batch."""
    num_kv_heads = 2
    batch = make_batch(
        MIXED,
        group * num_kv_heads,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        device,
        seed=group * 1000 + block_size + head_dim,
    )
    ref, ref_cache = reference(batch)
    key0, value0 = batch.cache.key.clone(), batch.cache.value.clone()
    out = run_kernels(batch)
    assert_cache_written(batch.cache, ref_cache)
    assert_close(out, ref, dtype)
    # The split-KV path over the same batch (multi-token q blocks, causal edges inside splits).
    batch.cache.key.copy_(key0)
    batch.cache.value.copy_(value0)
    assert_close(run_kernels(batch, num_splits=3), ref, dtype)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("query_len", [1, 4])
def test_long_context_decode_and_verify(group: int, query_len: int, device: torch.device, interpreting: bool) -> None:
    """Decode (query_len 1) and k+1 verify over long contexts: auto split, no split, odd split."""
    contexts = [1, 17, 300] if interpreting else [1, 17, 3000, 8191, 20000]
    specs = [(c, query_len) for c in contexts]
    dtype = torch.bfloat16
    batch = make_batch(specs, 8 * group, 8, 128, 16, dtype, device, seed=query_len * 10 + group)
    ref, _ = reference(batch)
    key0, value0 = batch.cache.key.clone(), batch.cache.value.clone()
    for num_splits in (None, 1, 7):
        batch.cache.key.copy_(key0)
        batch.cache.value.copy_(value0)
        assert_close(run_kernels(batch, num_splits), ref, dtype)


def test_auto_split_for_batch_one(device: torch.device) -> None:
    from specserve.attention.triton_paged import choose_num_splits

    assert choose_num_splits(1, 1, 131072, 8, 4, 132) > 16
    assert choose_num_splits(32, 1, 131072, 8, 4, 132) == 1
    assert choose_num_splits(1, 1, 100, 8, 4, 132) == 1


def test_backend_with_graph_padding(device: torch.device) -> None:
    """Backend entry point; padding tokens (slot -1) and zero-length sequences are ignored."""
    from specserve.attention.triton_backend import TritonBackend

    dtype = torch.bfloat16
    batch = make_batch([(40, 1), (3, 1), (0, 6)], 16, 4, 128, 16, dtype, device, seed=7, pad_tokens=5, pad_seqs=3)
    ref, ref_cache = reference(batch)
    fmt = kv_format("bfloat16", dtype)
    out = TritonBackend().forward(batch.q, batch.k, batch.v, batch.cache, fmt, batch.meta, batch.scale)
    assert out.shape == batch.q.shape and out.dtype == dtype
    assert_cache_written(batch.cache, ref_cache)
    assert_close(out[: batch.ref_meta.num_tokens], ref, dtype)


def test_backend_refuses_unknown_quantized_cache(device: torch.device) -> None:
    """fp8 / nvfp4 are read by triton_quant.py (tests/gpu/test_triton_quant_kv.py); others are refused."""
    from specserve.attention.triton_backend import TritonBackend

    batch = make_batch([(3, 1)], 4, 4, 64, 16, torch.bfloat16, device, seed=3)
    with pytest.raises(NotImplementedError, match="int4"):
        TritonBackend().forward(
            batch.q, batch.k, batch.v, batch.cache, KVFormat("int4", torch.uint8, 2, 32, None), batch.meta, batch.scale
        )


def test_cuda_graph_decode(device: torch.device) -> None:
    """Capture one decode forward (fixed upper bounds), replay it on new sequences of the same shape."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    from specserve.attention.triton_backend import TritonBackend

    dtype, backend = torch.bfloat16, TritonBackend()
    fmt = kv_format("bfloat16", dtype)
    max_seq_len = 4096

    def batch_for(seed: int, contexts: list[int]) -> Batch:
        b = make_batch([(c, 1) for c in contexts], 32, 8, 128, 16, dtype, device, seed=seed)
        b.meta.max_seq_len = max_seq_len
        return b

    first = batch_for(11, [5, 4095, 1000, 1])  # the largest pool and block table
    static = first  # tensors the graph reads; later batches are copied into them
    for _ in range(2):  # compile and warm up outside the capture
        backend.forward(static.q, static.k, static.v, static.cache, fmt, static.meta, static.scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = backend.forward(static.q, static.k, static.v, static.cache, fmt, static.meta, static.scale)
    for seed, contexts in ((12, [300, 7, 4095, 64]), (13, [1, 2, 3, 2000])):
        new = batch_for(seed, contexts)
        ref, _ = reference(new)
        width = new.meta.block_tables.shape[1]
        if new.cache.key.shape[0] > static.cache.key.shape[0] or width > static.meta.block_tables.shape[1]:
            pytest.skip("replay batch does not fit the captured pool")
        for dst, src in (
            (static.q, new.q),
            (static.k, new.k),
            (static.v, new.v),
            (static.meta.cu_query_lens, new.meta.cu_query_lens),
            (static.meta.seq_lens, new.meta.seq_lens),
            (static.meta.slot_mapping, new.meta.slot_mapping),
        ):
            dst.copy_(src)
        static.meta.block_tables.zero_()
        static.meta.block_tables[:, :width].copy_(new.meta.block_tables)
        static.cache.key.fill_(float("nan"))
        static.cache.value.fill_(float("nan"))
        static.cache.key[: new.cache.key.shape[0]].copy_(new.cache.key)
        static.cache.value[: new.cache.value.shape[0]].copy_(new.cache.value)
        graph.replay()
        assert_close(static_out, ref, dtype)
