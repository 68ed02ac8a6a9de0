"""Packed block payloads: every tensor of one KV block (all layers) in one contiguous byte buffer.

One buffer per block is what makes offloading cheap: a tier slot, a disk file body and a
host<->device copy are each one contiguous range instead of one small tensor per layer. The
named tensors ("{layer}.key", ...) stay available as views into the buffer, so a payload reads
like a dict (`payload["0.key"]`, `set(payload)`, `payload.items()`).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

# Every tensor starts at a multiple of this many bytes, so a uint8 buffer can be viewed as any
# dtype (torch needs the byte offset to be a multiple of the element size) and copies stay aligned.
ALIGN = 16


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


_DTYPES: dict[str, torch.dtype] = {
    name: dt for name in dir(torch) if isinstance(dt := getattr(torch, name), torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class LayoutEntry(NamedTuple):
    """One tensor of a packed block."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the buffer, a multiple of ALIGN
    nbytes: int


@dataclass(frozen=True)
class BlockLayout:
    """Where each named tensor lives in a packed block buffer of `nbytes` bytes."""

    entries: tuple[LayoutEntry, ...]
    nbytes: int

    @staticmethod
    def of(specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> BlockLayout:
        """Tensors packed in the given order, each aligned to ALIGN bytes."""
        entries, offset = [], 0
        for name, dtype, shape in specs:
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            entry = LayoutEntry(name, dtype, tuple(shape), offset, size)
            entries.append(entry)
            offset += _align(entry.nbytes)
        return BlockLayout(tuple(entries), offset)

    @staticmethod
    def of_tensors(tensors: Mapping[str, torch.Tensor]) -> BlockLayout:
        return BlockLayout.of([(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)

    @functools.cached_property
    def index(self) -> dict[str, LayoutEntry]:
        return {e.name: e for e in self.entries}

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named tensors viewing `buffer` ([nbytes] uint8): no copy."""
        return {e.name: buffer[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in self.entries}

    def to_json(self) -> bytes:
        return self.json

    @functools.cached_property
    def json(self) -> bytes:
        """The stored form (disk_format.py); computed once per layout, not once per block."""
        return json.dumps(
            [[e.name, dtype_name(e.dtype), list(e.shape), e.offset] for e in self.entries], separators=(",", ":")
        ).encode()

    @staticmethod
    def from_json(raw: bytes) -> BlockLayout:
        """Parse (and validate) a stored layout; ValueError if it is not one this code writes."""
        return _parse_layout(bytes(raw))


@functools.lru_cache(maxsize=64)  # every file of one model has the same layout: parse it once
def _parse_layout(raw: bytes) -> BlockLayout:
    try:
        items = json.loads(raw)
        specs = [(str(name), _DTYPES[dtype], tuple(int(d) for d in shape)) for name, dtype, shape, _ in items]
        offsets = [int(item[3]) for item in items]
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise ValueError(f"unreadable block layout: {exc}") from exc
    layout = BlockLayout.of(specs)
    if [e.offset for e in layout.entries] != offsets or any(d < 0 for _, _, s in specs for d in s):
        raise ValueError("block layout offsets differ from the packing rule")
    return layout


class PackedPayload(Mapping):
    """One block: `buffer` ([layout.nbytes] uint8, CPU, contiguous) seen as named tensors.

    `lease`, when set, is an object whose lifetime keeps the buffer's memory from being reused
    (a CPU tier slot): it is referenced by the payload, its buffer and every view handed out, so
    the memory stays valid while any of them is alive.
    """

    __slots__ = ("_views", "buffer", "layout", "lease")

    def __init__(self, buffer: torch.Tensor, layout: BlockLayout, lease: object | None = None) -> None:
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != layout.nbytes:
            raise ValueError(
                f"payload buffer must be [{layout.nbytes}] uint8, got {buffer.dtype} {tuple(buffer.shape)}"
            )
        self.buffer = buffer
        self.layout = layout
        self.lease = lease
        self._views: dict[str, torch.Tensor] | None = None
        if lease is not None:
            setattr(buffer, "_specserve_lease", lease)  # noqa: B010  (torch.Tensor has no such field)

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def _tensors(self) -> dict[str, torch.Tensor]:
        if self._views is None:
            self._views = self.layout.views(self.buffer)
            if self.lease is not None:
                for t in self._views.values():
                    setattr(t, "_specserve_lease", self.lease)  # noqa: B010
        return self._views

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.layout.names)

    def __len__(self) -> int:
        return len(self.layout.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.layout.index

    def __repr__(self) -> str:
        return f"PackedPayload({self.nbytes} bytes, {len(self)} tensors)"


# The public name: a payload is any mapping of tensor names to tensors; tiers return PackedPayloads.
BlockPayload = Mapping[str, torch.Tensor] | PackedPayload


def pack(payload: BlockPayload, out: torch.Tensor | None = None) -> PackedPayload:
    """The payload as one packed buffer: itself if already packed (and no `out`), else a copy
    into `out` (or a fresh buffer)."""
    if isinstance(payload, PackedPayload) and out is None:
        return payload
    layout = payload.layout if isinstance(payload, PackedPayload) else BlockLayout.of_tensors(payload)
    if out is None:
        out = torch.empty(layout.nbytes, dtype=torch.uint8)
    if isinstance(payload, PackedPayload):
        copy_bytes(out, payload.buffer)
        return PackedPayload(out, layout)
    if layout.nbytes != out.numel():
        raise ValueError(f"payload of {layout.nbytes} bytes does not fit a buffer of {out.numel()}")
    for e in layout.entries:
        src = payload[e.name].detach()
        if src.device.type != "cpu":
            src = src.cpu()
        out[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape).copy_(src)
    return PackedPayload(out, layout)


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src for 1-D uint8 CPU tensors, on this thread alone. torch's CPU copy fans a
    large copy out to every intra-op thread; the store worker copying a step's blocks into the
    CPU tier must not take the cores the engine thread needs to launch the next forward (the
    GIL is released during the copy either way)."""
    np.copyto(dst.numpy(), src.numpy())


def payload_nbytes(payload: BlockPayload) -> int:
    """Bytes one payload takes packed (what tier budgets count)."""
    if isinstance(payload, PackedPayload):
        return payload.nbytes
    return BlockLayout.of_tensors(payload).nbytes


def paired_runs(srcs: list[torch.Tensor], dsts: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(source run, destination run) views such that copying each pair copies srcs[i] into
    dsts[i] for every i: neighbours adjacent on both sides share one copy."""
    out = []
    start = 0
    for i in range(1, len(srcs) + 1):
        if i < len(srcs) and _follows(srcs[i - 1], srcs[i]) and _follows(dsts[i - 1], dsts[i]):
            continue
        out.append((_span(srcs[start:i]), _span(dsts[start:i])))
        start = i
    return out


def _follows(prev: torch.Tensor, cur: torch.Tensor) -> bool:
    return (
        cur.data_ptr() == prev.data_ptr() + prev.numel()
        and cur.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
    )


def _span(buffers: list[torch.Tensor]) -> torch.Tensor:
    first = buffers[0]
    if len(buffers) == 1:
        return first
    return first.as_strided((sum(b.numel() for b in buffers),), (1,), first.storage_offset())


def contiguous_runs(buffers: list[torch.Tensor]) -> list[tuple[int, int, torch.Tensor]]:
    """Group buffers that follow each other in memory: (first index, end index, one view over the
    run). A run is one copy instead of many (slots filled in order are adjacent)."""
    runs: list[tuple[int, int, torch.Tensor]] = []
    start = 0
    for i in range(1, len(buffers) + 1):
        if i < len(buffers) and _follows(buffers[i - 1], buffers[i]):
            continue
        runs.append((start, i, _span(buffers[start:i])))
        start = i
    return runs
