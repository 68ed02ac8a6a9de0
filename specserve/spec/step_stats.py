"""What one engine step and its proposal measured, as the adaptive controller (adaptive.py) sees it.

The decoder builds these every step; the per-position counts are what the acceptance and fill
windows (estimators.PositionRates) learn from.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


def _exceeding(hist: list[int]) -> tuple[int, ...]:
    """hist[v] = how many values equal v (v <= len - 1)  ->  counts[i] = how many exceed i."""
    counts, acc = [], 0
    for i in range(len(hist) - 1, 0, -1):
        acc += hist[i]
        counts.append(acc)
    return tuple(reversed(counts))


def count_above(limits: Sequence[int], length: int) -> tuple[int, ...]:
    """counts[i] = how many of `limits` exceed i, for i < length."""
    hist = [0] * (length + 1)
    for n, c in Counter(limits).items():  # Counter counts in C: this runs every step, for every request
        hist[min(max(n, 0), length)] += c
    return _exceeding(hist)


def verify_counts(num_drafts: Sequence[int], num_accepted: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per draft position i: (reached_i, accepted_i) over the verified requests.

    reached_i: position i was verified with every earlier position accepted (i < k and i <= a);
    accepted_i: it was accepted (i < a). Requires 0 <= a <= k."""
    pairs = Counter(zip(num_drafts, num_accepted))
    length = max((k for k, _ in pairs), default=0)
    reached, accepted = [0] * (length + 1), [0] * (length + 1)
    for (k, a), c in pairs.items():
        reached[min(a + 1, k)] += c
        accepted[a] += c
    return _exceeding(reached), _exceeding(accepted)


@dataclass(frozen=True)
class ProposalStats:
    """One call of the proposer: what it was asked for and what it produced."""

    num_seqs: int  # requests asked for drafts
    num_speculative_tokens: int  # the k chosen for this proposal
    asked_per_pos: tuple[int, ...]  # requests asked for a draft at position i (budget > i)
    drafted_per_pos: tuple[int, ...]  # requests that got one
    seconds: float
    # requests left out of num_seqs because their output budget or the context window ends here (they may
    # not draft at all): what the drafts were predicted to give leaves them out (acceptance.predicted_accepted)
    num_at_end: int = 0

    @property
    def depth(self) -> int:
        """Draft positions asked of any request: k, or fewer where every request nears its output budget
        (a draft model runs this many forwards; at 1-2 tokens left one takes a tenth of a k = 12 proposal)."""
        return sum(1 for n in self.asked_per_pos if n > 0)

    @classmethod
    def measure(cls, k: int, budgets: Sequence[int], num_drafted: Sequence[int], seconds: float,
                num_at_end: int = 0) -> ProposalStats:
        return cls(len(budgets), k, count_above(budgets, k), count_above(num_drafted, k), seconds, num_at_end)

    @classmethod
    def nothing(cls, num_seqs: int) -> ProposalStats:
        """measure(0, [0] * num_seqs, [], 0.0) without building and counting the list: the record of a
        k = 0 choice, made every step at high load (engine/overlap.py), where host work bounds the step."""
        return cls(num_seqs, 0, (), (), 0.0)


@dataclass(frozen=True)
class SpecStepStats:
    """One engine step as the controller sees it."""

    batch_size: int  # requests scheduled
    num_batched_tokens: int  # tokens the target computed, drafts included
    num_draft_tokens: int  # drafts verified (0: a plain decode / prefill step)
    step_seconds: float  # target forward + sampling or verification
    reached_per_pos: tuple[int, ...] = ()  # see verify_counts
    accepted_per_pos: tuple[int, ...] = ()
    proposal: ProposalStats | None = None  # the proposal whose drafts this step verified
    # Observed late (after the next proposal was made, so that observing overlaps the next forward:
    # decoder.SpecDecoder.deliver_late): that proposal's host seconds, which the time since the observation
    # before now includes (estimators.StepCosts._timed). 0: observed before the next proposal.
    ahead_seconds: float = 0.0

    @property
    def plain(self) -> bool:
        """Nothing drafted: no drafts verified, and its proposal (if any) asked for none."""
        return self.num_draft_tokens == 0 and (self.proposal is None or self.proposal.num_speculative_tokens == 0)
