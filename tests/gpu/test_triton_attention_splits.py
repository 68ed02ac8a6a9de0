"""Split-KV paged attention (attention/triton_paged.py): the partials reduced by the last split program
(fused_reduce) against the two-kernel path, split counts sized for max_model_len over short contexts
(split_by_length), and the persistent split counters. The batches, the float64 oracle and the NaN
poisoning come from test_triton_attention.py."""
from __future__ import annotations

import random

import pytest
import torch

from specserve.kv.spec import kv_format
from tests.gpu.test_triton_attention import (
    assert_cache_written,
    assert_close,
    attend,
    make_batch,
    reference,
    run_kernels,
    write_cache,
)


@pytest.fixture
def adversarial(monkeypatch: pytest.MonkeyPatch, interpreting: bool) -> None:
    """Make split-KV ordering bugs show. Float32 buffers paged_attention allocates (the partials) start
    as NaN, not as an earlier call's values, so a partial read before it is written poisons the output.
    In the interpreter every launch also runs its programs in a random order: grid order runs a (q
    block, kv head)'s splits back to back, the last split last, which would hide a counter shared by two
    pairs or a wrong "last program" test. (On a GPU the programs really run concurrently.)"""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.dtype == torch.float32 else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))
    if not interpreting:
        return
    from triton.runtime.interpreter import interpreter_builder as builder

    rng, order = random.Random(0), []
    set_dim, set_idx = builder.set_grid_dim, builder.set_grid_idx

    def set_grid_dim(nx: int, ny: int, nz: int) -> None:  # once per launch, before its programs
        order[:] = [(x, y, z) for x in range(nx) for y in range(ny) for z in range(nz)]
        rng.shuffle(order)
        set_dim(nx, ny, nz)

    def set_grid_idx(x: int, y: int, z: int) -> None:
        _, ny, nz = builder.grid_dim
        set_idx(*order[(x * ny + y) * nz + z])

    monkeypatch.setattr(builder, "set_grid_dim", set_grid_dim)
    monkeypatch.setattr(builder, "set_grid_idx", set_grid_idx)


def assert_counters_reset(device: torch.device) -> None:
    from specserve.attention.triton_paged import _split_counters

    assert int(_split_counters(device, 0).count_nonzero()) == 0, "a split counter was left non-zero"


@pytest.mark.parametrize("group", [1, 6, 8])
@pytest.mark.parametrize("query_len", [1, 2, 3, 4, 5])
def test_fused_reduce_decode_and_verify(group: int, query_len: int, device: torch.device, adversarial: None) -> None:
    """Decode and k+1 verify with 2, 3, 16 and 17 splits over contexts so short that many splits own no
    KV tile (their partials are m=-inf, l=0): the fused reduce agrees with the two-kernel path (same
    math, other summation order) and with the oracle, and leaves every counter at 0."""
    dtype = torch.float32
    specs = [(c, query_len) for c in (0, 9, 300)]  # 1 to 10 KV tiles of 32 (fp32)
    batch = make_batch(specs, 2 * group, 2, 128, 16, dtype, device, seed=100 * group + query_len)
    ref, _ = reference(batch)
    write_cache(batch)
    for num_splits in (2, 3, 16, 17):
        fused = attend(batch, num_splits, fused_reduce=True)
        two = attend(batch, num_splits, fused_reduce=False)
        assert_close(fused, ref, dtype)
        assert_close(two, ref, dtype)
        torch.testing.assert_close(fused, two, rtol=1e-5, atol=1e-6)
    assert_counters_reset(device)


