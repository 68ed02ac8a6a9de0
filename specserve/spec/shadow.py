"""Acceptance of n-gram drafts measured while not drafting ("shadow" drafts).

An adaptive controller that stops drafting stops measuring acceptance, and then decides on what it
measured last. Where acceptance moves with the requests' stage (a fresh answer repeats nothing yet,
a long one repeats itself), that is the wrong moment's figure: on the H200 8B n-gram sweep at 16
requests, the k = 4 steps it took on a stale estimate got 1.18 tokens per request against the 1.44
predicted, and it ran at 0.93 of no drafts.

An n-gram draft is a pure function of the token history, so its outcome can be measured after the
fact for free: for a request whose last K tokens are known, the draft the proposer would have made
before them (`ngram.find_draft` on the history up to there) is compared with them. With greedy
sampling the matched prefix is exactly what verification would have accepted; with random sampling
a one-token draft is accepted with the target's probability of that token, which is also the
probability that the sampled token matches, so the count is an unbiased sample either way. A few
requests per step (round robin) keep the cost at a lookup or two per step.
"""
from __future__ import annotations

from collections.abc import Sequence

from specserve.scheduler.request import Request
from specserve.spec.ngram import find_draft
from specserve.spec.step_stats import count_above, verify_counts

SHADOW_EVERY = 4  # steps without drafts between shadow samples (each refreshes the controller's cached terms)
SHADOW_REQUESTS = 8  # requests per shadow sample: about two n-gram lookups per step


class ShadowDrafts:
    """Per step, the would-be outcome of a K-token n-gram draft for up to `per_step` requests."""

    def __init__(self, max_k: int, min_n: int, max_n: int, per_step: int = SHADOW_REQUESTS) -> None:
        self.max_k, self.min_n, self.max_n, self.per_step = max_k, min_n, max_n, per_step
        self._cursor = 0

    def sample(self, reqs: Sequence[Request]) -> tuple[tuple[int, ...], ...] | None:
        """(asked, drafted, reached, accepted) per draft position (step_stats' counts) over up to
        per_step of `reqs` that generated at least K + 1 known tokens; None when none had."""
        k = self.max_k
        budgets, drafted, accepted = [], [], []
        n = len(reqs)
        for i in range(n):
            if len(budgets) >= self.per_step:
                break
            req = reqs[(self._cursor + i) % n]
            known = len(req.all_token_ids) - req.num_pending_tokens
            start = known - k  # the draft would have been proposed here, before the last k known tokens
            if start - len(req.prompt_token_ids) < 1:
                continue  # drafts are proposed after a token was generated
            history = req.all_token_ids
            draft = find_draft(history[:start], self.min_n, self.max_n, k)
            match = 0
            while match < len(draft) and draft[match] == history[start + match]:
                match += 1
            budgets.append(k)
            drafted.append(len(draft))
            accepted.append(match)
        self._cursor = (self._cursor + self.per_step) % max(n, 1)
        if not budgets:
            return None
        reached, hits = verify_counts(drafted, accepted)
        return count_above(budgets, k), count_above(drafted, k), reached, hits
