"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step (Hopper and later).

A decode step is hundreds of small kernels back to back; between two of them the GPU drains one
grid, then launches and ramps up the next. With PDL the next kernel launches while the previous one
still runs; its programs start, then wait (`griddepcontrol.wait`) until the previous grid has
finished and its writes are visible.

The contract of every kernel launched with `launch_pdl=True`: every program calls
`pdl_prologue(True)` exactly once, before any load of something an earlier kernel of the forward
wrote (or may write), before any store, and before any early return (a program that returned
without waiting could let its grid complete before its predecessor did).

Before the wait, only loads of data no kernel of the forward writes: weights, constant tables (the
RoPE cos/sin cache) and the batch metadata (positions, slot_mapping, seq_lens, cu_query_lens,
block_tables), which the runner writes before the forward's first kernel, the embedding lookup,
a torch kernel launched without PDL. Never activations, the KV cache, split-KV partials or
counters. Since several PDL kernels in a row can be resident and past their pre-wait loads while an
earlier kernel still runs, the rule holds for the whole forward: NO kernel of a forward ever writes
batch metadata or constant tables. tests/unit/test_pdl.py checks the attention kernels' load order.

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
    """Let the next kernel launch now, then wait until the previous one has finished and its writes
    are visible (the contract: the module docstring)."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()


@functools.lru_cache(maxsize=8)
def _capable(device: torch.device) -> bool:
    return _HAVE_GDC and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def use_pdl(t: torch.Tensor) -> bool:
    """Whether a kernel over `t` (its device) launches with PDL: a CUDA device of sm_90 or later,
    not the interpreter, SPECSERVE_PDL not 0. Read per launch, so a test can flip the variable."""
    return t.is_cuda and not envs.triton_interpret() and _capable(t.device) and envs.pdl()
