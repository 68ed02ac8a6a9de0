"""EAGLE-2 style draft trees from a model drafter (Li et al. 2024): grown level by level, each expanded node
proposing its top-`branching` tokens scored by cumulative draft log-probability; the best `branching` new nodes of
a level are expanded (the drafter runs them: "fed", a tree of their own rooted at the request's last token), and
the tree kept is the best `budget` nodes of all proposed. A child never outscores its parent, so that set holds
every kept node's ancestors, and best-first order is topological.

Random requests' trees are sampled (tree_sample.py): children drawn from the draft distribution q without
replacement, in draw order. For verification to stay lossless (sample/tree_rejection.py) a node's number of
children is fixed before they are drawn, never by the drawn tokens: each level gets its share of the budget left
(spread over the levels to come), given to the frontier's best expected children (the node's score plus the log
of q's j-th largest probability, EAGLE-2's ranking without the draws); every drawn node is kept, in level order,
siblings in draw order (a prefix of that order is such a tree too: the scheduler may cut drafts from the end)."""

from __future__ import annotations

import numpy as np
import torch

from specserve.attention.tree_mask import MAX_TREE_NODES
from specserve.sample.metadata import SamplingMetadata
from specserve.speculative.tree import TreeShape
from specserve.speculative.tree_sample import sample_children


def add_level(
    trees: list[TreeDraft],
    logits: torch.Tensor,
    d2t: torch.Tensor | None = None,
    meta: SamplingMetadata | None = None,
) -> None:
    """The drafter's logits [sum of the trees' frontier sizes, width] (the frontiers' rows, tree by tree) -> each
    frontier node's children: its top tokens, or for a sampled tree tokens drawn from q. d2t: column -> target id,
    for a reduced vocabulary; meta: the drafter's sampling metadata, with row `tree.row` for each sampled tree's
    request at its next output position. One host read per kind of tree."""
    k = min(trees[0].shape.branching, logits.shape[-1])
    if not any(t.sampled for t in trees):
        _add_top(trees, logits, k, d2t)
        return
    assert meta is not None, "sampled trees need the drafter's sampling metadata"
    starts = np.cumsum([0, *(len(t.frontier) for t in trees)]).tolist()
    top = [t for t in trees if not t.sampled]
    if top:
        rows = [r for t, s in zip(trees, starts) if not t.sampled for r in range(s, s + len(t.frontier))]
        _add_top(top, logits[rows], k, d2t)
    sampled = [t for t in trees if t.sampled]
    rows = [r for t, s in zip(trees, starts) if t.sampled for r in range(s, s + len(t.frontier))]
    meta_rows = [t.row for t in sampled for _ in t.frontier]
    offsets = [t.frontier_depth(f) for t in sampled for f in range(len(t.frontier))]
    drawn = sample_children(logits[rows], meta.select_rows(meta_rows, offsets), k, d2t)
    j = 0
    for tree in sampled:
        n = len(tree.frontier)
        tree.add_drawn(drawn.tokens[j : j + n], drawn.top_logprobs[j : j + n], drawn.probs[j : j + n])
        j += n


def _add_top(trees: list[TreeDraft], logits: torch.Tensor, k: int, d2t: torch.Tensor | None) -> None:
    values, idx = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    found = zip(values.tolist(), (idx if d2t is None else d2t[idx]).tolist())
    for tree in trees:
        for f in range(len(tree.frontier)):
            tree.add_children(f, *next(found))


