"""Copies between the paged KV cache and packed host buffers, a few large copies per step. Store:
one index_select per cache tensor into device staging [n, block_bytes] (a snapshot, compute
stream), then one copy to pinned host rows on a side stream (an event says when they are valid).
Load: host buffers -> device staging -> one index_copy_ per cache tensor before the forward; the
host buffers stay untouched until the returned event completes. On the CPU both are synchronous."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.kv.offload.payload import BlockLayout, BlockPayload, PackedPayload, contiguous_runs, pack, runs
from specserve.kv.spec import LayerKVCache

_FIELDS = ("key", "value", "key_scale", "value_scale")
# Device staging per group of blocks: bounds the extra device memory.
MAX_STAGING_BYTES = 64 << 20


def cache_layout(caches: list[LayerKVCache]) -> BlockLayout:
    """Packed layout of one block of these caches: "{layer}.key" [block_size, H, packed_dim], ..."""
    return BlockLayout.of(
        [
            (f"{layer}.{name}", t.dtype, tuple(t.shape[1:]))
            for layer, cache in enumerate(caches)
            for name, t in zip(_FIELDS, cache)
            if t is not None
        ]
    )


@dataclass
class HostRows:
    """`rows` [n, block_bytes] uint8 on the host, valid once `ready` (None: synchronous) completes."""

    rows: torch.Tensor
    layout: BlockLayout
    ready: torch.cuda.Event | None

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()

    def payloads(self) -> list[PackedPayload]:
        """The rows as payloads, once the copy has completed."""
        self.wait()
        return [PackedPayload(row, self.layout) for row in self.rows.unbind(0)]


class BlockMover:
    """Moves whole blocks (every layer) between `caches` and packed buffers of `layout`."""

    def __init__(self, caches: list[LayerKVCache]) -> None:
        self.layout = cache_layout(caches)
        tensors = [(name, t) for cache in caches for name, t in zip(_FIELDS, cache) if t is not None]
        # Each cache tensor as [num_blocks, bytes of one block]: index_copy_ has no CPU float8 kernel.
        self.parts = [t.view(torch.uint8).view(t.shape[0], -1) for _, t in tensors]
        self.device = tensors[0][1].device if tensors else torch.device("cpu")
        self.is_cuda = self.device.type == "cuda"
        self.group = max(1, MAX_STAGING_BYTES // max(1, self.layout.nbytes))
        self._side: torch.cuda.Stream | None = None

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(block_ids), dtype=torch.long).to(self.device, non_blocking=True)

    def _gather_into(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        for part, e in zip(self.parts, self.layout.entries):
            torch.index_select(part, 0, ids, out=out[:, e.offset : e.offset + e.nbytes])

    def gather_to_host(self, block_ids: Sequence[int]) -> list[HostRows]:
        """Snapshot the blocks now (stream order); one HostRows per group."""
        out = []
        for start in range(0, len(block_ids), self.group):
            ids = self._ids(block_ids[start : start + self.group])
            rows = torch.empty((len(ids), self.layout.nbytes), dtype=torch.uint8, device=self.device)
            self._gather_into(ids, rows)
            out.append(self._to_host(rows) if self.is_cuda else HostRows(rows, self.layout, None))
        return out

    def _to_host(self, staging: torch.Tensor) -> HostRows:
        compute = torch.cuda.current_stream(self.device)
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        side = self._side
        side.wait_stream(compute)  # the copy reads what the gather wrote
        # Pinned, from torch's caching host allocator: reused across steps, no cudaHostAlloc.
        rows = torch.empty(staging.shape, dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(side):
            rows.copy_(staging, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(side)
        staging.record_stream(side)  # its memory is not reused before the copy has read it
        return HostRows(rows, self.layout, ready)

    def check(self, payloads: Sequence[BlockPayload]) -> list[PackedPayload]:
        """The payloads packed, or ValueError if a layout differs from the caches'."""
        packed = [pack(p) for p in payloads]
        for p in packed:
            if p.layout is not self.layout and p.layout != self.layout:
                raise ValueError(f"cannot insert KV block: {_mismatch(p.layout, self.layout)}")
        return packed

    def _scatter(self, block_ids: Sequence[int], ids: torch.Tensor, staging: torch.Tensor) -> None:
        id_runs = runs(len(block_ids), lambda i: block_ids[i] == block_ids[i - 1] + 1)
        if self.is_cuda or len(id_runs) > 8:  # one kernel per tensor
            for part, e in zip(self.parts, self.layout.entries):
                part.index_copy_(0, ids, staging[:, e.offset : e.offset + e.nbytes])
            return
        # On the CPU index_copy_ is much slower than slice copies of runs of consecutive ids.
        for part, e in zip(self.parts, self.layout.entries):
            for i, j in id_runs:
                part[block_ids[i] : block_ids[i] + j - i].copy_(staging[i:j, e.offset : e.offset + e.nbytes])

    def load_from_host(self, block_ids: Sequence[int], payloads: Sequence[PackedPayload]) -> torch.cuda.Event | None:
        """payloads[i] -> block block_ids[i] (layouts checked); the event after which the buffers may
        be reused (None: already copied)."""
        if len(block_ids) != len(payloads):
            raise ValueError(f"{len(block_ids)} block ids for {len(payloads)} payloads")
        for start in range(0, len(block_ids), self.group):
            group = payloads[start : start + self.group]
            ids = self._ids(block_ids[start : start + self.group])
            buf_runs = contiguous_runs([p.buffer for p in group])
            if not self.is_cuda and len(buf_runs) == 1:  # the host buffer itself is the staging
                staging = buf_runs[0][2].view(len(group), -1)
            else:
                staging = torch.empty((len(group), self.layout.nbytes), dtype=torch.uint8, device=self.device)
                for i, j, run in buf_runs:
                    staging[i:j].view(-1).copy_(run, non_blocking=self.is_cuda)
            self._scatter(block_ids[start : start + self.group], ids, staging)
        if not self.is_cuda or not block_ids:
            return None
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return done


def _mismatch(got: BlockLayout, want: BlockLayout) -> str:
    if got.names != want.names:
        return f"payload tensors {list(got.names)[:4]}... do not match the cache's {list(want.names)[:4]}..."
    for g, w in zip(got.entries, want.entries):
        if (g.dtype, g.shape) != (w.dtype, w.shape):
            return f"{g.name}: payload {g.dtype} {g.shape} vs cache block {w.dtype} {w.shape}"
    return "payload layout differs"
