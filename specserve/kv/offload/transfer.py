"""Copies between the paged KV cache and packed host buffers, a few large copies per step.

Store (`gather_to_host`): one index_select per cache tensor gathers the blocks, all layers side
by side, into a device staging buffer [n, block_bytes] on the compute stream, right after the
forward that wrote them; every later write to those blocks (a reused block, the next forward)
is ordered after the gather on that stream, so the staging buffer is a snapshot. One
device->host copy of the staging buffer into pinned memory then runs on a side stream, and an
event says when the host rows are valid. The step never waits for it.

Load (`load_from_host`): the payloads' buffers (slots filled in order are adjacent, so usually
one copy per run of blocks) are copied into a device staging buffer on the compute stream and
scattered into the blocks with one index_copy_ per cache tensor. The forward that reads those
blocks runs later on the same stream, so no host synchronization is needed; the host buffers
must stay untouched until the returned event completes.

On the CPU both directions are plain synchronous copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.kv.offload.payload import BlockLayout, BlockPayload, PackedPayload, contiguous_runs, pack
from specserve.kv.spec import LayerKVCache

_FIELDS = ("key", "value", "key_scale", "value_scale")
# Device staging is allocated per group of blocks of at most this size: peak extra device
# memory stays bounded however many blocks a step completes or a prefix hit loads.
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


class HostRows:
    """Blocks copied out of the device: `rows` [n, block_bytes] uint8 on the host, valid once
    `ready` (a CUDA event, or None when the copy was synchronous) has completed."""

    def __init__(self, rows: torch.Tensor, layout: BlockLayout, ready: torch.cuda.Event | None) -> None:
        self.rows = rows
        self.layout = layout
        self.ready = ready

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()

    def is_ready(self) -> bool:
        return self.ready is None or self.ready.query()

    def payloads(self) -> list[PackedPayload]:
        return [PackedPayload(row, self.layout) for row in self.rows.unbind(0)]


class BlockMover:
    """Moves whole blocks (every layer) between `caches` and packed buffers of `layout`."""

    def __init__(self, caches: list[LayerKVCache]) -> None:
        self.layout = cache_layout(caches)
        tensors = [(name, t) for cache in caches for name, t in zip(_FIELDS, cache) if t is not None]
        # Each cache tensor as [num_blocks, bytes of one block]: copies move bytes, whatever the
        # dtype (index_copy_ has no float8 kernel on the CPU; bytes are the same thing).
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

    # -- store ----------------------------------------------------------------------------------
    def gather_to_host(self, block_ids: Sequence[int]) -> list[HostRows]:
        """Snapshot the blocks now (in stream order); one HostRows per group of blocks."""
        out = []
        for start in range(0, len(block_ids), self.group):
            ids = self._ids(block_ids[start : start + self.group])
            if not self.is_cuda:
                rows = torch.empty((len(ids), self.layout.nbytes), dtype=torch.uint8)
                self._gather_into(ids, rows)
                out.append(HostRows(rows, self.layout, None))
                continue
            staging = torch.empty((len(ids), self.layout.nbytes), dtype=torch.uint8, device=self.device)
            self._gather_into(ids, staging)
            out.append(self._to_host(staging))
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

    # -- load -----------------------------------------------------------------------------------
    def check(self, payloads: Sequence[BlockPayload]) -> list[PackedPayload]:
        """The payloads packed (dicts are copied), or ValueError if a layout differs from the
        caches' (another model, KV format or block size)."""
        packed = [pack(p) for p in payloads]
        for p in packed:
            if p.layout is not self.layout and p.layout != self.layout:
                raise ValueError(f"cannot insert KV block: {_mismatch(p.layout, self.layout)}")
        return packed

    def _scatter(self, block_ids: Sequence[int], ids: torch.Tensor, staging: torch.Tensor) -> None:
        """staging[i] -> block block_ids[i] of every cache tensor."""
        runs = _id_runs(block_ids)
        if self.is_cuda or len(runs) > 8:  # one kernel per tensor
            for part, e in zip(self.parts, self.layout.entries):
                part.index_copy_(0, ids, staging[:, e.offset : e.offset + e.nbytes])
            return
        # On the CPU index_copy_ is ~15x slower than a slice copy; fresh blocks are mostly
        # consecutive ids, so a few slice copies per tensor do it.
        for part, e in zip(self.parts, self.layout.entries):
            for i, j, first in runs:
                part[first : first + j - i].copy_(staging[i:j, e.offset : e.offset + e.nbytes])

    def load_from_host(self, block_ids: Sequence[int], payloads: Sequence[PackedPayload]) -> torch.cuda.Event | None:
        """Copy payloads[i] into block block_ids[i]. Returns the event after which the payload
        buffers may be reused (None: already copied). Layouts must match (see `check`)."""
        if len(block_ids) != len(payloads):
            raise ValueError(f"{len(block_ids)} block ids for {len(payloads)} payloads")
        for start in range(0, len(block_ids), self.group):
            group = payloads[start : start + self.group]
            ids = self._ids(block_ids[start : start + self.group])
            runs = contiguous_runs([p.buffer for p in group])
            if not self.is_cuda and len(runs) == 1:  # the host buffer itself is the staging
                staging = runs[0][2].view(len(group), -1)
            else:
                staging = torch.empty((len(group), self.layout.nbytes), dtype=torch.uint8, device=self.device)
                flat = staging.view(-1)
                nbytes = self.layout.nbytes
                for i, j, run in runs:
                    flat[i * nbytes : j * nbytes].copy_(run, non_blocking=self.is_cuda)
            self._scatter(block_ids[start : start + self.group], ids, staging)
        if not self.is_cuda or not block_ids:
            return None
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return done


def _id_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first row, end row, first block id) of each run of consecutive block ids."""
    runs, start = [], 0
    for i in range(1, len(block_ids) + 1):
        if i < len(block_ids) and block_ids[i] == block_ids[i - 1] + 1:
            continue
        runs.append((start, i, block_ids[start]))
        start = i
    return runs


def _mismatch(got: BlockLayout, want: BlockLayout) -> str:
    if got.names != want.names:
        return f"payload tensors {list(got.names)[:4]}... do not match the cache's {list(want.names)[:4]}..."
    for g, w in zip(got.entries, want.entries):
        if (g.dtype, g.shape) != (w.dtype, w.shape):
            return f"{g.name}: payload {g.dtype} {g.shape} vs cache block {w.dtype} {w.shape}"
    return "payload layout differs"
