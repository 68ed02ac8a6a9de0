"""Block pool: reference counts, chained block hashes, LRU of cached blocks nobody references.

Invariants (checked by `check_integrity`):
- a block is in the free queue iff its ref_cnt is 0;
- `cached[h] == b` iff `blocks[b].block_hash == h` (a hash maps to at most one block);
- free blocks with a hash are reusable prefix-cache entries, evicted least recently freed first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

BlockHash = bytes


def hash_blocks(
    parent: BlockHash | None, token_ids: Sequence[int], block_size: int, extra: bytes = b""
) -> list[BlockHash]:
    """Chained hashes of the full blocks of `token_ids`; blake2b of int64 bytes, stable across
    processes (the disk tier relies on that)."""
    raw = np.asarray(token_ids, dtype=np.int64).tobytes()
    out: list[BlockHash] = []
    for start in range(0, len(raw), block_size * 8):
        parent = hashlib.blake2b(
            b"".join((parent or b"root", raw[start : start + block_size * 8], extra)), digest_size=16
        ).digest()
        out.append(parent)
    return out


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(
                f"the KV pool needs at least 1 block, got {num_blocks}; raise "
                "gpu_memory_utilization or kv_cache_memory_bytes."
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockHash, int] = {}
        # Called with (block_hash, block_id) just before a cached block's content is reused.
        self.on_evict: Callable[[BlockHash, int], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        """Fraction of blocks referenced by requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def allocate(self, num: int) -> list[int] | None:
        """Take `num` blocks from the LRU end of the free queue; None if there are not enough."""
        if num > len(self.free_queue):
            return None
        ids = []
        for _ in range(num):
            block_id, _ = self.free_queue.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                if self.on_evict is not None:
                    self.on_evict(block.block_hash, block_id)
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            ids.append(block_id)
        return ids

    def touch(self, block_ids: Sequence[int]) -> None:
        """Add a reference to cached blocks (prefix hits); revive them from the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free_queue[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference each. Pass a request's blocks tail-first: tails are evicted first."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block_id] = None
                if block.block_hash is None:  # nothing reusable: to the front, taken first
                    self.free_queue.move_to_end(block_id, last=False)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
        if not self.enable_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # another block already holds these tokens; keep this one private
        block.block_hash = block_hash
        self.cached[block_hash] = block_id

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes (only when nothing is referenced); whether it did."""
        if len(self.free_queue) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True

    def check_integrity(self, expected_refs: dict[int, int]) -> None:
        """expected_refs: block_id -> number of live requests holding it."""
        for block in self.blocks:
            want = expected_refs.get(block.block_id, 0)
            if block.ref_cnt != want:
                raise AssertionError(f"block {block.block_id}: ref_cnt {block.ref_cnt}, expected {want}")
            if (block.ref_cnt == 0) != (block.block_id in self.free_queue):
                raise AssertionError(f"block {block.block_id}: free-queue membership wrong")
            if block.block_hash is not None and self.cached.get(block.block_hash) != block.block_id:
                raise AssertionError(f"block {block.block_id}: hash not mapped back to it")
        for h, block_id in self.cached.items():
            if self.blocks[block_id].block_hash != h:
                raise AssertionError(f"cached hash maps to block {block_id} holding another hash")
        if len(self.free_queue) != sum(1 for b in self.blocks if b.ref_cnt == 0):
            raise AssertionError("free queue length mismatch")
