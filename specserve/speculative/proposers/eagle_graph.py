"""The EAGLE head's autoregressive draft steps as CUDA graphs, and one-copy host->device inputs."""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from specserve.attention.base import AttentionBackend, AttentionMetadata
from specserve.kv.spec import KVFormat, LayerKVCache
from specserve.runner.cuda_graph import gc_paused_for_capture
from specserve.runner.streams import record
from specserve.speculative.proposers.draft_model import DraftSampler
from specserve.speculative.proposers.draft_tokens import DraftTokens
from specserve.speculative.proposers.eagle_head import EagleHead

_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}
PAD_SLOT = -1  # stores no K/V: the Triton kernel and torch_ref both skip negative slots


def align8(n: int) -> int:
    return (n + 7) & ~7


def align16(n: int) -> int:
    return (n + 15) & ~15


class PinnedUpload:
    """Small host int arrays -> the device in ONE non-blocking copy per call."""

    def __init__(self, device: torch.device, slots: int = 8) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._host = [torch.zeros(0, dtype=torch.uint8) for _ in range(slots)]
        self._views: list[dict] = [{} for _ in range(slots)]  # per slot: layout -> its numpy views
        self._events = [torch.cuda.Event() if self._pinned else None for _ in range(slots)]
        self._pending = [False] * slots
        self._slot = -1

    def stage(self, nbytes: int) -> np.ndarray:
        """The next slot's first nbytes, for the caller to fill; send_staged then copies them."""
        return self._next(nbytes).numpy()[:nbytes]

    def stage_views(self, nbytes: int, layout: Callable[[np.ndarray], Any]) -> Any:
        """Like stage, but returns layout(the slot's whole buffer), made once per slot: the views a
        caller fills (the slot holds at least nbytes, the size `layout` needs at most)."""
        buf = self._next(nbytes)
        views = self._views[self._slot]
        got = views.get(layout)
        if got is None:
            got = views[layout] = layout(buf.numpy())
        return got

    def _next(self, nbytes: int) -> torch.Tensor:
        i = self._slot = (self._slot + 1) % len(self._host)
        if self._pending[i]:
            self._events[i].synchronize()
            self._pending[i] = False
        if self._host[i].numel() < nbytes:  # zeros: bytes a caller leaves unwritten are valid ids
            size = max(nbytes, 2 * self._host[i].numel(), 4096)
            self._host[i] = torch.zeros(size, dtype=torch.uint8, pin_memory=self._pinned)
            self._views[i] = {}
        return self._host[i]

    def send_staged(self, dst: torch.Tensor, nbytes: int) -> None:
        """Copy the staged slot's first nbytes into dst[:nbytes] (uint8 on the device)."""
        i = self._slot
        dst[:nbytes].copy_(self._host[i][:nbytes], non_blocking=True)
        if self._pinned:
            record(self._events[i], dst.device)
            self._pending[i] = True

    def send(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """int32 / int64 arrays -> device tensors of the same shapes, in fresh device memory."""
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            # 16-byte aligned: each piece views as its dtype, and every kernel sees 16-byte aligned
            # pointers whatever the batch (Triton compiles a variant per pointer alignment class).
            total = align16(total + a.nbytes)
        buf = self.stage(total)
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
    cu, seq_lens = arrays[0], arrays[1]
    return AttentionMetadata(
        *dev, max(q_lens), int(seq_lens.max()), len(seq_lens), int(cu[-1]), list(q_lens), seq_lens.tolist()
    )


@torch.inference_mode()
def capture_per_batch_size(owner) -> None:
    """Capture `owner._forward(bs)` for each of `owner.batch_sizes` into one shared memory pool, largest first so the
    smaller graphs reuse its memory; fills owner.graphs[bs] / outputs[bs]. owner: HeadStepGraphs or
    FirstForwardGraphs (batch_sizes, device, _fill_dummy, _forward, _pool)."""
    with gc_paused_for_capture():
        _capture_each(owner)


def _capture_each(owner) -> None:
    for bs in reversed(owner.batch_sizes):
        owner._fill_dummy(bs)
        for _ in range(2):  # warm up: Triton compiles, cuBLAS picks algorithms
            owner._forward(bs)
        torch.cuda.synchronize(owner.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=owner._pool):
            owner.outputs[bs] = owner._forward(bs)
        owner._pool = graph.pool()
        owner.graphs[bs] = graph
    torch.cuda.synchronize(owner.device)


def replay(owner, bs: int):
    """owner's forward of size bs: its graph's replay, or an eager run over the same static buffers
    where none was captured ("static" mode, the CPU); returns owner.outputs[bs]."""
    owner.runs[bs] += 1
    graph = owner.graphs.get(bs)
    if graph is None:
        owner.outputs[bs] = owner._forward(bs)
    else:
        graph.replay()
    return owner.outputs[bs]


class HeadStepGraphs:
    """Static buffers, and on CUDA graphs, for the head's one-row-per-request draft steps."""

    def __init__(
        self,
        head: EagleHead,
        target: torch.nn.Module,
        kv_cache: LayerKVCache,
        fmt: KVFormat,
        backend: AttentionBackend,
        scale: float,
        batch_sizes: Sequence[int],
        max_blocks: int,
        block_size: int,
        vocab_size: int,
        upload: PinnedUpload,
        capture: bool,
    ) -> None:
        self.head, self.target, self.kv_cache, self.fmt, self.backend = head, target, kv_cache, fmt, backend
        self.scale, self.vocab_size, self.upload = scale, vocab_size, upload
        self.batch_sizes = sorted(batch_sizes)
        self.max_blocks, self.block_size = max_blocks, block_size
        device = kv_cache.key.device
        self.device = device
        max_bs = self.batch_sizes[-1]
        # One device buffer laid out like the host slot each step fills: int64 positions,
        # slot_mapping, active rows [max_bs] each; int32 cu_query_lens [max_bs + 1], seq_lens [max_bs];
        # then int32 block_tables [max_bs, max_blocks], last so that only a propose's first step
        # (the one that sends them) copies them.
        self._i64, self._i32 = 3 * max_bs * 8, (2 * max_bs + 1) * 4
        self._fields = align8(self._i64 + self._i32)
        self._buf = torch.zeros(self._fields + max_bs * max_blocks * 4, dtype=torch.uint8, device=device)
        self.positions, self.slot_mapping, self.active = self._buf[: self._i64].view(torch.int64).split(max_bs)
        self.cu_query_lens, self.seq_lens = (
            self._buf[self._i64 : self._i64 + self._i32].view(torch.int32).split([max_bs + 1, max_bs])
        )
        self.block_tables = self._buf[self._fields :].view(torch.int32).view(max_bs, max_blocks)
        self.tokens = torch.zeros(max_bs, dtype=torch.int64, device=device)  # previous drafts
        dtype = target.embed_tokens.weight.dtype
        self.hidden = torch.zeros(max_bs, head.cfg.hidden_size, dtype=dtype, device=device)  # previous outputs
        self._arange = np.arange(max_bs + 1, dtype=np.int32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bs -> (logits, argmax)
        self.runs: Counter[int] = Counter()  # steps run per padded batch size
        self.dead_rows = 0  # rows run for requests that already had all their drafts
        self._pool = None
        if capture:
            self.capture()

    # -- forward -----------------------------------------------------------------------------
    def _forward(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft row per sequence of the static buffers -> (logits [bs, head.cfg.logits_width]
        float32, argmax [bs] target ids)."""
        meta = AttentionMetadata(
            self.cu_query_lens[: bs + 1],
            self.seq_lens[:bs],
            self.block_tables[:bs],
            self.slot_mapping[:bs],
            max_query_len=1,
            max_seq_len=self.max_blocks * self.block_size,
            num_seqs=bs,
            num_tokens=bs,
        )

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.backend.forward(q, k, v, self.kv_cache, self.fmt, meta, self.scale)

        embeds = self.target.embed_tokens(self.tokens[:bs])
        out, normed = self.head(embeds, self.hidden[:bs], self.positions[:bs], self.target.cos_sin_cache, attend)
        logits = self.head.compute_logits(normed, self.target)
        argmax = self.head.greedy_token_ids(logits)  # target ids (a reduced vocabulary maps through d2t)
        # The next step's inputs are this step's outputs: written here, nothing runs between
        # replays for greedy rows (random rows overwrite `tokens` with their samples).
        self.hidden[:bs].copy_(out)
        self.tokens[:bs].copy_(argmax)
        return logits, argmax

    def capture(self) -> None:
        capture_per_batch_size(self)

    def _fill_dummy(self, bs: int) -> None:
        self.tokens.zero_()
        self.hidden.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(PAD_SLOT)
        self.cu_query_lens[: bs + 1] = torch.arange(bs + 1, device=self.device, dtype=torch.int32)
        self.seq_lens[:bs] = 1
        self.block_tables.zero_()

    def _run(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        return replay(self, bs)

    # -- drafting ----------------------------------------------------------------------------
    def fits(self, n: int, tables: list[list[int]]) -> bool:
        return n <= self.batch_sizes[-1] and max(len(t) for t in tables) <= self.max_blocks

    def draft(
        self,
        dt: DraftTokens,
        sampler: DraftSampler,
        ks: list[int],
        ctx: list[int],
        last_pos: list[int],
        tables: list[list[int]],
        prev: torch.Tensor | None,
    ) -> bool:
        """Draft steps 1..max(ks) - 1 into dt, which holds step 0's tokens [n] for all n requests."""
        n = len(ks)
        if not self.fits(n, tables):
            return False
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]
        greedy = all(sampler.is_greedy(r) for r in range(n))
        if prev is not None:
            self.hidden[:n].copy_(prev)
        if prev is not None or not greedy:  # random rows: step 0's samples, not its argmax
            self.tokens[:n].copy_(dt.last_tokens)
        host = _StepHost(ks, ctx, last_pos, tables)
        max_k = max(ks)
        for step in range(1, max_k):
            rows = self._send(host, step, n, bs)
            logits, argmax = self._run(bs)
            self.dead_rows += n - len(rows)
            # Only the still-drafting rows' outputs are drafts (random rows: only they draw noise,
            # as on the eager path); their device indices came in this step's copy.
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

    def _send(self, host: _StepHost, step: int, n: int, bs: int) -> list[int]:
        """Fill a pinned slot with step `step`'s inputs and copy it into the static buffers;
        returns the rows still drafting."""
        first = step == 1
        nbytes = self._fields + (n * self.max_blocks * 4 if first else 0)
        pos, slots, active, cu, seq_lens, tables = self.upload.stage_views(self._buf.numel(), self._host_views)
        # Plain Python over the requests: few of them, where numpy's per-call cost would dominate.
        rows = [i for i, k in enumerate(host.ks) if k > step]
        idx = [host.ctx[i] + step - 1 for i in rows]  # compact index of this draft row in its head sequence
        bsz = self.block_size
        at = slice(0, n) if len(rows) == n else rows
        pos[:bs] = 0
        pos[at] = [host.last_pos[i] + step for i in rows]
        slots[:bs] = PAD_SLOT
        slots[at] = [host.tables[i][x // bsz] * bsz + x % bsz for i, x in zip(rows, idx)]
        active[: len(rows)] = rows
        cu[: n + 1] = self._arange[: n + 1]
        cu[n + 1 : bs + 1] = n  # padding sequences are empty
        seq_lens[:bs] = 0
        seq_lens[:n] = 1  # dead rows: one query over their first cached row, harmless to read
        seq_lens[at] = [x + 1 for x in idx]
        if first:
            tables[:n] = 0
            for i, t in enumerate(host.tables):
                tables[i, : len(t)] = t
        self.upload.send_staged(self._buf, nbytes)
        return rows

    def _host_views(self, buf: np.ndarray) -> tuple[np.ndarray, ...]:
        """A pinned slot as the static buffers' layout: pos, slots, active, cu, seq_lens, tables."""
        max_bs = self.tokens.numel()
        pos, slots, active = buf[: self._i64].view(np.int64).reshape(3, max_bs)
        cu, seq_lens = np.split(buf[self._i64 : self._i64 + self._i32].view(np.int32), [max_bs + 1])
        tables = buf[self._fields : self._buf.numel()].view(np.int32).reshape(max_bs, self.max_blocks)
        return pos, slots, active, cu, seq_lens, tables


class _StepHost:
    """A propose's per-request host lists for the draft steps ([n] each; tables: each one's blocks)."""

    def __init__(self, ks: list[int], ctx: list[int], last_pos: list[int], tables: list[list[int]]) -> None:
        self.ks, self.ctx, self.last_pos, self.tables = ks, ctx, last_pos, tables
