"""N-gram prompt lookup: draft the tokens that followed the latest earlier occurrence of the suffix."""

from __future__ import annotations

import numpy as np

from specserve.speculative.proposers.base import ProposeInput, Proposer
from specserve.speculative.tree import TreeShape, build_tree, is_chain


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max.")
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, inp: ProposeInput) -> None:
        for req, k in zip(inp.requests, inp.num_draft_tokens):
            req.spec_token_ids = find_draft(req.all_token_ids, self.min_n, self.max_n, k)
            req.spec_draft_probs = None

    def propose_tree(self, inp: ProposeInput, shape: TreeShape) -> None:
        """Several matches as branches: longer suffix matches first, later ones first among equals."""
        for req, budget in zip(inp.requests, inp.num_draft_tokens):
            found = find_drafts(req.all_token_ids, self.min_n, self.max_n, shape.depth, 4 * shape.branching)
            req.spec_token_ids, parents = build_tree(found, shape, budget)
            req.spec_tree_parents = None if is_chain(parents) else parents
            req.spec_draft_probs = None


def find_draft(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Longest suffix n-gram (max_n down to min_n) seen earlier; the k tokens after its latest match."""
    found = find_drafts(tokens, min_n, max_n, k, 1)
    return found[0] if found else []


def find_drafts(tokens: list[int], min_n: int, max_n: int, k: int, max_matches: int) -> list[list[int]]:
    """Up to max_matches continuations (k tokens each at most) after earlier occurrences of the suffix
    n-gram, n from max_n down to min_n, latest occurrence first for each n."""
    if k <= 0 or len(tokens) < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    total = len(arr)
    found: list[list[int]] = []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = arr[total - n :]
        # windows[i] = arr[i:i+n] for i < total - n (never the suffix itself)
        windows = np.lib.stride_tricks.sliding_window_view(arr[: total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        for start in hits[hits + n < total][::-1][: max_matches - len(found)] + n:
            found.append(arr[start : start + k].tolist())
        if len(found) >= max_matches:
            break
    return found
