"""CUDA graphs over static input buffers, one shared pool. Uniform graphs (bs, q) score every row (catch-up
graphs: one per sequence); a step pads up to a captured bs and q. Mixed graphs (bs, t, t) run any ragged step
of up to t tokens and stop at the hidden states. Padding tokens have slot -1 (no K/V stored), padding
sequences length 0; their output rows are ignored."""

from __future__ import annotations

import bisect
import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from specserve.attention.base import AttentionMetadata, ForwardContext, forward_context
from specserve.runner.batch import HostBatch, pad_to_query_len
from specserve.runner.streams import record

if TYPE_CHECKING:
    from specserve.runner.model_runner import ModelRunner

T = TypeVar("T")

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# Decode (query length 1) graphs go on up to max_num_seqs: every 64 to 512, then every 128, so a large batch
# pads by at most a quarter instead of running eagerly (launches cost ~10% of a step at batch 1,024).
LARGE_BATCH_SIZES = (320, 384, 448, 512, 640, 768, 896, 1024)
# Verify graphs (query length > 1) stop at 256: speculation is off long before, and their logits are bs * q rows.
VERIFY_MAX_BATCH = 256
MID_QUERY_MAX_BATCH = 32
# Short prefills (launch-bound eagerly); their [bs * q, vocab] float32 logits are why the batch cap is small.
PREFILL_QUERY_LENS = (16, 64)
PREFILL_MAX_BATCH = 2
# A draft model's catch-up lengths; their graphs score each sequence's last row only ([bs, vocab] logits).
CATCH_UP_QUERY_LENS = (4, 16, 64)
CATCH_UP_MAX_BATCH = 32
# Mixed graphs' token counts (a prompt chunk beside decodes); past 1024 tokens GPU work outweighs launches.
MIXED_TOKEN_LENS = (128, 256, 512, 1024)


def sizes_by_query_len(
    batch_sizes: list[int],
    query_lens: tuple[int, ...],
    prefill_lens: tuple[int, ...] = (),
    catch_up_lens: tuple[int, ...] = (),
) -> dict[int, tuple[int, ...]]:
    """Batch sizes to capture per query length; middle verify, prefill and catch-up lengths up to their caps."""
    edge = (query_lens[0], query_lens[-1])
    caps = [(q, None if q == 1 else VERIFY_MAX_BATCH if q in edge else MID_QUERY_MAX_BATCH) for q in query_lens]
    caps += [(q, PREFILL_MAX_BATCH) for q in prefill_lens] + [(q, CATCH_UP_MAX_BATCH) for q in catch_up_lens]
    sizes: dict[int, tuple[int, ...]] = {}
    for q, cap in caps:
        if q not in sizes:
            sizes[q] = tuple(b for b in batch_sizes if cap is None or b <= cap) or tuple(batch_sizes[:1])
    return sizes


