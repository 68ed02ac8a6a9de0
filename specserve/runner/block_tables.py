"""BlockTables: the block table of every running request kept in one persistent numpy array, one row
(slot) per request, so a step copies only the blocks added since the last step and gathers its rows
with one numpy index (like vLLM's InputBatch), instead of rebuilding every row from Python lists."""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain

import numpy as np


def block_table_array(block_lists: list[list[int]]) -> np.ndarray:
    """[len(block_lists), longest list (at least 1)] int32, each row its list padded with 0."""
    if len(block_lists) == 1 and block_lists[0]:
        return np.array(block_lists, dtype=np.int32)
    widths = np.fromiter(map(len, block_lists), dtype=np.int64, count=len(block_lists))
    tables = np.zeros((len(block_lists), max(1, int(widths.max(initial=1)))), dtype=np.int32)
    # Row i's first widths[i] entries, filled row-major from the concatenated lists in one go.
    tables[np.arange(tables.shape[1]) < widths[:, None]] = np.fromiter(
        chain.from_iterable(block_lists), dtype=np.int32, count=int(widths.sum())
    )
    return tables


def ranks(counts: np.ndarray) -> np.ndarray:
    """[counts.sum()]: 0..counts[i]-1 for each i in turn."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


class _Slots(dict):
    """request_id -> slot; an unknown id takes a free slot (marked unfilled) on first lookup."""

    def __init__(self, owner: BlockTables) -> None:
        super().__init__()
        self.owner = owner

    def __missing__(self, request_id: str) -> int:
        slot = self[request_id] = self.owner.take_slot()
        return slot


class BlockTables:
    """Cached block-table rows. Contract with the KV manager (kv/manager.py): a request's block list
    only grows while it is the same list object; a list replaced (freed, allocated again) or shrunk is
    rewritten whole. Each slot keeps a reference to the list it copied, so that list's id() cannot be
    reused by another list while the slot trusts it."""

    def __init__(self, num_slots: int = 64, width: int = 16) -> None:
        self.tables = np.zeros((num_slots, width), dtype=np.int32)  # entries past a row's length are 0
        self.filled = np.zeros(num_slots, dtype=np.int64)  # blocks copied into each row
        self.list_ids = np.zeros(num_slots, dtype=np.int64)  # id() of the list each row copies (0: none)
        self.lists: list[list[int] | None] = [None] * num_slots
        self.free: list[int] = list(range(num_slots - 1, -1, -1))
        self.slots = _Slots(self)

    def take_slot(self) -> int:
        if not self.free:
            self._grow_slots(2 * len(self.lists))
        slot = self.free.pop()
        self.list_ids[slot] = 0
        return slot

    def gather(self, request_ids: list[str], block_ids_of: Callable[[str], list[int]]) -> np.ndarray:
        """[len(request_ids), longest list (at least 1)] int32: each request's blocks padded with 0."""
        slots = np.fromiter(map(self.slots.__getitem__, request_ids), dtype=np.int64, count=len(request_ids))
        lists = list(map(block_ids_of, request_ids))
        lens = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
        width = max(1, int(lens.max(initial=1)))
        if width > self.tables.shape[1]:
            self._grow_width(max(width, 2 * self.tables.shape[1]))
        same = self.list_ids[slots] == np.fromiter(map(id, lists), dtype=np.int64, count=len(lists))
        filled = self.filled[slots]
        stale = np.flatnonzero(~same | (lens < filled))
        if stale.size:  # new, replaced or shrunk lists: whole rows, in one vectorized write
            self._rewrite(slots[stale], [lists[i] for i in stale.tolist()])
            filled[stale] = lens[stale]
        grown = np.flatnonzero(lens > filled)  # the common decode step: a few rows gained a block
        if grown.size:
            added, start = lens[grown] - filled[grown], filled[grown].tolist()
            tails = chain.from_iterable(lists[i][f:] for i, f in zip(grown.tolist(), start))
            rows, cols = np.repeat(slots[grown], added), np.repeat(filled[grown], added) + ranks(added)
            self.tables[rows, cols] = np.fromiter(tails, dtype=np.int32, count=int(added.sum()))
            self.filled[slots[grown]] = lens[grown]
        if len(self.slots) > 2 * len(request_ids) + 256:
            self._release_except(request_ids)
        return self.tables[slots, :width]

    def _rewrite(self, slots: np.ndarray, lists: list[list[int]]) -> None:
        rows = block_table_array(lists)
        self.tables[slots] = 0
        self.tables[slots, : rows.shape[1]] = rows
        self.filled[slots] = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
        self.list_ids[slots] = np.fromiter(map(id, lists), dtype=np.int64, count=len(lists))
        for s, blocks in zip(slots.tolist(), lists):
            self.lists[s] = blocks

    def _release_except(self, request_ids: list[str]) -> None:
        """Free the slots of requests not in this step (finished ones); a live one comes back as new."""
        keep = set(request_ids)
        for rid in [r for r in self.slots if r not in keep]:
            s = self.slots.pop(rid)
            self.lists[s], self.list_ids[s], self.filled[s] = None, 0, 0
            self.tables[s] = 0
            self.free.append(s)

    def _grow_slots(self, n: int) -> None:
        old = len(self.lists)
        self.tables = np.concatenate([self.tables, np.zeros((n - old, self.tables.shape[1]), np.int32)])
        self.filled = np.concatenate([self.filled, np.zeros(n - old, np.int64)])
        self.list_ids = np.concatenate([self.list_ids, np.zeros(n - old, np.int64)])
        self.lists.extend([None] * (n - old))
        self.free.extend(range(n - 1, old - 1, -1))

    def _grow_width(self, width: int) -> None:
        grown = np.zeros((self.tables.shape[0], width), dtype=np.int32)
        grown[:, : self.tables.shape[1]] = self.tables
        self.tables = grown
