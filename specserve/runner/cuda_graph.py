"""CUDA graphs for decode (1 token per sequence) and verify (k+1 tokens per sequence) steps.

Captured once per (batch size, query length) into one shared memory pool, over static input
buffers. A step with a uniform query length and a batch no larger than the largest captured size
is padded up to the next captured size: padding tokens have slot -1 (their K/V is not stored) and
padding sequences have length 0 (the attention kernel skips them); their output rows are ignored.
A step whose sequences have different query lengths (drafts of different lengths), all within a
captured length, is padded to it per sequence (`graph_for`). Short prefills of one or two sequences
(a question after a prefix-cache hit, a chat turn, a short prompt) pad the same way to a captured
prefill length. A draft model's catch-ups (the tokens it skipped while the controller drafted nothing,
for every running request) pad to catch-up graphs, which score one row per sequence at most (the rows
in a static index buffer) and so stay small at batch sizes up to CATCH_UP_MAX_BATCH. Everything else
runs eagerly.
"""
from __future__ import annotations

import bisect
import contextlib
import gc
from collections.abc import Iterator

import torch

from specserve.attention.base import AttentionMetadata, ForwardContext, forward_context
from specserve.runner.batch import HostBatch, pad_to_query_len
from specserve.runner.streams import record

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
MID_QUERY_MAX_BATCH = 32
# Prefill lengths captured for batches of up to PREFILL_MAX_BATCH sequences. Eagerly, the ~12
# launches per layer of a 13-token prefill after an 8k-token prefix hit took 15-28 ms of host time on
# the H200 machine for ~2 ms of GPU work (bench/tier_ttft.py). The graphs' [bs * q, vocab] float32
# logits cost 240 rows of vocabulary (146 MB at Qwen2's 152k).
PREFILL_QUERY_LENS = (16, 64)
PREFILL_MAX_BATCH = 2
# Catch-up lengths (spec/draft_model.py): eagerly, a forward of the 0.5B draft took ~10 ms of host
# time on the H200 for any 3-128 tokens, and a drafting start at 4 requests paid 12-26 ms for its
# catch-up (docs/benchmarks.md, seventeenth session). Scoring only each sequence's last row keeps a
# graph's logits at [bs, vocab]: every length up to 32 sequences holds ~160 MB at a 152k vocabulary.
CATCH_UP_QUERY_LENS = (4, 16, 64)
CATCH_UP_MAX_BATCH = 32


def sizes_by_query_len(batch_sizes: list[int], query_lens: tuple[int, ...], prefill_lens: tuple[int, ...] = (),
                       catch_up_lens: tuple[int, ...] = ()) -> dict[int, tuple[int, ...]]:
    """Batch sizes to capture per query length. Lengths between the shortest and the longest serve
    verify steps of shorter drafts, which the speculation controller picks at small batches; above
    MID_QUERY_MAX_BATCH such steps pad to the longest instead (each graph keeps its [bs * q, vocab]
    float32 logits: every length at every size would hold GBs). `prefill_lens` not already among
    query_lens get batch sizes up to PREFILL_MAX_BATCH; `catch_up_lens` not among either, up to
    CATCH_UP_MAX_BATCH."""
    edge = (query_lens[0], query_lens[-1])
    sizes = {q: tuple(b for b in batch_sizes if q in edge or b <= MID_QUERY_MAX_BATCH) or tuple(batch_sizes[:1])
             for q in query_lens}
    for q in prefill_lens:
        if q not in sizes:
            sizes[q] = tuple(b for b in batch_sizes if b <= PREFILL_MAX_BATCH) or tuple(batch_sizes[:1])
    for q in catch_up_lens:
        if q not in sizes:
            sizes[q] = tuple(b for b in batch_sizes if b <= CATCH_UP_MAX_BATCH) or tuple(batch_sizes[:1])
    return sizes


