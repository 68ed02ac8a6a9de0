"""kv_offload_hits_total{tier} counts tokens loaded into a request's KV from that tier, not the
blocks a tier read: a lookup that finds 3 blocks of which only 2 are loaded counts 2 blocks."""

from __future__ import annotations

import torch

from specserve.config import OffloadConfig
from specserve.kv.offload.offloader import KVOffloader
from specserve.kv.quant import write_kv
from specserve.kv.spec import KVCacheSpec, kv_format
from specserve.metrics.stats import StatsCollector

BLOCK = 4


def test_hits_count_loaded_blocks_per_tier(tmp_path) -> None:
    fmt = kv_format("bfloat16", torch.bfloat16)
    caches = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=16, block_size=BLOCK, fmt=fmt).allocate(
        16, torch.device("cpu")
    )
    for b in range(4):
        g = torch.Generator().manual_seed(b)
        for cache in caches:
            write_kv(
                cache,
                fmt,
                torch.arange(b * BLOCK, b * BLOCK + BLOCK),
                torch.randn(BLOCK, 2, 16, generator=g),
                torch.randn(BLOCK, 2, 16, generator=g),
            )
    stats = StatsCollector()
    off = KVOffloader(OffloadConfig(cpu_bytes=1 << 20), caches, "ns", block_size=BLOCK, stats=stats)
    for i in range(3):
        off.block_completed(b"h%d" % i, i)
    off.after_forward()
    found = off.lookup([b"h0", b"h1", b"h2", b"h9"])
    assert len(found) == 3
    off.load_into([8, 9], found[:2])  # the pool had room for two
    off.record_stats()
    assert stats.get("kv_offload_hits_total", {"tier": "cpu"}) == 2 * BLOCK
    assert stats.get("kv_offload_queries_total", {"tier": "cpu"}) >= 3 * BLOCK
    off.close()
