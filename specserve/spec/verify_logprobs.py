"""Logprobs of the tokens a speculative verify step emits, as plain decoding reports them.

A request asking for logprobs drafts like any other: the verify step scored each of its k + 1
positions, and token j of its output (accepted drafts, then the bonus or resampled token) comes from
its row j. Their logprobs are the log-softmax of those rows' raw logits (vLLM's default raw_logprobs,
what the plain sampler returns), top-N included.
"""
from __future__ import annotations

import torch

from specserve.sample.sampler import LogprobsTensors, compute_logprobs
from specserve.scheduler.request import Request


def verify_logprobs(reqs: list[Request], num_drafts: list[int], token_lists: list[list[int]],
                    logits: torch.Tensor) -> tuple[list[Request], LogprobsTensors] | None:
    """logits: [sum(num_drafts) + len(reqs), vocab], each request's k + 1 rows in turn. Returns (the
    request of each emitted token that asked for logprobs, their logprobs) or None if none asked."""
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
    idx = torch.tensor(rows, dtype=torch.int64).to(logits.device)
    ids = torch.tensor(tokens, dtype=torch.int64).to(logits.device)
    return owners, compute_logprobs(logits.index_select(0, idx), ids, max(r.params.logprobs for r in owners))
