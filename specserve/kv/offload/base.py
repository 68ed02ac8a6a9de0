"""Shared pieces of the offload tiers (cpu.py, disk.py): byte-bounded key -> payload stores where evicted KV blocks go.

Keys are content addresses (namespace + chained block hash), so a tier may drop an entry at any
time and a miss is always safe (the block is recomputed). Tier methods never raise on bad stored
data or I/O trouble: those are misses counted in `stats.errors`. `put` copies the payload and never
blocks on slow storage; payloads from `get` may view the tier's memory (read-only, valid while
alive). `flush` returns once every earlier put is stored or counted as failed.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

BlockKey = bytes


@dataclass
class TierStats:
    """Counters of one tier; they only grow."""

    queries: int = 0  # get() calls
    hits: int = 0
    bytes_in: int = 0  # payload bytes accepted by put()
    bytes_out: int = 0  # payload bytes returned by get() hits
    errors: int = 0  # corrupt / foreign entries met, failed writes
    evictions: int = 0  # entries dropped to stay under the byte budget
    dropped: int = 0  # puts not stored: larger than the tier, or the write queue was full


class StatsCounter:
    """TierStats behind a lock: tiers update them from more than one thread."""

    def __init__(self) -> None:
        self._stats = TierStats()
        self._lock = threading.Lock()

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + delta)

    def snapshot(self) -> TierStats:
        with self._lock:
            return dataclasses.replace(self._stats)


class Tier:
    """What the tiers share: a name, a byte budget, counters, `put` as a one-block `put_many`."""

    name: str

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self._capacity = int(capacity_bytes)
        self._stats = StatsCounter()

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def stats(self) -> TierStats:
        return self._stats.snapshot()

    def put(self, key: BlockKey, payload: object) -> None:
        self.put_many([key], [payload])  # type: ignore[attr-defined]