def test_fused_reduce_profiled_decode_shape(device: torch.device, adversarial: None) -> None:
    """The profiled case: Qwen2.5-1.5B batch-1 decode (12 q heads over 2 kv heads, head_dim 128, bf16),
    a graph bound of max_seq_len 4096 (16 splits chosen) over contexts of 128-400 tokens."""
    from specserve.attention.triton_paged import attention_config, choose_num_splits

    dtype = torch.bfloat16
    block_m = attention_config(1, 6, 128, dtype)[0]
    assert choose_num_splits(1, 1, 4096, 2, block_m // 6, 132) == 16
    for seed, context in enumerate((128, 255, 400)):
        batch = make_batch([(context, 1)], 12, 2, 128, 16, dtype, device, seed=seed)
        batch.meta.max_seq_len = 4096
        ref, _ = reference(batch)
        write_cache(batch)
        fused, two = attend(batch), attend(batch, fused_reduce=False)
        assert_close(fused, ref, dtype)
        assert_close(two, ref, dtype)
        torch.testing.assert_close(fused, two, rtol=1e-2, atol=1e-2)  # a bf16 rounding step apart at most
    assert_counters_reset(device)


def test_fused_reduce_repeated_launches(device: torch.device, adversarial: None) -> None:
    """The last program zeroes its counter, so launches over the same counters (as CUDA-graph replays
    are) keep working: three identical launches give identical outputs, then other split counts."""
    dtype = torch.float32
    batch = make_batch([(40, 1), (300, 3), (7, 5)], 12, 2, 128, 16, dtype, device, seed=5, pad_tokens=3, pad_seqs=2)
    n = batch.ref_meta.num_tokens
    ref, _ = reference(batch)
    write_cache(batch)
    first = attend(batch, 16)
    assert_close(first[:n], ref, dtype)
    for _ in range(2):
        assert torch.equal(attend(batch, 16)[:n], first[:n])
    for num_splits in (17, 3, 16):
        assert_close(attend(batch, num_splits)[:n], ref, dtype)
    assert_counters_reset(device)


@pytest.mark.parametrize("regs", [0, 1024], ids=["one_split_per_step", "all_splits_at_once"])
def test_fused_reduce_chunking(regs: int, device: torch.device, adversarial: None,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The last program's loops over chunks of splits (maxima, then weighted sums) at both extremes."""
    import specserve.attention.triton_paged as tp

    monkeypatch.setattr(tp, "M_REDUCE_REGS", regs)
    monkeypatch.setattr(tp, "ACC_REDUCE_REGS", regs)
    dtype = torch.float32
    batch = make_batch([(0, 2), (60, 1), (300, 4)], 8, 2, 64, 16, dtype, device, seed=21)
    ref, _ = reference(batch)
    write_cache(batch)
    for num_splits in (3, 17):
        fused = attend(batch, num_splits)
        assert_close(fused, ref, dtype)
        torch.testing.assert_close(fused, attend(batch, num_splits, fused_reduce=False), rtol=1e-5, atol=1e-6)
    assert_counters_reset(device)


@pytest.mark.parametrize("split_by_length", [True, False], ids=["by_length", "all_splits"])
@pytest.mark.parametrize("fused_reduce", [True, False], ids=["fused", "two_kernels"])
def test_graph_sized_splits_over_short_contexts(split_by_length: bool, fused_reduce: bool, device: torch.device,
                                                 adversarial: None) -> None:
    """A split count sized for a long max_model_len (as a CUDA graph's) over contexts of 0-700 keys,
    decode and 4-row verify rows in one batch. By length, a q block uses only the splits its keys
    warrant (1-2 here, MIN_KEYS_PER_SPLIT each): the splits past them own no tile and leave their acc
    unwritten (NaN under `adversarial`), which both reduces must skip. Both settings match the oracle,
    and each other to rounding."""
    from specserve.attention.triton_paged import paged_attention

    dtype = torch.float32
    batch = make_batch([(0, 1), (9, 1), (300, 4), (700, 1), (520, 4)], 8, 2, 64, 16, dtype, device, seed=21)
    ref, _ = reference(batch)
    write_cache(batch)
    meta, cache = batch.meta, batch.cache
    outs = []
    for by_length in (split_by_length, not split_by_length):
        out = torch.full(batch.q.shape, float("nan"), dtype=dtype, device=batch.q.device)
        outs.append(paged_attention(batch.q, cache.key, cache.value, meta.cu_query_lens, meta.seq_lens,
                                    meta.block_tables, meta.max_query_len, 32768, batch.scale, out=out,
                                    num_splits=64, fused_reduce=fused_reduce, split_by_length=by_length))
    assert_close(outs[0], ref, dtype)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    assert_counters_reset(device)


@pytest.mark.parametrize("fused_reduce", [True, False], ids=["fused", "two_kernels"])
def test_backend_split_with_graph_padding(fused_reduce: bool, device: torch.device, adversarial: None) -> None:
    """Through the backend with 16 splits: padding tokens and zero-length sequences make spare q blocks,
    which return before touching a counter; every real row is still reduced."""
    from specserve.attention.triton_backend import TritonBackend

    dtype = torch.bfloat16
    batch = make_batch([(40, 1), (3, 1), (0, 6), (200, 4)], 16, 4, 128, 16, dtype, device, seed=9,
                       pad_tokens=5, pad_seqs=3)
    ref, ref_cache = reference(batch)
    backend = TritonBackend(num_splits=16, fused_reduce=fused_reduce)
    out = backend.forward(batch.q, batch.k, batch.v, batch.cache, kv_format("bfloat16", dtype), batch.meta,
                          batch.scale)
    assert_cache_written(batch.cache, ref_cache)
    assert_close(out[:batch.ref_meta.num_tokens], ref, dtype)
    assert_counters_reset(device)


def test_fused_reduce_needs_no_second_launch(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    import specserve.attention.triton_paged as tp

    class NoLaunch:
        def __getitem__(self, grid: tuple[int, ...]) -> None:
            raise AssertionError("the reduce kernel was launched")

    batch = make_batch([(100, 1), (20, 2)], 8, 2, 64, 16, torch.float32, device, seed=3)
    ref, _ = reference(batch)
    monkeypatch.setattr(tp, "_reduce_splits_kernel", NoLaunch())
    assert_close(run_kernels(batch, 4), ref, torch.float32)
    with pytest.raises(AssertionError, match="reduce kernel was launched"):
        attend(batch, 4, fused_reduce=False)


def test_split_counters_grow_outside_capture_only(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """Zeroed counters, grown (never during CUDA-graph capture: that raises) with older buffers kept
    alive for graphs captured over them."""
    import specserve.attention.triton_paged as tp

    monkeypatch.setattr(tp, "_counters", {})
    first = tp._split_counters(device, 10)
    assert first.dtype == torch.int32 and first.numel() >= tp.MIN_SPLIT_COUNTERS and not first.any()
    assert tp._split_counters(device, first.numel()) is first
    bigger = tp._split_counters(device, first.numel() + 1)
    assert bigger.numel() > first.numel() and not bigger.any() and tp._counters[first.device][0] is first
    gpu = torch.device("cuda", 0)  # the check runs before any allocation: no GPU needed
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="cannot grow during CUDA-graph capture"):
        # more than any buffer held: on a GPU run, `device` is cuda:0 and holds `bigger` already
        tp._split_counters(gpu, bigger.numel() + 1)
