"""Acceptance of greedy speculation for every k, replayed on the target's greedy output.

Greedy verification accepts exactly the drafts equal to the target's own greedy tokens, and the
output does not depend on the drafts (lossless), so one no-speculation output tells what any k
would have accepted: replay the proposer at each verification point (draft budget as the engine's
`draft_budget`: at most k, none past max_tokens), accept the matching prefix, move past it and the
bonus token. n-gram: the proposer itself on the true prefix. A greedy draft model: its chain from
position j agrees with the target for as long as its argmax given the TRUE prefix does (while it
agrees, its own context is the true prefix), so one teacher-forced forward gives every position's
run length. bench/spec_bench.py checks these against the measured acceptance of the k it runs.
"""
from __future__ import annotations

import torch


def _walk(n_out: int, max_tokens: int, k: int, accept) -> tuple[int, int, int]:
    """Replay verification over an output of n_out tokens: returns (drafts, draft tokens, accepted).
    accept(j, budget) -> (number drafted, number accepted) at output position j."""
    drafts = drafted = accepted = 0
    j = 1  # the prefill samples the first output token
    while j < n_out:
        budget = min(k, max_tokens - j - 1)
        n, a = accept(j, budget) if budget > 0 else (0, 0)
        a = min(a, n_out - j)
        if n:
            drafts, drafted, accepted = drafts + 1, drafted + n, accepted + a
        j += a + 1
    return drafts, drafted, accepted


def simulate_ngram(prompt: list[int], output: list[int], max_tokens: int, k: int, min_n: int,
                   max_n: int) -> tuple[int, int, int]:
    """The n-gram proposer (prompt_lookup_min/max = min_n/max_n) replayed on a greedy output."""
    from specserve.spec.ngram import find_draft

    seq = prompt + output

    def accept(j: int, budget: int) -> tuple[int, int]:
        d = find_draft(seq[:len(prompt) + j], min_n, max_n, budget)
        a = 0
        while a < len(d) and d[a] == output[j + a]:
            a += 1
        return len(d), a

    return _walk(len(output), max_tokens, k, accept)


def draft_agreement(loaded, prompt: list[int], output: list[int]) -> list[int]:
    """run[j]: how many output tokens from j on the draft's greedy chain reproduces, computed from one
    teacher-forced forward (argmax at each position given the true prefix)."""
    from specserve.spec.train_target import dense_forward

    device = loaded.model.embed_tokens.weight.device
    seq = prompt + output
    _, hidden, _ = dense_forward(loaded.model, [seq], (), device)
    rows = hidden[len(prompt) - 1:len(seq) - 1]  # row i predicts output[i]
    argmax = torch.cat([loaded.model.compute_logits(rows[i:i + 256]).argmax(-1) for i in range(0, len(rows), 256)])
    match = (argmax.cpu() == torch.tensor(output)).tolist()
    run = [0] * (len(output) + 1)
    for j in range(len(output) - 1, -1, -1):
        run[j] = run[j + 1] + 1 if match[j] else 0
    return run


def simulate_draft(run: list[int], n_out: int, max_tokens: int, k: int) -> tuple[int, int, int]:
    """A greedy draft model replayed on a greedy output, from its `draft_agreement` runs."""
    return _walk(n_out, max_tokens, k, lambda j, budget: (budget, min(run[j], budget)))
