"""Flatten one scheduler step into model inputs: input_ids, positions, slot_mapping, block tables."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specserve.attention.base import AttentionMetadata
from specserve.scheduler.scheduler import SchedulerOutput


@dataclass
class BatchInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_logit_rows] int64: flat token index of each row to score
    # Per scheduled request: (first logit row, number of rows) or None when it does not sample.
    logit_rows: list[tuple[int, int] | None]


def build_batch(sched: SchedulerOutput, block_ids_of, block_size: int, device: torch.device,
                pad_blocks_to: int | None = None) -> BatchInputs:
    """block_ids_of(request_id) -> list[int]. Runs on the host; one copy per tensor to the device."""
    num_seqs = len(sched.scheduled)
    query_lens = [s.num_new_tokens for s in sched.scheduled]
    num_tokens = sum(query_lens)
    input_ids = np.empty(num_tokens, dtype=np.int64)
    positions = np.empty(num_tokens, dtype=np.int64)
    seq_lens = np.empty(num_seqs, dtype=np.int32)
    block_lists = []
    logits_idx: list[int] = []
    logit_rows: list[tuple[int, int] | None] = []
    start = 0
    for i, s in enumerate(sched.scheduled):
        req, n = s.request, s.num_new_tokens
        c = req.num_computed_tokens
        tokens = req.all_token_ids[c:c + n]
        if len(tokens) < n:  # the tail is draft tokens under verification
            tokens = tokens + req.spec_token_ids[:n - len(tokens)]
        input_ids[start:start + n] = tokens
        positions[start:start + n] = np.arange(c, c + n)
        seq_lens[i] = c + n
        block_lists.append(block_ids_of(req.request_id))
        if s.samples:
            rows = s.num_spec_tokens + 1
            logit_rows.append((len(logits_idx), rows))
            logits_idx.extend(range(start + n - rows, start + n))
        else:
            logit_rows.append(None)
        start += n
    max_blocks = max((len(b) for b in block_lists), default=1)
    if pad_blocks_to is not None:
        max_blocks = max(max_blocks, pad_blocks_to)
    block_tables = np.zeros((num_seqs, max(1, max_blocks)), dtype=np.int32)
    for i, blocks in enumerate(block_lists):
        block_tables[i, :len(blocks)] = blocks
    # slot of token at position p of seq i: block_tables[i, p // bs] * bs + p % bs
    seq_index = np.repeat(np.arange(num_seqs), query_lens)
    slot_mapping = (block_tables[seq_index, positions // block_size].astype(np.int64) * block_size
                    + positions % block_size)
    cu = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(query_lens, out=cu[1:])

    def dev(a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        if device.type == "cuda":
            t = t.pin_memory().to(device, non_blocking=True)
        return t

    meta = AttentionMetadata(
        cu_query_lens=dev(cu), seq_lens=dev(seq_lens), block_tables=dev(block_tables),
        slot_mapping=dev(slot_mapping), max_query_len=max(query_lens, default=0),
        max_seq_len=int(seq_lens.max(initial=0)), num_seqs=num_seqs, num_tokens=num_tokens,
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens.tolist())
    return BatchInputs(dev(input_ids), dev(positions), meta,
                       dev(np.asarray(logits_idx, dtype=np.int64)), logit_rows)