def catch_up_lens_of(query_lens: tuple[int, ...], prefill_lens: tuple[int, ...],
                     catch_up_lens: tuple[int, ...]) -> tuple[int, ...]:
    """The catch-up lengths that get graphs of their own (scoring one row per sequence): those that are
    not already verify or prefill lengths (whose graphs score every row)."""
    return tuple(sorted(set(catch_up_lens) - set(query_lens) - set(prefill_lens)))


def graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes graphs are captured for: DEFAULT_BATCH_SIZES up to max_num_seqs, and it."""
    sizes = tuple(b for b in DEFAULT_BATCH_SIZES if b <= max_num_seqs) or (1,)
    if max_num_seqs not in sizes and max_num_seqs < DEFAULT_BATCH_SIZES[-1]:
        sizes = sizes + (max_num_seqs,)
    return sizes


def graph_output_bytes(max_num_seqs: int, query_lens: tuple[int, ...], prefill_lens: tuple[int, ...],
                       vocab_size: int, hidden_size: int, act_bytes: int, catch_up_lens: tuple[int, ...] = ()) -> int:
    """Memory the captured graphs keep after capture: every graph's static outputs (float32 logits
    [bs * q, vocab], [bs, vocab] for a catch-up graph, and the final hidden states [bs * q, hidden])
    live in the shared pool for good, so they add up over all (batch size, query length) pairs; +10%
    for the pool's own slack. The KV pool is sized with this held back, so gpu_memory_utilization
    bounds the engine as a whole."""
    query_lens = tuple(sorted(set(query_lens)))
    catch_up = catch_up_lens_of(query_lens, prefill_lens, catch_up_lens)
    sizes = sizes_by_query_len(sorted(graph_batch_sizes(max_num_seqs)), query_lens, prefill_lens, catch_up)
    total = 0
    for q, batch_sizes in sizes.items():
        for bs in batch_sizes:
            total += (bs if q in catch_up else bs * q) * vocab_size * 4 + bs * q * hidden_size * act_bytes
    return int(total * 1.1)


@contextlib.contextmanager
def gc_paused_for_capture() -> Iterator[None]:
    """Collect garbage once, then keep Python's cycle collector off while graphs are captured.
    torch.cuda.graph no longer collects on entry, so an automatic collection could run mid-capture
    and free a dead engine's pinned buffers or CUDA events (a process that builds engines one after
    another: benchmarks, tests). In the global capture mode that call invalidates the capture, and the
    next launch fails with "operation failed due to a previous error during capture"."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, kv_caches, fmt, backend, device: torch.device,
                 max_model_len: int, block_size: int, batch_sizes: tuple[int, ...],
                 query_lens: tuple[int, ...] = (1,), prefill_query_lens: tuple[int, ...] = (),
                 catch_up_query_lens: tuple[int, ...] = ()) -> None:
        self.model, self.kv_caches, self.fmt, self.backend = model, kv_caches, fmt, backend
        self.device = device
        self.max_model_len = max_model_len
        self.batch_sizes = sorted(batch_sizes)
        self.verify_query_lens = tuple(sorted(set(query_lens)))  # decode (1) and verify (k + 1) lengths
        self.prefill_query_lens = tuple(q for q in prefill_query_lens if q <= max_model_len)
        self.catch_up_query_lens = catch_up_lens_of(  # their graphs score one row per sequence at most
            self.verify_query_lens, self.prefill_query_lens, tuple(q for q in catch_up_query_lens if q <= max_model_len))
        self.sizes_by_q = sizes_by_query_len(self.batch_sizes, self.verify_query_lens, self.prefill_query_lens,
                                             self.catch_up_query_lens)
        self.query_lens = tuple(sorted(self.sizes_by_q))
        self.max_blocks = -(-max_model_len // block_size)
        max_bs = self.batch_sizes[-1]
        t = max(bs * q for q, sizes in self.sizes_by_q.items() for bs in sizes)
        r = max((self.sizes_by_q[q][-1] for q in self.catch_up_query_lens), default=0)
        # All int inputs travel in one pinned host buffer and one copy per step (views below).
        self._i64_host = torch.zeros(3 * t + r, dtype=torch.int64, pin_memory=True)
        self._i32_host = torch.zeros(max_bs + 1 + max_bs + max_bs * self.max_blocks, dtype=torch.int32,
                                     pin_memory=True)
        self._i64 = torch.zeros_like(self._i64_host, device=device)
        self._i32 = torch.zeros_like(self._i32_host, device=device)
        # score_rows: the flat token index each catch-up graph's LM head scores, one per sequence
        self.input_ids, self.positions, self.slot_mapping, self.score_rows = self._i64.split([t, t, t, r])
        self.cu_query_lens, self.seq_lens, flat_tables = self._i32.split([max_bs + 1, max_bs,
                                                                          max_bs * self.max_blocks])
        self.block_tables = flat_tables.view(max_bs, self.max_blocks)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.hidden_outputs: dict[tuple[int, int], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self.aux_hidden_layers = tuple(getattr(model, "aux_hidden_layers", ()))  # what the graphs return
        self._pool = None
        self._copied = torch.cuda.Event()
        self._copied_recorded = False

    def _meta(self, bs: int, q: int) -> AttentionMetadata:
        n = bs * q
        return AttentionMetadata(self.cu_query_lens[:bs + 1], self.seq_lens[:bs], self.block_tables[:bs],
                                 self.slot_mapping[:n], max_query_len=q, max_seq_len=self.max_model_len,
                                 num_seqs=bs, num_tokens=n)

    def _forward(self, bs: int, q: int) -> torch.Tensor:
        n = bs * q
        ctx = ForwardContext(self._meta(bs, q), self.kv_caches, self.fmt, self.backend)
        with forward_context(ctx):
            out = self.model(self.input_ids[:n], self.positions[:n])
        hidden, aux = out if isinstance(out, tuple) else (out, [])
        # Every token of a decode/verify step is scored, so the LM head runs inside the graph too; a
        # catch-up scores each sequence's last fed token only (the rows in score_rows).
        # hidden/aux stay static outputs too: EAGLE heads read them after the replay.
        scored = hidden.index_select(0, self.score_rows[:bs]) if self.scores_rows(q) else hidden
        return self.model.compute_logits(scored), hidden, aux

    def scores_rows(self, q: int) -> bool:
        """Whether graphs of query length q score only the rows in score_rows (catch-up graphs)."""
        return q in self.catch_up_query_lens

    def _fits(self, batch: HostBatch, q: int) -> bool:
        """A catch-up graph scores one row per sequence at most; the others score every token."""
        return not self.scores_rows(q) or len(batch.logits_indices) <= batch.num_seqs

    @torch.inference_mode()
    def capture(self) -> None:
        with gc_paused_for_capture():
            self._capture_all()

    def _capture_all(self) -> None:
        for q in self.query_lens:
            for bs in reversed(self.sizes_by_q[q]):  # largest first: later graphs reuse its pool
                self._fill_dummy(bs, q)
                for _ in range(2):  # warm up: Triton compiles, cuBLAS picks algorithms
                    self._forward(bs, q)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    out, hidden, aux = self._forward(bs, q)
                self._pool = graph.pool()
                self.graphs[(bs, q)] = graph
                self.outputs[(bs, q)] = out
                self.hidden_outputs[(bs, q)] = (hidden, aux)
        torch.cuda.synchronize(self.device)

    def _fill_dummy(self, bs: int, q: int) -> None:
        self.input_ids.zero_()
        self.score_rows.zero_()
        self.slot_mapping.fill_(-1)
        self.cu_query_lens[:bs + 1] = torch.arange(bs + 1, device=self.device, dtype=torch.int32) * q
        self.seq_lens[:bs] = q
        self.block_tables.zero_()

    def graph_key(self, batch: HostBatch) -> tuple[int, int] | None:
        q = batch.uniform_query_len()
        if q not in self.query_lens or batch.block_tables.shape[1] > self.max_blocks or not self._fits(batch, q):
            return None
        sizes = self.sizes_by_q.get(q, ())
        if not sizes or batch.num_seqs > sizes[-1]:
            return None
        return (sizes[bisect.bisect_left(sizes, batch.num_seqs)], q)

    def graph_for(self, batch: HostBatch) -> tuple[HostBatch, tuple[int, int]] | None:
        """(the batch to run, its graph): the batch itself if a graph fits it as it is, else the
        batch padded to the shortest captured query length that holds every sequence (runner/
        batch.py pad_to_query_len; steps mixing draft lengths), else None (run eagerly)."""
        key = self.graph_key(batch)
        if key is not None:
            return batch, key
        if not batch.query_lens or batch.block_tables.shape[1] > self.max_blocks:
            return None
        longest = max(batch.query_lens)
        for q in sorted(self.query_lens):
            sizes = self.sizes_by_q.get(q, ())
            if q >= longest and sizes and batch.num_seqs <= sizes[-1] and self._fits(batch, q):
                padded = pad_to_query_len(batch, q, self.max_model_len)
                return None if padded is None else (padded, (sizes[bisect.bisect_left(sizes, batch.num_seqs)], q))
        return None

    def hidden(self, key: tuple[int, int], n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The last replay's final hidden states [n, hidden] and aux layer inputs (each [n, hidden]);
        valid until the next replay."""
        hidden, aux = self.hidden_outputs[key]
        return hidden[:n], [a[:n] for a in aux]

    def run(self, batch: HostBatch, key: tuple[int, int],
            fill: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Replay the graph for `key` on this batch; returns logits [batch.num_tokens, vocab], or for a
        catch-up graph those of its scored rows, [len(batch.logits_indices), vocab].
        fill: (flat token indices, their input ids), both on the device: placeholders' tokens."""
        bs, q = key
        if self._copied_recorded:  # the previous step's copies have left the pinned buffers
            self._copied.synchronize()
        n, s = batch.num_tokens, batch.num_seqs
        t = self.input_ids.numel()
        i64 = self._i64_host.numpy()
        i64[:n] = batch.input_ids
        i64[n:bs * q] = 0  # padding tokens: any valid id (not a placeholder left by an earlier step)
        i64[t:t + n] = batch.positions
        i64[2 * t:2 * t + bs * q] = -1  # padding tokens store no K/V
        i64[2 * t:2 * t + n] = batch.slot_mapping
        scored = self.scores_rows(q)
        if scored:
            rows = len(batch.logits_indices)
            i64[3 * t:3 * t + bs] = 0  # padding sequences score row 0 (any row; nobody reads it)
            i64[3 * t:3 * t + rows] = batch.logits_indices
        max_bs = self.seq_lens.numel()
        i32 = self._i32_host.numpy()
        i32[:bs + 1] = n  # padding sequences are empty
        i32[:s + 1] = batch.cu_query_lens
        i32[max_bs + 1:max_bs + 1 + bs] = 0
        i32[max_bs + 1:max_bs + 1 + s] = batch.seq_lens
        tables = i32[2 * max_bs + 1:].reshape(max_bs, self.max_blocks)
        tables[:s, :batch.block_tables.shape[1]] = batch.block_tables
        # Stale entries beyond each row's blocks are never read (seq_lens bounds the reads).
        self._i64.copy_(self._i64_host, non_blocking=True)
        rows = 2 * max_bs + 1 + s * self.max_blocks
        self._i32[:rows].copy_(self._i32_host[:rows], non_blocking=True)
        record(self._copied, self.device)
        self._copied_recorded = True
        if fill is not None:
            self.input_ids.index_copy_(0, fill[0], fill[1])
        self.graphs[key].replay()
        return self.outputs[key][:rows] if scored else self.outputs[key][:n]
