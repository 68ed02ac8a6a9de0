"""Request: one sequence's state as the scheduler and runner see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from specserve.sampling_params import SamplingParams

# Stands for a sampled token the host has not read back yet (never a valid token id).
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens or what fits in max_model_len
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify, not in all_token_ids
    # [len(spec_token_ids), vocab] distribution each draft was sampled from; None = one-hot drafts.
    spec_draft_probs: torch.Tensor | None = None
    spec_tree_parents: list[int] | None = None  # a draft tree's parent node per draft (speculative/tree.py)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = -1  # prefix-hit tokens at first scheduling; -1 until scheduled
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list = field(default_factory=list)
    # prompt_logprobs=N: [None, entry for prompt token 1, ...] (runner/prompt_logprobs.py); None: not asked.
    prompt_logprobs: list | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # Asynchronous scheduling: sampled tokens still on the device, each a PLACEHOLDER at the tail of
    # all_token_ids (not in output_token_ids until resolved).
    num_pending_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    def append_output_tokens(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def trim_output_tokens(self, n: int) -> None:
        """Forget the last n output tokens (accepted drafts past a stop string)."""
        if n > 0:
            del self.output_token_ids[-n:]
            del self.all_token_ids[-n:]

    def trim_logprobs(self) -> None:
        """Drop logprob entries past the output tokens (a verify step scored every token it emitted)."""
        while len(self.logprobs) > len(self.output_token_ids):
            entry = self.logprobs.pop()
            self.cumulative_logprob -= next(iter(entry.values()))[0]  # the sampled token comes first

    def add_pending_token(self) -> None:
        self.all_token_ids.append(PLACEHOLDER)
        self.num_pending_tokens += 1

    def resolve_pending_token(self, token_id: int) -> None:
        self.all_token_ids[len(self.all_token_ids) - self.num_pending_tokens] = token_id
        self.output_token_ids.append(token_id)
        self.num_pending_tokens -= 1

    def drop_pending_tokens(self) -> None:
        del self.all_token_ids[len(self.all_token_ids) - self.num_pending_tokens :]
        self.num_pending_tokens = 0

    def finishes_by_length_on_pending(self, max_model_len: int) -> bool:
        """The pending tokens end the request by length whatever they are: no step for it needed."""
        return self.num_pending_tokens > 0 and (
            self.num_output_tokens + self.num_pending_tokens >= self.max_tokens or self.num_tokens >= max_model_len
        )

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt tokens still to score: their positions must be computed, not taken from the prefix cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished
