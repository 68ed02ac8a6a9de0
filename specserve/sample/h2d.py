"""Host -> device copies of the small per-step sampling tensors that never wait for the GPU."""
from __future__ import annotations

import torch


def h2d(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on `device`. On CUDA through pinned memory and a non-blocking copy: a copy from pageable
    memory would block the host until the GPU finished all queued work, which with asynchronous
    scheduling is the next step's forward (torch's host allocator keeps the pinned buffer alive
    until the copy has run)."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
