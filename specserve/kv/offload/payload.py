"""Packed block payloads: every tensor of one KV block (all layers) in one contiguous byte buffer,
read like a dict of named views (`payload["0.key"]`)."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

# Every tensor starts at a multiple of ALIGN bytes, so the uint8 buffer can be viewed as any dtype.
ALIGN = 16
_DTYPES: dict[str, torch.dtype] = {
    name: dt for name in dir(torch) if isinstance(dt := getattr(torch, name), torch.dtype)
}


class LayoutEntry(NamedTuple):
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
            entries.append(LayoutEntry(name, dtype, tuple(shape), offset, size))
            offset += -(-size // ALIGN) * ALIGN
        return BlockLayout(tuple(entries), offset)

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named tensors viewing `buffer` ([nbytes] uint8): no copy."""
        return {e.name: buffer[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in self.entries}

    @functools.cached_property
    def json(self) -> bytes:
        """The stored form (disk_io.py)."""
        items = [[e.name, str(e.dtype).removeprefix("torch."), list(e.shape), e.offset] for e in self.entries]
        return json.dumps(items, separators=(",", ":")).encode()

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def from_json(raw: bytes) -> BlockLayout:
        """Parse a stored layout; ValueError if it is not one this code writes."""
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
    """One block: `buffer` ([layout.nbytes] uint8, CPU, contiguous) seen as named tensors. `lease`
    (a CPU tier slot's) is held by the payload, its buffer and every view, keeping the memory valid."""

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


BlockPayload = Mapping[str, torch.Tensor] | PackedPayload


def pack(payload: BlockPayload, out: torch.Tensor | None = None) -> PackedPayload:
    """The payload packed: itself if packed and no `out`, else a copy into `out` (or a new buffer)."""
    if isinstance(payload, PackedPayload):
        if out is not None:
            copy_bytes(out, payload.buffer)
        return payload if out is None else PackedPayload(out, payload.layout)
    layout = BlockLayout.of([(n, t.dtype, tuple(t.shape)) for n, t in payload.items()])
    out = torch.empty(layout.nbytes, dtype=torch.uint8) if out is None else out
    if layout.nbytes != out.numel():
        raise ValueError(f"payload of {layout.nbytes} bytes does not fit a buffer of {out.numel()}")
    for e in layout.entries:
        out[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape).copy_(payload[e.name].detach())
    return PackedPayload(out, layout)


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src (1-D uint8 CPU) on this thread alone: torch's copy takes every intra-op thread."""
    np.copyto(dst.numpy(), src.numpy())


def runs(n: int, follows: Callable[[int], bool]) -> list[tuple[int, int]]:
    """[start, end) ranges of range(n) where each item i inside a range has follows(i)."""
    out, start = [], 0
    for i in range(1, n + 1):
        if i == n or not follows(i):
            out.append((start, i))
            start = i
    return out


def copy_runs(srcs: list[torch.Tensor], dsts: list[torch.Tensor]) -> None:
    """dsts[i][:] = srcs[i]; neighbours adjacent on both sides share one copy."""
    for i, j in runs(len(srcs), lambda i: _follows(srcs[i - 1], srcs[i]) and _follows(dsts[i - 1], dsts[i])):
        copy_bytes(_span(dsts[i:j]), _span(srcs[i:j]))


def _follows(prev: torch.Tensor, cur: torch.Tensor) -> bool:
    return (
        cur.data_ptr() == prev.data_ptr() + prev.numel()
        and cur.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
    )


def _span(buffers: list[torch.Tensor]) -> torch.Tensor:
    first = buffers[0]
    return first.as_strided((sum(b.numel() for b in buffers),), (1,), first.storage_offset())


def contiguous_runs(buffers: list[torch.Tensor]) -> list[tuple[int, int, torch.Tensor]]:
    """(first index, end index, one view) of each run of buffers adjacent in memory."""
    return [(i, j, _span(buffers[i:j])) for i, j in runs(len(buffers), lambda i: _follows(buffers[i - 1], buffers[i]))]
