"""Device facts the kernels' launch choices read."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 132 (an H100 / H200) for interpreter runs."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count
