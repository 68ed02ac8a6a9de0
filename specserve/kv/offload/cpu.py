"""CPU memory tier: an LRU of block payloads under a byte budget."""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from specserve.kv.offload.base import BlockKey, BlockPayload, StatsCounter, TierStats, payload_nbytes


class CpuTier:
    """LRU under `capacity_bytes` of payload tensor bytes (Python object overhead not counted).

    With `pin_memory` (default: when CUDA is available) payloads are copied into page-locked
    memory on `put`, so later host->device copies can run asynchronously at full bandwidth.
    Thread-safe: one lock around the index (the engine and a loader thread may share it).
    """

    def __init__(self, capacity_bytes: int, pin_memory: bool | None = None, name: str = "cpu") -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.name = name
        self._capacity = int(capacity_bytes)
        self._pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._entries: OrderedDict[BlockKey, tuple[BlockPayload, int]] = OrderedDict()  # oldest first
        self._used = 0
        self._lock = threading.Lock()
        self._stats = StatsCounter()

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def stats(self) -> TierStats:
        return self._stats.snapshot()

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[BlockKey]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._entries)

    def contains(self, key: BlockKey) -> bool:
        with self._lock:
            return key in self._entries

    def get(self, key: BlockKey) -> BlockPayload | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        if entry is None:
            self._stats.add(queries=1)
            return None
        self._stats.add(queries=1, hits=1, bytes_out=entry[1])
        return entry[0]

    def put(self, key: BlockKey, payload: BlockPayload) -> None:
        size = payload_nbytes(payload)
        if size > self._capacity:
            self._stats.add(dropped=1)
            return
        with self._lock:
            if key in self._entries:
                # Same key, same content (content-addressed): refreshing recency is enough.
                self._entries.move_to_end(key)
                return
        if self._pin:
            payload = {name: t.pin_memory() for name, t in payload.items()}
        evicted = 0
        with self._lock:
            if key in self._entries:  # another thread stored it meanwhile
                self._entries.move_to_end(key)
                return
            while self._used + size > self._capacity:
                _, (_, old_size) = self._entries.popitem(last=False)
                self._used -= old_size
                evicted += 1
            self._entries[key] = (payload, size)
            self._used += size
        self._stats.add(bytes_in=size, evictions=evicted)

    def flush(self) -> None:
        """Nothing is pending in memory."""

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._used = 0
