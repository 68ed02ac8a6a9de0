"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step (Hopper and later).

Why: at batch 1 a decode step of a 1.5B model is ~250 small kernels back to back inside a CUDA
graph, and between two of them the GPU drains the first grid, then launches and ramps up the next:
about a microsecond per boundary with nothing running. With PDL the next kernel is launched while
the previous one still runs; its programs start, then wait (`griddepcontrol.wait`) until the
previous grid has finished and its writes are visible, so only the launch, not the data, moves.

The contract every kernel launched with `launch_pdl=True` keeps: every program calls
`pdl_prologue(True)` before any load of something an earlier kernel of the forward wrote (or may
write), before any store, and before any early return. (A program that returned without waiting
could let its grid complete before its predecessor did, and the kernel after it would then read
unfinished data.) Kernels launched without the flag are ordered as usual, so mixing them with
cuBLAS or torch kernels is safe.

What may come before the wait: loads of data that no kernel of the forward writes, whose latency
then overlaps the previous kernel's tail. Those are
  * weights and constant tables (the RoPE cos/sin cache): written once at load time;
  * the batch metadata: positions, slot_mapping, seq_lens, cu_query_lens, block_tables. The
    runner writes them (host-to-device copies, torch ops) before the forward's first kernel, the
    embedding lookup, which is a torch kernel launched without PDL and so starts only once all
    earlier stream work (those copies included) has completed.
Never before the wait: activations (q, k, v, hidden states), the KV cache (the kernel before
attention writes the new token's K/V), split-KV partials, counters; anything an earlier kernel of
the forward produced. Why a writer anywhere inside the forward is unsafe, not just in the kernel
right before: a PDL kernel may start once every program of the kernel before it has called
`pdl_prologue` (which lets dependents launch before it waits), so several PDL kernels in a row can
be resident and past their pre-wait loads while the first of them, or the non-PDL kernel before
it, is still running.

Hence the rule for every kernel, present and future: NO kernel of a forward (PDL or not) ever
writes batch metadata or the constant tables; the metadata is written only before the forward
starts. Kernels may then read it before their wait. Tests in tests/unit/test_pdl.py check the
order of the decode-path attention kernels' loads against this.

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
    are visible. Each program must execute it exactly once, before any store, any early return and
    any load of data an earlier kernel of the forward writes (activations, KV cache, partials).
    Only loads of weights, constant tables and batch metadata (positions, slot_mapping, seq_lens,
    cu_query_lens, block_tables; see the module docstring) may come before it."""
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
