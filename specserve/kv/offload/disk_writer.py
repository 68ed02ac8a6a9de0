"""The disk tier's write queue and writer threads. `submit` copies each block into a slot of its
own, so the caller's staging is free at once; until its file is in place a block is served from
here, copied under the lock (a slot is never reused while a reader copies out of it)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import NamedTuple

import torch

from specserve.kv.offload.base import BlockKey, SlotSlab, StatsCounter
from specserve.kv.offload.payload import BlockLayout, PackedPayload, copy_bytes, pack, paired_runs

logger = logging.getLogger(__name__)

_BATCH = 8  # blocks per queue item: fewer queue operations per block

WriteBlock = Callable[[BlockKey, PackedPayload], None]


class _Pending(NamedTuple):
    payload: PackedPayload  # views the slot, or a buffer of its own (a block of another size)
    slot: int | None


class DiskWriter:
    """At most `max_pending_bytes` wait; more are dropped. `write(key, payload)` stores one block;
    a failure is counted in `errors`."""

    def __init__(self, write: WriteBlock, max_pending_bytes: int, threads: int, stats: StatsCounter) -> None:
        self._write = write
        self._max_pending = int(max_pending_bytes)
        self._stats = stats
        self._lock = threading.Lock()
        self._slab: SlotSlab | None = None  # sized by the first block (an engine's are all alike)
        self._pending: dict[BlockKey, _Pending] = {}  # complete copies, queued or being written
        self._reserved: set[BlockKey] = set()  # room taken, copy in progress
        self._pending_bytes = 0
        self._queue: queue.Queue[list[BlockKey] | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._loop, name=f"specserve-disk-writer-{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        for t in self._threads:
            t.start()

    @property
    def _slots(self) -> SlotSlab:
        assert self._slab is not None
        return self._slab

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._pending or key in self._reserved

    def submit(self, items: list[tuple[BlockKey, PackedPayload]]) -> None:
        taken: list[tuple[BlockKey, PackedPayload, int | None]] = []
        dropped = 0
        with self._lock:
            for key, src in items:
                if key in self:
                    continue
                if self._pending_bytes + src.nbytes > self._max_pending:
                    dropped += 1
                    continue
                slot = self._take_slot(src.nbytes)
                self._reserved.add(key)
                self._pending_bytes += src.nbytes
                taken.append((key, src, slot))
        if dropped:
            self._stats.add(dropped=dropped)
        try:
            entries = self._copy(taken)
        except BaseException:  # give the room back: nothing of these blocks is queued
            with self._lock:
                for key, src, slot in taken:
                    self._reserved.discard(key)
                    self._pending_bytes -= src.nbytes
                    if slot is not None:
                        self._slots.free(slot)
            raise
        with self._lock:
            for key, pending in entries:
                self._reserved.discard(key)
                self._pending[key] = pending
        keys = [key for key, _ in entries]
        for start in range(0, len(keys), _BATCH):
            self._queue.put(keys[start : start + _BATCH])

    def _copy(self, taken: list[tuple[BlockKey, PackedPayload, int | None]]) -> list[tuple[BlockKey, _Pending]]:
        slotted = [(src.buffer, self._slots.view(slot)) for _, src, slot in taken if slot is not None]
        for run_src, run_dst in paired_runs([s for s, _ in slotted], [d for _, d in slotted]):
            copy_bytes(run_dst, run_src)
        out: list[tuple[BlockKey, _Pending]] = []
        for key, src, slot in taken:
            if slot is None:  # a buffer of its own
                pending = _Pending(pack(src, out=torch.empty(src.nbytes, dtype=torch.uint8)), None)
            else:
                pending = _Pending(PackedPayload(self._slots.view(slot), src.layout), slot)
            out.append((key, pending))
        return out

    def _take_slot(self, size: int) -> int | None:
        """Under the lock: a slot for `size` bytes, or None (a buffer of its own)."""
        if self._slab is None:
            self._slab = SlotSlab(size, max(1, self._max_pending // size), pin_memory=False)
        if size != self._slab.slot_bytes:
            return None
        slot = self._slab.allocate()
        if slot is None and self._slab.grow():  # unpinned: an mmap, no page touched yet
            slot = self._slab.allocate()
        return slot

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
                if pending is not None and (layout is None or pending.payload.layout == layout):
                    out = torch.empty(pending.payload.nbytes, dtype=torch.uint8) if rows is None else rows[i]
                    found[i] = pack(pending.payload, out=out)
        return found

    def flush(self) -> None:
        self._queue.join()

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()

    def _loop(self) -> None:
        while True:
            keys = self._queue.get()
            try:
                if keys is None:
                    return
                for key in keys:
                    self._write_one(key)
            finally:
                self._queue.task_done()

    def _write_one(self, key: BlockKey) -> None:
        pending = self._pending[key]  # published before it was queued; only this thread removes it
        try:
            self._write(key, pending.payload)
        except Exception as exc:  # disk full, permissions, a bad tensor: count, never die
            logger.warning("KV disk tier: write of %s failed: %s", key.hex()[:32], exc)
            self._stats.add(errors=1)
        finally:
            with self._lock:
                del self._pending[key]
                self._pending_bytes -= pending.payload.nbytes
                if pending.slot is not None:
                    self._slots.free(pending.slot)
