"""EAGLE-2 style draft trees from a model drafter (Li et al. 2024): grown level by level, each expanded node
proposing its top-`branching` tokens scored by cumulative draft log-probability; the best `branching` new nodes of
a level are expanded (the drafter runs them: "fed", a tree of their own rooted at the request's last token), and
the tree kept is the best `budget` nodes of all proposed. A child never outscores its parent, so that set holds
every kept node's ancestors, and best-first order is topological."""

from __future__ import annotations

import torch

from specserve.attention.tree_mask import MAX_TREE_NODES
from specserve.speculative.tree import TreeShape


def add_level(trees: list[TreeDraft], logits: torch.Tensor, d2t: torch.Tensor | None = None) -> None:
    """The drafter's logits [sum of the trees' frontier sizes, width] (the frontiers' rows, tree by tree) -> each
    frontier node's top children (d2t: column -> target id, for a reduced vocabulary). One host read."""
    k = min(trees[0].shape.branching, logits.shape[-1])
    values, idx = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    found = zip(values.tolist(), (idx if d2t is None else d2t[idx]).tolist())
    for tree in trees:
        for f in range(len(tree.frontier)):
            tree.add_children(f, *next(found))


class TreeDraft:
    """One request's tree. Candidates are ids 0..; node 0 of the fed tree is the root, fed[i] its node i + 1."""

    def __init__(self, shape: TreeShape, budget: int, depth: int, max_fed: int) -> None:
        self.shape, self.budget, self.depth = shape, budget, min(depth, budget)  # a tree of n nodes: depth <= n
        self.max_fed = min(max_fed, budget, MAX_TREE_NODES - 1)  # fed nodes take slots after the root's
        self.tokens: list[int] = []
        self.parent: list[int] = []  # candidate id, -1: the root
        self.score: list[float] = []  # cumulative log-probability
        self.path: list[tuple[int, ...]] = []  # child ranks from the root
        self.fed: list[int] = []
        self.node_of: dict[int, int] = {-1: 0}  # candidate -> fed node
        self.frontier: list[int] = [-1]  # candidates whose children the next add_children calls give
        self._level = 0  # first candidate of the newest level

    def add_children(self, i: int, logprobs: list[float], tokens: list[int]) -> None:
        """The top tokens (best first) after frontier[i]."""
        c = self.frontier[i]
        base, path = (0.0, ()) if c < 0 else (self.score[c], self.path[c])
        for rank, (lp, tok) in enumerate(zip(logprobs, tokens)):
            if self.shape.paths is None or (*path, rank) in self.shape.paths:
                self.tokens.append(int(tok))
                self.parent.append(c)
                self.score.append(base + lp)
                self.path.append((*path, rank))

    def expand(self) -> bool:
        """Pick the newest level's best nodes to feed next (the new frontier); False: the tree is done."""
        new = range(self._level, len(self.tokens))
        self._level = len(self.tokens)
        if not new or len(self.path[new[0]]) >= self.depth:
            return False
        width = self.shape.branching if self.shape.paths is None else len(new)
        picks = sorted(new, key=lambda c: -self.score[c])[: min(width, self.max_fed - len(self.fed))]
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
        """(tokens, parents) of the best `budget` candidates, best first."""
        keep = sorted(range(len(self.tokens)), key=lambda c: (-self.score[c], c))[: self.budget]
        node = {-1: 0, **{c: i for i, c in enumerate(keep, start=1)}}
        return [self.tokens[c] for c in keep], [node[self.parent[c]] for c in keep]
