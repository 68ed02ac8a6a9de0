"""The current CUDA stream as a torch Stream object, rebuilt only when the raw handle changes
(`torch.cuda.current_stream()` costs tens of microseconds per call on the host's critical path)."""

from __future__ import annotations

import torch

_cache: dict[int, tuple[int, torch.cuda.Stream]] = {}  # device index -> (raw handle, its Stream)


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """torch.cuda.current_stream(device), reused while the current raw stream stays the same."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    raw = torch._C._cuda_getCurrentRawStream(index)
    hit = _cache.get(index)
    if hit is None or hit[0] != raw:
        hit = _cache[index] = (raw, torch.cuda.current_stream(index))
    return hit[1]


def record(event: torch.cuda.Event, device: torch.device) -> None:
    """event.record() on the device's current stream, without building a Stream object per call."""
    event.record(current_stream(device))
