"""Compile at start-up the Triton variants that small eager forwards use (the GEMV picks a variant per
row count), so a draft catch-up or a short prompt remainder never stalls on a first compile mid-serving."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from specserve.attention.launch_sizes import MIN_KEYS_PER_SPLIT, SMALL_QUERY_MAX
from specserve.kv.manager import KVCacheManager
from specserve.runner.model_runner import ModelRunner
from specserve.sampling_params import SamplingParams
from specserve.scheduler.request import Request
from specserve.scheduler.scheduler import ScheduledRequest, SchedulerOutput


def dummy_forward(runner: ModelRunner, num_tokens: int, context: int = 0) -> None:
    """One forward of num_tokens placeholder tokens after `context`, through ModelRunner.execute (TP: every rank)."""
    # A few blocks are enough: a manager over the whole pool would build a free list of every block.
    num_blocks = min(runner.num_blocks, -(-(context + num_tokens) // runner.block_size) + 1)
    kv = KVCacheManager(num_blocks, runner.block_size, enable_prefix_caching=False)
    req = Request(f"dummy-{context}-{num_tokens}", [0] * (context + num_tokens), SamplingParams(max_tokens=1), 1)
    kv.allocate_slots(req, context + num_tokens)
    req.num_computed_tokens = context
    ModelRunner.execute(runner, SchedulerOutput([ScheduledRequest(req, num_tokens, 0)], num_tokens), kv.block_ids)


def dummy_logits(runner: ModelRunner, rows: int) -> torch.Tensor:
    """The LM head over `rows` zero hidden states: [rows, vocab]."""
    model = runner.model
    return model.compute_logits(
        torch.zeros(rows, runner.loaded.arch.hidden_size, device=runner.device, dtype=model.embed_tokens.weight.dtype)
    )


@torch.inference_mode()
def warm_small_forwards(runner: ModelRunner, max_rows: int, context: int = 0) -> list[int]:
    """dummy_forward of t tokens after `context` for t = 1..max_rows, eagerly, and the LM head over t rows."""
    room = min(runner.loaded.max_model_len - 1, (runner.num_blocks - 1) * runner.block_size) - context
    max_rows = min(max_rows, room)
    with _eager(runner):
        for t in range(1, max_rows + 1):
            dummy_forward(runner, t, context)
            dummy_logits(runner, t)
    return list(range(1, max_rows + 1))


@contextlib.contextmanager
def _eager(runner: ModelRunner) -> Iterator[None]:
    graphs, runner.graphs = runner.graphs, None
    try:
        yield
    finally:
        runner.graphs = graphs


SPLIT_CONTEXT = 2 * MIN_KEYS_PER_SPLIT  # a context long enough for split-KV attention launches
# Prompt-sized row counts (attention's 64-row query blocks past SMALL_QUERY_MAX; Triton specializes integer
# arguments that are 1 or divisible by 16, so 64 and a length of neither kind cover the classes).
PROMPT_ROWS = (64, 200)


@torch.inference_mode()
def warm_prompt_forwards(runner: ModelRunner, rows: tuple[int, ...] = PROMPT_ROWS) -> list[tuple[int, int]]:
    """dummy_forward of each prompt-sized row count, fresh and after SPLIT_CONTEXT (split-KV), eagerly."""
    room = min(runner.loaded.max_model_len - 1, (runner.num_blocks - 1) * runner.block_size)
    done = [(context, t) for context in (0, SPLIT_CONTEXT) for t in rows if context + t <= room]
    with _eager(runner):
        for context, t in done:
            dummy_forward(runner, t, context)
    return done


def start_up_rows() -> tuple[list[int], list[int]]:
    """(fresh, after-SPLIT_CONTEXT) row counts: every GEMV row count and decode-sized attention query length."""
    from specserve.model.layers.triton_gemv import gemv_max_m  # imports triton: GPU start-up only

    return list(range(1, max(gemv_max_m(), SMALL_QUERY_MAX) + 1)), list(range(1, SMALL_QUERY_MAX + 1))


def warm_start_up(runner: ModelRunner) -> None:
    """Warm every start_up_rows() count, fresh and after SPLIT_CONTEXT, and the prompt-sized row counts."""
    fresh, after = start_up_rows()
    warm_small_forwards(runner, len(fresh))
    warm_small_forwards(runner, len(after), context=SPLIT_CONTEXT)
    warm_prompt_forwards(runner)
