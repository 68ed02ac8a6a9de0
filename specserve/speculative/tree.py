"""Draft trees (EAGLE-2 / SpecInfer style): per request a tree of candidate continuations, verified in one
target forward. Node 0 is the root (the request's last token, not yet in the KV); drafts are nodes 1..N in
topological order, stored flat in `req.spec_token_ids` with `req.spec_tree_parents[i]` the parent node of
node i + 1. Every prefix of the nodes is a tree too, so the scheduler may cut drafts from the end. A chain
is the tree with parents [0, 1, ..., N - 1]; chains keep `spec_tree_parents = None` and the chain path.

Verify layout: node i is the i-th query token from the root, so its KV goes to the request's slot at
root position + i (the chain's slots); its RoPE position is root position + depth(i), and it attends to the
committed KV and its ancestors only (`ancestor_masks`). After acceptance `compact_kv` moves the accepted
path's KV to consecutive positions; the rejected nodes' slots lie beyond the committed length."""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.attention.tree_mask import MAX_TREE_NODES
from specserve.kv.spec import LayerKVCache
from specserve.runner.model_runner import ModelRunner
from specserve.sample.penalties import has_penalty
from specserve.scheduler.request import Request


@dataclass(frozen=True)
class TreeShape:
    """What a proposer may draft per request: depth <= depth, <= branching children per node, <= budget
    draft nodes; `paths` (vLLM's speculative_token_tree), when set, the only child-rank paths allowed."""

    depth: int
    branching: int
    budget: int
    paths: frozenset[tuple[int, ...]] | None = None


def parse_token_tree(value: str | Sequence[Sequence[int]]) -> frozenset[tuple[int, ...]]:
    """vLLM's speculative_token_tree: paths of child ranks, e.g. "[(0,), (1,), (0, 0)]"; prefix-closed."""
    raw = ast.literal_eval(value) if isinstance(value, str) else value
    paths = frozenset(tuple(int(r) for r in p) for p in raw)
    if not paths or any(not p or min(p) < 0 or (len(p) > 1 and p[:-1] not in paths) for p in paths):
        raise ValueError(
            "speculative_config.speculative_token_tree must be non-empty, prefix-closed paths of ranks >= 0."
        )
    if len(paths) >= MAX_TREE_NODES:
        raise ValueError(f"speculative_config.speculative_token_tree has more than {MAX_TREE_NODES - 1} nodes.")
    return paths


def tree_shape(
    depth: int, branching: int | None, budget: int | None, token_tree: str | Sequence[Sequence[int]] | None
) -> TreeShape | None:
    """The configured shape (speculative_config keys), or None for chains (the default)."""
    if token_tree is not None:
        paths = parse_token_tree(token_tree)
        return TreeShape(max(map(len, paths)), max(max(p) for p in paths) + 1, len(paths), paths)
    if branching is None or branching <= 1:
        return None
    return TreeShape(depth, branching, min(budget or depth * branching, MAX_TREE_NODES - 1))


def build_tree(candidates: Sequence[Sequence[int]], shape: TreeShape, budget: int) -> tuple[list[int], list[int]]:
    """(tokens, parents) of the trie of `candidates` (best first), within the shape and `budget` nodes."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[int, dict[int, int]] = {0: {}}  # node -> token -> child node
    rank_path: dict[int, tuple[int, ...]] = {0: ()}
    for cand in candidates:
        node = 0
        for tok in cand[: shape.depth]:
            kids = children[node]
            if tok in kids:
                node = kids[tok]
                continue
            path = (*rank_path[node], len(kids))
            if len(kids) >= shape.branching or len(tokens) >= budget or (shape.paths and path not in shape.paths):
                break
            tokens.append(int(tok))
            parents.append(node)
            new = len(tokens)
            kids[tok], children[new], rank_path[new] = new, {}, path
            node = new
    return tokens, parents


def is_chain(parents: Sequence[int]) -> bool:
    return all(p == i for i, p in enumerate(parents))


def path_nodes(parents: Sequence[int], leaf: int) -> list[int]:
    """Nodes from depth 1 to `leaf` (empty for the root)."""
    path = []
    while leaf:
        path.append(leaf)
        leaf = parents[leaf - 1]
    return path[::-1]


def compact_kv(caches: Sequence[LayerKVCache], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy every layer's KV (and scales) at slots src [n] to slots dst [n] (int64, on the cache's device);
    all reads happen before the writes, so a destination may be another move's source."""
    for layer in caches:
        for t in (layer.key, layer.value, layer.key_scale, layer.value_scale):
            if t is not None:
                flat = t.view(-1, *t.shape[2:])
                flat.index_copy_(0, dst, flat.index_select(0, src))


def accepted_kv_moves(
    block_ids: Sequence[int], block_size: int, root_pos: int, path: Sequence[int]
) -> tuple[list[int], list[int]]:
    """(src, dst) slots moving accepted node path[d - 1] (at root_pos + node) to root_pos + d."""
    src: list[int] = []
    dst: list[int] = []
    for d, node in enumerate(path, start=1):
        if node != d:
            for pos, out in ((root_pos + node, src), (root_pos + d, dst)):
                out.append(block_ids[pos // block_size] * block_size + pos % block_size)
    return src, dst


def tree_depth(parents: Sequence[int]) -> int:
    """The deepest node's depth (0: no drafts)."""
    depth = [0]
    for p in parents:
        depth.append(depth[p] + 1)
    return max(depth)


def tree_eligible(req: Request) -> bool:
    """Whether a request's drafts may form a tree: the flat layout holds no per-path history, so requests
    with penalties (which count the tokens before each position) or logprobs (read by row) draft chains."""
    return not has_penalty(req.params) and req.params.logprobs is None


def tree_allowed(runner: ModelRunner) -> bool:
    """Trees need the KV on this process (compaction) and a backend with the tree mask (not quantized Triton)."""
    return runner.accepts_pending and not (runner.fmt.quantized and runner.device.type == "cuda")
