"""Record CUDA events on the current stream without `torch.cuda.current_stream()` per call (tens of
microseconds on the host's critical path): its Stream object is rebuilt only when the raw handle changes."""

from __future__ import annotations

import torch

_cache: dict[int, tuple[int, torch.cuda.Stream]] = {}  # device index -> (raw handle, its Stream)


def record(event: torch.cuda.Event, device: torch.device) -> None:
    """event.record() on the device's current stream."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    raw = torch._C._cuda_getCurrentRawStream(index)
    hit = _cache.get(index)
    if hit is None or hit[0] != raw:
        hit = _cache[index] = (raw, torch.cuda.current_stream(index))
    event.record(hit[1])
