"""Setting up an EAGLE proposer: the target's graphs recaptured with aux outputs, step sizes, graph memory."""

from __future__ import annotations

import gc

import torch

from specserve.speculative.proposers.eagle_first import MAX_GRAPH_PICKS


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
    """The draft steps' padded batch sizes: the target's CUDA graph sizes (the same rule without)."""
    if parts.runner.graphs is not None:
        return tuple(parts.runner.graphs.batch_sizes)
    from specserve.runner.cuda_graph import DEFAULT_BATCH_SIZES

    m = parts.scheduler.max_num_seqs
    sizes = tuple(b for b in DEFAULT_BATCH_SIZES if b <= m) or (1,)
    return sizes + (m,) if m not in sizes and m < DEFAULT_BATCH_SIZES[-1] else sizes


def graph_logits_bytes(batch_sizes: tuple[int, ...], k: int, parallel: bool, vocab_size: int) -> int:
    """What the head's CUDA graphs keep allocated after the KV pool: their float32 logits outputs, [bs * picks,
    vocab] per first-forward graph and [bs, vocab] per draft-step graph (vocab: the head's logits width, its draft
    vocabulary when reduced)."""
    picks = k if parallel else 1
    rows = sum(b * picks for b in batch_sizes if b * picks <= MAX_GRAPH_PICKS)
    if not parallel and k > 1:
        rows += sum(batch_sizes)
    return rows * vocab_size * 4
