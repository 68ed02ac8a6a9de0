"""KVOffloader: connects the GPU block pool to the CPU / disk tiers. Store: a full block is gathered
after the forward that wrote it, an evicted one before it is overwritten; a worker puts the host
copies into the tiers (readers `wait_for` a pending key). Load: tier-resident blocks past the last
GPU prefix hit are copied into fresh blocks before the forward; disk hits are promoted to CPU.
Prefetch: disk -> CPU in the background. Keys are chained block hashes (model and KV format in them).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from specserve.config import OffloadConfig
from specserve.kv.block_pool import BlockHash
from specserve.kv.offload.base import BlockKey, TierStats
from specserve.kv.offload.cpu import CpuTier
from specserve.kv.offload.disk import DiskTier
from specserve.kv.offload.payload import BlockPayload, PackedPayload
from specserve.kv.offload.transfer import BlockMover, HostRows
from specserve.kv.spec import LayerKVCache
from specserve.metrics.stats import StatsCollector

logger = logging.getLogger(__name__)

PutMany = Callable[[list[BlockKey], list[PackedPayload]], None]


class StoreQueue:
    """put(keys, payloads) jobs on one worker thread, in submission order."""

    def __init__(self) -> None:
        self._inflight: dict[BlockKey, Future] = {}
        self._lock = threading.Lock()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-kv-store")

    def submit(self, keys: list[BlockKey], data: HostRows | list[PackedPayload], put: PutMany) -> None:
        """put(keys, payloads) in the background; HostRows once the copy that fills them completes."""
        job = self._worker.submit(_run_put, keys, data, put)  # RuntimeError once closed
        with self._lock:
            self._inflight.update(dict.fromkeys(keys, job))
        job.add_done_callback(functools.partial(self._forget, keys))

    def _forget(self, keys: list[BlockKey], job: Future) -> None:
        with self._lock:
            for key in keys:
                if self._inflight.get(key) is job:
                    del self._inflight[key]

    def pending(self, key: BlockKey) -> bool:
        return key in self._inflight  # one dict lookup: atomic under the GIL

    def wait_for(self, key: BlockKey) -> None:
        job = self._inflight.get(key)
        if job is not None:
            job.result()

    def flush(self) -> None:
        self._worker.submit(lambda: None).result()  # one worker: every earlier job has run

    def close(self) -> None:
        self._worker.shutdown(wait=True)


def _run_put(keys: list[BlockKey], data: HostRows | list[PackedPayload], put: PutMany) -> None:
    try:
        put(keys, data.payloads() if isinstance(data, HostRows) else data)
    except Exception:  # a failed store is a later miss; the worker must survive it
        logger.exception("KV offload: storing %d blocks failed", len(keys))


class KVOffloader:
    def __init__(
        self,
        cfg: OffloadConfig,
        caches: list[LayerKVCache],
        namespace: str,
        block_size: int,
        stats: StatsCollector | None = None,
    ) -> None:
        self.mover = BlockMover(caches)
        self.cpu = CpuTier(cfg.cpu_bytes, slot_bytes=self.mover.layout.nbytes) if cfg.cpu_bytes > 0 else None
        self.disk = DiskTier(cfg.disk_path, cfg.disk_bytes, namespace) if cfg.disk_path and cfg.disk_bytes > 0 else None
        self.tiers: list[CpuTier | DiskTier] = [t for t in (self.cpu, self.disk) if t is not None]
        self.block_size = block_size
        self.stats = stats
        self.queue = StoreQueue()
        # (hash, block id, already computed): blocks completed since the last forward
        self._pending: dict[BlockHash, tuple[int, bool]] = {}
        self._evicted: list[tuple[BlockHash, int]] | None = None  # collected inside batch_evictions()
        self._loads: deque[tuple[torch.cuda.Event, list[PackedPayload]]] = deque()  # H2D copies in flight
        self._last: dict[str, TierStats] = {}
        # Tier of each payload the last lookup returned (by id), and blocks loaded per tier:
        # kv_offload_hits_total counts what served a request, not what a tier read.
        self._origin: dict[int, str] = {}
        self._served: dict[str, int] = {}  # since the last record_stats
        self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-prefetch")
        self._lock = threading.Lock()  # orders engine lookups after a running prefetch

    def block_completed(self, block_hash: BlockHash, block_id: int, computed: bool = False) -> None:
        """A full block entered the prefix cache; `computed`: its forward has already run."""
        self._pending[block_hash] = (block_id, computed)

    def after_forward(self) -> None:
        """Start copying out the blocks completed by the forward that was just launched."""
        self._reap_loads()
        pending, self._pending = self._pending, {}
        self._store([(h, b) for h, (b, _) in pending.items()])
        self.record_stats()

    def on_evict(self, block_hash: BlockHash, block_id: int) -> None:
        """The GPU is about to reuse a cached block: keep its content in a tier."""
        entry = self._pending.pop(block_hash, None)
        if entry is not None and not entry[1]:
            return  # its forward has not run: there is nothing to keep (it was never computed)
        if self._evicted is not None:
            self._evicted.append((block_hash, block_id))
        else:
            self._store([(block_hash, block_id)])

    @contextlib.contextmanager
    def batch_evictions(self) -> Iterator[None]:
        """Blocks evicted inside are gathered in one copy on leaving; leave it before anything
        writes to the blocks handed out inside."""
        outer, self._evicted = self._evicted, []
        try:
            yield
        finally:
            evicted, self._evicted = self._evicted, outer
            if outer is not None:
                outer.extend(evicted)
            else:
                self._store(evicted)

    def _store(self, blocks: list[tuple[BlockHash, int]]) -> None:
        fresh = [(h, b) for h, b in blocks if not self.queue.pending(h) and not self._stored(h)]
        if not fresh:
            return
        start = 0
        for rows in self.mover.gather_to_host([b for _, b in fresh]):
            n = rows.rows.shape[0]
            self.queue.submit([h for h, _ in fresh[start : start + n]], rows, self._put_many)
            start += n

    def _put_many(self, keys: list[BlockHash], payloads: list[PackedPayload]) -> None:
        for tier in self.tiers:  # write-through: each tier evicts on its own budget
            tier.put_many(keys, payloads)

    def _stored(self, key: BlockHash) -> bool:
        # No stat on the step path: the disk writer skips files another process wrote.
        return (self.cpu is not None and self.cpu.contains(key)) or (self.disk is not None and self.disk.knows(key))

    def lookup(self, hashes: list[BlockHash]) -> list[PackedPayload]:
        """Payloads for the longest run of `hashes` (in order) that some tier holds."""
        self._reap_loads()
        with self._lock:
            return self._lookup(hashes)

    def _lookup(self, hashes: list[BlockHash]) -> list[PackedPayload]:
        found: list[PackedPayload] = []
        self._origin = {}
        while len(found) < len(hashes):
            rest = hashes[len(found) :]
            for h in rest:
                self.queue.wait_for(h)  # a block on its way into the tiers: wait until it is there
            if self.cpu is not None:
                hits = self.cpu.get_many(rest)
                found.extend(hits)
                if len(hits) == len(rest):
                    break
                rest = rest[len(hits) :]
            run = self._disk_run(rest, count_miss=True)
            if not run or self.disk is None:  # an empty run without a disk tier
                break
            hits = _prefix(self.disk.get_many(run, self.mover.layout))
            found.extend(hits)
            self._origin.update((id(p), self.disk.name) for p in hits)
            if self.cpu is not None and hits:  # promote off the engine thread
                self.queue.submit(run[: len(hits)], hits, self.cpu.put_many)
            if len(hits) < len(run):
                break
        return found

    def _disk_run(self, hashes: list[BlockHash], count_miss: bool = False) -> list[BlockHash]:
        """The leading hashes on disk and not in the CPU tier; count_miss: a probe the disk misses
        counts as a disk query (as the CPU tier's first miss does)."""
        run: list[BlockHash] = []
        if self.disk is None:
            return run
        for h in hashes:
            self.queue.wait_for(h)
            if self.cpu is not None and self.cpu.contains(h):
                break
            if not self.disk.contains(h):
                if count_miss:
                    self.disk.count_miss()
                break
            run.append(h)
        return run

    def load_into(self, block_ids: list[int], payloads: Sequence[BlockPayload]) -> None:
        packed = self.mover.check(payloads)
        for p in payloads:  # a payload the disk did not serve came from the CPU tier
            tier = self._origin.get(id(p), "cpu")
            self._served[tier] = self._served.get(tier, 0) + 1
        done = self.mover.load_from_host(block_ids, packed)
        if done is not None:  # the host buffers (tier slots) stay leased until the copy has run
            self._loads.append((done, packed))

    def _reap_loads(self) -> None:
        while self._loads and self._loads[0][0].query():  # events complete in stream order
            self._loads.popleft()

    def prefetch(self, hashes: list[BlockHash]) -> None:
        """Warm the CPU tier from disk in the background."""
        if self.cpu is not None and self.disk is not None and hashes:
            self._prefetcher.submit(self._prefetch, list(hashes))

    def _prefetch(self, hashes: list[BlockHash]) -> None:
        assert self.cpu is not None and self.disk is not None  # prefetch() checked
        with self._lock:
            start = 0
            while start < len(hashes) and (self.cpu.contains(hashes[start]) or self.queue.pending(hashes[start])):
                start += 1
            run = self._disk_run(hashes[start:])
            hits = _prefix(self.disk.get_many(run, self.mover.layout))
            self.cpu.put_many(run[: len(hits)], hits)

    def record_stats(self) -> None:
        if self.stats is None:
            return
        for tier in self.tiers:
            name, now, last = tier.name, tier.stats, self._last.get(tier.name, TierStats())
            lbl = {"tier": name}
            self.stats.inc("kv_offload_queries_total", (now.queries - last.queries) * self.block_size, lbl)
            self.stats.inc("kv_offload_hits_total", self._served.pop(name, 0) * self.block_size, lbl)
            self.stats.inc("kv_offload_bytes_total", now.bytes_in - last.bytes_in, {**lbl, "direction": "store"})
            self.stats.inc("kv_offload_bytes_total", now.bytes_out - last.bytes_out, {**lbl, "direction": "load"})
            self.stats.inc("kv_offload_errors_total", now.errors - last.errors, lbl)
            self._last[name] = now

    def close(self) -> None:
        """Flush pending writes (graceful shutdown)."""
        self.after_forward()
        for done, _ in self._loads:
            done.synchronize()
        self._loads.clear()
        self._prefetcher.shutdown(wait=True)
        self.queue.close()
        for tier in self.tiers:
            tier.flush()
            tier.close()
        self.record_stats()


def _prefix(payloads: list[PackedPayload | None]) -> list[PackedPayload]:
    """The payloads before the first miss."""
    return list(itertools.takewhile(lambda p: p is not None, payloads))  # type: ignore[arg-type]
