"""CPU memory tier: an LRU of packed block payloads in fixed-size slots of a (pinned) slab."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Sequence

import torch

from specserve.kv.offload.base import BlockKey, Tier
from specserve.kv.offload.payload import BlockLayout, BlockPayload, PackedPayload, copy_runs, pack

DEFAULT_CHUNK_BYTES = 64 << 20  # a power of two: torch's pinned allocator rounds sizes up to one


class SlotSlab:
    """`num_slots` slots of `slot_bytes` each: pieces of a few large host buffers of `chunk_bytes`,
    allocated (and pinned: slow) once and reused without touching the allocator. Not thread-safe."""

    def __init__(
        self, slot_bytes: int, num_slots: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES, pin_memory: bool = False
    ) -> None:
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.slots_per_chunk = max(1, chunk_bytes // slot_bytes)
        self._chunks = [  # [slots_in_chunk * slot_bytes] uint8 each
            torch.empty(
                min(self.slots_per_chunk, num_slots - first) * slot_bytes, dtype=torch.uint8, pin_memory=pin_memory
            )
            for first in range(0, num_slots, self.slots_per_chunk)
        ]
        # In address order: blocks stored together are adjacent and move in one copy.
        self._free = deque(range(num_slots))

    def allocate(self) -> int | None:
        return self._free.popleft() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def view(self, slot: int) -> torch.Tensor:
        """The slot's memory: [slot_bytes] uint8."""
        chunk, index = divmod(slot, self.slots_per_chunk)
        return self._chunks[chunk][index * self.slot_bytes : (index + 1) * self.slot_bytes]


class _Lease:
    """Held by a payload from `get`, its buffer and every view: the slot is not reused while it lives."""

    __slots__ = ("__weakref__",)


class CpuTier(Tier):
    """LRU under `capacity_bytes`, in slots of `slot_bytes` (the whole budget allocated up front;
    payloads of other sizes are dropped), pinned when CUDA is available. `get` returns views into a
    slot, not reused while any of them is alive. Thread-safe: one lock around the index; copies run
    outside it."""

    name = "cpu"

    def __init__(
        self,
        capacity_bytes: int,
        slot_bytes: int,
        pin_memory: bool | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        super().__init__(capacity_bytes)
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._slab = SlotSlab(slot_bytes, self._capacity // slot_bytes, chunk_bytes, pin)
        self._entries: OrderedDict[BlockKey, tuple[int, BlockLayout]] = OrderedDict()  # oldest first
        self._leases: dict[int, weakref.ref[_Lease]] = {}  # slot -> its lease, alive or dead
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return len(self._entries) * self._slab.slot_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[BlockKey]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._entries)

    def contains(self, key: BlockKey) -> bool:
        return key in self._entries  # one dict lookup: atomic under the GIL

    def get(self, key: BlockKey) -> PackedPayload | None:
        hits = self.get_many([key])
        return hits[0] if hits else None

    def get_many(self, keys: list[BlockKey]) -> list[PackedPayload]:
        """`get` of the leading keys that are all here (the first miss counts as a query)."""
        found: list[PackedPayload] = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    break
                self._entries.move_to_end(key)
                slot, layout = entry
                found.append(PackedPayload(self._slab.view(slot), layout, self._lease(slot)))
        missed = len(found) < len(keys)
        self._stats.add(queries=len(found) + missed, hits=len(found), bytes_out=sum(p.nbytes for p in found))
        return found

    def _lease(self, slot: int) -> _Lease:
        """Under the lock: the slot's live lease, else a new one."""
        ref = self._leases.get(slot)
        lease = None if ref is None else ref()
        if lease is None:
            lease = _Lease()
            self._leases[slot] = weakref.ref(lease)
        return lease

    def put_many(self, keys: list[BlockKey], payloads: Sequence[BlockPayload]) -> None:
        """`put` of each pair; runs adjacent in source and slots are copied together."""
        packed = [(k, pack(p)) for k, p in zip(keys, payloads)]
        slots = [self._reserve(k, p.nbytes) for k, p in packed]
        todo = [(k, p, s) for (k, p), s in zip(packed, slots) if s is not None]
        if not todo:
            return
        copy_runs([p.buffer for _, p, _ in todo], [self._slab.view(s) for _, _, s in todo])
        stored = 0
        with self._lock:
            for key, payload, slot in todo:
                if key in self._entries:  # another thread stored it meanwhile
                    self._slab.free(slot)
                    self._entries.move_to_end(key)
                else:
                    self._entries[key] = (slot, payload.layout)
                    stored += payload.nbytes
        self._stats.add(bytes_in=stored)

    def _reserve(self, key: BlockKey, size: int) -> int | None:
        """A free slot, or the LRU unleased entry's; None: stored already, another size, all leased."""
        if size != self._slab.slot_bytes or size > self._capacity:
            self._stats.add(dropped=1)
            return None
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return None
            slot = self._slab.allocate()
            return slot if slot is not None else self._evict_one()

    def _evict_one(self) -> int | None:
        """Under the lock: free the least recently used entry whose slot nobody reads."""
        for key, (slot, _) in self._entries.items():
            ref = self._leases.get(slot)
            if ref is None or ref() is None:
                del self._entries[key]
                self._stats.add(evictions=1)
                return slot
        self._stats.add(dropped=1)
        return None

    def flush(self) -> None:
        pass

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._slab = SlotSlab(self._slab.slot_bytes, 0)  # memory goes once no payload views it any more
