"""Host -> device copies of the small per-step sampling tensors that never wait for the GPU."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def h2d(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on `device`; on CUDA pinned and non-blocking (a pageable copy would wait for all queued GPU work)."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def h2d_packed(arrays: Sequence[np.ndarray | Sequence[int]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Host integer arrays -> flat int64 tensors on `device`, sent packed in ONE copy (on the CPU: views, no copy)."""
    packed = torch.from_numpy(np.concatenate([np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays]))
    if torch.device(device).type != "cpu":
        packed = h2d(packed, device)
    return packed.split([int(np.size(a)) for a in arrays])


_cached: dict[tuple[str, object], torch.Tensor] = {}
_MAX_CACHED = 256


def cached_tensor(device: torch.device, key: object, make) -> torch.Tensor:
    """The device tensor for `key`, built by make() on the host and sent once; callers must never write to it."""
    k = (str(device), key)
    t = _cached.get(k)
    if t is None:
        if len(_cached) >= _MAX_CACHED:
            _cached.clear()
        t = _cached[k] = h2d(make(), device)
    return t
