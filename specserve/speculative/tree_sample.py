"""Sampled children for draft trees of random (temperature > 0) requests: each expanded node's children are drawn
from the draft distribution q there WITHOUT replacement, in draw order (exponential races: the top-m of q / E,
E ~ Exp(1), is an ordered draw without replacement, the Gumbel-top-k trick), and q is recorded so that
`verify_trees` can check them losslessly (it removes the rejected siblings' tokens from q and renormalizes).

Seeded rows race on the target's keyed noise for (seed, output position), as the target sampler and the chain
drafters do: the first child is the token a seeded draft chain would draft there, the next ones the race's
runners-up (any tree is lossless for them: verification emits the target sampler's own token)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from specserve.sample.metadata import SamplingMetadata
from specserve.sample.sampler import compute_target_probs, draw_exponential, keyed_exponential


class SampledChildren(NamedTuple):
    probs: Tensor  # [rows, vocab] q of each frontier row (the request's temperature, top-k, top-p, min-p)
    tokens: list[list[int]]  # per row: up to k distinct tokens in draw order (zero-probability draws left out)
    top_logprobs: list[list[float]]  # per row: the log of q's largest probabilities, descending, as many


def race_noise(meta: SamplingMetadata, device: torch.device) -> Tensor:
    """[rows, vocab] Exp(1) noise: keyed by (seed, position) for seeded rows (`seeded_tokens`'s), torch's default
    generator for the others (the chain drafters')."""
    noise = draw_exponential(meta.num_seqs, meta.vocab_size, None, device)
    seeded = [(i, (s + (1 << 63)) % (1 << 64) - (1 << 63)) for i, s in enumerate(meta.seeds) if s is not None]
    if seeded:
        rows, seeds = zip(*seeded)  # seeds as int64, as seeded_tokens reads them
        pos = torch.tensor([meta.positions[i] for i in rows], dtype=torch.int64, device=device)
        keyed = keyed_exponential(torch.tensor(seeds, dtype=torch.int64, device=device), pos, meta.vocab_size)
        noise[list(rows)] = keyed
    return noise


def sample_children(logits: Tensor, meta: SamplingMetadata, k: int, d2t: Tensor | None = None) -> SampledChildren:
    """logits [rows, width] of random rows (meta: one row each, at the output position its children take) ->
    each row's q, k children drawn from it without replacement and q's k largest log-probabilities. d2t:
    column -> target id (a reduced draft vocabulary; q is zero outside it). One host read."""
    if d2t is not None:
        full = logits.new_full((logits.shape[0], meta.vocab_size), float("-inf"))
        logits = full.index_copy_(1, d2t, logits)
    probs = compute_target_probs(logits[:, : meta.vocab_size], meta)
    keys, tokens = (probs / race_noise(meta, probs.device)).topk(min(k, meta.vocab_size), dim=-1)
    out_t, out_top = [], []
    for row_t, row_top in zip(tokens.tolist(), probs.topk(tokens.shape[1], dim=-1).values.tolist()):
        n = sum(x > 0 for x in row_top)  # q's support may be smaller than k: zero-probability draws come last
        out_t.append(row_t[:n])
        out_top.append([math.log(x) for x in row_top[:n]])
    return SampledChildren(probs, out_t, out_top)
