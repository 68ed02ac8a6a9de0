"""Programmatic dependent launch (sm_90+; `SPECSERVE_PDL=0` turns it off). Contract of a kernel
launched with `launch_pdl=True`: every program calls `pdl_prologue(True)` once, before any store, early
return, or load of data a kernel of the forward writes; before it, only weights, constant tables and
batch metadata may be loaded (so no kernel of a forward writes those)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from specserve import envs

try:  # triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAVE_GDC = True
except ImportError:  # pragma: no cover - older triton: PDL stays off
    gdc_launch_dependents = gdc_wait = None
    _HAVE_GDC = False


@triton.jit
def pdl_prologue(USE_PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the previous one's writes (contract: module docstring)."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()


@functools.lru_cache(maxsize=8)
def _capable(device: torch.device) -> bool:
    return _HAVE_GDC and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def use_pdl(t: torch.Tensor) -> bool:
    """Whether a kernel over `t` launches with PDL (sm_90+, not interpreted, SPECSERVE_PDL not 0; read per launch)."""
    return t.is_cuda and not envs.triton_interpret() and _capable(t.device) and envs.pdl()
