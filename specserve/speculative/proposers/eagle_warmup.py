"""Compile, at start-up, the kernels of an EAGLE head's eager forwards.

The head's draft steps and its short first forwards replay CUDA graphs captured at start-up (their
kernels compiled then), but a new request's first propose feeds the head every prompt row in one
eager forward: prefill-sized attention through the head's own KV, the separate RoPE and KV-write
kernels, GEMV row counts of the fuse and LM-head linears that no graph used. Triton compiles each such
variant the first time it runs, which would slow the first requests of the first engine of a
process several times over. These forwards move that compile to start-up.
Variants that sizes alone do not reach are made one instead: the attention kernels do not specialize
the block table's width (triton_paged.py), and head uploads are 16-byte aligned (eagle_graph.py).
"""

from __future__ import annotations

import torch

from specserve.model.layers.triton_gemv import gemv_max_m
from specserve.runner import warmup
from specserve.speculative.proposers.eagle_graph import attention_arrays, attention_metadata


def warm_rows() -> tuple[list[int], list[int]]:
    """(row counts of fresh forwards, row counts of forwards after warmup.SPLIT_CONTEXT): the target's
    start-up row counts and, fresh, the prompt-sized ones (warmup.PROMPT_ROWS)."""
    fresh, after = warmup.start_up_rows()
    return fresh + list(warmup.PROMPT_ROWS), after


@torch.inference_mode()
def warm_eager_head(proposer) -> list[tuple[int, int]]:
    """One eager first forward of the head (fuse the target features, the layer, the LM head over the
    last rows) per (context, rows) of warm_rows(), over zero inputs in the head's own KV blocks 0..
    before any request holds one (nothing that matters is overwritten). Returns the (context, rows)
    run; sizes the head's KV pool cannot hold are skipped."""
    head, target = proposer.head, proposer.target
    dev = proposer.device
    dtype = target.embed_tokens.weight.dtype
    hidden = target.embed_tokens.weight.shape[1]
    width = hidden * (len(proposer.aux_hidden_layers) if head.cfg.method == "eagle3" else 1)
    block_size = proposer.kv.block_size
    capacity = min(proposer.kv.num_blocks * block_size, target.cos_sin_cache.shape[0])  # KV room, positions
    fresh, after = warm_rows()
    done = []
    for context, rows in [(0, t) for t in fresh] + [(warmup.SPLIT_CONTEXT, t) for t in after]:
        if context + rows > capacity:
            continue
        table = list(range(-(-(context + rows) // block_size)))
        arrays = attention_arrays([context], [rows], [table], block_size)
        meta = attention_metadata(arrays, proposer.upload.send(arrays), [rows])
        feats = head.fuse_target(torch.zeros(rows, width, device=dev, dtype=dtype))  # [rows, hidden]
        embeds = target.embed_tokens(torch.zeros(rows, dtype=torch.int64, device=dev))  # [rows, hidden]
        positions = torch.arange(context, context + rows, device=dev)
        _, normed = proposer._head(embeds, feats, positions, meta)
        proposer._logits(normed[-min(rows, gemv_max_m()) :])  # the picks: one row per request, k for P-EAGLE
        done.append((context, rows))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return done
