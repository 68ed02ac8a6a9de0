"""Flatten one scheduler step into model inputs (input_ids, positions, slot_mapping, block tables):
built on the host with numpy over the whole batch (`HostBatch`; block tables cached across steps in
`BlockTables`), then copied through persistent pinned buffers (`Staging`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specserve.attention.base import AttentionMetadata
from specserve.attention.tree_mask import tree_inputs
from specserve.runner.batch_rows import VECTORIZE_MIN_SEQS, query_rows
from specserve.runner.block_tables import BlockTables, block_table_array
from specserve.runner.streams import record
from specserve.scheduler.scheduler import SchedulerOutput


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_logit_rows] int64: flat token index of each row to score
    # Per scheduled request: (first logit row, number of rows) or None when it does not sample.
    logit_rows: list[tuple[int, int] | None]


@dataclass
class HostBatch:
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32
    seq_lens: np.ndarray  # [num_seqs] int32
    cu_query_lens: np.ndarray  # [num_seqs + 1] int32
    logits_indices: np.ndarray  # [num_logit_rows] int64
    query_lens: list[int]
    logit_rows: list[tuple[int, int] | None]
    tree_mask: np.ndarray | None = None  # [num_tokens] int64 (AttentionMetadata.tree_mask); runs eagerly

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def uniform_query_len(self) -> int | None:
        """The query length shared by every sequence, if they all have the same one."""
        ql = self.query_lens
        return ql[0] if ql and ql.count(ql[0]) == len(ql) else None

    def to_device(self, device: torch.device, staging: Staging | None = None, only_logits: bool = False) -> BatchInputs:
        """only_logits: the CUDA-graph path copies the other inputs into its own buffers."""
        put = putter(device, staging)
        if only_logits:
            return BatchInputs(None, None, None, put("logits_indices", self.logits_indices), self.logit_rows)
        ids, positions, meta = put("input_ids", self.input_ids), put("positions", self.positions), self.meta(put)
        return BatchInputs(ids, positions, meta, put("logits_indices", self.logits_indices), self.logit_rows)

    def meta(self, put) -> AttentionMetadata:
        """The attention metadata on the device; put(name, array) -> tensor (see `putter`)."""
        return AttentionMetadata(
            cu_query_lens=put("cu", self.cu_query_lens),
            seq_lens=put("seq_lens", self.seq_lens),
            block_tables=put("block_tables", self.block_tables),
            slot_mapping=put("slots", self.slot_mapping),
            max_query_len=max(self.query_lens, default=0),
            max_seq_len=int(self.seq_lens.max(initial=0)),
            num_seqs=self.num_seqs,
            num_tokens=self.num_tokens,
            query_lens_cpu=self.query_lens,
            seq_lens_cpu=self.seq_lens.tolist(),
            tree_mask=None if self.tree_mask is None else put("tree_mask", self.tree_mask),
        )


def putter(device: torch.device, staging: Staging | None):
    """put(name, array) -> the array on the device: through the staging buffers, or a plain copy."""
    return staging.put if staging is not None else (lambda name, a: torch.from_numpy(a).to(device))


@dataclass
class PendingTokens:
    """Tokens the step in flight sampled, still on the device: the next step's placeholders read them."""

    tokens: torch.Tensor  # [num_rows] int64, on the device
    # request_id -> the row of its first placeholder; its later placeholders in a step read the rows
    # after it (a proposal's drafts, spec/draft_tokens.py DeferredDrafts; one token per request here).
    row_of: dict[str, int]


def pad_to_query_len(host: HostBatch, q: int, max_model_len: int) -> HostBatch | None:
    """The batch with every query padded to q tokens, for a graph of uniform query length q (or None)."""
    ql = np.asarray(host.query_lens, dtype=np.int64)
    pad = q - ql
    if (pad < 0).any() or (host.seq_lens.astype(np.int64) + pad > max_model_len).any():
        return None
    ns = len(ql)
    seq_index = np.repeat(np.arange(ns), ql)
    new_idx = seq_index * q + (np.arange(host.num_tokens) - host.cu_query_lens[seq_index])
    ids = np.zeros(ns * q, dtype=np.int64)
    ids[new_idx] = host.input_ids
    first = host.seq_lens.astype(np.int64) - ql  # position of each sequence's first query token
    positions = (first[:, None] + np.arange(q)).reshape(-1)
    slots = np.full(ns * q, -1, dtype=np.int64)
    slots[new_idx] = host.slot_mapping
    seq_lens, cu = (host.seq_lens + pad).astype(np.int32), (np.arange(ns + 1) * q).astype(np.int32)
    return HostBatch(
        ids, positions, slots, host.block_tables, seq_lens, cu, new_idx[host.logits_indices], [q] * ns, host.logit_rows
    )


