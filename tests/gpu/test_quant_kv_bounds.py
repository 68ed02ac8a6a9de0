"""Quantized-KV attention kernels (fp8 v3, nvfp4 v4 and v7) never read or write outside their
tensors: the sequences own the last blocks of an exactly sized pool, so an over-read runs off the end
of every cache tensor. In the interpreter every load and store address is checked
(tests/helpers/triton_bounds.py); on the GPU the outputs are compared with the float64 oracle.
"""

from __future__ import annotations

import pytest
import torch

from specserve.kv.spec import kv_format
from tests.helpers.quant_kv import (  # noqa: F401  (fp8_interpreter: an autouse fixture)
    KERNEL_IDS,
    KERNELS,
    assert_close,
    assert_same_bytes,
    clone_cache,
    fp8_interpreter,
    make_batch,
    reference,
    restore_cache,
    run_kernels,
)
from tests.helpers.triton_bounds import watch_addresses


@pytest.fixture
def over_reads(monkeypatch: pytest.MonkeyPatch, interpreting: bool) -> list[str]:
    """The interpreter's out-of-bounds loads and stores (tests/helpers/triton_bounds.py); on the GPU
    nothing is hooked and the list stays empty."""
    return watch_addresses(monkeypatch) if interpreting else []


# The engine's small-model shapes (Qwen2.5-Coder-1.5B: 12 / 2 heads, head_dim 128; Qwen2.5-0.5B: 14 / 2, 64)
# and their neighbours: KV heads fewer than a 16-byte fp8 scale vector, GQA groups that are no power of two.
# Sequence 0 (32 tokens) ends on the pool's last slot; decode, k+1 verify, prefill and CUDA-graph padding.
TAIL_SPECS = [(31, 1), (13, 4), (0, 9)]


@pytest.mark.parametrize("name,variant", KERNELS, ids=KERNEL_IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 6, 7])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_pool_tail_in_bounds(
    name: str, variant: str, num_kv_heads: int, group: int, head_dim: int, device: torch.device, over_reads: list[str]
) -> None:
    """KV in the last blocks of an exactly sized pool, padding table entries outside it: every load and
    store stays inside its tensor (checked in the interpreter) and the output matches, split or not."""
    dtype = torch.bfloat16
    fmt = kv_format(name, dtype)
    batch = make_batch(
        TAIL_SPECS,
        num_kv_heads * group,
        num_kv_heads,
        head_dim,
        16,
        fmt,
        dtype,
        device,
        seed=num_kv_heads * 100 + group * 10 + head_dim,
        pad_tokens=2,
        pad_seqs=1,
        pool_tail=True,
    )
    ref, written = reference(batch, fmt)
    initial = clone_cache(batch.cache)
    for num_splits in (None, 3):
        restore_cache(batch.cache, initial)
        out = run_kernels(batch, fmt, num_splits, variant)
        assert not over_reads, f"num_splits={num_splits}: {sorted(set(over_reads))}"
        assert_same_bytes(batch.cache, written)
        assert_close(out[: batch.ref_meta.num_tokens], ref, dtype)


def test_over_read_check_catches_a_scale_window_past_the_row(
    monkeypatch: pytest.MonkeyPatch, device: torch.device, over_reads: list[str]
) -> None:
    """The check above fails on the suspected bug of the fp8 kernel's scale window: 8 heads' fp8 scales
    (16 bytes) loaded per token with 2 KV heads, which runs 12 bytes past the end of the scale
    tensors at the pool's last slot and still matches the reference (the extra columns are dropped)."""
    if device.type != "cpu":
        pytest.skip("the address check runs in Triton's interpreter")
    import specserve.attention.triton_quant_fp8 as fp8

    monkeypatch.setattr(fp8, "scale_window", lambda num_kv_heads: 8)
    fmt = kv_format("fp8", torch.bfloat16)
    batch = make_batch([(31, 1)], 12, 2, 128, 16, fmt, torch.bfloat16, device, seed=3, pool_tail=True)
    ref, _ = reference(batch, fmt)
    assert_close(run_kernels(batch, fmt, variant="v3")[:1], ref, torch.bfloat16)
    assert over_reads and all(r.startswith("load: 12 bytes past") for r in over_reads), over_reads
