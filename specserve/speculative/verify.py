"""Verification of a step's drafts: draft distributions for the rejection sampler, per-position counts, logprobs."""

from __future__ import annotations

import functools

import numpy as np
import torch

from specserve.metrics.stats import StatsCollector
from specserve.sample.metadata import SamplingMetadata
from specserve.sample.rejection import RejectionSampler
from specserve.sample.sampler import LogprobsTensors, compute_logprobs
from specserve.sample.tree_rejection import verify_trees
from specserve.scheduler.request import Request


@functools.cache
def position_labels(pos: int) -> dict[str, str]:
    """A draft position's metric labels, built once."""
    return {"position": str(pos)}


def stack_draft_probs(
    reqs: list[Request], num_drafts: list[int], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """[total_drafts, vocab] draft_probs for the rejection sampler; None when every draft is one-hot."""
    drafted = [(r, k) for r, k in zip(reqs, num_drafts) if k > 0]
    if all(r.spec_draft_probs is None for r, _ in drafted):
        return None
    rows = []
    for r, k in drafted:
        if r.spec_draft_probs is not None:
            rows.append(r.spec_draft_probs[:k].to(device))
        else:
            one_hot = torch.zeros(k, vocab_size, device=device)
            one_hot[torch.arange(k), torch.tensor(r.spec_token_ids[:k], device=device)] = 1.0
            rows.append(one_hot)
    return torch.cat(rows)


def verify_drafts(
    rejection: RejectionSampler,
    reqs: list[Request],
    num_drafts: list[int],
    logits: torch.Tensor,
    meta: SamplingMetadata,
    vocab_size: int,
) -> tuple[list[list[int]], list[int], list[list[int] | None] | None]:
    """logits: [sum(num_drafts) + len(reqs), vocab] -> per request its emitted tokens and accepted draft count,
    and where some request drafted a tree, per request its accepted nodes (None: a chain)."""
    is_tree = [k > 0 and r.spec_tree_parents is not None for r, k in zip(reqs, num_drafts)]
    if not any(is_tree):
        drafts = [r.spec_token_ids[:k] for r, k in zip(reqs, num_drafts)]
        out = rejection(drafts, stack_draft_probs(reqs, num_drafts, vocab_size, logits.device), logits, meta)
        return out.output_token_ids, out.num_accepted, None
    tokens: list[list[int]] = [[] for _ in reqs]
    accepted, paths = [0] * len(reqs), list[list[int] | None]([None] * len(reqs))
    ends = np.cumsum(np.asarray(num_drafts) + 1)
    for tree in (False, True):  # chains through the chain sampler, trees through the tree sampler
        idx = [i for i, t in enumerate(is_tree) if t == tree]
        if not idx:
            continue
        rows = torch.from_numpy(np.concatenate([np.arange(ends[i] - num_drafts[i] - 1, ends[i]) for i in idx]))
        sub, sub_k, sub_logits = [reqs[i] for i in idx], [num_drafts[i] for i in idx], logits[rows.to(logits.device)]
        if tree:
            found = verify_trees(
                [r.spec_token_ids[:k] for r, k in zip(sub, sub_k)],
                [r.spec_tree_parents[:k] for r, k in zip(sub, sub_k)],  # type: ignore[index]
                [None if r.spec_draft_probs is None else r.spec_draft_probs[:k] for r, k in zip(sub, sub_k)],
                sub_logits,
                meta.select_rows(idx),
                rejection.generator,
            )
            for i, toks, path in zip(idx, *found):
                tokens[i], accepted[i], paths[i] = toks, len(path), path
        else:
            t, a, _ = verify_drafts(rejection, sub, sub_k, sub_logits, meta.select_rows(idx), vocab_size)
            for i, toks, n in zip(idx, t, a):
                tokens[i], accepted[i] = toks, n
    return tokens, accepted, paths


def position_counts(num_drafts: list[int], num_accepted: list[int], k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per draft position j < k: (requests that had a draft at j, requests that accepted the draft at j)."""
    reached, accepted = [0] * k, [0] * k
    for d, a in zip(num_drafts, num_accepted):
        for j in range(min(d, k)):
            reached[j] += 1
        for j in range(min(a, k)):
            accepted[j] += 1
    return tuple(reached), tuple(accepted)


def record_verify_metrics(
    stats: StatsCollector, num_drafts: list[int], num_accepted: list[int], accepted_per_pos: tuple[int, ...]
) -> None:
    """The spec_decode_* counters of one verify step. accepted_per_pos: position_counts' accepted counts."""
    num_seqs = len(num_drafts) - num_drafts.count(0)
    if not num_seqs:
        return
    stats.inc("spec_decode_num_drafts_total", num_seqs)
    stats.inc("spec_decode_num_draft_tokens_total", sum(num_drafts))
    stats.inc("spec_decode_num_accepted_tokens_total", sum(num_accepted))  # 0 where k is 0
    for pos, count in enumerate(accepted_per_pos):
        if count:
            stats.inc("spec_decode_num_accepted_tokens_per_pos_total", count, position_labels(pos))


def verify_logprobs(
    reqs: list[Request], num_drafts: list[int], token_lists: list[list[int]], logits: torch.Tensor
) -> tuple[list[Request], LogprobsTensors] | None:
    """logits: [sum(num_drafts) + len(reqs), vocab], k + 1 rows per request -> (the request of each emitted token
    that asked for logprobs, their logprobs), or None if none asked."""
    rows: list[int] = []
    tokens: list[int] = []
    owners: list[Request] = []
    start = 0
    for req, k, emitted in zip(reqs, num_drafts, token_lists):
        if req.params.logprobs is not None:
            rows.extend(range(start, start + len(emitted)))
            tokens.extend(emitted)
            owners.extend([req] * len(emitted))
        start += k + 1
    if not owners:
        return None
    idx, ids = torch.tensor([rows, tokens], dtype=torch.int64).to(logits.device)
    return owners, compute_logprobs(logits.index_select(0, idx), ids, max(r.params.logprobs or 0 for r in owners))
