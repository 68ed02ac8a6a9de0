"""Offload tiers through the engine: exact output on GPU-pool, CPU-tier and disk-tier hits; restart; corruption."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from specserve import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _doc(seed: int, n: int = 70) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 300) for _ in range(n)]


def _metric(llm: LLM, name: str, **labels) -> float:
    return llm.engine.stats.get(name, labels or None)


def _make(path, num_blocks: int, **offload) -> LLM:
    probe = LLM(model=str(path), progress=False, kv_cache_memory_bytes=1 << 20)
    per_block = probe.engine.runner.spec.bytes_per_block
    return LLM(model=str(path), progress=False, kv_cache_memory_bytes=num_blocks * per_block, kv_offload=offload)


def _gen(llm: LLM, doc: list[int]) -> list[int]:
    return llm.generate({"prompt_token_ids": doc}, PARAMS)[0].outputs[0].token_ids


def test_cpu_tier_hit_after_gpu_eviction_is_exact(tiny_llama_dir):
    llm = _make(tiny_llama_dir, num_blocks=8, cpu_bytes=8 << 20)
    doc = _doc(1)
    first = _gen(llm, doc)
    assert _gen(llm, doc) == first  # GPU-pool hit
    gpu_hits = llm.engine.kv.prefix_hits
    assert gpu_hits > 0 and _metric(llm, "kv_offload_hits_total", tier="cpu") == 0
    for s in range(2, 6):  # other documents push the first one's blocks out of the 8-block pool
        _gen(llm, _doc(s))
    before = _metric(llm, "kv_offload_hits_total", tier="cpu")
    assert before == 0
    assert _gen(llm, doc) == first
    assert _metric(llm, "kv_offload_hits_total", tier="cpu") >= 64  # 4 full blocks of 16 tokens
    assert _metric(llm, "kv_offload_bytes_total", tier="cpu", direction="load") > 0
    llm.engine.kv.check_integrity()


def test_disk_tier_survives_restart_and_corruption_is_a_miss(tiny_llama_dir, tmp_path):
    disk = dict(disk_path=str(tmp_path / "kv"), disk_bytes=32 << 20)
    doc = _doc(11)
    first_llm = _make(tiny_llama_dir, num_blocks=8, **disk)
    first = _gen(first_llm, doc)
    first_llm.engine.shutdown()  # flushes pending disk writes
    files = list(Path(disk["disk_path"]).glob("*.kvb"))
    assert len(files) >= 4

    restarted = _make(tiny_llama_dir, num_blocks=8, **disk)
    assert _gen(restarted, doc) == first
    assert _metric(restarted, "kv_offload_hits_total", tier="disk") >= 64
    restarted.engine.shutdown()

    for f in Path(disk["disk_path"]).glob("*.kvb"):  # flip bytes in every body
        data = bytearray(f.read_bytes())
        data[-5] ^= 0xFF
        f.write_bytes(bytes(data))
    corrupted = _make(tiny_llama_dir, num_blocks=8, **disk)
    assert _gen(corrupted, doc) == first
    assert _metric(corrupted, "kv_offload_errors_total", tier="disk") >= 1
    assert _metric(corrupted, "kv_offload_hits_total", tier="disk") == 0
    corrupted.engine.shutdown()


def test_offload_needs_prefix_caching(tiny_llama_dir):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(model=str(tiny_llama_dir), progress=False, enable_prefix_caching=False, kv_offload={"cpu_bytes": 1 << 20})
