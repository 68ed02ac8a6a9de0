"""Triton kernels over quantized KV (fp8, nvfp4) against the torch oracle (kv/quant.py, torch_ref).

The write kernel must reproduce `quant.write_kv` bit for bit: data bytes and scales, ties and
saturation included, run on the CPU as the oracle. Attention reads the same bytes; its reference
is TorchRefBackend in float64 over the dequantized cache, so what differs is only the kernels'
float16 operands and fp32 accumulation. Every attention kernel variant (triton_quant.VARIANTS: fp8
v1 / v2, nvfp4 v1 / v2 / v3) runs every attention test, and the v2 / v3 kernels also under each
launch option bench/kv_quant_gpu.py sweeps (test_launch_options). Slots that no sequence owns hold NaN scales (and NaN fp8
bytes), so any read outside a sequence's context shows up as NaN; outputs are poisoned with NaN
before the kernel runs, so every row must be written. Reads past the end of a tensor need not show
in the output: test_pool_tail_in_bounds puts the KV at the end of an exactly sized pool and, in the
interpreter, checks the addresses of every load and store (the `over_reads` fixture).

Under TRITON_INTERPRET=1 the interpreter's float8 conversions are replaced by torch's (it
truncates instead of rounding to nearest even and drops the mantissa carry); see
`patch_fp8_interpreter`. The interpreter runs no inline PTX, so there nvfp4 v3 takes v2's decoder;
test_nvfp4_ptx_decode_is_exact checks v3's on the GPU against the torch LUT for all 65536 inputs.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch

from specserve.attention.base import AttentionMetadata
from specserve.attention.torch_ref import TorchRefBackend
from specserve.kv import quant
from specserve.kv.spec import KVFormat, LayerKVCache, kv_format
from tests.helpers.attention_meta import paged_metadata

F64 = KVFormat("float64", torch.float64, 1, None, None)
FORMATS = ["fp8", "nvfp4"]
# Every attention kernel variant of every format (triton_quant.VARIANTS), as (format, variant).
KERNELS = [("fp8", "v1"), ("fp8", "v2"), ("nvfp4", "v1"), ("nvfp4", "v2"), ("nvfp4", "v3")]
KERNEL_IDS = [f"{n}-{v}" for n, v in KERNELS]
# (relative norm error, max abs error) against the float64 reference, by q / output dtype
TOL = {torch.float32: (3e-3, 1e-2), torch.bfloat16: (1e-2, 5e-2)}
MIXED = [(0, 37), (2, 1), (48, 20), (37, 19), (70, 1), (33, 5), (0, 1), (100, 4), (16, 16)]
SMALL_MIXED = [(0, 21), (2, 1), (40, 9), (17, 1), (33, 5), (16, 16)]


def patch_fp8_interpreter():
    """Make the interpreter do float8 conversions with torch (round to nearest even, as the GPU).

    Returns a function that undoes it. Also used by bench/kv_quant_gpu.py --smoke.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    original = interp._convert_float
    as_torch = {tl.float8e4nv: torch.float8_e4m3fn, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16,
                tl.float32: torch.float32}
    bits = {8: (np.uint8, np.uint8, torch.uint8), 16: (np.uint16, np.int16, torch.int16),
            32: (np.uint32, np.int32, torch.int32)}

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
def _fp8_interpreter():
    """Interpreter only: do float8 conversions with torch (round to nearest even, as the GPU)."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    undo = patch_fp8_interpreter()
    yield
    undo()


def poisoned_cache(fmt: KVFormat, num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int) -> LayerKVCache:
    """A CPU cache whose every slot reads back as NaN (fp8: NaN bytes; both: NaN scales)."""
    data_shape = (num_blocks, block_size, num_kv_heads, fmt.packed_dim(head_dim))
    scale_shape = data_shape[:3] + (fmt.num_scale_groups(head_dim),)

    def data() -> torch.Tensor:
        return torch.full(data_shape, 0x7F, dtype=torch.uint8).view(fmt.storage_dtype)

    def scale() -> torch.Tensor:
        return torch.full(scale_shape, float("nan")).to(fmt.scale_dtype)

    return LayerKVCache(data(), data(), scale(), scale())


def to_device(cache: LayerKVCache, device: torch.device) -> LayerKVCache:
    return LayerKVCache(*(t.to(device) for t in cache))


def assert_same_bytes(got: LayerKVCache, want: LayerKVCache) -> None:
    for name, g, w in zip(LayerKVCache._fields, got, want):
        bits = torch.int16 if g.element_size() == 2 else torch.uint8
        g_bits, w_bits = g.cpu().view(bits), w.view(bits)
        bad = (g_bits != w_bits).sum().item()
        assert bad == 0, f"{name}: {bad} of {g.numel()} elements differ from quant.write_kv"


def kv_values(num_tokens: int, num_kv_heads: int, head_dim: int, gen: torch.Generator) -> torch.Tensor:
    """float32 [N, H, D] of mixed magnitudes, zero rows and groups, rounding ties and saturation."""
    x = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    x *= 10 ** (torch.rand(num_tokens, num_kv_heads, 1, generator=gen) * 6 - 3)  # amax 1e-3 .. 1e3
    x[0] = 0.0  # an all-zero token
    x[1, :, :16] = 0.0  # a zero nvfp4 group
    # fp8: amax 448 -> scale 1; 1.0625 / 1.1875 / 1.5 * 2^-9 sit exactly between two e4m3 values.
    fp8_ties = torch.tensor([448.0, 1.0625, -1.1875, 1.5 * 2 ** -9, -2.5 * 2 ** -9, 3.25, 0.0, 100.0])
    x[2, 0] = fp8_ties.repeat(head_dim // 8)
    # nvfp4 (global scale 4): group amax 24 -> scale 1; x / 4 lands on every e2m1 rounding boundary.
    nvfp4_ties = torch.tensor([24.0, 1, 3, 5, 7, 10, 14, 20, -1, -3, -5, -7, -10, -14, -20, 0])
    x[2, 1 % num_kv_heads] = nvfp4_ties.repeat(head_dim // 16)
    x[3] *= 1e-7  # below every normal scale
    x[4] = torch.randn(num_kv_heads, head_dim, generator=gen) * 3e4  # nvfp4 group amax past 10752
    return x


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_write_matches_oracle(name: str, dtype: torch.dtype, head_dim: int, device: torch.device) -> None:
    from specserve.attention.triton_quant import reshape_and_cache_quant

    fmt = kv_format(name, dtype)
    gen = torch.Generator().manual_seed(head_dim)
    # 8 heads at head_dim 128 (the Llama shape); 3 at 64 (a head count that is no power of two).
    num_tokens, num_kv_heads, block_size, num_blocks = 24, 8 if head_dim == 128 else 3, 16, 3
    # k / v as strided views of one fused projection, as the model hands them over.
    kv = kv_values(num_tokens, 2 * num_kv_heads, head_dim, gen).to(dtype)
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[5, 11]] = -1  # padding tokens: stored nowhere
    real = slots >= 0
    want = poisoned_cache(fmt, num_blocks, block_size, num_kv_heads, head_dim)
    got = to_device(want, device)
    quant.write_kv(want, fmt, slots[real], k[real], v[real])
    reshape_and_cache_quant(k.to(device), v.to(device), got, fmt, slots.to(device))
    assert_same_bytes(got, want)


class Batch(NamedTuple):
    q: torch.Tensor  # [num_tokens (+ padding), num_heads, head_dim]
    k: torch.Tensor  # [num_tokens (+ padding), num_kv_heads, head_dim]
    v: torch.Tensor
    cache: LayerKVCache  # on the device, context already written (by the oracle)
    cpu_cache: LayerKVCache  # the same, on the CPU, for the reference
    meta: AttentionMetadata  # what the kernel sees (may hold padding tokens / empty sequences)
    ref_meta: AttentionMetadata  # real tokens and sequences only
    scale: float


def make_batch(specs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
               fmt: KVFormat, dtype: torch.dtype, device: torch.device, seed: int, pad_tokens: int = 0,
               pad_seqs: int = 0, pool_tail: bool = False) -> Batch:
    """specs: (cached context_len, query_len) per sequence; block ids are shuffled over the pool.

    pool_tail: the sequences own the pool's last blocks instead (sequence 0 the very last ones, so
    with a length that is a multiple of block_size its last token is the pool's last slot and a read
    past its rows runs off the end of every cache tensor), and the kernel's block tables hold ids
    outside the pool past each sequence's blocks (padding entries must never be read).
    """
    gen = torch.Generator().manual_seed(seed)
    counts = [math.ceil((c + n) / block_size) for c, n in specs]
    num_blocks = sum(counts) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in counts:
        tables.append(list(range(num_blocks - at - n, num_blocks - at)) if pool_tail else perm[at:at + n])
        at += n
    cache = poisoned_cache(fmt, num_blocks, block_size, num_kv_heads, head_dim)
    for (c, _), t in zip(specs, tables):  # the cached context of every sequence, written by the oracle
        slots = torch.tensor([t[p // block_size] * block_size + p % block_size for p in range(c)], dtype=torch.long)
        quant.write_kv(cache, fmt, slots, torch.randn(c, num_kv_heads, head_dim, generator=gen),
                       torch.randn(c, num_kv_heads, head_dim, generator=gen) * 3)
    num_tokens = sum(n for _, n in specs) + pad_tokens
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype).to(device)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    meta = paged_metadata(specs, tables, block_size, device, pad_tokens, pad_seqs)
    if pool_tail:
        for b, t in enumerate(tables + [[]] * pad_seqs):
            meta.block_tables[b, len(t):] = num_blocks + 1000
    return Batch(q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim),
                 v.view(num_tokens, num_kv_heads, head_dim), to_device(cache, device), cache, meta,
                 paged_metadata(specs, tables, block_size, device), head_dim ** -0.5)


def reference(batch: Batch, fmt: KVFormat) -> tuple[torch.Tensor, LayerKVCache]:
    """float64 output for the real tokens over the dequantized cache, and the oracle-written cache."""
    n = batch.ref_meta.num_tokens
    written = LayerKVCache(*(t.clone() for t in batch.cpu_cache))
    slots = batch.ref_meta.slot_mapping.cpu()
    quant.write_kv(written, fmt, slots, batch.k[:n].cpu(), batch.v[:n].cpu())

    def dequantized(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        nb, bs, h, p = data.shape
        full = quant.dequantize(data.reshape(-1, h, p), scale.reshape(-1, h, scale.shape[-1]), fmt, torch.float64)
        return full.view(nb, bs, h, -1).nan_to_num(0.0)  # the oracle may read padded slots under a mask

    key, value = dequantized(written.key, written.key_scale), dequantized(written.value, written.value_scale)
    clean = LayerKVCache(key, value, None, None)
    h, d = key.shape[2], key.shape[3]
    k_new, v_new = key.view(-1, h, d)[slots], value.view(-1, h, d)[slots]  # re-storing them is a no-op
    meta = batch.ref_meta
    cpu_meta = AttentionMetadata(meta.cu_query_lens.cpu(), meta.seq_lens.cpu(), meta.block_tables.cpu(), slots,
                                 meta.max_query_len, meta.max_seq_len, meta.num_seqs, meta.num_tokens,
                                 meta.query_lens_cpu, meta.seq_lens_cpu)
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


def run_kernels(batch: Batch, fmt: KVFormat, num_splits: int | None = None, variant: str | None = None,
                **launch) -> torch.Tensor:
    from specserve.attention.triton_quant import (
        paged_attention_quant,
        reshape_and_cache_quant,
    )

    meta = batch.meta
    reshape_and_cache_quant(batch.k, batch.v, batch.cache, fmt, meta.slot_mapping)
    out = torch.full(batch.q.shape, float("nan"), dtype=batch.q.dtype, device=batch.q.device)
    return paged_attention_quant(batch.q, batch.cache, fmt, meta.cu_query_lens, meta.seq_lens, meta.block_tables,
                                 meta.max_query_len, meta.max_seq_len, batch.scale, out=out, num_splits=num_splits,
                                 variant=variant, **launch)


CASES = [(torch.bfloat16, 1, 16, 128), (torch.bfloat16, 4, 16, 128), (torch.bfloat16, 8, 32, 64),
         (torch.bfloat16, 6, 16, 128), (torch.float32, 4, 32, 128)]
CASE_IDS = [f"{str(dt).removeprefix('torch.')}-g{g}-bs{bs}-d{d}" for dt, g, bs, d in CASES]


@pytest.mark.parametrize("name,variant", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("dtype,group,block_size,head_dim", CASES, ids=CASE_IDS)
def test_mixed_batch(name: str, variant: str, dtype: torch.dtype, group: int, block_size: int, head_dim: int,
                     device: torch.device, interpreting: bool) -> None:
    """Prefill, prefix-hit prefill, chunk continuation, decode and k+1 verify in one flat batch."""
    fmt = kv_format(name, dtype)
    specs = SMALL_MIXED if interpreting else MIXED
    batch = make_batch(specs, group * 2, 2, head_dim, block_size, fmt, dtype, device,
                       seed=group * 1000 + block_size + head_dim)
    ref, written = reference(batch, fmt)
    initial = LayerKVCache(*(t.clone() for t in batch.cache))
    out = run_kernels(batch, fmt, variant=variant)
    assert_same_bytes(batch.cache, written)
    assert_close(out[:batch.ref_meta.num_tokens], ref, dtype)
    # The split-KV path over the same batch (multi-token q blocks, causal edges inside splits).
    for dst, src in zip(batch.cache, initial):
        dst.copy_(src)
    assert_close(run_kernels(batch, fmt, num_splits=3, variant=variant)[:batch.ref_meta.num_tokens], ref, dtype)


@pytest.mark.parametrize("name,variant", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("query_len", [1, 4])
def test_long_context_decode_and_verify(name: str, variant: str, query_len: int, device: torch.device,
                                        interpreting: bool) -> None:
    """Decode (query_len 1) and k+1 verify over long contexts: auto split, no split, odd split."""
    contexts = [1, 17, 300] if interpreting else [1, 17, 3000, 8191, 20000]
    dtype = torch.bfloat16
    fmt = kv_format(name, dtype)
    batch = make_batch([(c, query_len) for c in contexts], 32, 8, 128, 16, fmt, dtype, device,
                       seed=query_len * 10 + len(name))
    ref, written = reference(batch, fmt)
    initial = LayerKVCache(*(t.clone() for t in batch.cache))
    for num_splits in ((None, 1) if interpreting else (None, 1, 7)):
        for dst, src in zip(batch.cache, initial):
            dst.copy_(src)
        out = run_kernels(batch, fmt, num_splits, variant)
        assert_same_bytes(batch.cache, written)
        assert_close(out[:batch.ref_meta.num_tokens], ref, dtype)


# Non-default launches of the v2 / v3 kernels (what bench/kv_quant_gpu.py sweeps): grid order, tiles,
# warps, no register cap.
LAUNCHES = [{"heads_first": False}, {"block_n": 128, "num_warps": 8}, {"num_warps": 2}, {"block_n": 32},
            {"maxnreg": 0, "num_splits": 1}]
NEW_KERNELS = [k for k in KERNELS if k[1] != "v1"]


@pytest.mark.parametrize("launch", LAUNCHES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("name,variant", NEW_KERNELS, ids=[f"{n}-{v}" for n, v in NEW_KERNELS])
def test_launch_options(name: str, variant: str, launch: dict, device: torch.device, interpreting: bool) -> None:
    """Decode, k+1 verify and a short prefill under each launch option the benchmark sweeps."""
    dtype = torch.bfloat16
    fmt = kv_format(name, dtype)
    specs = [(300, 1), (17, 4), (0, 9)] if interpreting else [(3000, 1), (700, 4), (129, 1), (0, 33)]
    batch = make_batch(specs, 32, 8, 128, 16, fmt, dtype, device, seed=len(launch) + len(variant))
    ref, written = reference(batch, fmt)
    out = run_kernels(batch, fmt, variant=variant, **launch)
    assert_same_bytes(batch.cache, written)
    assert_close(out[:batch.ref_meta.num_tokens], ref, dtype)


@pytest.mark.parametrize("name,variant", KERNELS, ids=KERNEL_IDS)
def test_odd_kv_head_count(name: str, variant: str, device: torch.device, interpreting: bool) -> None:
    """SmolLM2's shape: 9 query / 3 KV heads (no power of two), head_dim 64."""
    dtype = torch.bfloat16
    fmt = kv_format(name, dtype)
    specs = [(40, 1), (21, 3), (0, 7)] if interpreting else [(500, 1), (77, 5), (0, 40), (1000, 1)]
    batch = make_batch(specs, 9, 3, 64, 16, fmt, dtype, device, seed=93)
    ref, written = reference(batch, fmt)
    out = run_kernels(batch, fmt, variant=variant)
    assert_same_bytes(batch.cache, written)
    assert_close(out[:batch.ref_meta.num_tokens], ref, dtype)