def pending_fill(
    host: HostBatch, request_ids: list[str], pending: PendingTokens | None
) -> tuple[np.ndarray, np.ndarray] | None:
    """(flat token indices holding a placeholder, the pending row each one reads) or None."""
    dst = np.flatnonzero(host.input_ids < 0)
    if not dst.size:
        return None
    seq = np.searchsorted(host.cu_query_lens, dst, side="right") - 1
    rank = np.arange(len(seq)) - np.searchsorted(seq, seq, side="left")  # i-th placeholder of its sequence
    try:
        rows = np.fromiter((pending.row_of[request_ids[i]] for i in seq), np.int64, len(seq))
    except (KeyError, AttributeError):
        raise RuntimeError("a scheduled token is a placeholder nothing in flight will produce") from None
    return dst.astype(np.int64), rows + rank


class Staging:
    """Persistent pinned host + device buffers, one pair per input name, grown on demand."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bufs: dict[str, _StagingBuffer] = {}
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._recorded = False

    def begin(self) -> None:
        if self._recorded:
            self._copied.synchronize()

    def end(self) -> None:
        if self._copied is not None:
            record(self._copied, self.device)
            self._recorded = True

    def put(self, name: str, arr: np.ndarray) -> torch.Tensor:
        """arr on the device, a view of name's device buffer (valid until name's next put)."""
        n = arr.size
        buf = self._bufs.get(name)
        if buf is None or buf.host.numel() < n or buf.host.dtype != _DTYPES[arr.dtype]:
            size = max(n, 2 * (buf.host.numel() if buf is not None else 0), 64)
            host = torch.empty(size, dtype=_DTYPES[arr.dtype], pin_memory=True)
            buf = self._bufs[name] = _StagingBuffer(
                host, host.numpy(), torch.empty(size, dtype=host.dtype, device=self.device), {}
            )
        buf.host_np[:n] = arr.reshape(-1)
        views = buf.views.get(n)
        if views is None:
            if len(buf.views) >= _MAX_VIEWS:
                buf.views.clear()
            views = buf.views[n] = (buf.host[:n], buf.dev[:n])
        views[1].copy_(views[0], non_blocking=True)
        return views[1] if arr.ndim == 1 else views[1].view(arr.shape)


_MAX_VIEWS = 64  # cached (host, device) first-n views per staging buffer


@dataclass
class _StagingBuffer:
    host: torch.Tensor  # pinned
    host_np: np.ndarray  # the same memory
    dev: torch.Tensor
    views: dict[int, tuple[torch.Tensor, torch.Tensor]]  # n -> (host[:n], dev[:n])


_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


def build_host_batch(
    sched: SchedulerOutput,
    block_ids_of,
    block_size: int,
    tables: BlockTables | None = None,
    vectorized: bool | None = None,
) -> HostBatch:
    """block_ids_of(request_id) -> list[int]; tables: the caller's persistent block tables (else rebuilt
    from the lists); vectorized: see batch_rows.query_rows."""
    rows = query_rows(sched.scheduled, vectorized)
    n, c, cu = rows.query_lens, rows.computed, rows.cu_query_lens
    seq_index = np.repeat(np.arange(len(n)), n)
    # position of each token: its sequence's first query position plus its rank within the query
    positions = c[seq_index] + np.arange(len(rows.input_ids)) - cu[:-1][seq_index]
    if tables is not None and len(n) >= VECTORIZE_MIN_SEQS:
        block_tables = tables.gather(rows.request_ids, block_ids_of)
    else:
        block_tables = block_table_array(list(map(block_ids_of, rows.request_ids)))
    # slot of the token at position p of sequence i: block_tables[i, p // bs] * bs + p % bs
    bs = block_size
    slots = block_tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs
    seq_lens = (c + n).astype(np.int32)
    trees = tree_roots(sched)
    tree_mask = tree_inputs(trees, positions, cu.astype(np.int64), seq_index) if trees else None
    arrays = (rows.input_ids, positions, slots, block_tables, seq_lens, cu.astype(np.int32), rows.logits_indices)
    return HostBatch(*arrays, n.tolist(), rows.logit_rows, tree_mask)


def tree_roots(sched: SchedulerOutput) -> list[tuple[int, list[int]]]:
    """(flat index of the root, parents) of each draft tree under verification in the step."""
    trees: list[tuple[int, list[int]]] = []
    if not sched.draft_trees:  # no tree shape configured: no request carries one (no scan of the batch)
        return trees
    start = 0
    for s in sched.scheduled:
        if s.num_spec_tokens and s.request.spec_tree_parents is not None:
            trees.append(
                (start + s.num_new_tokens - s.num_spec_tokens - 1, s.request.spec_tree_parents[: s.num_spec_tokens])
            )
        start += s.num_new_tokens
    return trees
