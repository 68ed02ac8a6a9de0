"""Fixed-size slots carved out of a few large host buffers, pinned once per chunk (pinning is slow)
and reused forever without touching the allocator."""

from __future__ import annotations

import threading
from collections import deque

import torch

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
        self._chunk_bytes: list[memoryview] = []  # the same memory, for file I/O
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
            self._chunk_bytes.append(chunk.numpy().data.cast("B"))  # before the chunk is published
            self._chunks.append(chunk)
            self._num_slots += count
            # In address order: blocks stored together are adjacent and move in one copy.
            self._free.extend(range(first, first + count))
            return True

    def view(self, slot: int) -> torch.Tensor:
        """The slot's memory: [slot_bytes] uint8."""
        chunk, index = divmod(slot, self.slots_per_chunk)
        return self._chunks[chunk][index * self.slot_bytes : (index + 1) * self.slot_bytes]

    def view_bytes(self, slot: int) -> memoryview:
        """The slot's memory as a memoryview."""
        chunk, index = divmod(slot, self.slots_per_chunk)
        return self._chunk_bytes[chunk][index * self.slot_bytes : (index + 1) * self.slot_bytes]
