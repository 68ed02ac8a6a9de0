"""The EAGLE head's autoregressive draft steps as CUDA graphs, and one-copy host->device inputs."""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import torch

from specserve.attention.base import AttentionBackend, AttentionMetadata
from specserve.kv.spec import KVFormat, LayerKVCache
from specserve.runner.cuda_graph import capture_graph, gc_paused_for_capture
from specserve.runner.streams import record
from specserve.speculative.proposers.draft_model import DraftSampler
from specserve.speculative.proposers.draft_tokens import DraftTokens
from specserve.speculative.proposers.eagle_head import EagleHead

_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}
PAD_SLOT = -1  # stores no K/V: the Triton kernel and torch_ref both skip negative slots


class PinnedUpload:
    """Small host int arrays -> the device in ONE non-blocking copy per call."""

    def __init__(self, device: torch.device, slots: int = 8) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._host = [torch.zeros(0, dtype=torch.uint8) for _ in range(slots)]
        self._views: list[dict] = [{} for _ in range(slots)]  # per slot: layout -> its numpy views
        # Per slot: its last copy's event (a never-recorded event synchronizes at once).
        self._events = [torch.cuda.Event() if self._pinned else None for _ in range(slots)]
        self._slot = -1

    def stage_views(self, nbytes: int, layout: Callable[[np.ndarray], Any]) -> Any:
        """layout(the next slot's buffer of >= nbytes), made once per slot: the views filled before send_staged."""
        buf = self._next(nbytes)
        views = self._views[self._slot]
        got = views.get(layout)
        if got is None:
            got = views[layout] = layout(buf.numpy())
        return got

    def _next(self, nbytes: int) -> torch.Tensor:
        i = self._slot = (self._slot + 1) % len(self._host)
        event = self._events[i]
        if event is not None:
            event.synchronize()
        if self._host[i].numel() < nbytes:  # zeros: bytes a caller leaves unwritten are valid ids
            size = max(nbytes, 2 * self._host[i].numel(), 4096)
            self._host[i] = torch.zeros(size, dtype=torch.uint8, pin_memory=self._pinned)
            self._views[i] = {}
        return self._host[i]

    def send_staged(self, dst: torch.Tensor, nbytes: int) -> None:
        """Copy the staged slot's first nbytes into dst[:nbytes] (uint8 on the device)."""
        i = self._slot
        dst[:nbytes].copy_(self._host[i][:nbytes], non_blocking=True)
        event = self._events[i]
        if event is not None:
            record(event, dst.device)

    def send(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """int32 / int64 arrays -> device tensors of the same shapes, in fresh device memory."""
        offsets, total = [], 0
        for a in arrays:  # 16-byte aligned: Triton compiles a variant per pointer alignment class
            offsets.append(total)
            total = (total + a.nbytes + 15) & ~15
        buf = self._next(total).numpy()[:total]
        for a, off in zip(arrays, offsets):
            buf[off : off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        dev = torch.empty(total, dtype=torch.uint8, device=self.device)
        self.send_staged(dev, total)
        out = [dev[off : off + a.nbytes].view(_TORCH[a.dtype]) for a, off in zip(arrays, offsets)]
        return [t if a.ndim == 1 else t.view(a.shape) for t, a in zip(out, arrays)]


def attention_arrays(
    ctx_lens: list[int], q_lens: list[int], tables: list[list[int]], block_size: int
) -> list[np.ndarray]:
    """Sequence i: q_lens[i] new rows after ctx_lens[i] cached ones, in blocks tables[i] -> [cu_query_lens [n + 1]
    int32, seq_lens [n] int32, block_tables [n, max blocks] int32, slot_mapping [sum(q_lens)] int64] on the host."""
    n = len(tables)
    block_tables = np.zeros((n, max(1, max(len(t) for t in tables))), dtype=np.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = t
    seq_lens = np.asarray(ctx_lens, dtype=np.int32) + np.asarray(q_lens, dtype=np.int32)
    seq_index = np.repeat(np.arange(n), q_lens)
    idx = np.concatenate([np.arange(c, c + q) for c, q in zip(ctx_lens, q_lens)])
    slots = block_tables[seq_index, idx // block_size].astype(np.int64) * block_size + idx % block_size
    cu = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(q_lens, out=cu[1:])
    return [cu, seq_lens, block_tables, slots]


def attention_metadata(arrays: list[np.ndarray], dev: Sequence[torch.Tensor], q_lens: list[int]) -> AttentionMetadata:
    """AttentionMetadata of attention_arrays' host arrays and their device copies."""
    cu, lens = arrays[0], arrays[1]
    sizes = (max(q_lens), int(lens.max()), len(lens), int(cu[-1]))
    return AttentionMetadata(dev[0], dev[1], dev[2], dev[3], *sizes, list(q_lens), lens.tolist())


def paged_attend(backend: AttentionBackend, cache: LayerKVCache, fmt: KVFormat, meta: AttentionMetadata, scale: float):
    """q, k, v -> attention through the head's paged KV cache (the `Attend` of EagleHead.forward)."""
    return lambda q, k, v: backend.forward(q, k, v, cache, fmt, meta, scale)


class StaticForward:
    """Static buffers of a head forward over the proposer's paged KV, on CUDA one graph per batch size.
    Subclasses define _forward(bs) and set slot_mapping (a view of _alloc's buffer)."""

    slot_mapping: torch.Tensor  # [max tokens] int64

    def __init__(self, proposer, batch_sizes: Sequence[int], max_blocks: int) -> None:
        self.head: EagleHead = proposer.head
        self.target, self.kv_cache, self.fmt = proposer.target, proposer.kv_caches[0], proposer.fmt
        self.backend, self.scale, self.upload = proposer.backend, proposer.scale, proposer.upload
        self.batch_sizes = sorted(batch_sizes)
        self.max_blocks, self.block_size = max_blocks, proposer.kv.block_size
        self.device = self.kv_cache.key.device
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Any] = {}
        self.runs: Counter[int] = Counter()  # forwards run per padded batch size
        self._pool: torch.cuda._POOL_HANDLE | None = None

    def _attend(self, meta: AttentionMetadata):
        return paged_attend(self.backend, self.kv_cache, self.fmt, meta, self.scale)

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest batch size first, into one shared memory pool that the smaller graphs reuse."""
        with gc_paused_for_capture():
            for bs in reversed(self.batch_sizes):
                self._fill_dummy(bs)
                graph, self.outputs[bs] = capture_graph(partial(self._forward, bs), self._pool, self.device)
                self._pool = graph.pool()
                self.graphs[bs] = graph
            torch.cuda.synchronize(self.device)

    def _run(self, bs: int):
        """The forward of size bs: its graph's replay, or an eager run over the same buffers ("static" mode)."""
        self.runs[bs] += 1
        graph = self.graphs.get(bs)
        if graph is None:
            self.outputs[bs] = self._forward(bs)
        else:
            graph.replay()
        return self.outputs[bs]

    def _alloc(self, groups: list[tuple[int, int]]) -> list[torch.Tensor]:
        """One device buffer laid out like a send's pinned slot: int64 fields (per group (count, length): count
        fields [length]; returned), int32 cu_query_lens [max_bs + 1], seq_lens [max_bs], then block tables
        [max_bs, max_blocks] (last: only the sends that change them copy them)."""
        max_bs, self._groups = self.batch_sizes[-1], groups
        self._i64, self._i32 = 8 * sum(c * n for c, n in groups), 4 * (2 * max_bs + 1)
        self._fields = (self._i64 + self._i32 + 7) & ~7
        self._buf = torch.zeros(self._fields + max_bs * self.max_blocks * 4, dtype=torch.uint8, device=self.device)
        *i64, self.cu_query_lens, self.seq_lens, self.block_tables = self._views(self._buf, torch.int64, torch.int32)
        return i64

    def _host_views(self, buf: np.ndarray) -> list[np.ndarray]:
        """A pinned slot as the device buffer's fields, in _alloc's order (int64 fields, then the int32 ones)."""
        return self._views(buf[: self._buf.numel()], np.int64, np.int32)

    def _views(self, buf: Any, i64_type: Any, i32_type: Any) -> list[Any]:
        """The _alloc layout over a uint8 buffer (a torch tensor or a numpy array of the same size)."""
        max_bs, i64, at = self.batch_sizes[-1], buf[: self._i64].view(i64_type), 0
        fields = []
        for count, length in self._groups:
            fields += list(i64[at : at + count * length].reshape(count, length))
            at += count * length
        i32 = buf[self._i64 : self._i64 + self._i32].view(i32_type)
        tables = buf[self._fields :].view(i32_type).reshape(max_bs, self.max_blocks)
        return [*fields, i32[: max_bs + 1], i32[max_bs + 1 :], tables]

    def _meta(self, bs: int, num_tokens: int, max_query_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            self.cu_query_lens[: bs + 1],
            self.seq_lens[:bs],
            self.block_tables[:bs],
            self.slot_mapping[:num_tokens],
            max_query_len=max_query_len,
            max_seq_len=self.max_blocks * self.block_size,
            num_seqs=bs,
            num_tokens=num_tokens,
        )

    def _fill_dummy(self, bs: int) -> None:
        self._buf.zero_()
        self.slot_mapping.fill_(PAD_SLOT)
        self.cu_query_lens[: bs + 1] = torch.arange(bs + 1, device=self.device, dtype=torch.int32)
        self.seq_lens[:bs] = 1

    def _forward(self, bs: int) -> Any:
        raise NotImplementedError


class HeadStepGraphs(StaticForward):
    """Static buffers, and on CUDA graphs, for the head's one-row-per-request draft steps."""

    def __init__(self, proposer, batch_sizes: Sequence[int], max_blocks: int, capture: bool) -> None:
        super().__init__(proposer, batch_sizes, max_blocks)
        device, head, target = self.device, self.head, self.target
        max_bs = self.batch_sizes[-1]
        self.positions, self.slot_mapping, self.active = self._alloc([(3, max_bs)])
        self.tokens = torch.zeros(max_bs, dtype=torch.int64, device=device)  # previous drafts
        dtype = target.embed_tokens.weight.dtype
        self.hidden = torch.zeros(max_bs, head.cfg.hidden_size, dtype=dtype, device=device)  # previous outputs
        self._arange = np.arange(max_bs + 1, dtype=np.int32)
        self.dead_rows = 0  # rows run for requests that already had all their drafts
        if capture:
            self.capture()

    def _forward(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft row per sequence -> (logits [bs, logits_width] float32, argmax [bs] target ids)."""
        meta = self._meta(bs, bs, 1)
        embeds = self.head.embed(self.tokens[:bs], self.target)
        out, normed = self.head(
            embeds, self.hidden[:bs], self.positions[:bs], self.target.cos_sin_cache, self._attend(meta)
        )
        logits = self.head.compute_logits(normed, self.target)
        argmax = self.head.greedy_token_ids(logits)  # target ids (a reduced vocabulary maps through d2t)
        self.hidden[:bs].copy_(out)  # the next step's inputs (random rows overwrite `tokens` with their samples)
        self.tokens[:bs].copy_(argmax)
        return logits, argmax

    def _fill_dummy(self, bs: int) -> None:
        super()._fill_dummy(bs)
        self.tokens.zero_()
        self.hidden.zero_()

    def draft(self, dt: DraftTokens, sampler: DraftSampler, host: StepHost, prev: torch.Tensor | None) -> bool:
        """Draft steps 1..max(ks) - 1 into dt, which holds step 0's tokens [n]; False: the batch does not fit."""
        n = len(host.ks)
        if n > self.batch_sizes[-1] or max(len(t) for t in host.tables) > self.max_blocks:
            return False
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]
        greedy = all(sampler.is_greedy(r) for r in range(n))
        if prev is not None:
            self.hidden[:n].copy_(prev)
        if prev is not None or not greedy:  # random rows: step 0's samples, not its argmax
            self.tokens[:n].copy_(dt.last_tokens)
        max_k = max(host.ks)
        for step in range(1, max_k):
            rows = self._send(host, step, n, bs)
            logits, argmax = self._run(bs)
            self.dead_rows += n - len(rows)
            # only the still-drafting rows' outputs are drafts (and only they draw noise)
            pick = None if len(rows) == n else self.active[: len(rows)]
            if greedy:
                dt.add(rows, argmax[:n].clone() if pick is None else argmax.index_select(0, pick), None)
                continue
            tokens, probs = sampler.sample(logits[:n] if pick is None else logits.index_select(0, pick), rows)
            dt.add(rows, tokens, probs)  # probs: exactly the distribution each draft was drawn from
            if step + 1 < max_k:  # the next step embeds the samples, not the argmax the graph fed
                if pick is None:
                    self.tokens[:n].copy_(tokens)
                else:
                    self.tokens.index_copy_(0, pick, tokens)
        return True

    def _send(self, host: StepHost, step: int, n: int, bs: int) -> list[int]:
        """Copy step `step`'s inputs into the static buffers (one pinned slot); returns the rows still drafting."""
        ks, ctx, last_pos, tabs = host
        first = step == 1
        nbytes = self._fields + (n * self.max_blocks * 4 if first else 0)
        pos, slots, active, cu, seq_lens, tables = self.upload.stage_views(self._buf.numel(), self._host_views)
        # Plain Python over the requests: few of them, where numpy's per-call cost would dominate.
        rows = [i for i, k in enumerate(ks) if k > step]
        idx = [ctx[i] + step - 1 for i in rows]  # compact index of this draft row in its head sequence
        bsz = self.block_size
        at = slice(0, n) if len(rows) == n else rows
        pos[:bs] = 0
        pos[at] = [last_pos[i] + step for i in rows]
        slots[:bs] = PAD_SLOT
        slots[at] = [tabs[i][x // bsz] * bsz + x % bsz for i, x in zip(rows, idx)]
        active[: len(rows)] = rows
        cu[: n + 1] = self._arange[: n + 1]
        cu[n + 1 : bs + 1] = n  # padding sequences are empty
        seq_lens[:bs] = 0
        seq_lens[:n] = 1  # dead rows: one query over their first cached row, harmless to read
        seq_lens[at] = [x + 1 for x in idx]
        if first:
            tables[:n] = 0
            for i, t in enumerate(tabs):
                tables[i, : len(t)] = t
        self.upload.send_staged(self._buf, nbytes)
        return rows


class StepHost(NamedTuple):
    """A propose's per-request host lists for the draft steps ([n] each; tables: each one's blocks)."""

    ks: list[int]
    ctx: list[int]
    last_pos: list[int]
    tables: list[list[int]]
