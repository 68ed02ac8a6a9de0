"""N-gram prompt lookup: draft the tokens that followed the latest earlier occurrence of the suffix."""

from __future__ import annotations

import numpy as np

from specserve.speculative.proposers.base import ProposeInput, Proposer


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


def find_draft(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Longest suffix n-gram (max_n down to min_n) seen earlier; the k tokens after its latest match."""
    if k <= 0 or len(tokens) < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    total = len(arr)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = arr[total - n :]
        # windows[i] = arr[i:i+n] for i < total - n (never the suffix itself)
        windows = np.lib.stride_tricks.sliding_window_view(arr[: total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        hits = hits[hits + n < total]
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []
