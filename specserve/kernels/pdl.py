"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step (Hopper and later):
the next kernel launches while the previous one still runs, and waits (`griddepcontrol.wait`) before
touching its outputs.

Contract of every kernel launched with `launch_pdl=True`: every program calls `pdl_prologue(True)`
exactly once, before any store, any early return, and any load of data a kernel of the forward writes.
Before the wait it may load only weights, constant tables (RoPE cos/sin) and batch metadata, so NO
kernel of a forward ever writes those. tests/unit/test_pdl.py checks the attention kernels' load order.
`SPECSERVE_PDL=0` turns it off; the CPU interpreter and GPUs before sm_90 never use it.
"""

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
