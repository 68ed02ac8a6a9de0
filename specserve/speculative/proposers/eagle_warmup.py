"""Compile, at start-up, the kernels of an EAGLE head's eager forwards."""

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
    """One eager first forward of the head (fuse the target features, the layer, the LM head over the last rows) per
    (context, rows) of warm_rows(), over zero inputs in the head's own KV blocks 0.. before any request holds one
    (nothing that matters is overwritten)."""
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
