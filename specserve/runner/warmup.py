"""Compile, at start-up, the kernels an eager forward of a few rows uses.

The GEMV (model/layers/triton_gemv.py) serves every linear of up to `gemv_max_m()` rows, with a
BLOCK_M, tiles and prefetch choice per row count: a row count no forward has used yet compiles new
Triton variants, one per linear. CUDA graphs cover the decode and verify shapes, but other small
forwards run eagerly mid-serving: a draft model catching up on 3-8 tokens, a prompt remainder of a
few tokens, a verify batch between the captured lengths. In the H200 controller sweep one request of
eight at concurrency 1 took 846 ms against 290-341 ms for the others, a one-off stall of the size such
compiles take. Running one forward of each small row count here, together with the LM head at that
many rows, moves those compiles to start-up (Triton's disk cache makes later start-ups cheap).
"""
from __future__ import annotations

import torch

from specserve.kv.manager import KVCacheManager
from specserve.runner.model_runner import ModelRunner
from specserve.sampling_params import SamplingParams
from specserve.scheduler.request import Request
from specserve.scheduler.scheduler import ScheduledRequest, SchedulerOutput


@torch.inference_mode()
def warm_small_forwards(runner: ModelRunner, max_rows: int) -> list[int]:
    """One forward of a single sequence of t tokens for t = 1..max_rows (through the runner's
    dispatch: a captured graph where one fits, eagerly otherwise) and the LM head over t rows.
    Writes only KV slots of a throwaway block table over the runner's pool (called before any
    request exists, so nothing is overwritten that matters). Returns the row counts run."""
    block_size = runner.block_size
    max_rows = min(max_rows, runner.loaded.max_model_len - 1, (runner.num_blocks - 1) * block_size)
    model = runner.model
    hidden_size, dtype = runner.loaded.arch.hidden_size, model.embed_tokens.weight.dtype
    done = []
    # A few blocks are enough (ids 0.. of the runner's pool); a manager over the whole pool would
    # build its free list of every block (0.2 s for 266k blocks) for each row count.
    num_blocks = min(runner.num_blocks, -(-max_rows // block_size) + 1)
    for t in range(1, max_rows + 1):
        kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        req = Request(f"warm-{t}", [0] * t, SamplingParams(max_tokens=1), 1)
        kv.allocate_slots(req, t)
        # The base class's execute, not an override: under tensor parallelism rank 0's runner
        # (distributed/executor.py TPExecutor) would broadcast the step to workers that are running
        # this same warm-up themselves; here every rank runs the same forwards in the same order.
        ModelRunner.execute(runner, SchedulerOutput([ScheduledRequest(req, t, 0)], t), kv.block_ids)
        model.compute_logits(torch.zeros(t, hidden_size, device=runner.device, dtype=dtype))
        done.append(t)
    return done