class TreeDraft:
    """One request's tree. Candidates are ids 0..; node 0 of the fed tree is the root, fed[i] its node i + 1."""

    def __init__(
        self, shape: TreeShape, budget: int, depth: int, max_fed: int, sampled: bool = False, row: int = 0
    ) -> None:
        self.shape, self.budget, self.depth = shape, budget, min(depth, budget)  # a tree of n nodes: depth <= n
        self.sampled, self.row = sampled, row  # row: the request's row of add_level's sampling metadata
        self.max_fed = min(max_fed, budget, MAX_TREE_NODES - 1)  # fed nodes take slots after the root's
        self.tokens: list[int] = []
        self.parent: list[int] = []  # candidate id, -1: the root
        self.score: list[float] = []  # cumulative log-probability
        self.path: list[tuple[int, ...]] = []  # child ranks from the root
        self.fed: list[int] = []
        self.node_of: dict[int, int] = {-1: 0}  # candidate -> fed node
        self.frontier: list[int] = [-1]  # candidates whose children the next add_children calls give
        self._level = 0  # first candidate of the newest level
        self.dist: list[torch.Tensor] = []  # sampled: per candidate, the q [vocab] it was drawn from

    def add_children(self, i: int, logprobs: list[float], tokens: list[int], dist: torch.Tensor | None = None) -> None:
        """The top tokens (best first) and their scores after frontier[i]; for a sampled tree drawn ones (in draw
        order, from `dist`)."""
        c = self.frontier[i]
        base, path = (0.0, ()) if c < 0 else (self.score[c], self.path[c])
        for rank, (lp, tok) in enumerate(zip(logprobs, tokens)):
            if self.shape.paths is None or (*path, rank) in self.shape.paths:
                self.tokens.append(int(tok))
                self.parent.append(c)
                self.score.append(base + lp)
                self.path.append((*path, rank))
                if dist is not None:
                    self.dist.append(dist)

    def add_drawn(self, tokens: list[list[int]], top: list[list[float]], probs: torch.Tensor) -> None:
        """A sampled tree's next level: per frontier node its draws (draw order), the log of q's largest
        probabilities (descending) and its row of probs [frontier, vocab] (q). Each node keeps its first draws, as
        many as its best expected children among the level's share of the budget; the j-th draw scores as q's j-th
        largest probability (it is tried j-th: the first draw is the likeliest to be accepted, whatever its q)."""
        base = [0.0 if c < 0 else self.score[c] for c in self.frontier]
        allowed = [self._allowed(() if c < 0 else self.path[c]) for c in self.frontier]
        expected = [(base[f] + lq, f, j) for f in range(len(top)) for j, lq in enumerate(top[f][: allowed[f]])]
        best = sorted(expected, key=lambda e: (-e[0], e[1], e[2]))[: self._level_budget(self.frontier_depth(0))]
        for f in range(len(tokens)):
            n = sum(e[1] == f for e in best)  # j < n: q's n largest probabilities made the cut
            self.add_children(f, top[f][:n], tokens[f][:n], probs[f])

    def _level_budget(self, depth: int) -> int:
        """Nodes a sampled tree adds after its nodes at `depth`: the budget left, spread over the levels to come
        (an explicit tree's budget is its own nodes: all of them)."""
        levels, room = self.depth - depth, self.budget - len(self.tokens)
        return 0 if levels <= 0 else room if self.shape.paths is not None else -(-room // levels)

    def frontier_depth(self, i: int) -> int:
        """The depth of frontier[i] (0: the root); its children are that many tokens into the drafts."""
        c = self.frontier[i]
        return 0 if c < 0 else len(self.path[c])

    def _allowed(self, path: tuple[int, ...]) -> int:
        """Children the shape allows after the node at `path`; of an explicit tree its leading listed ranks (a
        sampled node's children must be the first draws)."""
        if self.shape.paths is None:
            return self.shape.branching
        n = 0
        while (*path, n) in self.shape.paths:
            n += 1
        return n

    def expand(self) -> bool:
        """Pick the newest level's best nodes to feed next (the new frontier); False: the tree is done."""
        new = range(self._level, len(self.tokens))
        self._level = len(self.tokens)
        if not new or len(self.path[new[0]]) >= self.depth:
            return False
        width = self.shape.branching if self.shape.paths is None else len(new)
        picks = sorted(new, key=lambda c: -self.score[c])[: min(width, self.max_fed - len(self.fed))]
        if self.sampled:  # no more nodes fed than the next level may add
            picks = picks[: self._level_budget(len(self.path[new[0]]))]
        self.frontier = sorted(picks)
        for c in self.frontier:
            self.fed.append(c)
            self.node_of[c] = len(self.fed)
        return bool(picks)

    def fed_tree(self) -> tuple[list[int], list[int]]:
        """(tokens, parents) of the fed nodes."""
        return [self.tokens[c] for c in self.fed], [self.node_of[self.parent[c]] for c in self.fed]

    def frontier_nodes(self) -> list[int]:
        return [self.node_of[c] for c in self.frontier]

    def result(self) -> tuple[list[int], list[int]]:
        """(tokens, parents) of the best `budget` candidates, best first; of a sampled tree every candidate, in
        level order (draw order among siblings)."""
        if self.sampled:
            return list(self.tokens), [p + 1 for p in self.parent]
        keep = sorted(range(len(self.tokens)), key=lambda c: (-self.score[c], c))[: self.budget]
        node = {-1: 0, **{c: i for i, c in enumerate(keep, start=1)}}
        return [self.tokens[c] for c in keep], [node[self.parent[c]] for c in keep]

    def draft_probs(self) -> torch.Tensor | None:
        """Of a sampled tree: [nodes, vocab], node i + 1's q (the distribution it and its siblings were drawn
        from, without replacement); None for a top-k tree (its drafts are one-hot)."""
        return torch.stack(self.dist) if self.sampled and self.dist else None
