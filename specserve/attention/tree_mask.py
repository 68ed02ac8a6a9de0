"""Draft-tree query rows (speculative/tree.py): RoPE positions by depth and ancestor bitmasks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MAX_TREE_NODES = 63  # root included: a row's bitmask (int64, sign bit unused) covers its query's first 63 tokens


def tree_layout(parents: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(depth [N + 1], ancestor bitmask [N + 1] int64) of nodes 0..N, node i + 1's parent parents[i] <= i:
    bit j of mask[i] = node j is node i or one of its ancestors."""
    n = len(parents) + 1
    depth = np.zeros(n, dtype=np.int64)
    mask = np.ones(n, dtype=np.int64)
    for i, p in enumerate(parents, start=1):
        depth[i], mask[i] = depth[p] + 1, mask[p] | (1 << i)
    return depth, mask


def tree_inputs(
    trees: list[tuple[int, list[int]]], positions: np.ndarray, cu_query_lens: np.ndarray, seq_index: np.ndarray
) -> np.ndarray:
    """trees: (flat index of the root, parents) per draft tree. Sets the tree rows' positions (in place) to
    the root's plus their depth; returns the [num_tokens] int64 mask (-1: causal rows). The KV slots stay
    the query order's, so the tree's nodes fill the slots a chain of the same length would."""
    mask = np.full(len(positions), -1, dtype=np.int64)
    for root, parents in trees:
        before = root - int(cu_query_lens[seq_index[root]])  # query tokens ahead of the root: all ancestors
        if before + len(parents) + 1 > MAX_TREE_NODES:
            raise ValueError(f"a draft tree and its query prefix exceed {MAX_TREE_NODES} tokens")
        depth, bits = tree_layout(parents)
        rows = slice(root, root + len(depth))
        positions[rows] = positions[root] + depth
        mask[rows] = (bits << before) | ((1 << before) - 1)
        mask[int(cu_query_lens[seq_index[root]]) : root] = -1
    return mask
