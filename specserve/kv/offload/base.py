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
from collections import deque
from dataclasses import dataclass

import torch

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


# Slots: fixed-size pieces of a few large host buffers, pinned once per chunk (pinning is slow)
# and reused forever without touching the allocator.
DEFAULT_CHUNK_BYTES = 64 << 20  # a power of two: torch's pinned allocator rounds sizes up to one


class SlotSlab:
    """`max_slots` slots of `slot_bytes` each, allocated `chunk_bytes` at a time. Only `grow` is
    thread-safe: the owner serializes `allocate` / `free` under its lock and grows outside it."""

    def __init__(
        self, slot_bytes: int, max_slots: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES, pin_memory: bool = False
    ) -> None:
        if slot_bytes <= 0 or max_slots < 0:
            raise ValueError(f"slot_bytes must be > 0 and max_slots >= 0, got {slot_bytes}, {max_slots}")
        self.slot_bytes = slot_bytes
        self.max_slots = max_slots
        self.slots_per_chunk = max(1, chunk_bytes // slot_bytes)
        self.pin_memory = pin_memory
        self._chunks: list[torch.Tensor] = []  # [slots_in_chunk * slot_bytes] uint8 each
        self._free: deque[int] = deque()  # slot ids; new chunks append in ascending order
        self._num_slots = 0
        self._grow_lock = threading.Lock()

    @property
    def num_slots(self) -> int:
        return self._num_slots

    def allocate(self) -> int | None:
        return self._free.popleft() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def grow(self) -> bool:
        """Add one chunk of slots (False at max_slots); the chunk is published only once pinned."""
        with self._grow_lock:
            count = min(self.slots_per_chunk, self.max_slots - self._num_slots)
            if count <= 0:
                return False
            chunk = torch.empty(count * self.slot_bytes, dtype=torch.uint8, pin_memory=self.pin_memory)
            first = self._num_slots
            self._chunks.append(chunk)
            self._num_slots += count
            # In address order: blocks stored together are adjacent and move in one copy.
            self._free.extend(range(first, first + count))
            return True

    def view(self, slot: int) -> torch.Tensor:
        """The slot's memory: [slot_bytes] uint8."""
        chunk, index = divmod(slot, self.slots_per_chunk)
        return self._chunks[chunk][index * self.slot_bytes : (index + 1) * self.slot_bytes]
