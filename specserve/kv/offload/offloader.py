"""KVOffloader: connects the GPU block pool to the CPU / disk tiers.

- Store: a full block is queued when it enters the prefix cache and copied out after the
  forward that wrote it (one gather per cache tensor for all of a step's blocks); a cached block
  about to be reused is copied out first if no tier has it.
- Load: past the last GPU prefix hit, consecutive blocks found in a tier are copied into fresh
  GPU blocks and become ordinary prefix-cache hits.
- Prefetch: when a request arrives, a background thread reads its blocks from disk into the CPU
  tier, so the scheduler's later lookup usually hits memory.
Keys are the chained block hashes, which already include the model identity and KV format.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from specserve.config import OffloadConfig
from specserve.kv.block_pool import BlockHash
from specserve.kv.offload.base import BlockPayload, TierStats, extract_block, extract_blocks, insert_blocks
from specserve.kv.offload.cpu import CpuTier
from specserve.kv.offload.disk import DiskTier
from specserve.kv.offload.tiered import TieredStore
from specserve.kv.spec import LayerKVCache
from specserve.metrics.stats import StatsCollector


class KVOffloader:
    def __init__(self, cfg: OffloadConfig, caches: list[LayerKVCache], namespace: str, block_size: int,
                 stats: StatsCollector | None = None) -> None:
        tiers = []
        if cfg.cpu_bytes > 0:
            tiers.append(CpuTier(cfg.cpu_bytes))
        if cfg.disk_path and cfg.disk_bytes > 0:
            tiers.append(DiskTier(cfg.disk_path, cfg.disk_bytes, namespace))
        self.store = TieredStore(tiers)
        self.caches = caches
        self.block_size = block_size
        self.stats = stats
        self._pending: list[tuple[BlockHash, int]] = []
        self._last: dict[str, TierStats] = {}
        self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-prefetch")
        self._lock = threading.Lock()  # the tiers are thread-safe; this orders get vs prefetch

    # -- store -------------------------------------------------------------------------------
    def block_completed(self, block_hash: BlockHash, block_id: int) -> None:
        self._pending.append((block_hash, block_id))

    def after_forward(self) -> None:
        """Copy out the blocks completed by the forward that just ran."""
        pending, self._pending = self._pending, []
        fresh = [(h, b) for h, b in pending if not self.store.contains(h)]
        if fresh:
            for (h, _), payload in zip(fresh, extract_blocks(self.caches, [b for _, b in fresh])):
                self.store.put(h, payload)
        self.record_stats()

    def on_evict(self, block_hash: BlockHash, block_id: int) -> None:
        """The GPU is about to reuse a cached block: keep its content in a tier."""
        if any(h == block_hash for h, _ in self._pending):
            self._pending = [(h, b) for h, b in self._pending if h != block_hash]
        if not self.store.contains(block_hash):
            self.store.put(block_hash, extract_block(self.caches, block_id))

    # -- load --------------------------------------------------------------------------------
    def lookup(self, hashes: list[BlockHash]) -> list[BlockPayload]:
        """Payloads for the longest run of `hashes` (in order) that some tier holds."""
        found: list[BlockPayload] = []
        with self._lock:
            for h in hashes:
                payload = self.store.get(h)
                if payload is None:
                    break
                found.append(payload)
        return found

    def load_into(self, block_ids: list[int], payloads: list[BlockPayload]) -> None:
        insert_blocks(self.caches, block_ids, payloads)

    def prefetch(self, hashes: list[BlockHash]) -> None:
        """Warm the CPU tier from disk in the background (promotion happens inside get)."""
        if len(self.store.tiers) > 1 and hashes:
            self._prefetcher.submit(self.lookup, list(hashes))

    # -- housekeeping ------------------------------------------------------------------------
    def record_stats(self) -> None:
        if self.stats is None:
            return
        for name, now in self.store.stats.items():
            last = self._last.get(name, TierStats())
            lbl = {"tier": name}
            self.stats.inc("kv_offload_queries_total", (now.queries - last.queries) * self.block_size, lbl)
            self.stats.inc("kv_offload_hits_total", (now.hits - last.hits) * self.block_size, lbl)
            self.stats.inc("kv_offload_bytes_total", now.bytes_in - last.bytes_in, {**lbl, "direction": "store"})
            self.stats.inc("kv_offload_bytes_total", now.bytes_out - last.bytes_out, {**lbl, "direction": "load"})
            self.stats.inc("kv_offload_errors_total", now.errors - last.errors, lbl)
            self._last[name] = now

    def close(self) -> None:
        """Flush pending writes (graceful shutdown)."""
        self.after_forward()
        self._prefetcher.shutdown(wait=True)
        self.store.flush()
        self.store.close()
        self.record_stats()
