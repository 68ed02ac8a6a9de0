"""The `Proposer` interface: anything that drafts tokens for the target to verify."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specserve.runner.model_runner import StepOutput
from specserve.scheduler.request import Request
from specserve.speculative.tree import TreeShape

if TYPE_CHECKING:
    from specserve.speculative.proposers.draft_tokens import DeferredDrafts


@dataclass
class ProposeInput:
    requests: list[Request]  # running, just got tokens, not finished
    num_draft_tokens: list[int]  # per request: how many to draft (>= 1; the controller decided)
    step: StepOutput | None  # the target forward of this step (hidden states for EAGLE heads)
    # Per request: index in step.batch of its scheduled entry, to find its tokens' hidden states.
    batch_index: list[int]


class Proposer(ABC):
    """Drafts tokens. Only `propose` is required; the other hooks default to doing nothing."""

    name: str = "proposer"
    # Target layers whose hidden states the proposer needs (EAGLE-3); () = none.
    aux_hidden_layers: tuple[int, ...] = ()
    # Whether the proposer reads the target's hidden states (then `absorb` gets mid-prefill rows).
    needs_target_hidden: bool = False

    @abstractmethod
    def propose(self, inp: ProposeInput) -> None:
        """Set req.spec_token_ids (len <= num_draft_tokens) and req.spec_draft_probs for each request."""

    def propose_tree(self, inp: ProposeInput, shape: TreeShape) -> None:
        """Draft trees (speculative/tree.py): per request at most num_draft_tokens nodes of depth <= shape.depth
        and <= shape.branching children each: req.spec_token_ids = the nodes' tokens, req.spec_tree_parents =
        their parents (None for a chain), req.spec_draft_probs = [nodes, vocab] or None. Chain proposers keep
        this default: the chain of depth <= shape.depth."""
        depths = [min(n, shape.depth) for n in inp.num_draft_tokens]
        self.propose(ProposeInput(inp.requests, depths, inp.step, inp.batch_index))

    def absorb(self, inp: ProposeInput) -> None:
        """Rows of requests that computed prompt tokens without sampling, for a proposer keeping target features."""

    def allow_deferred(self, allowed: bool) -> None:
        """Whether drafts may stay on the device until the verify step; set once by the decoder."""

    def take_deferred(self) -> DeferredDrafts | None:
        """The last proposal's drafts still on the device, handed over once (None: on the host)."""
        return None

    def catch_up_tokens(self) -> int:
        """Tokens the last proposal fed beyond its drafting (a draft model catching up)."""
        return 0

    def on_request_finished(self, req: Request) -> None:
        """Release per-request proposer state (e.g. the draft model's KV blocks)."""

    def on_request_preempted(self, req: Request) -> None:
        """The target forgot this request's KV; forget the proposer's too."""


class OwnKVLifecycle:
    """Request lifecycle of a proposer with its own paged KV (draft model, EAGLE head)."""

    def on_request_finished(self, req: Request) -> None:
        self._drop(req)

    def on_request_preempted(self, req: Request) -> None:
        self._drop(req)

    def _drop(self, req: Request) -> None:
        seq = self.seqs.pop(req.request_id, None)  # type: ignore[attr-defined]
        if seq is not None:
            self.kv.free(seq)  # type: ignore[attr-defined]


def draft_budget(req: Request, k: int, max_model_len: int) -> int:
    """At most k drafts, and none beyond the context window or the output budget."""
    room_ctx = max_model_len - req.num_tokens - 1
    room_out = req.max_tokens - req.num_output_tokens - 1
    return max(0, min(k, room_ctx, room_out))
