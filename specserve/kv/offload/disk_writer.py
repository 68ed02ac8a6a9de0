"""The disk tier's write queue and writer threads. `submit` copies each block, so the caller's
staging is free at once; until its file is in place a block is served from here (copied out under
the lock)."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from specserve.kv.offload.base import BlockKey, StatsCounter
from specserve.kv.offload.payload import BlockLayout, PackedPayload, pack

logger = logging.getLogger(__name__)

_BATCH = 8  # blocks per queue item: fewer queue operations per block

WriteBlock = Callable[[BlockKey, PackedPayload], None]


def _copy(payload: PackedPayload, out: torch.Tensor | None = None) -> PackedPayload:
    return pack(payload, out=torch.empty(payload.nbytes, dtype=torch.uint8) if out is None else out)


class DiskWriter:
    """At most `max_pending_bytes` wait; more are dropped. `write(key, payload)` stores one block;
    a failure is counted in `errors`."""

    def __init__(self, write: WriteBlock, max_pending_bytes: int, threads: int, stats: StatsCounter) -> None:
        self._write = write
        self._max_pending = int(max_pending_bytes)
        self._stats = stats
        self._lock = threading.Lock()
        self._pending: dict[BlockKey, PackedPayload] = {}  # complete copies, queued or being written
        self._reserved: set[BlockKey] = set()  # room taken, copy in progress
        self._pending_bytes = 0
        self._jobs: set[Future] = set()
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="specserve-disk-writer")

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._pending or key in self._reserved

    def submit(self, items: list[tuple[BlockKey, PackedPayload]]) -> None:
        taken: list[tuple[BlockKey, PackedPayload]] = []
        dropped = 0
        with self._lock:
            for key, src in items:
                if key in self:
                    continue
                if self._pending_bytes + src.nbytes > self._max_pending:
                    dropped += 1
                    continue
                self._reserved.add(key)
                self._pending_bytes += src.nbytes
                taken.append((key, src))
        if dropped:
            self._stats.add(dropped=dropped)
        try:
            copies = [_copy(src) for _, src in taken]
        except BaseException:  # give the room back: nothing of these blocks is queued
            with self._lock:
                for key, src in taken:
                    self._reserved.discard(key)
                    self._pending_bytes -= src.nbytes
            raise
        keys = [key for key, _ in taken]
        with self._lock:
            self._reserved.difference_update(keys)
            self._pending.update(zip(keys, copies))
        for start in range(0, len(keys), _BATCH):
            job = self._pool.submit(self._write_batch, keys[start : start + _BATCH])
            self._jobs.add(job)
            job.add_done_callback(self._jobs.discard)

    def copy_pending(
        self, keys: list[BlockKey], layout: BlockLayout | None, rows: torch.Tensor | None
    ) -> list[PackedPayload | None]:
        """Copies of the queued blocks of `layout` (None: any) among `keys`, into rows
        [len(keys), layout.nbytes] if given."""
        found: list[PackedPayload | None] = [None] * len(keys)
        if not self._pending:
            return found
        with self._lock:
            for i, key in enumerate(keys):
                pending = self._pending.get(key)
                if pending is not None and (layout is None or pending.layout == layout):
                    found[i] = _copy(pending, None if rows is None else rows[i])
        return found

    def flush(self) -> None:
        concurrent.futures.wait(list(self._jobs))

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _write_batch(self, keys: list[BlockKey]) -> None:
        for key in keys:
            self._write_one(key)

    def _write_one(self, key: BlockKey) -> None:
        payload = self._pending[key]  # published before it was queued; only this thread removes it
        try:
            self._write(key, payload)
        except Exception as exc:  # disk full, permissions, a bad tensor: count, never die
            logger.warning("KV disk tier: write of %s failed: %s", key.hex()[:32], exc)
            self._stats.add(errors=1)
        finally:
            with self._lock:
                del self._pending[key]
                self._pending_bytes -= payload.nbytes
