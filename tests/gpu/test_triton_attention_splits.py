"""Split-KV paged attention (attention/triton_paged.py) under adversarial conditions: NaN-poisoned
partials, programs in random order, split counts sized for max_model_len over short contexts. The
batches and the float64 oracle come from test_triton_attention.py."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.kv.spec import kv_format
from tests.gpu.test_triton_attention import (
    assert_cache_written,
    assert_close,
    make_batch,
    reference,
    write_cache,
)


@pytest.fixture
def adversarial(monkeypatch: pytest.MonkeyPatch, interpreting: bool) -> None:
    """Make split-KV ordering bugs show. Float32 buffers paged_attention allocates (the partials) start
    as NaN, not as an earlier call's values, so a partial read before it is written poisons the output.
    In the interpreter every launch also runs its programs in a random order: grid order runs a (q
    block, kv head)'s splits back to back, which would hide a split that reads another's partials.
    (On a GPU the programs really run concurrently.)"""
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


def test_graph_sized_splits_over_short_contexts(device: torch.device, adversarial: None) -> None:
    """A split count sized for a long max_model_len (as a CUDA graph's) over contexts of 0-700 keys,
    decode and 4-row verify rows in one batch: most splits own no tile and leave their acc unwritten
    (NaN under `adversarial`), which the reduce must skip."""
    from specserve.attention.triton_paged import paged_attention

    dtype = torch.float32
    batch = make_batch([(0, 1), (9, 1), (300, 4), (700, 1), (520, 4)], 8, 2, 64, 16, dtype, device, seed=21)
    ref, _ = reference(batch)
    write_cache(batch)
    meta, cache = batch.meta, batch.cache
    out = torch.full(batch.q.shape, float("nan"), dtype=dtype, device=batch.q.device)
    out = paged_attention(
        batch.q,
        cache.key,
        cache.value,
        meta.cu_query_lens,
        meta.seq_lens,
        meta.block_tables,
        meta.max_query_len,
        32768,
        batch.scale,
        out=out,
        num_splits=64,
    )
    assert_close(out, ref, dtype)


def test_backend_split_with_graph_padding(device: torch.device, adversarial: None) -> None:
    """Through the backend with 16 splits: padding tokens and zero-length sequences make spare q blocks;
    every real row is still reduced."""
    from specserve.attention.triton_backend import TritonBackend

    dtype = torch.bfloat16
    batch = make_batch(
        [(40, 1), (3, 1), (0, 6), (200, 4)], 16, 4, 128, 16, dtype, device, seed=9, pad_tokens=5, pad_seqs=3
    )
    ref, ref_cache = reference(batch)
    backend = TritonBackend(num_splits=16)
    out = backend.forward(batch.q, batch.k, batch.v, batch.cache, kv_format("bfloat16", dtype), batch.meta, batch.scale)
    assert_cache_written(batch.cache, ref_cache)
    assert_close(out[: batch.ref_meta.num_tokens], ref, dtype)
