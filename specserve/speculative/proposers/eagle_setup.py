"""Setting up an EAGLE proposer: the target's graphs recaptured with aux outputs, step sizes, graph memory, and
the eager head's kernels compiled at start-up."""

from __future__ import annotations

import gc

import torch

from specserve.runner import warmup
from specserve.speculative.proposers.eagle_first import MAX_GRAPH_PICKS
from specserve.speculative.proposers.eagle_graph import attention_arrays, attention_metadata


def recapture_with_aux(runner, aux_layers: tuple[int, ...]) -> None:
    """The target must return these layers' inputs. CUDA graphs captured before that return other
    outputs (the runner would run such steps eagerly), so capture them again with the aux outputs."""
    runner.model.aux_hidden_layers = aux_layers
    old = runner.graphs
    if old is None or old.aux_hidden_layers == tuple(aux_layers):
        return
    args = (
        old.batch_sizes[-1],
        old.max_model_len,
        old.verify_query_lens,
        old.prefill_query_lens,
        old.catch_up_query_lens,
        old.mixed_token_lens,
    )
    runner.graphs = None
    del old  # free its memory pool before the new capture
    gc.collect()
    torch.cuda.empty_cache()
    runner.capture_graphs(*args)


def step_batch_sizes(parts) -> tuple[int, ...]:
    """The draft steps' padded batch sizes: the target's CUDA graph sizes (the same rule without), up to
    VERIFY_MAX_BATCH (larger batches draft eagerly: speculation is off long before)."""
    from specserve.runner.cuda_graph import VERIFY_MAX_BATCH, graph_batch_sizes

    graphs = parts.runner.graphs
    sizes = tuple(graphs.batch_sizes) if graphs is not None else graph_batch_sizes(parts.scheduler.max_num_seqs)
    return tuple(b for b in sizes if b <= VERIFY_MAX_BATCH) or (1,)


def graph_logits_bytes(batch_sizes: tuple[int, ...], k: int, parallel: bool, vocab_size: int) -> int:
    """What the head's CUDA graphs keep allocated after the KV pool: their float32 logits outputs, [bs * picks,
    vocab] per first-forward graph and [bs, vocab] per draft-step graph (vocab: the head's logits width, its draft
    vocabulary when reduced)."""
    picks = k if parallel else 1
    rows = sum(b * picks for b in batch_sizes if b * picks <= MAX_GRAPH_PICKS)
    if not parallel and k > 1:
        rows += sum(batch_sizes)
    return rows * vocab_size * 4


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
    from specserve.model.layers.triton_gemv import gemv_max_m  # imports triton

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
        head.compute_logits(normed[-min(rows, gemv_max_m()) :], target)  # the picks: one row per request, k for P-EAGLE
        done.append((context, rows))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return done
