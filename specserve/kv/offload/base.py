"""Offload tiers: byte-bounded key -> payload stores where evicted device KV blocks go.

Keys are content addresses (namespace + chained block hash): one key always names the same bytes,
so a tier may drop or rewrite an entry at any time and a miss is always safe (the block is
recomputed). `put` copies the payload, so the caller may reuse its buffers once it returns.
Payloads returned by `get` may view the tier's memory: read-only, valid while they are alive.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields
from typing import Protocol, runtime_checkable

from specserve.kv.offload.payload import BlockPayload, PackedPayload

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
            return TierStats(**{f.name: getattr(self._stats, f.name) for f in fields(TierStats)})


@runtime_checkable
class OffloadTier(Protocol):
    """A byte-bounded store of KV blocks. No method raises on bad stored data or I/O trouble: those
    become misses (and `stats.errors`). `contains` is cheap and may be stale; `put` never blocks on
    slow storage; `flush` returns once every earlier put is stored or counted as failed."""

    name: str

    def contains(self, key: BlockKey) -> bool: ...

    def get(self, key: BlockKey) -> PackedPayload | None: ...

    def put(self, key: BlockKey, payload: BlockPayload) -> None: ...

    @property
    def used_bytes(self) -> int: ...

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def stats(self) -> TierStats: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...
