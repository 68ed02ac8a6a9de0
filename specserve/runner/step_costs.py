"""The target's step cost by (batch size, query length), measured once at start-up through the runner's
own `execute` (CUDA graphs and padding included): the adaptive speculation controller's prices."""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from specserve.kv.manager import KVCacheManager
from specserve.runner.cuda_graph import graph_batch_sizes
from specserve.runner.model_runner import ModelRunner
from specserve.sampling_params import SamplingParams
from specserve.scheduler.request import Request
from specserve.scheduler.scheduler import ScheduledRequest, SchedulerOutput

CPU_BATCH_SIZES = (1, 4, 16)  # few: CPU tests build engines often; the table extrapolates beyond
REPEATS = 3
CONTEXT_TOKENS = 256  # tokens each measured request has in the KV before its step (attention reads them)


class CostTable:
    """Seconds of a step of `batch_size` requests of `query_len` tokens, from a grid {(bs, q): seconds}."""

    def __init__(self, grid: Mapping[tuple[int, int], float]) -> None:
        if not grid:
            raise ValueError("grid must hold at least one (batch_size, query_len) measurement")
        rows: dict[int, list[tuple[int, float]]] = {}
        for (b, q), seconds in grid.items():
            if b < 1 or q < 1 or not seconds > 0.0:
                raise ValueError(
                    f"grid entry ({b}, {q}): {seconds!r} needs batch_size >= 1, query_len >= 1 and seconds > 0"
                )
            rows.setdefault(b, []).append((q, float(seconds)))
        self._rows: dict[int, tuple[list[int], list[float]]] = {}
        for b, points in rows.items():  # each length's cost raised to the lengths' below it
            points.sort()
            self._rows[b] = ([q for q, _ in points], list(itertools.accumulate((c for _, c in points), max)))
        self.batch_sizes: tuple[int, ...] = tuple(sorted(self._rows))

    @property
    def grid(self) -> dict[tuple[int, int], float]:
        """The measured grid as the table uses it (each length raised to the lengths below it)."""
        return {(b, q): s for b, (qs, costs) in self._rows.items() for q, s in zip(qs, costs)}

    def seconds(self, batch_size: int, query_len: int) -> float:
        return _interpolate(self.batch_sizes, lambda b: self._at(b, query_len), batch_size)

    def _at(self, batch_size: int, query_len: int) -> float:
        """The measured batch size's cost at query_len."""
        qs, costs = self._rows[batch_size]
        return _interpolate(qs, lambda q: costs[qs.index(q)], query_len)


def _interpolate(xs: Sequence[int], y: Callable[[int], float], x: int) -> float:
    """y at x from the measured points xs (sorted): the first point's below them, in proportion to x with one
    point, else on the line through the neighbouring points (past the last, never decreasing)."""
    if x <= xs[0]:
        return y(xs[0])
    if len(xs) == 1:
        return y(xs[0]) * x / xs[0]
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return y(x)
    lo, hi = xs[min(i, len(xs) - 1) - 1], xs[min(i, len(xs) - 1)]
    slope = (y(hi) - y(lo)) / (hi - lo)
    return y(lo) + slope * (x - lo) if x <= hi else y(hi) + max(slope, 0.0) * (x - hi)


def step_cost_batch_sizes(runner: ModelRunner, max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes to measure: the graph sizes on CUDA, CPU_BATCH_SIZES on the CPU; up to max_num_seqs."""
    if runner.graphs is not None:
        sizes: tuple[int, ...] = tuple(runner.graphs.batch_sizes)
    elif runner.device.type == "cuda":
        sizes = graph_batch_sizes(max_num_seqs)
    else:
        sizes = CPU_BATCH_SIZES
    return tuple(b for b in sizes if b <= max_num_seqs) or (1,)


@torch.inference_mode()
def measure_step_costs(
    runner: ModelRunner, batch_sizes: tuple[int, ...] | list[int], max_query_len: int, kv: KVCacheManager | None = None
) -> CostTable:
    """Time a step per (batch size, query length 1..max_query_len): after a warm-up, the fastest of REPEATS
    (noise only ever adds time; one slow sample would price a verify length out for good)."""
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len!r}")
    free = kv.num_free_blocks() if kv is not None else runner.num_blocks
    grid: dict[tuple[int, int], float] = {}
    for b in sorted(b for b in set(batch_sizes) if b > 0):
        room = min(free // b * runner.block_size, runner.loaded.max_model_len) - max_query_len
        if room < 0:
            continue
        context = min(CONTEXT_TOKENS, room)
        num_blocks = -(-(context + max_query_len) // runner.block_size)
        ids = kv.pool.allocate(b * num_blocks) if kv is not None else list(range(b * num_blocks))
        if ids is None:
            continue
        try:
            tables = [ids[i * num_blocks : (i + 1) * num_blocks] for i in range(b)]
            for q in range(1, max_query_len + 1):
                grid[(b, q)] = _time_step(runner, tables, context, q)
        finally:
            if kv is not None:
                kv.pool.free(list(reversed(ids)))
    if not grid:
        raise ValueError("the KV pool holds no measurable step; raise kv_cache_memory_bytes or gpu_memory_utilization")
    return CostTable(grid)


def _time_step(runner: ModelRunner, tables: list[list[int]], context: int, q: int) -> float:
    """Seconds of one step of len(tables) requests, each verifying q - 1 drafts after `context` tokens."""
    scheduled = []
    for i in range(len(tables)):
        req = Request(f"step-cost-{i}", [0] * (context + 1), SamplingParams(max_tokens=1), 1)
        req.num_computed_tokens, req.spec_token_ids = context, [0] * (q - 1)
        scheduled.append(ScheduledRequest(req, q, q - 1))
    sched = SchedulerOutput(scheduled, len(tables) * q, len(tables) * (q - 1))
    block_ids = {s.request.request_id: table for s, table in zip(scheduled, tables)}
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else lambda device: None
    times = []
    for _ in range(1 + REPEATS):  # the first is a warm-up: compiles, allocator growth
        sync(runner.device)
        start = time.perf_counter()
        runner.execute(sched, block_ids.__getitem__).logits.argmax(dim=-1).cpu()  # the greedy pick and read-back
        sync(runner.device)
        times.append(time.perf_counter() - start)
    return min(times[1:])
