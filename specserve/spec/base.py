"""Proposer interface: anything that drafts tokens for the target to verify.

After each step the engine hands the proposer the requests that just received tokens and what
the target computed in that step; the proposer sets each request's `spec_token_ids` (and
`spec_draft_probs` when its drafts were sampled from a distribution rather than chosen
deterministically). The next step verifies them in one target forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specserve.runner.model_runner import StepOutput
from specserve.scheduler.request import Request


@dataclass
class ProposeInput:
    requests: list[Request]  # running, just got tokens, not finished
    num_draft_tokens: list[int]  # per request: how many to draft (>= 1; the controller decided)
    step: StepOutput | None  # the target forward of this step (hidden states for EAGLE heads)
    # Per request: index in step.batch of its scheduled entry, to find its tokens' hidden states.
    batch_index: list[int]


class Proposer(Protocol):
    name: str
    # Target layers whose hidden states the proposer needs (EAGLE-3); () = none.
    aux_hidden_layers: tuple[int, ...]
    needs_target_hidden: bool

    def propose(self, inp: ProposeInput) -> None:
        """Set req.spec_token_ids (len <= num_draft_tokens) and req.spec_draft_probs for each request."""

    def on_request_finished(self, req: Request) -> None:
        """Release per-request proposer state (e.g. the draft model's KV blocks)."""

    def on_request_preempted(self, req: Request) -> None:
        """The target forgot this request's KV; forget the proposer's too."""


class OwnKVLifecycle:
    """Request lifecycle of a proposer with its own paged KV (draft model, EAGLE head).

    Expects `self.seqs` (request id -> the proposer's sequence), `self.kv` (its KV manager) and
    `self.sampler` (its draft sampler, which keeps per-request generators)."""

    def on_request_finished(self, req: Request) -> None:
        self._drop(req)

    def on_request_preempted(self, req: Request) -> None:
        self._drop(req)

    def _drop(self, req: Request) -> None:
        seq = self.seqs.pop(req.request_id, None)
        if seq is not None:
            self.kv.free(seq)
        self.sampler.forget(req.request_id)


def draft_budget(req: Request, k: int, max_model_len: int) -> int:
    """At most k drafts, and none beyond the context window or the output budget."""
    room_ctx = max_model_len - req.num_tokens - 1
    room_out = req.max_tokens - req.num_output_tokens - 1
    return max(0, min(k, room_ctx, room_out))


def stack_draft_probs(reqs: list[Request], num_drafts: list[int], vocab_size: int,
                      device: torch.device) -> torch.Tensor | None:
    """[total_drafts, vocab] draft_probs for the rejection sampler; None when every draft is one-hot."""
    if all(r.spec_draft_probs is None for r, k in zip(reqs, num_drafts) if k > 0):
        return None
    rows = []
    for r, k in zip(reqs, num_drafts):
        if k == 0:
            continue
        if r.spec_draft_probs is not None:
            rows.append(r.spec_draft_probs[:k].to(device))
        else:
            one_hot = torch.zeros(k, vocab_size, device=device)
            one_hot[torch.arange(k), torch.tensor(r.spec_token_ids[:k], device=device)] = 1.0
            rows.append(one_hot)
    return torch.cat(rows)