@pytest.fixture
def over_reads(monkeypatch: pytest.MonkeyPatch, interpreting: bool) -> list[str]:
    """Interpreter only: collects every load / store of a kernel whose unmasked addresses run past the
    end of the tensor argument they start in (or start in none), as 'load: 12 bytes past the end'.

    An over-read does not always show in the output (v2 fp8 reads a window of heads' scales and keeps
    one column), and on the GPU it faults only when it leaves the allocation, so the test checks the
    addresses themselves. On the GPU nothing is hooked: the list stays empty.
    """
    found: list[str] = []
    if not interpreting:
        return found
    import numpy as np
    from triton.runtime import interpreter as interp

    ranges: list[tuple[int, int]] = []  # [start, end) bytes of each tensor argument's storage
    init_args, load, store = (interp.GridExecutor._init_args_hst, interp.InterpreterBuilder.create_masked_load,
                              interp.InterpreterBuilder.create_masked_store)

    def init_args_hst(self, args_dev, kwargs):
        args, kw = init_args(self, args_dev, kwargs)
        storages = [a.untyped_storage() for a in (*args, *kw.values()) if isinstance(a, torch.Tensor)]
        ranges[:] = [(st.data_ptr(), st.data_ptr() + st.nbytes()) for st in storages]
        return args, kw

    def check(op: str, ptrs, mask) -> None:
        addr = np.asarray(ptrs.data).astype(np.uint64)
        live = addr[np.broadcast_to(np.asarray(mask.data), addr.shape)]
        if live.size:
            lo, hi = int(live.min()), int(live.max()) + ptrs.get_element_ty().primitive_bitwidth // 8
            end = next((b for a, b in ranges if a <= lo < b), None)
            if end is None:
                found.append(f"{op}: outside every argument")
            elif hi > end:
                found.append(f"{op}: {hi - end} bytes past the end")

    def masked_load(self, ptrs, mask, other, *rest):
        check("load", ptrs, mask)
        return load(self, ptrs, mask, other, *rest)

    def masked_store(self, ptrs, value, mask, *rest):
        check("store", ptrs, mask)
        return store(self, ptrs, value, mask, *rest)

    monkeypatch.setattr(interp.GridExecutor, "_init_args_hst", init_args_hst)
    monkeypatch.setattr(interp.InterpreterBuilder, "create_masked_load", masked_load)
    monkeypatch.setattr(interp.InterpreterBuilder, "create_masked_store", masked_store)
    return found


