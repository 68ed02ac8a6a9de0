"""Lossless verification of draft trees (SpecInfer, Miao et al. 2024: recursive rejection over siblings; with
siblings drawn without replacement, Yang et al. 2024, "Multi-candidate speculative decoding").

At a node with target distribution p and children x_1..x_m, r = p; child i is accepted with probability
min(1, r(x_i) / q_i(x_i)), else r becomes normalize(max(0, r - q_i)) and the next sibling is tried; when every
child is rejected the emitted token is drawn from r, and at a leaf from p (the bonus token). A child's draft
distribution q (one-hot when there are no draft probs) is the one its siblings were drawn from, in node order
and without replacement: q_i is q with x_1..x_{i-1} removed and renormalized (`sibling_q`), the distribution
x_i was drawn from. Each step is then the one-candidate speculative-sampling step from r_i with q_i, and a
rejected x_i has r_{i+1}(x_i) = 0, so the emitted sequence follows the target.
Greedy and seeded rows emit the plain sampler's token at each node (argmax, or the race keyed by
(seed, position = root + depth)) and follow the child holding it, so their output equals plain decoding."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple, cast

import torch
from torch import Tensor

from specserve.sample.metadata import SamplingMetadata
from specserve.sample.rejection import _fixed_tokens
from specserve.sample.sampler import compute_target_probs, random_sample


class TreeOutput(NamedTuple):
    output_token_ids: list[list[int]]  # per sequence: the accepted path's tokens + one recovered/bonus token
    paths: list[list[int]]  # per sequence: the accepted nodes (1..N), by depth


def residual(r: Tensor, token: int, q: Tensor | None) -> Tensor:
    """normalize(max(0, r - q)) of a rejected sibling `token` (q None: one-hot); r itself if nothing is left."""
    out = r.clone()
    if q is None:
        out[token] = 0.0
    else:
        out = (out - q.to(out.dtype)).clamp_(min=0.0)
    total = out.sum()
    return r if total <= 0 else out / total


def sibling_q(q: Tensor, drawn: Sequence[int]) -> Tensor:
    """The distribution the next sibling was drawn from: q [vocab] without the earlier siblings' tokens,
    renormalized."""
    if not drawn:
        return q
    out = q.clone()
    out[list(drawn)] = 0.0
    total = out.sum()
    return out / total if total > 0 else out


def verify_trees(
    tokens: Sequence[Sequence[int]],
    parents: Sequence[Sequence[int]],
    draft_probs: Sequence[Tensor | None],
    target_logits: Tensor,
    meta: SamplingMetadata,
    generator: torch.Generator | None = None,
) -> TreeOutput:
    """tokens/parents: per sequence its N_i draft nodes (see speculative/tree.py); draft_probs: per sequence
    [N_i, vocab] (node i + 1's q, shared by its siblings: the module docstring) or None (one-hot).
    target_logits: [sum(N_i + 1), vocab], node order. meta: one row per sequence; its penalties are ignored
    (callers draft trees only for requests without: a node's history is its path, which the flat layout does
    not hold)."""
    meta = replace(meta, penalties=None)
    depths = [_depths(p) for p in parents]
    row_ids = [i for i, d in enumerate(depths) for _ in d]
    expanded = meta._select(row_ids, [x for d in depths for x in d])  # position = root + depth
    probs = compute_target_probs(target_logits, expanded)  # [rows, vocab]
    fixed_t = probs.argmax(dim=-1) if expanded.all_greedy else _fixed_tokens(probs, expanded)
    fixed = fixed_t.tolist() if fixed_t is not None else [-1] * len(row_ids)
    random_rows = [r for r, f in enumerate(fixed) if f < 0]
    host = dict(zip(random_rows, probs[random_rows].double().cpu())) if random_rows else {}
    draft_host = _random_draft_probs(draft_probs, [row_ids[r] for r in random_rows])
    outputs, paths, start = [], [], 0
    for seq, (toks, par) in enumerate(zip(tokens, parents)):
        children: list[list[int]] = [[] for _ in range(len(toks) + 1)]
        for i, p in enumerate(par, start=1):
            children[p].append(i)
        node, path, q_host = 0, [], draft_host.get(seq)
        while True:
            row, kids = start + node, children[node]
            if fixed[row] >= 0:
                nxt = next((c for c in kids if toks[c - 1] == fixed[row]), None)
                if nxt is None:
                    emitted = fixed[row]
                    break
                node = nxt
                path.append(node)
                continue
            r, nxt, drawn = host[row], None, list[int]()
            for c in kids:
                x = toks[c - 1]
                qc = None if q_host is None else sibling_q(q_host[c - 1], drawn)
                qx = 1.0 if qc is None else float(qc[x])
                if float(torch.rand((), dtype=torch.float64, generator=generator)) * qx < float(r[x]):
                    nxt = c
                    break
                r = residual(r, x, qc)
                drawn.append(x)
            if nxt is None:
                noise = torch.empty_like(r).exponential_(generator=generator)
                emitted = int(random_sample(r, noise))
                break
            node = nxt
            path.append(node)
        outputs.append([toks[n - 1] for n in path] + [emitted])
        paths.append(path)
        start += len(toks) + 1
    return TreeOutput(outputs, paths)


def _random_draft_probs(draft_probs: Sequence[Tensor | None], seqs: Sequence[int]) -> dict[int, Tensor]:
    """The draft probs of the sequences in `seqs` (those with a random row) on the host, float64: one copy."""
    need = sorted({s for s in seqs if draft_probs[s] is not None})
    if not need:
        return {}
    rows = [cast(Tensor, draft_probs[s]) for s in need]
    return dict(zip(need, torch.cat(rows).cpu().double().split([len(q) for q in rows])))


def _depths(parents: Sequence[int]) -> list[int]:
    """Depth of nodes 0..N."""
    depth = [0]
    for p in parents:
        depth.append(depth[p] + 1)
    return depth
