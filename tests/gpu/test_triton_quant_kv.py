"""Triton kernels over quantized KV (fp8, nvfp4) against the torch oracle (kv/quant.py, torch_ref).

The write kernel must reproduce `quant.write_kv` bit for bit: data bytes and scales, ties and saturation
included, run on the CPU as the oracle. Attention reads the same bytes; its reference is TorchRefBackend
in float64 over the dequantized cache, so what differs is only the kernels' float16 operands and fp32
accumulation. Every attention kernel variant (triton_quant.VARIANTS: fp8 v3, nvfp4 v4 and v7) runs every
attention test, also under each non-default launch option (test_launch_options). Slots that no sequence
owns hold NaN scales (and NaN fp8 bytes), so any read outside a sequence's context shows up as NaN;
outputs are poisoned with NaN before the kernel runs, so every row must be written. Reads past the end
of a tensor need not show in the output: test_quant_kv_bounds.py puts the KV at the end of an exactly
sized pool and, in the interpreter, checks the addresses of every load and store.

Under TRITON_INTERPRET=1 the interpreter's float8 conversions are replaced by torch's (it
truncates instead of rounding to nearest even and drops the mantissa carry); see
`tests/helpers/quant_kv.patch_fp8_interpreter`. The interpreter runs no inline PTX, so there nvfp4
takes the plain Triton decoder (fp8: a byte bitcast; v7's K: its plain twin, same column order), and
has no dot layouts to change (they are compiled for the GPU only: tests/unit/test_triton_dot_layout.py);
test_nvfp4_decoders_are_exact and test_fp8_unit_decode_is_exact check the PTX decoders on the GPU for all
65536 inputs (test_nvfp4_pair_decoder_is_exact: v7's K decoder, each unit in both halves of a word).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specserve.kv import quant
from specserve.kv.spec import KVFormat, kv_format
from tests.helpers.quant_kv import (  # noqa: F401  (fp8_interpreter: an autouse fixture)
    KERNEL_IDS,
    KERNELS,
    assert_close,
    assert_same_bytes,
    clone_cache,
    fp8_interpreter,
    make_batch,
    poisoned_cache,
    reference,
    restore_cache,
    run_kernels,
    to_device,
)

FORMATS = ["fp8", "nvfp4"]
MIXED = [(0, 37), (2, 1), (48, 20), (37, 19), (70, 1), (33, 5), (0, 1), (100, 4), (16, 16)]
SMALL_MIXED = [(0, 21), (2, 1), (40, 9), (17, 1), (33, 5), (16, 16)]


def kv_values(num_tokens: int, num_kv_heads: int, head_dim: int, gen: torch.Generator) -> torch.Tensor:
    """float32 [N, H, D] of mixed magnitudes, zero rows and groups, rounding ties and saturation."""
    x = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    x *= 10 ** (torch.rand(num_tokens, num_kv_heads, 1, generator=gen) * 6 - 3)  # amax 1e-3 .. 1e3
    x[0] = 0.0  # an all-zero token
    x[1, :, :16] = 0.0  # a zero nvfp4 group
    # fp8: amax 448 -> scale 1; 1.0625 / 1.1875 / 1.5 * 2^-9 sit exactly between two e4m3 values.
    fp8_ties = torch.tensor([448.0, 1.0625, -1.1875, 1.5 * 2**-9, -2.5 * 2**-9, 3.25, 0.0, 100.0])
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


CASES = [
    (torch.bfloat16, 1, 16, 128),
    (torch.bfloat16, 4, 16, 128),
    (torch.bfloat16, 8, 32, 64),
    (torch.bfloat16, 6, 16, 128),
    (torch.float32, 4, 32, 128),
]
CASE_IDS = [f"{str(dt).removeprefix('torch.')}-g{g}-bs{bs}-d{d}" for dt, g, bs, d in CASES]


@pytest.mark.parametrize("name,variant", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("dtype,group,block_size,head_dim", CASES, ids=CASE_IDS)
def test_mixed_batch(
    name: str,
    variant: str,
    dtype: torch.dtype,
    group: int,
    block_size: int,
    head_dim: int,
    device: torch.device,
    interpreting: bool,
) -> None:
    """Prefill, prefix-hit prefill, chunk continuation, decode and k+1 verify in one flat batch."""
    fmt = kv_format(name, dtype)
    specs = SMALL_MIXED if interpreting else MIXED
    batch = make_batch(
        specs, group * 2, 2, head_dim, block_size, fmt, dtype, device, seed=group * 1000 + block_size + head_dim
    )
    ref, written = reference(batch, fmt)
    initial = clone_cache(batch.cache)
    out = run_kernels(batch, fmt, variant=variant)
    assert_same_bytes(batch.cache, written)
    assert_close(out[: batch.ref_meta.num_tokens], ref, dtype)
    # The split-KV path over the same batch (multi-token q blocks, causal edges inside splits).
    restore_cache(batch.cache, initial)
    assert_close(run_kernels(batch, fmt, num_splits=3, variant=variant)[: batch.ref_meta.num_tokens], ref, dtype)


@pytest.mark.parametrize("name,variant", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("query_len", [1, 4])
def test_long_context_decode_and_verify(
    name: str, variant: str, query_len: int, device: torch.device, interpreting: bool
) -> None:
    """Decode (query_len 1) and k+1 verify over long contexts: auto split, no split, odd split."""
    contexts = [1, 17, 300] if interpreting else [1, 17, 3000, 8191, 20000]
    dtype = torch.bfloat16
    fmt = kv_format(name, dtype)
    batch = make_batch(
        [(c, query_len) for c in contexts], 32, 8, 128, 16, fmt, dtype, device, seed=query_len * 10 + len(name)
    )
    ref, written = reference(batch, fmt)
    initial = clone_cache(batch.cache)
    for num_splits in (None, 1) if interpreting else (None, 1, 7):
        restore_cache(batch.cache, initial)
        out = run_kernels(batch, fmt, num_splits, variant)
        assert_same_bytes(batch.cache, written)
        assert_close(out[: batch.ref_meta.num_tokens], ref, dtype)


# Non-default launches of the kernels: grid order (huge batches), tiles (head_dim > 128: 32 keys), no split.
LAUNCHES = [{"heads_first": False}, {"block_n": 128}, {"block_n": 32}, {"num_splits": 1}]


@pytest.mark.parametrize("launch", LAUNCHES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("name,variant", KERNELS, ids=KERNEL_IDS)
def test_launch_options(name: str, variant: str, launch: dict, device: torch.device, interpreting: bool) -> None:
    """Decode, k+1 verify and a short prefill under each non-default launch option."""
    dtype = torch.bfloat16
    fmt = kv_format(name, dtype)
    specs = [(300, 1), (17, 4), (0, 9)] if interpreting else [(3000, 1), (700, 4), (129, 1), (0, 33)]
    batch = make_batch(specs, 32, 8, 128, 16, fmt, dtype, device, seed=len(launch) + len(variant))
    ref, written = reference(batch, fmt)
    out = run_kernels(batch, fmt, variant=variant, **launch)
    assert_same_bytes(batch.cache, written)
    assert_close(out[: batch.ref_meta.num_tokens], ref, dtype)


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
    assert_close(out[: batch.ref_meta.num_tokens], ref, dtype)


@pytest.mark.parametrize("name,variant", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("head_dim,num_kv_heads", [(64, 3), (128, 2)])
def test_key_smoothing(
    name: str, variant: str, head_dim: int, num_kv_heads: int, device: torch.device, interpreting: bool
) -> None:
    """A cache with key smoothing (cache.key_smooth, powers of two): the write stores quant.write_kv's
    bytes of k / s, attention (q rotated by diag(s) Hn per head) matches the oracle's q . (s k_hat).
    Factors within 2^-1 .. 2 (random ones that do not fit the data inflate the float16 dots' rounding)."""
    dtype = torch.bfloat16
    fmt = kv_format(name, dtype)
    gen = torch.Generator().manual_seed(head_dim + num_kv_heads)
    key_smooth = torch.exp2(torch.randint(-1, 2, (num_kv_heads, head_dim), generator=gen).float())
    specs = [(40, 1), (21, 3), (0, 7)] if interpreting else [(500, 1), (77, 5), (0, 40), (3000, 1)]
    batch = make_batch(
        specs, 3 * num_kv_heads, num_kv_heads, head_dim, 16, fmt, dtype, device, seed=7, key_smooth=key_smooth
    )
    assert batch.cache.key_smooth is not None and batch.cache.key_smooth.device == batch.q.device
    ref, written = reference(batch, fmt)
    out = run_kernels(batch, fmt, variant=variant)
    assert_same_bytes(batch.cache, written)
    assert_close(out[: batch.ref_meta.num_tokens], ref, dtype)


def test_nvfp4_decoders_are_exact(device: torch.device) -> None:
    """The nvfp4 decoders (plain Triton; inline PTX: the GPU only) against the torch LUT,
    on all 65536 units."""
    from specserve.attention.triton_nvfp4_decode import E4M3_DECODE
    from specserve.attention.triton_quant_common import NVFP4_DECODE
    from tests.helpers.quant_decode import nvfp4_units_kernel

    units = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).to(device)
    fmt = dataclasses.replace(kv_format("nvfp4", torch.float32), rotate=False)  # the decoders see stored codes
    codes = units.cpu().view(torch.uint8).view(-1, 1, 2)  # the unit's two bytes = elements 4c .. 4c + 3
    want = (
        quant.dequantize(codes, torch.ones(codes.shape[0], 1, 1).to(torch.float8_e4m3fn), fmt, torch.float32).reshape(
            -1
        )
        / fmt.global_scale
    )
    decoders = {"ptx": 1, "plain": 0} if device.type == "cuda" else {"plain": 0}
    for variant, decoder in decoders.items():
        out = torch.empty(4 * units.numel(), dtype=torch.float16, device=device)
        nvfp4_units_kernel[(units.numel() // 1024,)](units, out, DECODER=decoder, BLOCK=1024)
        factor = E4M3_DECODE if decoder == 1 else NVFP4_DECODE
        assert torch.equal(out.float().cpu() * factor, want), f"{variant}'s decoder differs from the torch LUT"


def test_nvfp4_pair_decoder_is_exact(device: torch.device) -> None:
    """v7's K decoder (32-bit words, no byte permute; inline PTX on the GPU, plain Triton in the
    interpreter) against the torch LUT on all 65536 units, each once in a word's low and once in its
    high half, every value at the element the kernel's Q order gives it."""
    from specserve.attention.triton_nvfp4_decode import E4M3_DECODE
    from specserve.attention.triton_quant_common import NVFP4_DECODE
    from tests.helpers.quant_decode import nvfp4_pairs_kernel

    all_units = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    fmt = dataclasses.replace(kv_format("nvfp4", torch.float32), rotate=False)  # the decoders see stored codes
    for units in (all_units, all_units.roll(1)):  # unit i in the low half, then in the high half
        codes = units.view(torch.uint8).view(-1, 1, 2)
        want = (
            quant.dequantize(
                codes, torch.ones(codes.shape[0], 1, 1).to(torch.float8_e4m3fn), fmt, torch.float32
            ).reshape(-1)
            / fmt.global_scale
        )
        words = units.view(torch.int32).to(device)  # little-endian: unit 2a is word a's low half
        for decoder in (0, 1) if device.type == "cuda" else (0,):
            out = torch.full((4 * units.numel(),), float("nan"), dtype=torch.float16, device=device)
            nvfp4_pairs_kernel[(words.numel() // (64 * 16),)](words, out, DECODER=decoder, ROWS=64, WORDS=16)
            factor = E4M3_DECODE if decoder == 1 else NVFP4_DECODE
            assert torch.equal(out.float().cpu() * factor, want), f"pair decoder {decoder} differs from the torch LUT"


# Decode-only batches: v7 computes the softmax of the first half of every q block's rows only
# (triton_quant_nvfp4.half_rows_apply); the mixed batches above never qualify.
DECODE_ONLY = [(1, 4), (4, 1), (4, 2), (6, 1), (8, 1), (7, 1)]


@pytest.mark.parametrize(
    "name,variant", [k for k in KERNELS if k[0] == "nvfp4"], ids=[f"{n}-{v}" for n, v in KERNELS if n == "nvfp4"]
)
@pytest.mark.parametrize("group,query_len", DECODE_ONLY, ids=[f"g{g}-q{q}" for g, q in DECODE_ONLY])
def test_decode_only_batch(
    name: str, variant: str, group: int, query_len: int, device: torch.device, interpreting: bool
) -> None:
    """Plain decode / 2-token verify batches at several GQA groups, split and unsplit, with tiles with
    and without masks. v7 skips the second half of the rows exactly where half_rows_apply says so
    (here: query_len * group <= 8); every output row must still be written (they start as NaN)."""
    from specserve.attention import triton_quant, triton_quant_nvfp4

    dtype = torch.bfloat16
    fmt = kv_format(name, dtype)
    contexts = [1, 130, 300] if interpreting else [1, 130, 3000, 9000]
    batch = make_batch(
        [(c, query_len) for c in contexts], group * 2, 2, 128, 16, fmt, dtype, device, seed=group * 10 + query_len
    )
    block_m = triton_quant.quant_attention_config(query_len, group, 128, name, variant)[0]
    half = triton_quant_nvfp4.half_rows_apply(query_len, group, block_m)
    assert half == (query_len * group <= 8)
    ref, written = reference(batch, fmt)
    initial = clone_cache(batch.cache)
    for num_splits in (None, 1):
        restore_cache(batch.cache, initial)
        out = run_kernels(batch, fmt, num_splits, variant)
        assert_same_bytes(batch.cache, written)
        assert_close(out[: batch.ref_meta.num_tokens], ref, dtype)


def test_fp8_unit_decode_is_exact(device: torch.device) -> None:
    """fp8 v3's V decoder (inline PTX on the GPU, a byte bitcast in the interpreter) against torch's
    e4m3 -> float16 on all 65536 units: low byte -> E_0, high byte -> E_1, NaN codes included."""
    from tests.helpers.quant_decode import fp8_units_kernel

    units = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).to(device)
    out = torch.empty(2 * units.numel(), dtype=torch.float16, device=device)
    fp8_units_kernel[(units.numel() // 1024,)](units, out, PTX=device.type == "cuda", BLOCK=1024)
    want = units.cpu().view(torch.float8_e4m3fn).to(torch.float16)  # little-endian: element 2c first
    got = out.cpu()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16)), "decode differs from torch"


@pytest.mark.parametrize("name", FORMATS)
def test_backend_with_graph_padding(name: str, device: torch.device) -> None:
    """TritonBackend entry point; padding tokens (slot -1) and zero-length sequences are ignored."""
    from specserve.attention.triton_backend import TritonBackend

    dtype = torch.bfloat16
    fmt = kv_format(name, dtype)
    batch = make_batch([(40, 1), (3, 1), (0, 6)], 16, 4, 128, 16, fmt, dtype, device, seed=7, pad_tokens=5, pad_seqs=3)
    ref, written = reference(batch, fmt)
    out = TritonBackend().forward(batch.q, batch.k, batch.v, batch.cache, fmt, batch.meta, batch.scale)
    assert out.shape == batch.q.shape and out.dtype == dtype
    assert_same_bytes(batch.cache, written)
    assert_close(out[: batch.ref_meta.num_tokens], ref, dtype)


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
    initial = clone_cache(batch.cache)
    for _ in range(2):  # compile and warm up outside the capture
        backend.forward(batch.q, batch.k, batch.v, batch.cache, fmt, batch.meta, batch.scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = backend.forward(batch.q, batch.k, batch.v, batch.cache, fmt, batch.meta, batch.scale)
    restore_cache(batch.cache, initial)
    fresh = torch.randn(batch.q.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    batch.q.copy_(fresh.to(device))
    ref, _ = reference(batch, fmt)
    graph.replay()
    assert_close(static_out, ref, dtype)