# The engine's small-model shapes (Qwen2.5-Coder-1.5B: 12 / 2 heads, head_dim 128; Qwen2.5-0.5B: 14 / 2, 64)
# and their neighbours: KV heads fewer than a 16-byte fp8 scale vector, GQA groups that are no power of two.
# Sequence 0 (32 tokens) ends on the pool's last slot; decode, k+1 verify, prefill and CUDA-graph padding.
TAIL_SPECS = [(31, 1), (13, 4), (0, 9)]


@pytest.mark.parametrize("name,variant", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 6, 7])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_pool_tail_in_bounds(name: str, variant: str, num_kv_heads: int, group: int, head_dim: int,
                             device: torch.device, over_reads: list[str]) -> None:
    """KV in the last blocks of an exactly sized pool, padding table entries outside it: every load and
    store stays inside its tensor (checked in the interpreter) and the output matches, split or not."""
    dtype = torch.bfloat16
    fmt = kv_format(name, dtype)
    batch = make_batch(TAIL_SPECS, num_kv_heads * group, num_kv_heads, head_dim, 16, fmt, dtype, device,
                       seed=num_kv_heads * 100 + group * 10 + head_dim, pad_tokens=2, pad_seqs=1, pool_tail=True)
    ref, written = reference(batch, fmt)
    initial = LayerKVCache(*(t.clone() for t in batch.cache))
    for num_splits in (None, 3):
        for dst, src in zip(batch.cache, initial):
            dst.copy_(src)
        out = run_kernels(batch, fmt, num_splits, variant)
        assert not over_reads, f"num_splits={num_splits}: {sorted(set(over_reads))}"
        assert_same_bytes(batch.cache, written)
        assert_close(out[:batch.ref_meta.num_tokens], ref, dtype)


