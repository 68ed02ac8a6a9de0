"""KV offload on CUDA: the store copy runs on a side stream and lands later, loads are
non-blocking copies out of pinned tier slots. The GPU is kept busy (torch.cuda._sleep) so that
the host runs ahead of every copy: results must not depend on the timing."""

from __future__ import annotations

import random

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.config import OffloadConfig
from specserve.kv.offload.offloader import KVOffloader
from specserve.kv.offload.transfer import cache_layout
from specserve.kv.quant import write_kv
from specserve.kv.spec import KVCacheSpec, kv_format
from tests.helpers.kv_gather import gather_kv

_BUSY = 100_000_000  # GPU cycles (~50 ms): the host gets ahead of everything queued after it


def _setup(kv_dtype: str, num_blocks: int = 16):
    fmt = kv_format(kv_dtype, torch.bfloat16)
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=64, block_size=16, fmt=fmt)
    return spec.allocate(num_blocks, torch.device("cuda")), fmt


def _fill(caches, fmt, block_id: int, seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    slots = torch.arange(block_id * 16, block_id * 16 + 16, device="cuda")
    for cache in caches:
        k = torch.randn(16, 2, 64, device="cuda", generator=g)
        write_kv(cache, fmt, slots, k, -k)


def _block(caches, fmt, block_id: int) -> list[torch.Tensor]:
    ids = torch.tensor([block_id], device="cuda")
    return [t.cpu() for cache in caches for t in gather_kv(cache, fmt, ids, 16, torch.float32)]


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8", "nvfp4"])
def test_store_snapshot_and_load_order(device: torch.device, kv_dtype: str) -> None:
    if device.type != "cuda":
        pytest.skip("streams and pinned memory need CUDA")
    caches, fmt = _setup(kv_dtype)
    # Room for exactly the 6 blocks: a 7th put must find every slot leased by the load in flight.
    off = KVOffloader(OffloadConfig(cpu_bytes=6 * cache_layout(caches).nbytes), caches, "ns", block_size=16)
    for b in range(6):
        _fill(caches, fmt, b, seed=b)
    want = [_block(caches, fmt, b) for b in range(6)]
    torch.cuda._sleep(_BUSY)  # everything below is queued behind this
    for b in range(4):
        off.block_completed(bytes([b]), b)
    off.after_forward()  # the gather is queued; nothing has been copied yet
    with off.batch_evictions():
        off.on_evict(bytes([4]), 4)
        off.on_evict(bytes([5]), 5)
    for b in range(6):  # the blocks are reused at once: the gathers ran before, in stream order
        _fill(caches, fmt, b, seed=100 + b)
    found = off.lookup([bytes([b]) for b in range(6)])  # waits for the stores
    assert len(found) == 6
    torch.cuda._sleep(_BUSY)
    off.load_into(list(range(10, 16)), found)  # queued behind the sleep; returns at once
    del found
    # New puts evict LRU entries, but never slots an in-flight load still reads.
    off.block_completed(b"x", 0)
    off.after_forward()
    off.queue.flush()
    assert not off.cpu.contains(b"x") and off.cpu.stats.dropped == 1
    for b in range(6):
        got = _block(caches, fmt, 10 + b)
        assert all(torch.equal(x, y) for x, y in zip(got, want[b]))
    off.close()


def test_cpu_tier_slots_are_pinned_and_loads_are_one_copy(device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("pinned memory needs CUDA")
    caches, fmt = _setup("bfloat16")
    off = KVOffloader(OffloadConfig(cpu_bytes=64 << 20), caches, "ns", block_size=16)
    for b in range(8):
        _fill(caches, fmt, b, seed=b)
        off.block_completed(bytes([b]), b)
    off.after_forward()
    found = off.lookup([bytes([b]) for b in range(8)])
    assert all(p.buffer.is_pinned() for p in found)
    ptrs = [p.buffer.data_ptr() for p in found]
    assert ptrs == [ptrs[0] + i * off.mover.layout.nbytes for i in range(8)]  # adjacent slots
    off.close()


def _doc(seed: int, n: int = 150) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 300) for _ in range(n)]


def test_engine_tier_hits_are_exact(tiny_llama_dir, tmp_path, device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("the CUDA offload path")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    offload = {"cpu_bytes": 64 << 20, "disk_path": str(tmp_path / "kv"), "disk_bytes": 64 << 20}
    llm = LLM(
        model=str(tiny_llama_dir),
        progress=False,
        device="cuda",
        dtype="float32",
        kv_cache_memory_bytes=4 << 20,
        kv_offload=offload,
    )
    docs = [_doc(s) for s in range(3)]
    first = [llm.generate({"prompt_token_ids": d}, params)[0].outputs[0].token_ids for d in docs]
    for _ in range(2):
        assert llm.engine.kv.reset_prefix_cache()
        again = [llm.generate({"prompt_token_ids": d}, params)[0].outputs[0].token_ids for d in docs]
        assert again == first
    stats = llm.engine.stats
    assert stats.get("kv_offload_hits_total", {"tier": "cpu"}) >= 3 * 9 * 16
    llm.engine.shutdown()
    restarted = LLM(
        model=str(tiny_llama_dir),
        progress=False,
        device="cuda",
        dtype="float32",
        kv_cache_memory_bytes=4 << 20,
        kv_offload={**offload, "cpu_bytes": 0},
    )
    assert [restarted.generate({"prompt_token_ids": d}, params)[0].outputs[0].token_ids for d in docs] == first
    assert restarted.engine.stats.get("kv_offload_hits_total", {"tier": "disk"}) >= 3 * 9 * 16
    restarted.engine.shutdown()
