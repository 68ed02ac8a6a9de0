"""Adaptive speculation (issue 7): each step, the k in 0..K that maximizes expected tokens per second.

Goodput model (TurboSpec-style), per request in a batch of B:
  E[tokens | k]   = 1 + sum_{j<k} fill_j * prod_{i<=j} alpha_i
  tokens verified = 1 + sum_{j<k} fill_j
  cost(k)         = t_verify,k(B * tokens verified) + t_propose(k, B);   cost(0) = t_decode(B)
  choose          argmax_k  B * E[tokens | k] / cost(k)
alpha_i is the acceptance of draft position i given that every earlier one was accepted; fill_j is
how often the proposer produced a draft at position j when asked for one (n-gram lookups come back
short or empty). Everything is measured here, over moving windows:
  - alpha and fill: exponentially decayed counts per position, with an optimistic prior (so a fresh
    controller drafts K and measures, rather than never trying);
  - t_verify, t_decode: linear fits a + b * decode tokens + c * prefill tokens over recent steps
    with and without drafts (prefill chunks that share a step are costed apart, and predictions are
    for pure decode steps); b is pulled toward 0 (memory-bound, the optimistic guess) until the data
    can tell it. Until a step without drafts and without a prompt chunk was seen, t_decode comes
    from the verify fit (a prefill-only sample says nothing about a decode step); the controller
    probes one early (and again whenever the decode fit has no data near the batch size);
  - t_verify is fitted per k (the proposal's k), the fit over every k standing in until a k has its
    own: verify steps are not one smooth curve, a query length with a captured CUDA graph replays in
    a fraction of an eager forward's time, so k = K (captured) can be cheaper than k = 1 (not);
  - each fit is trusted up to twice the largest step it measured lately: a k whose verify step would
    be larger is explored (within budget) before it can be chosen, and a plain decode step is probed
    when the decode fit has no data near this batch size (samples beyond a fit's range are not
    clipped as outliers: they are news);
  - t_propose: a non-negative fit over 1, k, k*B and B (draft models cost ~k forwards; n-gram ~B lookups),
    from "warm" proposals only: the first proposal after a step without drafts (or the first ever)
    also makes a draft model catch up on every token it skipped, a one-off that says nothing about
    the steady cost of drafting.
Exploration: every `explore_every`-th choice tries another k on a fixed schedule (no randomness), so
costs and the acceptance of positions just beyond the best k stay measured: a neighbour of the best
(from k = 0, alternately 1 and K); a k predicted to beat the best where the fits have no data is
tried at once (every few choices) instead. A neighbour predicted to cost more than `explore_max_loss` of the throughput only every
`explore_backoff`-th time. Exploring from k = 0 lasts `explore_burst` steps: the first pays a draft
model's catch-up, the next gives a warm proposal to learn from, and the two measure what the catch-up
costs (n-gram lookups: nothing, so their cold proposals are fitted too). Exploring is paid from a
budget: the time it measurably lost (an exploring step's time minus the time the best k would have
taken for the tokens it produced) stays under `explore_budget` of the time observed, over a moving
window, counting what the next exploration is expected to lose (for a proposer that catches up: what
the last one lost per request, times the batch). With an expensive draft model or useless drafts the
controller so stays within about that fraction of no speculation; where exploring costs nothing it
explores on every slot.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

from specserve.config import SpeculativeConfig
from specserve.spec.estimators import DecayedRegression, PositionRates
from specserve.spec.step_stats import (
    ProposalStats,
    SpecStepStats,
    count_above,
    verify_counts,
)

# The measurements and estimators live in step_stats.py and estimators.py; their names stay importable
# from here (the decoder, the controller protocol, benches and tests import them from this module).
__all__ = [
    "AdaptiveController", "AdaptiveSettings", "ControllerEstimates", "DecayedRegression", "PositionRates",
    "ProposalStats", "SpecStepStats", "count_above", "verify_counts",
]

_CATCH_UP_EXTRA = 0.25  # a proposer whose first proposal after a pause costs 25% more catches up
_TRUST = 2.0  # a k is chosen on predictions for verify steps up to this x the largest recently measured
_PROMISING_GAP = 3  # choices between explorations of a promising k outside the schedule


@dataclass(frozen=True)
class AdaptiveSettings:
    """Tuning of the adaptive controller; the defaults are what the engine uses."""

    acceptance_prior: float = 0.8  # optimistic: a fresh controller drafts and measures
    prior_weight: float = 4.0  # samples the prior is worth
    acceptance_window: float = 100.0  # samples per position
    cost_window: float = 32.0  # steps per cost model
    slope_ridge: float = 1e-4
    explore_every: int = 10  # every n-th choice tries a neighbour of the best k (0: never)
    explore_max_loss: float = 0.25  # a neighbour predicted this much slower ...
    explore_backoff: int = 4  # ... is tried on every n-th exploration slot only
    explore_burst: int = 2  # steps an exploration from k = 0 lasts (a draft model's catch-up, then a warm step)
    explore_budget: float | None = 0.01  # exploring may lose at most this fraction of the time (None: no cap)
    budget_window: float = 2000.0  # steps over which the exploration budget is counted
    switch_margin: float = 0.02  # keep the previous best unless another k is this much faster


@dataclass(frozen=True)
class ControllerEstimates:
    """What the controller believed when it chose; tuples indexed by k (0..K) or position."""

    batch_size: int
    best_k: int
    chosen_k: int
    acceptance_per_pos: tuple[float, ...]
    fill_per_pos: tuple[float, ...]
    expected_tokens: tuple[float, ...]  # per request per step
    step_seconds: tuple[float, ...]  # predicted verify (or decode) + proposal time
    tokens_per_s: tuple[float, ...]
    trusted: tuple[int, ...] = ()  # the k whose predictions lie where the fits have data (0 always)


class _Choice(NamedTuple):
    """A choice waiting for the step that verifies its proposal."""

    k: int
    exploring: bool
    best_k: int  # the best k when this one was chosen
    cold: bool  # no drafts were proposed the step before (or never): a draft model catches up first


class AdaptiveController:
    """Chooses k in 0..num_speculative_tokens each step from batch size, acceptance and measured costs."""

    def __init__(self, cfg: SpeculativeConfig, settings: AdaptiveSettings | None = None) -> None:
        s = self.settings = settings or AdaptiveSettings()
        self.max_k = cfg.num_speculative_tokens
        self.acceptance = PositionRates(self.max_k, s.acceptance_prior, s.prior_weight, s.acceptance_window)
        self.fill = PositionRates(self.max_k, 1.0, s.prior_weight, s.acceptance_window)
        # features (1, decode tokens, prefill tokens)
        ridge = (0.0, s.slope_ridge, s.slope_ridge)

        def fit() -> DecayedRegression:
            return DecayedRegression(3, s.cost_window, ridge, range_feature=1)

        self.verify_cost = fit()  # every verify step: the first guess for a k without a fit of its own
        self.verify_cost_by_k = [fit() for _ in range(self.max_k + 1)]
        self.decode_cost = fit()
        # features (1, k, k * B, B); a fit that has seen one batch size splits a per-forward cost between
        # "per call" and "per request" (no guess is safe both ways: exploration measures the new size)
        self.propose_cost = DecayedRegression(4, s.cost_window, (0.0, s.slope_ridge, s.slope_ridge, s.slope_ridge))
        self._cost_keep = 1.0 - 1.0 / s.cost_window
        self.pure_decode_weight = 0.0  # decayed count of steps without drafts and without prompt chunks
        self._budget_keep = 1.0 - 1.0 / s.budget_window
        self.observed_seconds = 0.0  # decayed: every step and proposal observed
        self.exploration_loss_seconds = 0.0  # decayed: what exploring cost beyond the best k
        self._last_cold: tuple[int, float] | None = None  # (k, seconds) of the last proposal if it was cold
        self.cold_extra: float | None = None  # a first proposal after a pause costs (1 + this) x a warm one
        self.explore_loss_per_request: list[float | None] = [None] * (self.max_k + 1)  # per exploring step, by k
        self.num_choices = 0
        self._last_probe: int | None = None  # the choice that last probed a plain decode step
        self._last_promising = -_PROMISING_GAP  # the choice that last explored a promising untrusted k
        self.best_k = self.max_k
        self.last_choice = self.max_k
        self.last: ControllerEstimates | None = None
        self._prev_k: int | None = None  # the k of the previous choice (None: none yet)
        self._pending: _Choice | None = None
        self._burst_k, self._burst_left = 0, 0
        self._drafting_version = 0  # bumped by every observation that changes what drafting is predicted to give
        self._drafting_cache: tuple[tuple[float, int], tuple] | None = None

    # -- the model ---------------------------------------------------------------------------
    def _decode_seconds(self, b: float) -> float:
        """A plain decode step of b requests; the verify fit stands in until a clean decode step was seen."""
        x = [(1.0, b, 0.0)]
        order = (self.decode_cost, self.verify_cost)
        if self.pure_decode_weight < 1.0 and self.verify_cost.weight >= 1.0:
            order = (self.verify_cost, self.decode_cost)
        for model in order:
            t = model.predict_many(x)
            if t is not None:
                return max(t[0], 1e-9)
        return 1.0  # nothing measured: every k costs the same, the prior decides

    def _verify_seconds(self, num_tokens: list[float]) -> tuple[list[float], list[float]]:
        """Verify steps for k = 1.. (num_tokens[k - 1] tokens): each k's own fit once it has one (a query
        length with a CUDA graph costs a fraction of an eager one), before that the fit over every k.
        Also the token count up to which each prediction is trusted."""
        pooled = None
        for model in (self.verify_cost, self.decode_cost):
            pooled = model.predict_many([(1.0, x, 0.0) for x in num_tokens])
            if pooled is not None:
                break
        seconds, trusted = [], []
        for k, x in enumerate(num_tokens, start=1):
            own = self.verify_cost_by_k[k]
            if own.weight >= 1.0:
                seconds.append(max(own.predict((1.0, x, 0.0)), 1e-9))
                trusted.append(_TRUST * own.max_x)
            else:
                seconds.append(max(pooled[k - 1], 1e-9) if pooled is not None else 1.0)
                trusted.append(_TRUST * self.verify_cost.max_x if self.verify_cost.weight >= 1.0 else math.inf)
        return seconds, trusted

    def _drafting_terms(self, b: float) -> tuple[list[float], list[float], list[float], list[float], list[bool]]:
        """At batch b: alpha and fill per position; expected tokens per request for k = 0..K; predicted
        seconds for k = 1..K; whether each k's prediction lies where its fit has data ([0]: always).
        Only steps with drafts change them: while the controller sits at k = 0 they come from a cache
        (every step's bookkeeping runs this)."""
        key = (b, self._drafting_version)
        if self._drafting_cache is not None and self._drafting_cache[0] == key:
            return self._drafting_cache[1]
        alpha, fill = self.acceptance.rates(), self.fill.rates()
        expected, verified = [1.0], [1.0]
        survive = 1.0
        for a, f in zip(alpha, fill):
            survive *= a
            expected.append(expected[-1] + f * survive)
            verified.append(verified[-1] + f)
        seconds, trusted = self._verify_seconds([b * v for v in verified[1:]])
        propose = self.propose_cost.predict_many([(1.0, k, k * b, b) for k in range(1, self.max_k + 1)])
        for k, t in enumerate(propose or [], start=1):
            seconds[k - 1] += max(t, 0.0)
        within = [True] + [b * v <= t for v, t in zip(verified[1:], trusted)]
        terms = (alpha, fill, expected, seconds, within)
        if self.verify_cost.weight >= 1.0:  # before that, the decode fit (which changes) stands in
            self._drafting_cache = (key, terms)
        return terms

    def estimate(self, batch_size: int) -> ControllerEstimates:
        """Expected tokens/s for every k at this batch size (no exploration, no state change)."""
        b = float(max(batch_size, 1))
        alpha, fill, expected, drafting_s, within = self._drafting_terms(b)
        seconds = [self._decode_seconds(b)] + drafting_s
        rates = [b * e / t for e, t in zip(expected, seconds)]
        # Trust region: a verify step much larger than any the fit has seen lately is a guess (a linear
        # fit from small steps misses where verification turns compute-bound). Such a k is explored
        # first, within budget, rather than chosen on the guess: for a draft model the first step also
        # pays the catch-up, which a short burst of load cannot win back.
        eligible = [0] + [k for k in range(1, len(rates)) if within[k]]
        best = max(eligible, key=rates.__getitem__)
        if self.best_k in eligible and rates[self.best_k] >= (1.0 - self.settings.switch_margin) * rates[best]:
            best = self.best_k  # hysteresis: near-ties do not flip k back and forth
        return ControllerEstimates(int(b), best, best, tuple(alpha), tuple(fill), tuple(expected), tuple(seconds),
                                   tuple(rates), tuple(eligible))

    # -- the interface the decoder calls ------------------------------------------------------
    def choose(self, batch_size: int) -> int:
        """k for the next proposal: the best k; or, within budget, a k to measure (see the module doc)."""
        est = self.estimate(batch_size)
        self.best_k = best = est.best_k
        self.num_choices += 1
        k, s = best, self.settings
        if self._burst_left > 0:
            self._burst_left -= 1
            if self._burst_k != best:
                k = self._burst_k
        elif best != 0 and self._should_probe_decode(batch_size):
            # A plain decode step, measured: without a recent one at about this batch size the decode
            # cost is a guess (from verify steps, or from another load), and drafting can look better
            # than it is.
            self._last_probe = self.num_choices
            k = 0
        else:
            promising = self._promising(est)
            slot = s.explore_every and self.num_choices % s.explore_every == 0
            if promising is not None and self.num_choices - self._last_promising >= _PROMISING_GAP:
                # predicted to beat the best where the fits have no data (the load just grew, say):
                # measure it now rather than at the next slot
                self._last_promising = self.num_choices
                candidate = promising
            elif slot:
                candidate = self._neighbour(est, self.num_choices // s.explore_every, promising)
            else:
                candidate = best
            steps = max(s.explore_burst, 1) if best == 0 else 1
            if candidate != best and self._may_explore(candidate, steps, est):
                k = candidate
                self._burst_k, self._burst_left = k, steps - 1
        self._pending = _Choice(k, k != best, best, self._prev_k in (None, 0))
        self._prev_k = self.last_choice = k
        self.last = est if k == best else replace(est, chosen_k=k)
        return k

    def _should_probe_decode(self, batch_size: int) -> bool:
        if self.verify_cost.weight < 2.0:
            return False  # the first steps: drafting K and measuring it comes first
        known = self.pure_decode_weight >= 1.0 and self.decode_cost.covers(batch_size)
        recent = self._last_probe is not None and self.num_choices - self._last_probe < 4 * self.settings.explore_every
        return not known and not recent

    def _may_explore(self, k: int, steps: int, est: ControllerEstimates) -> bool:
        """Whether the budget has room for exploring k now. What it will cost: for a proposer that catches
        up after a pause (a draft model), what exploring k lost lately per request, times this batch
        (the catch-up grows with it; a k never explored costs what the dearest explored one did); else
        what the model predicts (the step's time minus the time the best k takes for its tokens; a
        predicted gain is always worth measuring: once measured, the k is no longer a guess)."""
        budget = self.settings.explore_budget
        if budget is None:
            return True
        if self.catches_up():
            per_request = self.explore_loss_per_request[k]
            if per_request is None:
                per_request = max((v for v in self.explore_loss_per_request if v is not None), default=0.0)
            expected = per_request * est.batch_size
        else:
            best_rate = est.tokens_per_s[est.best_k]
            tokens = est.batch_size * est.expected_tokens[k]
            expected = est.step_seconds[k] - tokens / best_rate if best_rate > 0 else 0.0
            if expected < 0:
                return True  # predicted to gain (where the fits have no data yet): past losses do not matter
        return self.exploration_loss_seconds + max(expected, 0.0) * steps <= budget * self.observed_seconds

    def _promising(self, est: ControllerEstimates) -> int | None:
        """The k predicted to beat the best by more than the switch margin where its fit has no data
        (so it may not be chosen on the prediction alone), if any."""
        rates, bar = est.tokens_per_s, (1.0 + self.settings.switch_margin) * est.tokens_per_s[est.best_k]
        untrusted = [k for k in range(1, self.max_k + 1) if k not in est.trusted and rates[k] > bar]
        return max(untrusted, key=rates.__getitem__) if untrusted else None

    def _neighbour(self, est: ControllerEstimates, slot: int, promising: int | None) -> int:
        """The k to try at exploration slot `slot`: `promising` (see _promising: a k predicted to beat the
        best where the fits have no data yet), if any; else alternately above and below the best k, and
        from k = 0 alternately 1 and K (verify costs are not smooth in k: K may replay a CUDA graph where
        1 runs eagerly, so "1 does not pay" does not mean "nothing pays")."""
        best, s = est.best_k, self.settings
        if promising is not None:
            return promising
        step = 1 if slot % 2 == 1 else -1
        if not 0 <= best + step <= self.max_k:
            step = -step
        k = min(max(best + step, 0), self.max_k)
        if best == 0 and slot % 2 == 0:
            k = self.max_k
        costly = est.tokens_per_s[k] < (1.0 - s.explore_max_loss) * est.tokens_per_s[best]
        if costly and (slot // 2) % s.explore_backoff != 0:
            return best  # measured often enough: this neighbour is far from paying
        return k

    def observe(self, step: SpecStepStats) -> None:
        """Learn from one finished step: its cost, the acceptance of its drafts, its proposal's cost."""
        p = step.proposal
        choice = None
        if p is not None:
            choice, self._pending = self._pending, None
        if step.num_draft_tokens > 0 or (p is not None and p.num_speculative_tokens > 0):
            self._drafting_version += 1
        self._observe_step_cost(step, p)
        self.acceptance.add(step.reached_per_pos, step.accepted_per_pos)
        if p is not None and p.num_seqs > 0 and p.num_speculative_tokens > 0:
            self.fill.add(p.asked_per_pos, p.drafted_per_pos)
            k, b = p.num_speculative_tokens, p.num_seqs
            x = (1.0, k, k * b, b)
            cold = choice is not None and choice.cold
            last_cold, self._last_cold = self._last_cold, (k, p.seconds) if cold else None
            if not cold and last_cold is not None and last_cold[0] == k:
                # a cold proposal and the warm one right after it, same k (an exploration burst): how
                # much more the first proposal after a pause costs
                extra = min(last_cold[1] / p.seconds - 1.0, 10.0) if p.seconds > 1e-7 else 0.0
                self.cold_extra = extra if self.cold_extra is None else 0.5 * (self.cold_extra + extra)
            if not cold or not self.catches_up():
                self.propose_cost.add(x, p.seconds)
        elif p is not None:
            self._last_cold = None
        self._account(step, p, choice)

    def catches_up(self) -> bool:
        """Whether the proposer pays extra after a step without drafts (a draft model feeding the tokens
        it skipped; n-gram lookups do not), as far as measured; unknown counts as yes."""
        return self.cold_extra is None or self.cold_extra > _CATCH_UP_EXTRA

    def _observe_step_cost(self, step: SpecStepStats, p: ProposalStats | None) -> None:
        if step.step_seconds <= 0 or step.num_batched_tokens <= 0:
            return
        decode = step.batch_size + step.num_draft_tokens  # one token per request, plus its drafts
        prefill = max(step.num_batched_tokens - decode, 0)  # the rest: prompt chunks
        x = (1.0, float(decode), float(prefill))
        if step.num_draft_tokens > 0:
            k = p.num_speculative_tokens if p is not None and p.num_speculative_tokens > 0 else self.max_k
            k = min(k, self.max_k)
            self.verify_cost.add(x, step.step_seconds)
            self.verify_cost_by_k[k].add(x, step.step_seconds)
        else:
            self.decode_cost.add(x, step.step_seconds)
            self.pure_decode_weight = self.pure_decode_weight * self._cost_keep + (1.0 if prefill == 0 else 0.0)

    def _account(self, step: SpecStepStats, p: ProposalStats | None, choice: _Choice | None) -> None:
        """Exploration budget: all the time observed, and what exploring lost against the best k."""
        cycle = max(step.step_seconds, 0.0) + (p.seconds if p is not None else 0.0)
        keep = self._budget_keep
        self.observed_seconds = self.observed_seconds * keep + cycle
        self.exploration_loss_seconds *= keep
        if choice is not None and choice.exploring:
            # against the best k as priced now, with this step's data in: a best priced wrong before
            # (a batch size the fits had not seen) must not be booked as exploration's loss
            best_rate = self.estimate(step.batch_size).tokens_per_s[choice.best_k]
            if best_rate <= 0:
                return
            tokens = step.batch_size + sum(step.accepted_per_pos)
            loss = cycle - tokens / best_rate
            self.exploration_loss_seconds += loss
            per_request = loss / max(step.batch_size, 1)
            last = self.explore_loss_per_request[choice.k]
            self.explore_loss_per_request[choice.k] = per_request if last is None else 0.5 * (last + per_request)