def test_over_read_check_catches_a_scale_window_past_the_row(monkeypatch: pytest.MonkeyPatch, device: torch.device,
                                                           over_reads: list[str]) -> None:
    """The check above fails on the suspected v2 bug: 8 heads' fp8 scales (16 bytes) loaded per token
    with 2 KV heads, which runs 12 bytes past the end of the scale tensors at the pool's last slot
    and still matches the reference (the extra columns are dropped)."""
    if device.type != "cpu":
        pytest.skip("the address check runs in Triton's interpreter")
    import specserve.attention.triton_quant_fp8 as fp8

    monkeypatch.setattr(fp8, "scale_window", lambda num_kv_heads: 8)
    fmt = kv_format("fp8", torch.bfloat16)
    batch = make_batch([(31, 1)], 12, 2, 128, 16, fmt, torch.bfloat16, device, seed=3, pool_tail=True)
    ref, _ = reference(batch, fmt)
    assert_close(run_kernels(batch, fmt, variant="v2")[:1], ref, torch.bfloat16)
    assert over_reads and all(r.startswith("load: 12 bytes past") for r in over_reads), over_reads


def test_nvfp4_ptx_decode_is_exact(device: torch.device) -> None:
    """v3's inline-PTX decoder against the plain-Triton one and the torch LUT, on all 65536 units."""
    if device.type != "cuda":
        pytest.skip("inline PTX runs on the GPU only")
    import triton
    import triton.language as tl

    from specserve.attention.triton_quant_nvfp4 import _decode

    @triton.jit
    def decode_all(units_ptr, out_ptr, PTX: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        e0, e1, e2, e3 = _decode(tl.load(units_ptr + offs).to(tl.uint16, bitcast=True), PTX)
        tl.store(out_ptr + 4 * offs, e0)
        tl.store(out_ptr + 4 * offs + 1, e1)
        tl.store(out_ptr + 4 * offs + 2, e2)
        tl.store(out_ptr + 4 * offs + 3, e3)

    units = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).to(device)
    outs = {}
    for ptx in (True, False):
        out = torch.empty(4 * units.numel(), dtype=torch.float16, device=device)
        decode_all[(units.numel() // 1024,)](units, out, PTX=ptx, BLOCK=1024)
        outs[ptx] = out.float().cpu()
    fmt = kv_format("nvfp4", torch.float32)
    codes = units.cpu().view(torch.uint8).view(-1, 1, 2)  # the unit's two bytes = elements 4c .. 4c + 3
    want = quant.dequantize(codes, torch.ones(codes.shape[0], 1, 1).to(torch.float8_e4m3fn), fmt,
                            torch.float32).reshape(-1) / fmt.global_scale
    assert torch.equal(outs[True] * 64.0, want), "PTX decode differs from the torch LUT"
    assert torch.equal(outs[False] * 16384.0, want), "bit decode differs from the torch LUT"


@pytest.mark.parametrize("name", FORMATS)
def test_backend_with_graph_padding(name: str, device: torch.device) -> None:
    """TritonBackend entry point; padding tokens (slot -1) and zero-length sequences are ignored."""
    from specserve.attention.triton_backend import TritonBackend

    dtype = torch.bfloat16
    fmt = kv_format(name, dtype)
    batch = make_batch([(40, 1), (3, 1), (0, 6)], 16, 4, 128, 16, fmt, dtype, device, seed=7,
                       pad_tokens=5, pad_seqs=3)
    ref, written = reference(batch, fmt)
    out = TritonBackend().forward(batch.q, batch.k, batch.v, batch.cache, fmt, batch.meta, batch.scale)
    assert out.shape == batch.q.shape and out.dtype == dtype
    assert_same_bytes(batch.cache, written)
    assert_close(out[:batch.ref_meta.num_tokens], ref, dtype)


def test_unsupported_layouts_are_refused(device: torch.device) -> None:
    from specserve.attention.triton_quant import reshape_and_cache_quant

    fmt = kv_format("nvfp4", torch.bfloat16)
    cache = to_device(poisoned_cache(fmt, 2, 16, 2, 24), device)  # head_dim 24: not whole groups of 16
    x = torch.randn(3, 2, 24, device=device)
    with pytest.raises(NotImplementedError, match="head_dim"):
        reshape_and_cache_quant(x, x, cache, fmt, torch.arange(3, device=device))
    int4 = KVFormat("int4", torch.uint8, 2, 32, torch.float16)
    with pytest.raises(NotImplementedError, match="int4"):
        reshape_and_cache_quant(x, x, poisoned_cache(int4, 2, 16, 2, 64), int4, torch.arange(3, device=device))


def test_cuda_graph_decode_nvfp4(device: torch.device) -> None:
    """Capture one nvfp4 decode forward and replay it after new tokens land in the same pool."""
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    from specserve.attention.triton_backend import TritonBackend

    dtype, backend = torch.bfloat16, TritonBackend()
    fmt = kv_format("nvfp4", dtype)
    batch = make_batch([(5, 1), (4095, 1), (1000, 1), (1, 1)], 32, 8, 128, 16, fmt, dtype, device, seed=11)
    initial = LayerKVCache(*(t.clone() for t in batch.cache))
    for _ in range(2):  # compile and warm up outside the capture
        backend.forward(batch.q, batch.k, batch.v, batch.cache, fmt, batch.meta, batch.scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = backend.forward(batch.q, batch.k, batch.v, batch.cache, fmt, batch.meta, batch.scale)
    for dst, src in zip(batch.cache, initial):
        dst.copy_(src)
    fresh = torch.randn(batch.q.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    batch.q.copy_(fresh.to(device))
    ref, _ = reference(batch, fmt)
    graph.replay()
    assert_close(static_out, ref, dtype)
