"""KV cache manager: prefix hits, slot allocation (incl. speculative lookahead), freeing. Token i
of a request lives in its block i // block_size at offset i % block_size; full blocks get a chained
hash and enter the prefix cache as soon as their tokens are computed."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import TYPE_CHECKING, Protocol

from specserve.kv.block_pool import BlockHash, BlockPool, hash_blocks

if TYPE_CHECKING:
    from specserve.kv.offload.offloader import KVOffloader


class Request(Protocol):
    """What the manager reads of a request or a draft sequence (optional `num_pending_tokens`:
    placeholder tokens whose ids are not known yet)."""

    request_id: str
    block_hashes: list[BlockHash]
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, hash_extra: bytes = b""
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.hash_extra = hash_extra
        self.req_blocks: dict[str, list[int]] = defaultdict(list)
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found (in GPU blocks or loaded from an offload tier)
        self.offloader: KVOffloader | None = None  # when CPU/disk tiers are configured

    def attach_offloader(self, offloader: KVOffloader) -> None:
        self.offloader = offloader
        self.pool.on_evict = offloader.on_evict

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def _update_hashes(self, req: Request) -> list[BlockHash]:
        hashes = req.block_hashes
        tokens = req.all_token_ids
        bs = self.block_size
        first, last = len(hashes), _num_known(req) // bs  # placeholders have no hash yet
        if last > first:
            parent = hashes[-1] if hashes else None
            hashes.extend(hash_blocks(parent, tokens[first * bs : last * bs], bs, self.hash_extra))
        return hashes

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks. Leaves >= 1 token to compute (its logits are needed)."""
        if not self.enable_prefix_caching:
            return [], 0
        hashes = self._update_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in hashes[:max_blocks]:
            block_id = self.pool.lookup(h)
            if block_id is None:
                break
            hits.append(block_id)
        if self.offloader is not None and len(hits) < max_blocks:
            hits.extend(self._load_from_tiers(hashes[len(hits) : max_blocks], hits))
        self.prefix_queries += req.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def _load_from_tiers(self, hashes: list[BlockHash], gpu_hits: list[int]) -> list[int]:
        """Copy the tier-resident run of `hashes` into fresh blocks, cached and free like GPU hits."""
        assert self.offloader is not None
        payloads = self.offloader.lookup(hashes)
        # Pin the GPU hits so allocating room for the loads cannot evict them.
        self.pool.touch(gpu_hits)
        payloads = payloads[: self.pool.num_free_blocks]
        with self.offloader.batch_evictions():  # blocks evicted here are copied out in one go
            ids = self.pool.allocate(len(payloads)) if payloads else []
        if ids:
            self.offloader.load_into(ids, payloads)
            for block_id, h in zip(ids, hashes):
                self.pool.cache_block(block_id, h)
            self.pool.free(list(reversed(ids)))
        self.pool.free(list(reversed(gpu_hits)))
        return ids or []

    def prefetch(self, req: Request) -> None:
        """Read a new request's offloaded prefix blocks disk -> CPU in the background."""
        if self.offloader is None or not self.enable_prefix_caching:
            return
        hashes = self._update_hashes(req)
        missing = [h for h in hashes if self.pool.lookup(h) is None]
        self.offloader.prefetch(missing)

    def after_forward(self) -> None:
        if self.offloader is not None:
            self.offloader.after_forward()

    def allocate_slots(
        self, req: Request, num_new_tokens: int, new_computed: list[int] | None = None, num_lookahead_tokens: int = 0
    ) -> bool:
        """Reserve KV slots for num_new_tokens (+ lookahead for drafts). False: not enough blocks, nothing changed."""
        new_computed = new_computed or []
        blocks = self.req_blocks.get(req.request_id)
        end = req.num_computed_tokens + num_new_tokens
        if (
            not new_computed
            and blocks is not None
            and len(blocks) * self.block_size >= end + num_lookahead_tokens
            and (
                not self.enable_prefix_caching
                or min(end, _num_known(req)) // self.block_size <= self.num_cached_blocks.get(req.request_id, 0)
            )
        ):
            return True  # the common decode step: the slots exist and no block completes
        total = req.num_computed_tokens + len(new_computed) * self.block_size + num_new_tokens + num_lookahead_tokens
        need = max(0, -(-total // self.block_size) - len(blocks or ()) - len(new_computed))
        # Touching cached-but-free hits takes them out of the free queue too.
        revived = sum(1 for b in new_computed if self.pool.blocks[b].ref_cnt == 0)
        if need + revived > self.pool.num_free_blocks:
            return False
        blocks = self.req_blocks[req.request_id]
        if new_computed:
            self.pool.touch(new_computed)
            blocks.extend(new_computed)
            self.num_cached_blocks[req.request_id] = len(blocks)
        if need:
            with self.offloader.batch_evictions() if self.offloader is not None else contextlib.nullcontext():
                new_ids = self.pool.allocate(need)
            assert new_ids is not None
            blocks.extend(new_ids)
        self._cache_full_blocks(req, req.num_computed_tokens + len(new_computed) * self.block_size + num_new_tokens)
        return True

    def _cache_full_blocks(self, req: Request, num_tokens_after_step: int) -> None:
        if not self.enable_prefix_caching:
            return
        # Only real tokens (not drafts) computed by the end of the step.
        num_full = min(num_tokens_after_step, _num_known(req)) // self.block_size
        done = self.num_cached_blocks.get(req.request_id, 0)
        if num_full <= done:
            return
        hashes = self._update_hashes(req)
        blocks = self.req_blocks[req.request_id]
        for i in range(done, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
            if self.offloader is not None and self.pool.blocks[blocks[i]].block_hash == hashes[i]:
                # computed: the forward writing it is already launched (not so in the step being scheduled).
                computed = (i + 1) * self.block_size <= req.num_computed_tokens
                self.offloader.block_completed(hashes[i], blocks[i], computed)
        self.num_cached_blocks[req.request_id] = num_full

    def cache_computed_blocks(self, req: Request) -> None:
        """A resolved pending token: a computed block it completes enters the prefix cache now."""
        if req.request_id in self.req_blocks:
            self._cache_full_blocks(req, req.num_computed_tokens)

    def free(self, req: Request) -> None:
        blocks = self.req_blocks.pop(req.request_id, [])
        self.num_cached_blocks.pop(req.request_id, None)
        self.pool.free(list(reversed(blocks)))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        refs: dict[int, int] = defaultdict(int)
        for blocks in self.req_blocks.values():
            if len(set(blocks)) != len(blocks):
                raise AssertionError("a request holds the same block twice")
            for b in blocks:
                refs[b] += 1
        self.pool.check_integrity(refs)


def _num_known(req: Request) -> int:
    return req.num_tokens - getattr(req, "num_pending_tokens", 0)
