"""What drafts get, for the adaptive controller (adaptive.py): `PositionRates`, a success rate per draft
position over a decayed window with a prior (acceptance, and how often a proposer fills a position), and
`TokenCalibration`, per batch-size bucket the ratio of the drafts accepted to those predicted."""
from __future__ import annotations

import math
from collections.abc import Sequence

from specserve.spec.step_stats import ProposalStats


class PositionRates:
    """A success rate per draft position over a decayed window of samples, with a prior.

    Older samples fade per new sample, not per step, but never faster than over `min_steps` steps: a
    large batch brings hundreds of samples a step, and one step of brand-new requests (an n-gram
    lookup finds nothing in a fresh request) must not erase what the previous ones showed. A step's
    requests share their moment (the same stage of their answers), so a window of a few steps is
    noisy, and a controller that drafts when the estimate is high then over-predicts what drafting
    gives: with 8 steps, a CPU run (SmolLM2, n-gram, batch 16, adaptive) predicted 1.33x the accepted
    tokens its k = 4 steps got, with 16 steps 1.03x."""

    def __init__(self, num_positions: int, prior: float, prior_weight: float, window: float,
                 min_steps: float = 16.0) -> None:
        self.prior, self.prior_weight, self.window, self.min_steps = prior, prior_weight, window, min_steps
        self.hits = [0.0] * num_positions
        self.trials = [0.0] * num_positions

    def add(self, trials: Sequence[int], hits: Sequence[int]) -> None:
        for i, (n, h) in enumerate(zip(trials[:len(self.trials)], hits)):
            if n > 0:
                keep = math.exp(-n / max(self.window, self.min_steps * n))
                self.trials[i] = self.trials[i] * keep + n
                self.hits[i] = self.hits[i] * keep + h

    def age(self, keep: float) -> None:
        """Fade the samples of every position measured below the prior by `keep` (time passing without
        samples: what was measured long ago counts less, and the rate drifts back toward the prior until
        measured again). A rate measured above the prior stays: faded, it would price drafting below what
        was measured, and a controller that stops drafting on it measures nothing to correct it, while
        one that drafts on a rate that no longer holds measures the truth at once."""
        for i, r in enumerate(self.rates()):
            if r < self.prior:
                self.hits[i] *= keep
                self.trials[i] *= keep

    def rates(self) -> list[float]:
        pw, prior = self.prior_weight, self.prior
        return [(h + prior * pw) / (n + pw) for h, n in zip(self.hits, self.trials)]


class TokenCalibration:
    """Per batch bucket, what drafting steps got against what the acceptance model predicted for them
    (accepted drafts per request), as a decayed ratio that starts at 1.

    The acceptance and fill windows are shared by every batch size and follow the requests measured
    last. Where the requests running at one load accept less than that (requests at another stage of
    their answers, the tail of a batch), the model over-predicts there every time: on the H200 8B
    n-gram sweep, k = 4 steps at 8 and 16 requests got 0.23-0.31 and 0.17-0.25 accepted drafts per
    request where 0.61 and 0.44-0.49 were predicted, and the controller kept drafting at 0.93-0.96 of
    no drafts. What drafting is predicted to give at a bucket is scaled by its ratio. Drafts a request was
    not asked for (its output budget ends: predicted_accepted) are not predicted, so they are no part of it.

    The window counts requests (`window`), but at least `min_steps` steps: one request's drafts vary a
    lot from step to step (a batch-1 ratio over 16 steps fell to 0.86 by chance where drafting paid, and
    a ratio that stops drafting gets no samples to recover from), and a step's requests share their
    moment. A prior of `prior_requests` requests at the ratio 1 keeps a few samples from deciding."""

    def __init__(self, window: float = 128.0, min_steps: float = 16.0, prior_requests: float = 16.0,
                 lo: float = 0.2, hi: float = 1.5) -> None:
        self.window, self.min_steps, self.prior_requests, self.lo, self.hi = window, min_steps, prior_requests, lo, hi
        self._sums: dict[int, list[float]] = {}  # bucket -> [realized, predicted, requests], decayed

    def add(self, bucket: int, predicted: float, realized: float, requests: int) -> None:
        """One drafting step: drafts accepted per request, predicted and realized, over `requests`."""
        sums = self._sums.setdefault(bucket, [0.0, 0.0, 0.0])
        keep = math.exp(-requests / max(self.window, self.min_steps * requests))
        sums[0] = sums[0] * keep + realized * requests
        sums[1] = sums[1] * keep + predicted * requests
        sums[2] = sums[2] * keep + requests

    def ratio(self, bucket: int) -> float:
        realized, predicted, requests = self._sums.get(bucket, (0.0, 0.0, 0.0))
        if requests <= 0.0:
            return 1.0
        prior = self.prior_requests * predicted / requests  # prior_requests at the mean prediction
        if predicted + prior <= 0.0:
            return 1.0
        return min(max((realized + prior) / (predicted + prior), self.lo), self.hi)

    def age(self, keep: float) -> None:
        """Time passing: every bucket's ratio drifts back toward 1 until measured again."""
        for sums in self._sums.values():
            for i in range(3):
                sums[i] *= keep


def predicted_accepted(increments: Sequence[float], proposal: ProposalStats, batch_size: int) -> float:
    """Drafts accepted per request that the windows predict for a step, given its proposal's budgets.

    increments[i]: what draft position i adds per request asked for a draft there (fill_i x alpha_0..i,
    uncalibrated). A request asked for fewer than k drafts, or none (near the end of its output budget or
    the context window: proposal.asked_per_pos, num_at_end), is predicted for those only. A request of
    the step that the proposal did not ask at all (it computed a prompt chunk, or came in since, or is
    a seeded sampled request, which does not draft under a k that follows the load) is predicted as
    asked for k, so the calibration still learns how much of the batch drafts.

    Predicted as asked for k, capped drafts look like poor acceptance. On the H200 pair (twenty-fifth
    session) the calibration at 8 and 16 requests was 0.954-0.955. That came from the parts' tails, where
    requests end together: there the steps got 4.5 tokens per request where 5.6-6.2 were predicted. In full
    batches the steps got from 3% less to 12% more than the uncalibrated prediction (5.10 against 4.93 at
    k = 5, 8 requests), and 1-14% more than the calibrated one."""
    asked = proposal.asked_per_pos
    capped = sum(n * inc for n, inc in zip(asked, increments))
    unasked = max(batch_size - proposal.num_seqs - proposal.num_at_end, 0) * sum(increments)
    return (capped + unasked) / batch_size
