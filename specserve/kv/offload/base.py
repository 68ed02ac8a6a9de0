"""Offload tiers: where KV blocks evicted from the device cache go, and come back from.

A tier is a key -> payload store under a byte budget. Keys are content addresses (the caller's
`namespace_hash + chained_block_hash`): one key always names the same bytes, so a tier may drop,
keep or rewrite an entry at any time without coordination, and a miss is always safe (the engine
recomputes the block).

A payload is one block of every layer (payload.py): any mapping of tensor names to tensors may
be `put`; tiers return `PackedPayload`s (one contiguous buffer, named tensors viewing it).
Ownership: `put` copies the payload (into a CPU tier slot, or the disk tier's write queue), so
the caller may reuse its buffers once `put` returns: a pinned staging buffer goes back to its
allocator at once, not when the disk has caught up. Payloads returned by `get` may view the
tier's memory: treat them as read-only; the memory stays valid while the payload (or a tensor of
it) is alive.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Protocol, runtime_checkable

from specserve.kv.offload.payload import BlockPayload, PackedPayload, payload_nbytes
from specserve.kv.offload.transfer import BlockMover
from specserve.kv.spec import LayerKVCache

BlockKey = bytes

__all__ = [
    "BlockKey",
    "BlockPayload",
    "OffloadTier",
    "PackedPayload",
    "StatsCounter",
    "TierStats",
    "check_payload",
    "extract_block",
    "extract_blocks",
    "insert_block",
    "insert_blocks",
    "payload_nbytes",
]


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

    def snapshot(self) -> TierStats:
        return TierStats(**{f.name: getattr(self, f.name) for f in fields(self)})


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
            return self._stats.snapshot()


@runtime_checkable
class OffloadTier(Protocol):
    """A byte-bounded store of KV blocks. No method raises on bad stored data or I/O trouble:
    those become misses (and `stats.errors`)."""

    name: str

    def contains(self, key: BlockKey) -> bool:
        """Cheap existence check (a later `get` may still miss: eviction, corruption)."""
        ...

    def get(self, key: BlockKey) -> PackedPayload | None:
        """The block, or None on a miss or on a corrupt / foreign entry."""
        ...

    def put(self, key: BlockKey, payload: BlockPayload) -> None:
        """Store the block (may evict older ones; never blocks on slow storage)."""
        ...

    @property
    def used_bytes(self) -> int: ...

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def stats(self) -> TierStats:
        """A consistent copy of the counters."""
        ...

    def flush(self) -> None:
        """Return once every earlier put is stored (or has failed and been counted)."""
        ...

    def close(self) -> None:
        """Flush and release resources; the tier is unusable afterwards."""
        ...


def extract_blocks(caches: list[LayerKVCache], block_ids: Sequence[int]) -> list[PackedPayload]:
    """Copy blocks of every layer to the CPU, one packed payload per block id (synchronous).

    One gather per cache tensor and one device->host copy per group of blocks, whatever the
    number of blocks."""
    payloads: list[PackedPayload] = []
    for rows in BlockMover(caches).gather_to_host(list(block_ids)):
        rows.wait()
        payloads.extend(rows.payloads())
    return payloads


def extract_block(caches: list[LayerKVCache], block_id: int) -> PackedPayload:
    """Copy one block of every layer to the CPU: {"{layer}.key": [block_size, H, packed_dim], ...}."""
    return extract_blocks(caches, [block_id])[0]


def check_payload(caches: list[LayerKVCache], payload: BlockPayload) -> str | None:
    """Why `payload` cannot go into `caches` (names, shapes, dtypes), or None if it can."""
    try:
        BlockMover(caches).check([payload])
    except ValueError as exc:
        return str(exc).removeprefix("cannot insert KV block: ")
    return None


def insert_block(caches: list[LayerKVCache], block_id: int, payload: BlockPayload) -> None:
    """Copy a payload into block `block_id` of every layer. ValueError (nothing written) if the
    payload's layout differs from the caches' (another model, KV format or block size)."""
    insert_blocks(caches, [block_id], [payload])


def insert_blocks(caches: list[LayerKVCache], block_ids: Sequence[int], payloads: Sequence[BlockPayload]) -> None:
    """Copy payloads[i] into block block_ids[i] of every layer; returns once the payloads may be
    modified again. ValueError, with nothing written, if any payload's layout differs."""
    if len(block_ids) != len(payloads):
        raise ValueError(f"{len(block_ids)} block ids for {len(payloads)} payloads")
    mover = BlockMover(caches)
    done = mover.load_from_host(list(block_ids), mover.check(payloads))
    if done is not None:
        done.synchronize()
