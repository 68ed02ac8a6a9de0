"""Draft trees from one parallel forward (P-EAGLE): a request's k rows predict depths 1..k, each without the
earlier drafts, so the tree branches at the first level only: the first row's `branching` likeliest tokens
(greedy) or draws without replacement (random, tree_sample.py), the first of them continued by the later rows'
chain. A node at depth d is drawn from row d - 1's q whatever its parent, and the tree's shape depends on the
shape and budget only (never on the drawn tokens), so verification (sample/tree_rejection.py) stays lossless."""

from __future__ import annotations

from typing import NamedTuple

import torch

from specserve.sample.metadata import SamplingMetadata
from specserve.speculative.tree import TreeShape, build_tree
from specserve.speculative.tree_sample import sample_children


class ParallelTree(NamedTuple):
    tokens: list[int]
    parents: list[int]
    draft_probs: torch.Tensor | None  # [nodes, vocab]: node i + 1's q (None: a greedy request's one-hot drafts)


def parallel_trees(
    logits: torch.Tensor,
    ks: list[int],
    budgets: list[int],
    shape: TreeShape,
    greedy: list[bool],
    d2t: torch.Tensor | None,
    meta: SamplingMetadata | None,
) -> list[ParallelTree]:
    """logits [sum(ks), width]: request i's k_i rows (depths 1..k_i) -> its tree of at most budgets[i] nodes.
    meta: one row per request at its next output position (needed where some request is random)."""
    starts = [sum(ks[:i]) for i in range(len(ks))]
    b = min(shape.branching, logits.shape[-1])
    cands: list[list[list[int]]] = [[] for _ in ks]
    top_rows = [r for i, s in enumerate(starts) if greedy[i] for r in range(s, s + ks[i])]
    if top_rows:
        idx = torch.log_softmax(logits[top_rows].float(), dim=-1).topk(b, dim=-1).indices
        found = iter((idx if d2t is None else d2t[idx]).tolist())
        for i in (i for i in range(len(ks)) if greedy[i]):
            rows = [next(found) for _ in range(ks[i])]
            cands[i] = [[rows[0][0], *(r[0] for r in rows[1:])], *([t] for t in rows[0][1:])]
    probs: dict[int, torch.Tensor] = {}
    random = [i for i in range(len(ks)) if not greedy[i]]
    if random:
        assert meta is not None, "random requests need the drafter's sampling metadata"
        rows = [r for i in random for r in range(starts[i], starts[i] + ks[i])]
        depth = [d for i in random for d in range(ks[i])]
        drawn = sample_children(
            logits[rows], meta.select_rows([i for i in random for _ in range(ks[i])], depth), b, d2t
        )
        j = 0
        for i in random:
            toks = drawn.tokens[j : j + ks[i]]  # each row draws at least one token (q sums to 1)
            cands[i] = [[toks[0][0], *(t[0] for t in toks[1:])], *([t] for t in toks[0][1:])]
            probs[i] = drawn.probs[j : j + ks[i]]
            j += ks[i]
    out = []
    for i, budget in enumerate(budgets):
        tokens, parents = build_tree(cands[i], shape, budget)
        q = None
        if i in probs:  # node at depth d: drawn from row d - 1
            depth = [0]
            for p in parents:
                depth.append(depth[p] + 1)
            q = probs[i][[d - 1 for d in depth[1:]]]
        out.append(ParallelTree(tokens, parents, q))
    return out
