"""Prompt logprobs (vLLM's `prompt_logprobs=N`): the hidden state at prompt position p scores token p + 1.

`req.prompt_logprobs` is [None, entry(1), entry(2), ...], entry = {token_id: (logprob, rank)} for the
prompt token and the top N, from float32 log_softmax over the full vocabulary, a few hundred rows at a
time. Positions already scored (recompute after preemption) are skipped: exact whatever the chunking."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Rows of full-vocab float32 logits materialized at once: 2**26 values = 256 MiB.
_MAX_LOGIT_VALUES = 1 << 26

PromptLogprobEntry = dict[int, tuple[float, int]]  # token id -> (logprob, rank)


@dataclass
class PromptLogprobRows:
    """The rows of one scheduled request whose logits score prompt tokens in this step."""

    sched_index: int  # index into SchedulerOutput.scheduled
    first_row: int  # flat token index (in the step's batch) of the first row
    target_ids: list[int]  # the prompt tokens those rows score, one per row
    num_top: int  # N of prompt_logprobs=N


def plan_prompt_logprobs(sched) -> list[PromptLogprobRows]:
    """Which flat rows of this step score prompt tokens that have no entry yet."""
    plan: list[PromptLogprobRows] = []
    start = 0
    for i, s in enumerate(sched.scheduled):
        req, n = s.request, s.num_new_tokens
        done = req.prompt_logprobs
        if done is not None and len(done) < req.num_prompt_tokens:
            c = req.num_computed_tokens
            # Positions lo .. hi-1 of this chunk score tokens lo+1 .. hi (entries lo+1 .. hi).
            lo, hi = max(c, len(done) - 1), min(c + n, req.num_prompt_tokens - 1)
            if hi > lo:
                targets = req.prompt_token_ids[lo + 1 : hi + 1]
                plan.append(PromptLogprobRows(i, start + lo - c, targets, req.params.prompt_logprobs))
        start += n
    return plan


@torch.inference_mode()
def compute_prompt_logprobs(
    compute_logits, hidden: torch.Tensor, plan: list[PromptLogprobRows], vocab_size: int
) -> list[list[PromptLogprobEntry]]:
    """hidden [num_tokens, hidden] of the whole step -> per plan item, its entries in row order."""
    step = max(1, _MAX_LOGIT_VALUES // max(1, vocab_size))
    results = []
    for item in plan:
        entries: list[PromptLogprobEntry] = []
        targets = torch.tensor(item.target_ids, dtype=torch.long, device=hidden.device)
        for r in range(0, len(item.target_ids), step):
            rows = hidden[item.first_row + r : item.first_row + min(r + step, len(item.target_ids))]
            entries.extend(_entries(compute_logits(rows), targets[r : r + rows.shape[0]], item.num_top))
        results.append(entries)
    return results


def _entries(logits: torch.Tensor, targets: torch.Tensor, num_top: int) -> list[PromptLogprobEntry]:
    """logits [rows, vocab], targets [rows] -> one entry per row: the target plus the top num_top."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [rows, vocab]
    target_lp = logprobs.gather(1, targets[:, None])  # [rows, 1]
    ranks = (logprobs >= target_lp).sum(dim=-1)  # vLLM's rank: tokens at least as likely
    top_lp, top_ids = (t.tolist() for t in logprobs.topk(num_top, dim=-1))  # [rows, num_top] each
    out = []
    for row, (tid, lp, rank) in enumerate(zip(targets.tolist(), target_lp[:, 0].tolist(), ranks.tolist())):
        entry = {tid: (lp, rank)}
        for j, (t, v) in enumerate(zip(top_ids[row], top_lp[row]), 1):
            entry.setdefault(t, (v, j))
        out.append(entry)
    return out