def mixed_graph_sizes(
    batch_sizes: tuple[int, ...] | list[int], token_lens: tuple[int, ...], max_model_len: int
) -> dict[int, tuple[int, ...]]:
    """Mixed graphs' batch sizes per token count t: powers of two (and the largest) below t that fit t tokens."""
    if not batch_sizes:
        return {}
    ladder = sorted({b for b in batch_sizes if b & (b - 1) == 0} | {max(batch_sizes)})
    fits = {t: tuple(b for b in ladder if b < t and -(-t // b) <= max_model_len) for t in sorted(set(token_lens))}
    return {t: fit for t, fit in fits.items() if fit}


def catch_up_lens_of(
    query_lens: tuple[int, ...], prefill_lens: tuple[int, ...], catch_up_lens: tuple[int, ...]
) -> tuple[int, ...]:
    """The catch-up lengths that are not already verify or prefill lengths (whose graphs score every row)."""
    return tuple(sorted(set(catch_up_lens) - set(query_lens) - set(prefill_lens)))


def graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes graphs are captured for: DEFAULT_BATCH_SIZES and LARGE_BATCH_SIZES up to max_num_seqs,
    then every 128 up to max_num_seqs, and max_num_seqs itself: every batch the scheduler forms has a graph."""
    ladder = DEFAULT_BATCH_SIZES + LARGE_BATCH_SIZES
    ladder += tuple(range(ladder[-1] + 128, max_num_seqs, 128))
    sizes = tuple(b for b in ladder if b <= max_num_seqs) or (1,)
    return sizes if sizes[-1] == max_num_seqs else sizes + (max_num_seqs,)


def graph_output_bytes(
    max_num_seqs: int,
    query_lens: tuple[int, ...],
    prefill_lens: tuple[int, ...],
    vocab_size: int,
    hidden_size: int,
    act_bytes: int,
    catch_up_lens: tuple[int, ...] = (),
    mixed_token_lens: tuple[int, ...] = (),
    max_model_len: int | None = None,
) -> int:
    """Memory the captured graphs keep (static logits and hidden states) +10%, held back from the KV pool."""
    query_lens = tuple(sorted(set(query_lens)))
    catch_up = catch_up_lens_of(query_lens, prefill_lens, catch_up_lens)
    sizes = sizes_by_query_len(sorted(graph_batch_sizes(max_num_seqs)), query_lens, prefill_lens, catch_up)
    total = 0
    for q, batch_sizes in sizes.items():
        for bs in batch_sizes:
            total += (bs if q in catch_up else bs * q) * vocab_size * 4 + bs * q * hidden_size * act_bytes
    window = max(mixed_token_lens, default=0) if max_model_len is None else max_model_len
    for t, batch_sizes in mixed_graph_sizes(graph_batch_sizes(max_num_seqs), mixed_token_lens, window).items():
        total += len(batch_sizes) * t * hidden_size * act_bytes
    return int(total * 1.1)


def capture_graph(forward: Callable[[], T], pool: Any, device: torch.device) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run `forward` twice (Triton compiles, cuBLAS picks algorithms), then capture it into `pool` (None: a new one);
    returns the graph and the captured call's outputs, which each replay overwrites."""
    for _ in range(2):
        forward()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out


@contextlib.contextmanager
def gc_paused_for_capture() -> Iterator[None]:
    """Collect once, then keep the cycle collector off: a collection mid-capture could free a dead engine's
    CUDA events and invalidate the capture."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class CudaGraphRunner:
    def __init__(self, runner: ModelRunner, max_model_len: int, batch_sizes: tuple[int, ...], *lens: tuple[int, ...]):
        """lens: the verify (decode 1 and k + 1), prefill, catch-up and mixed-token lengths; verify (1,) if absent."""
        query_lens, prefill_query_lens, catch_up_query_lens, mixed_token_lens = lens + ((1,), (), (), ())[len(lens) :]
        self.model, self.kv_caches, self.fmt, self.backend = runner.model, runner.kv_caches, runner.fmt, runner.backend
        self.device, self.max_model_len, self.batch_sizes = runner.device, max_model_len, sorted(batch_sizes)
        self.verify_query_lens = tuple(sorted(set(query_lens)))  # decode (1) and verify (k + 1) lengths
        self.prefill_query_lens = tuple(q for q in prefill_query_lens if q <= max_model_len)
        catch_up = tuple(q for q in catch_up_query_lens if q <= max_model_len)
        self.catch_up_query_lens = catch_up_lens_of(self.verify_query_lens, self.prefill_query_lens, catch_up)
        self.sizes_by_q = sizes_by_query_len(
            self.batch_sizes, self.verify_query_lens, self.prefill_query_lens, self.catch_up_query_lens
        )
        self.query_lens = tuple(sorted(self.sizes_by_q))
        self.mixed_sizes = mixed_graph_sizes(self.batch_sizes, mixed_token_lens, max_model_len)
        self.mixed_token_lens = tuple(sorted(self.mixed_sizes))
        self.max_blocks = -(-max_model_len // runner.block_size)
        max_bs = self.batch_sizes[-1]
        t = max([bs * q for q, sizes in self.sizes_by_q.items() for bs in sizes] + list(self.mixed_sizes))
        r = max((self.sizes_by_q[q][-1] for q in self.catch_up_query_lens), default=0)
        # All int inputs travel in one pinned host buffer and one copy per step (views below).
        self._i64_host = torch.zeros(3 * t + r, dtype=torch.int64, pin_memory=True)
        self._i32_host = torch.zeros(max_bs + 1 + max_bs + max_bs * self.max_blocks, dtype=torch.int32, pin_memory=True)
        self._i64 = torch.zeros_like(self._i64_host, device=self.device)
        self._i32 = torch.zeros_like(self._i32_host, device=self.device)
        # score_rows: the flat token index each catch-up graph's LM head scores, one per sequence
        self.input_ids, self.positions, self.slot_mapping, self.score_rows = self._i64.split([t, t, t, r])
        self.cu_query_lens, self.seq_lens, flat_tables = self._i32.split([max_bs + 1, max_bs, max_bs * self.max_blocks])
        self.block_tables = flat_tables.view(max_bs, self.max_blocks)
        # Keys: (bs, q) for uniform query length q; (bs, tokens, tokens) for a mixed graph.
        self.graphs: dict[tuple[int, ...], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, ...], torch.Tensor] = {}
        self.hidden_outputs: dict[tuple[int, ...], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self.aux_hidden_layers = tuple(getattr(runner.model, "aux_hidden_layers", ()))  # what the graphs return
        self._pool = None
        self._copied = torch.cuda.Event()
        self._copied_recorded = False

    @staticmethod
    def num_tokens_of(key: tuple[int, ...]) -> int:
        return key[2] if len(key) > 2 else key[0] * key[1]

    @staticmethod
    def is_mixed(key: tuple[int, ...]) -> bool:
        """A mixed graph: its replay returns hidden states [n, hidden], not logits."""
        return len(key) > 2

    def _meta(self, key: tuple[int, ...]) -> AttentionMetadata:
        bs, q, n = key[0], key[1], self.num_tokens_of(key)
        return AttentionMetadata(
            self.cu_query_lens[: bs + 1],
            self.seq_lens[:bs],
            self.block_tables[:bs],
            self.slot_mapping[:n],
            max_query_len=q,
            max_seq_len=self.max_model_len,
            num_seqs=bs,
            num_tokens=n,
        )

    def _forward(self, key: tuple[int, ...]) -> tuple[torch.Tensor | None, torch.Tensor, list[torch.Tensor]]:
        bs, q, n = key[0], key[1], self.num_tokens_of(key)
        ctx = ForwardContext(self._meta(key), self.kv_caches, self.fmt, self.backend)
        with forward_context(ctx):
            out = self.model(self.input_ids[:n], self.positions[:n])
        hidden, aux = out if isinstance(out, tuple) else (out, [])
        if self.is_mixed(key):  # the LM head runs after the replay, on the rows the step scores
            return None, hidden, aux
        # The LM head runs inside the graph (catch-ups: on score_rows); EAGLE heads read hidden/aux after it.
        scored = hidden.index_select(0, self.score_rows[:bs]) if self.scores_rows(q) else hidden
        return self.model.compute_logits(scored), hidden, aux

    def scores_rows(self, q: int) -> bool:
        """Whether graphs of query length q score only the rows in score_rows (catch-up graphs)."""
        return q in self.catch_up_query_lens

    def _fits(self, batch: HostBatch, q: int) -> bool:
        return not self.scores_rows(q) or len(batch.logits_indices) <= batch.num_seqs

    @torch.inference_mode()
    def capture(self) -> None:
        # largest first within each kind: later graphs reuse its pool
        keys = [(bs, q) for q in self.query_lens for bs in reversed(self.sizes_by_q[q])]
        keys += [(bs, t, t) for t in sorted(self.mixed_sizes, reverse=True) for bs in reversed(self.mixed_sizes[t])]
        with gc_paused_for_capture():
            for key in keys:
                self._capture(key)
        torch.cuda.synchronize(self.device)

    def _capture(self, key: tuple[int, ...]) -> None:
        self._fill_dummy(key)
        graph, (out, hidden, aux) = capture_graph(lambda: self._forward(key), self._pool, self.device)
        self._pool = graph.pool()
        self.graphs[key] = graph
        if out is not None:
            self.outputs[key] = out
        self.hidden_outputs[key] = (hidden, aux)

    def _fill_dummy(self, key: tuple[int, ...]) -> None:
        """bs sequences sharing the key's tokens evenly over block 0, storing no K/V (replays read real inputs)."""
        bs, n = key[0], self.num_tokens_of(key)
        self.input_ids.zero_()
        self.score_rows.zero_()
        self.slot_mapping.fill_(-1)
        lens = torch.full((bs,), n // bs, dtype=torch.int32, device=self.device)
        lens[: n % bs] += 1
        self.cu_query_lens[0] = 0
        self.cu_query_lens[1 : bs + 1] = torch.cumsum(lens, 0, dtype=torch.int32)
        self.seq_lens[:bs] = lens
        self.block_tables.zero_()

    def graph_key(self, batch: HostBatch, q: int | None = None) -> tuple[int, int] | None:
        """The uniform graph (bs, q) for the batch: q its shared query length, or the one it is padded to."""
        q = batch.uniform_query_len() if q is None else q
        if q is None or q not in self.query_lens:
            return None
        sizes = self.sizes_by_q.get(q, ())
        if not sizes or batch.num_seqs > sizes[-1]:
            return None
        if batch.block_tables.shape[1] > self.max_blocks or not self._fits(batch, q):
            return None
        return (sizes[bisect.bisect_left(sizes, batch.num_seqs)], q)

    def graph_for(self, batch: HostBatch) -> tuple[HostBatch, tuple[int, ...]] | None:
        """(batch to run, graph key): as is, padded to a captured q, or a mixed graph (fewest rows); None: eager."""
        key = self.graph_key(batch)
        if key is not None:
            return batch, key
        if not batch.query_lens or batch.block_tables.shape[1] > self.max_blocks:
            return None
        mixed = self.mixed_key(batch)
        for q in sorted(q for q in self.query_lens if q >= max(batch.query_lens)):
            key = self.graph_key(batch, q)
            if key is not None:
                if mixed is None or self.num_tokens_of(mixed) >= self.num_tokens_of(key):
                    padded = pad_to_query_len(batch, q, self.max_model_len)
                    if padded is not None:
                        return padded, key
                break
        return None if mixed is None else (batch, mixed)

    def mixed_key(self, batch: HostBatch) -> tuple[int, int, int] | None:
        """The smallest mixed graph that holds the batch as it is: (bs, tokens, tokens), or None."""
        if batch.block_tables.shape[1] > self.max_blocks:
            return None
        for t in sorted(self.mixed_sizes):
            sizes = self.mixed_sizes[t]
            if t >= batch.num_tokens and batch.num_seqs <= sizes[-1]:
                return (sizes[bisect.bisect_left(sizes, batch.num_seqs)], t, t)
        return None

    def hidden(self, key: tuple[int, ...], n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The last replay's hidden states [n, hidden] and aux layer inputs (each [n, hidden])."""
        hidden, aux = self.hidden_outputs[key]
        return hidden[:n], [a[:n] for a in aux]

    def run(
        self, batch: HostBatch, key: tuple[int, ...], fill: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Replay `key`: logits [rows, vocab], hidden [num_tokens, hidden] if mixed; fill: placeholders' (index, id)."""
        bs, q, padded = key[0], key[1], self.num_tokens_of(key)
        if self._copied_recorded:  # the previous step's copies have left the pinned buffers
            self._copied.synchronize()
        n, s = batch.num_tokens, batch.num_seqs
        t = self.input_ids.numel()
        i64 = self._i64_host.numpy()
        i64[:n] = batch.input_ids
        i64[n:padded] = 0  # padding tokens: any valid id (not a placeholder left by an earlier step)
        i64[t : t + n] = batch.positions
        i64[2 * t : 2 * t + padded] = -1  # padding tokens store no K/V
        i64[2 * t : 2 * t + n] = batch.slot_mapping
        scored = not self.is_mixed(key) and self.scores_rows(q)
        scored_rows = len(batch.logits_indices)
        if scored:
            i64[3 * t : 3 * t + bs] = 0  # padding sequences score row 0 (any row; nobody reads it)
            i64[3 * t : 3 * t + scored_rows] = batch.logits_indices
        max_bs = self.seq_lens.numel()
        i32 = self._i32_host.numpy()
        i32[: bs + 1] = n  # padding sequences are empty
        i32[: s + 1] = batch.cu_query_lens
        i32[max_bs + 1 : max_bs + 1 + bs] = 0
        i32[max_bs + 1 : max_bs + 1 + s] = batch.seq_lens
        tables = i32[2 * max_bs + 1 :].reshape(max_bs, self.max_blocks)
        tables[:s, : batch.block_tables.shape[1]] = batch.block_tables
        # Stale entries beyond each row's blocks are never read (seq_lens bounds the reads).
        self._i64.copy_(self._i64_host, non_blocking=True)
        filled = 2 * max_bs + 1 + s * self.max_blocks
        self._i32[:filled].copy_(self._i32_host[:filled], non_blocking=True)
        record(self._copied, self.device)
        self._copied_recorded = True
        if fill is not None:
            self.input_ids.index_copy_(0, fill[0], fill[1])
        self.graphs[key].replay()
        if self.is_mixed(key):
            return self.hidden_outputs[key][0][:n]
        return self.outputs[key][:scored_rows] if scored else self.outputs[key][:n]
