"""Offload tiers (cpu.py, disk.py): byte-bounded key -> payload stores where evicted KV blocks go.

Keys are content addresses (namespace + chained block hash): one key always names the same bytes,
so a tier may drop or rewrite an entry at any time and a miss is always safe (the block is
recomputed). No tier method raises on bad stored data or I/O trouble: those are misses counted in
`stats.errors`. `put` copies the payload and never blocks on slow storage; payloads returned by
`get` may view the tier's memory: read-only, valid while they are alive. `flush` returns once
every earlier put is stored or counted as failed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields

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
