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
    controller drafts K and measures, rather than never trying); they also fade in time
    (`acceptance_horizon`), so what was measured below the prior long ago (while not drafting) drifts
    back to it (a rate measured above it stays: faded, it would keep the controller from drafting, so
    from measuring it again);
  - per batch-size bucket, the ratio of the drafts accepted per request to those predicted, over the
    bucket's drafting steps (estimators.TokenCalibration): it scales E[tokens | k] - 1 there, since
    the windows above follow the requests measured last and another load's may accept less;
  - costs per batch-size bucket (1, 2, 3-4, 5-8, ...: estimators.StepCosts): a plain decode step, a
    verify step per k, a (warm) proposal per k, each fitted on the steps of that bucket only. Step
    costs are not one smooth curve across batch sizes (GEMV at one row, GEMM above; graph sizes), nor
    across k (a query length with a captured CUDA graph replays in a fraction of an eager forward's
    time), so a measurement at batch 2 says little about batch 1 or 8. Fits over every bucket (linear
    in decode and prefill tokens; proposals over 1, k, k*B, B) are the cost model that prices a bucket
    or k without data of its own, as a guess;
  - a k is chosen only on its own bucket's recent verify measurements ("trusted"; k = 0 always may be);
    a k predicted to win on a guess is measured first (explored at once, within budget), and so is one
    whose bucket data went stale (`stale_after` observations: warm-up, another load);
  - the first step without drafts after a step that ran synchronously (one with drafts proposed, the
    first after the engine idled) is not a decode measurement: with asynchronous scheduling
    (engine/overlap.py) that step is timed when its forward is launched, not when it ends, so it looks
    several times cheaper than a decode step is. A decode measurement (a "probe" while drafting, an
    exploration of k = 0) therefore lasts at least two steps. While drafting, a bucket's decode cost
    is probed when it has none and, unless the proposer catches up, again every `reprobe_after`
    observations: it is what drafting has to beat, and one measured in a disturbance (warm-up, a
    burst of prompts) would otherwise stand;
  - t_propose excludes "cold" proposals (the first after a step without drafts, or ever): they also
    make a draft model catch up on every token it has not seen, a one-off that says nothing about the
    steady cost of drafting. What catching up costs is fitted apart, over the tokens to catch up on
    (counted since the proposer last drafted, prompts included, less those of finished requests).
    Nor do warm proposals right after a prompt chunk enter a bucket's fit: where requests come and go
    a draft model feeds every new request's prompt at its next proposal, a recurring cost of drafting
    priced apart, per output token (estimators.StepCosts.prompt_feed_seconds).
Exploration: every `explore_every`-th choice tries another k on a fixed schedule (no randomness), so
costs and the acceptance of positions just beyond the best k stay measured: a neighbour of the best
(from k = 0, alternately 1 and K); a k predicted to beat the best where it has no fresh data of its
own bucket is tried at once (every few choices) instead. A neighbour predicted to cost more than
`explore_max_loss` of the throughput only every `explore_backoff`-th time. Exploring from k = 0 lasts
`explore_burst` steps (the first pays a draft model's catch-up, the next gives a warm proposal to learn
from), longer while its warm steps clearly beat no drafts; a draft model starts exploring a bucket only
once a plain decode step there was measured (what drafting has to beat). Exploring is paid from a
budget: the time it measurably lost (an exploring step's time minus the time the best k would have
taken for the tokens it produced) stays under `explore_budget` of the time observed, over a moving
window, counting what the next exploration is expected to lose: its steps as priced now (a predicted
gain offsets) plus, for a proposer that catches up, the catch-up when drafting starts or resumes. A k
that a bucket measured only once or twice lately (maybe a fluke: JIT, an eager first run), or the first
look at drafting in a bucket, is explored on the benefit of the doubt (capped by the budget itself, not
by what exploring elsewhere cost); so is drafting from k = 0 while a catch-up was measured fewer than
three times (charged at most a warm proposal for it). With an expensive draft model or useless drafts
the controller so stays within about that fraction of no speculation; where exploring costs nothing it
explores on every slot.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

from specserve.config import SpeculativeConfig
from specserve.spec.adaptive_settings import AdaptiveSettings, ControllerEstimates
from specserve.spec.estimators import (
    PositionRates,
    StepCosts,
    TokenCalibration,
    batch_bucket,
)
from specserve.spec.regression import DecayedRegression
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

_PROMISING_GAP = 3  # choices between explorations of a promising k outside the schedule
_EPOCH = 64  # observations between acceptance fading steps (and staleness checks of the cached terms)
_DOUBT_SAMPLES = 3  # a k measured fewer times than this at a bucket (lately) is explored as a guess


class _Choice(NamedTuple):
    """A choice waiting for the step that verifies its proposal."""

    k: int
    exploring: bool  # its loss against the best k is booked to the exploration budget
    best_k: int  # the best k when this one was chosen
    cold: bool  # no drafts were proposed the step before (or never): a draft model catches up first
    after_prompt: bool  # the step before computed a prompt chunk: a draft model may feed that prompt first
    unseen_tokens: float | None  # tokens computed since the last proposal with drafts (None: never drafted)
    predicted_extra: float  # drafts per request the model (uncalibrated) predicted to be accepted


class _Terms(NamedTuple):
    """Everything about drafting at one batch size that only steps with drafts change (cached)."""

    alpha: list[float]
    fill: list[float]
    expected: list[float]  # k = 0..K, calibrated (estimators.TokenCalibration)
    raw_expected: list[float]  # k = 0..K, as the acceptance and fill windows predict
    seconds: list[float]  # k = 1..K: verify + proposal
    propose: list[float]  # k = 1..K
    trusted: list[bool]  # k = 0..K ([0]: always)


class AdaptiveController:
    """Chooses k in 0..num_speculative_tokens each step from batch size, acceptance and measured costs."""

    def __init__(self, cfg: SpeculativeConfig, settings: AdaptiveSettings | None = None) -> None:
        s = self.settings = settings or AdaptiveSettings()
        self.max_k = cfg.num_speculative_tokens
        self.acceptance = PositionRates(self.max_k, s.acceptance_prior, s.prior_weight, s.acceptance_window)
        self.fill = PositionRates(self.max_k, 1.0, s.prior_weight, s.acceptance_window)
        self.costs = StepCosts(self.max_k, s.cost_window, s.slope_ridge, s.stale_after, s.budget_window)
        self.calibration = TokenCalibration()
        # the cost model's fits under the names benches and tests know
        self.verify_cost, self.verify_cost_by_k = self.costs.verify_cost, self.costs.verify_cost_by_k
        self.decode_cost, self.propose_cost = self.costs.decode_cost, self.costs.propose_cost
        self._budget_keep = 1.0 - 1.0 / s.budget_window
        self.observed_seconds = 0.0  # decayed: every step and proposal observed
        self.exploration_loss_seconds = 0.0  # decayed: what exploring cost beyond the best k
        self.num_choices = 0
        self._last_probe: int | None = None  # the choice that last probed a plain decode step
        self._last_promising = -_PROMISING_GAP  # the choice that last explored a promising untrusted k
        self.best_k = self.max_k
        self.last_choice = self.max_k
        self.last: ControllerEstimates | None = None
        self._prev_k: int | None = None  # the k of the previous choice (None: none yet)
        self._pending: _Choice | None = None
        self._burst_k, self._burst_left = 0, 0
        self._burst_extra = 0  # steps an exploration was extended by (see _extend_burst)
        self._burst_loss = self._burst_cycle = 0.0
        self._burst_exploring = False  # the burst in progress is booked to the exploration budget
        self._resume_booked = False  # the next drafting choice resumes after an exploration of k = 0
        self._decode_wait = 0  # choices waiting for a decode measurement (see _wait_for_decode)
        self._bucket, self._bucket_since = -1, 0  # the batch bucket of the last choice, since which choice
        self._drafting_version = 0  # bumped by every observation that changes what drafting is predicted to give
        self._drafting_cache: tuple[tuple[float, int, int], _Terms] | None = None
        self._ahead: tuple[float, int, _Terms] | None = None  # prepare(): (batch, num_observed, terms)

    @property
    def cold_extra(self) -> float | None:
        return self.costs.cold_extra

    @property
    def clock(self) -> Callable[[], float]:
        """Seconds, now: observations are timed with it to find pauses (tests give simulated time)."""
        return self.costs.clock

    @clock.setter
    def clock(self, value: Callable[[], float]) -> None:
        self.costs.clock = value

    def catches_up(self) -> bool:
        return self.costs.catches_up()

    # -- the model ---------------------------------------------------------------------------
    def _drafting_terms(self, b: float) -> _Terms:
        """At batch b: alpha and fill per position; expected tokens per request for k = 0..K; predicted
        seconds for k = 1..K; which k are priced on fresh data of this bucket. Only steps with drafts
        change them (and time, slowly: fading, staleness): while the controller sits at k = 0 they come
        from a cache (every step's bookkeeping runs this)."""
        key = (b, self._drafting_version, self.costs.num_observed // _EPOCH)
        if self._drafting_cache is not None and self._drafting_cache[0] == key:
            return self._drafting_cache[1]
        alpha, fill = self.acceptance.rates(), self.fill.rates()
        expected, verified = [1.0], [1.0]
        survive = 1.0
        for a, f in zip(alpha, fill):
            survive *= a
            expected.append(expected[-1] + f * survive)
            verified.append(verified[-1] + f)
        raw, ratio = expected, self.calibration.ratio(batch_bucket(b)) if self.settings.calibrate else 1.0
        expected = [1.0 + ratio * (e - 1.0) for e in raw]
        seconds, trusted = self.costs.verify_seconds(b, [b * v for v in verified[1:]])
        propose = self.costs.propose_seconds(b)
        # a draft model feeds every new request's prompt at its next proposal: per output token, a
        # recurring cost of drafting where requests come and go (the warm proposal fits leave it out)
        feed = b * self.costs.prompt_feed_seconds()
        seconds = [t + p + feed * e for t, p, e in zip(seconds, propose, expected[1:])]
        terms = _Terms(alpha, fill, expected, raw, seconds, propose, [True] + trusted)
        if self.verify_cost.weight >= 1.0:  # before that, the decode fit (which changes) stands in
            self._drafting_cache = (key, terms)
        return terms

    def prepare(self, batch_size: int) -> None:
        """Work ahead, while the GPU runs a step: the drafting terms for the next choice at this batch
        size. choose() takes them if the batch size is the same and at most that step was observed since
        (one step behind, for acceptance and the cost fits, which re-solve every few steps anyway), and
        skips their ~2/3 of its host time: a synchronous step's choice is on the critical path."""
        b = float(max(batch_size, 1))
        self._ahead = (b, self.costs.num_observed, self._drafting_terms(b))

    def _terms_for_choice(self, b: float) -> _Terms:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == b and self.costs.num_observed - ahead[1] <= 1:
            return ahead[2]
        return self._drafting_terms(b)

    def estimate(self, batch_size: int, terms: _Terms | None = None) -> ControllerEstimates:
        """Expected tokens/s for every k at this batch size (no exploration, no state change); `terms`:
        the drafting terms to use (default: as of now)."""
        b = float(max(batch_size, 1))
        terms = self._drafting_terms(b) if terms is None else terms
        decode_s, decode_trusted = self.costs.decode_seconds(b)
        seconds = [decode_s] + terms.seconds
        rates = [b * e / t for e, t in zip(terms.expected, seconds)]
        # A k is chosen on measurements of this batch bucket only: a guess carried over from another
        # batch size (or from long ago) is explored first, within budget, rather than acted on.
        eligible = [k for k in range(len(rates)) if terms.trusted[k]]
        best = max(eligible, key=rates.__getitem__)
        if self.best_k in eligible and rates[self.best_k] >= (1.0 - self.settings.switch_margin) * rates[best]:
            best = self.best_k  # hysteresis: near-ties do not flip k back and forth
        return ControllerEstimates(int(b), best, best, tuple(terms.alpha), tuple(terms.fill),
                                   tuple(terms.expected), tuple(seconds), tuple(rates), tuple(eligible),
                                   (0.0,) + tuple(terms.propose), decode_trusted)

    # -- the interface the decoder calls ------------------------------------------------------
    def choose(self, batch_size: int) -> int:
        """k for the next proposal: the best k; or, within budget, a k to measure (see the module doc)."""
        terms = self._terms_for_choice(float(max(batch_size, 1)))
        est = self.estimate(batch_size, terms)
        self.num_choices += 1
        bucket = batch_bucket(batch_size)
        if bucket != self._bucket:  # another load: what was being measured (a burst) is moot
            self._bucket, self._bucket_since, self._burst_left = bucket, self.num_choices, 0
        if self._not_worth_a_catch_up(est):
            est = replace(est, best_k=0, chosen_k=0)
        self.best_k = best = est.best_k
        k, exploring = best, False
        if self._burst_left > 0:
            self._burst_left -= 1
            if self._burst_k != best:
                k, exploring = self._burst_k, self._burst_exploring
        elif best != 0 and self._should_probe_decode(batch_size):
            # Plain decode steps, measured: without recent ones at this batch size the decode cost is a
            # guess (from verify steps, or from another load), and drafting can look better than it is.
            # Two at least: the first after drafting is no measurement (see the module doc).
            self._last_probe = self.num_choices
            k = 0
            # Two steps at least: the first after drafting is no measurement; three for a re-probe, whose
            # two measurements may restart a decode fit (estimators.LocalFits: twice the same way).
            self._start_burst(0, max(self.settings.explore_burst, 3 if self.costs.decode_age(batch_size) else 2),
                              exploring=False)
        elif not self._wait_for_decode(est):
            candidate = self._candidate(est)
            steps = self._burst_steps(candidate)
            if candidate != best and self._may_explore(candidate, steps, est):
                k, exploring = candidate, True
                self._start_burst(k, steps, exploring=True)
        cold = self._prev_k in (None, 0)
        if k > 0 and cold and self._resume_booked:
            exploring = True  # drafting resumes after exploring k = 0: its catch-up is exploration's cost
        self._resume_booked = k == 0 and exploring and best > 0
        self._pending = _Choice(k, exploring, best, cold, self.costs.after_prompt, self.costs.unseen_tokens,
                                terms.raw_expected[k] - 1.0)
        self._prev_k = self.last_choice = k
        self.last = est if k == best else replace(est, chosen_k=k)
        return k

    def _not_worth_a_catch_up(self, est: ControllerEstimates) -> bool:
        """Whether to stay at k = 0 although drafting is predicted to be faster: starting to draft costs
        a proposer that catches up (a draft model) a one-off catch-up, repaid only if the batch stays
        about this size long enough. How long is unknown; the guess is as long as it already has (a
        batch that just changed, say requests finishing one after another, is likely to change again)."""
        best = est.best_k
        if best == 0 or self.last_choice != 0 or not self.catches_up():
            return False
        rate0 = est.tokens_per_s[0]
        saved = est.batch_size * est.expected_tokens[best] / rate0 - est.step_seconds[best]  # per step
        catch_up = self.costs.catch_up_seconds(self.costs.unseen_tokens, est.propose_seconds[best])
        steady = max(self.num_choices - self._bucket_since, self.settings.explore_every)
        return saved * steady < catch_up

    def _wait_for_decode(self, est: ControllerEstimates) -> bool:
        """Whether a proposer that catches up waits with exploring drafting from k = 0: until a step or
        two without drafts measured here what drafting has to beat (the decode cost carried over from
        another batch size is a guess, and a catch-up paid on it is lost), a few slots at most (a load
        where every step computes prompt chunks gives no plain decode step to measure)."""
        waiting = est.best_k == 0 and not est.decode_trusted and self.catches_up()
        self._decode_wait = self._decode_wait + 1 if waiting else 0
        return waiting and self._decode_wait <= 4 * self.settings.explore_every

    def _candidate(self, est: ControllerEstimates) -> int:
        """The k to explore now, or the best k: a promising one at once (every few choices), else a
        neighbour on the schedule's slots."""
        s = self.settings
        promising = self._promising(est)
        if promising is not None and self.num_choices - self._last_promising >= _PROMISING_GAP:
            # predicted to beat the best where this bucket has no fresh data (the load just changed,
            # say): measure it now rather than at the next slot
            self._last_promising = self.num_choices
            return promising
        if s.explore_every and self.num_choices % s.explore_every == 0:
            return self._neighbour(est, self.num_choices // s.explore_every, promising)
        return est.best_k

    def _start_burst(self, k: int, steps: int, exploring: bool) -> None:
        self._burst_k, self._burst_left, self._burst_exploring, self._burst_extra = k, steps - 1, exploring, 0
        self._burst_loss = self._burst_cycle = 0.0  # over its warm steps (see _extend_burst)

    def _burst_steps(self, candidate: int) -> int:
        """Steps an exploration lasts: from k = 0, a cold proposal then a warm one; to k = 0 from drafting,
        two (the first step without drafts is no measurement); else one."""
        if candidate == 0:
            return max(self.settings.explore_burst, 2) if self.last_choice != 0 else 1
        return max(self.settings.explore_burst, 1) if self.last_choice == 0 else 1

    def _should_probe_decode(self, batch_size: int) -> bool:
        if self.verify_cost.weight < 2.0:
            return False  # the first steps: drafting K and measuring it comes first
        s = self.settings
        recent = self._last_probe is not None and self.num_choices - self._last_probe < 4 * s.explore_every
        if recent:
            return False
        known = self.costs.pure_decode_weight >= 1.0 and self.costs.decode_seconds(batch_size)[1]
        # Known, but measured long ago: what drafting has to beat is the decisive number, and a
        # measurement from warm-up or a passing disturbance would otherwise stand until it goes stale.
        # Not for a proposer that catches up (a draft model): every probe would cost it a catch-up
        # when drafting resumes, and its decode cost is re-measured when it goes stale anyway.
        age = self.costs.decode_age(batch_size)
        return not known or (not self.catches_up() and age is not None and age >= s.reprobe_after)

    def _may_explore(self, k: int, steps: int, est: ControllerEstimates) -> bool:
        """Whether the budget has room for exploring k now. What it will cost: its steps as priced now
        (each step's time minus the time the best k takes for its tokens; a predicted gain offsets and,
        where nothing else is paid, is always worth measuring: once measured, the k is no longer a
        guess), plus, for a proposer that catches up after a pause (a draft model), one catch-up when
        drafting starts (k > 0 after k = 0: every token it has not seen) or resumes (after k = 0)."""
        s = self.settings
        if s.explore_budget is None or self.observed_seconds <= 0:
            return True  # no cap; or nothing measured yet, so no price to judge it by
        b, best = est.batch_size, est.best_k
        best_rate = est.tokens_per_s[best]
        step_loss = est.step_seconds[k] - b * est.expected_tokens[k] / best_rate if best_rate > 0 else 0.0
        # Doubt: this bucket measured k far from paying only once or twice lately (maybe a fluke: JIT,
        # an eager first run, a pause), or no k > 0 at all (drafting here is priced on guesses from other
        # batch sizes, and they do not say it is far from paying). Then give k the benefit of the doubt
        # (at most a step's worth lost) and do not hold its measurement back by what exploring elsewhere
        # cost (the budget itself still caps it): a few such explorations per bucket and period.
        measured = self.costs.samples(b, k) if k > 0 else _DOUBT_SAMPLES
        near = est.tokens_per_s[k] >= (1.0 - s.explore_max_loss) * best_rate
        doubt = (0 < measured < _DOUBT_SAMPLES and not near) or (measured == 0 and near and len(est.trusted) == 1)
        cold_start = k > 0 and best == 0 and self.catches_up()
        # So is a catch-up priced on fewer than a few measurements (the first ones may have run into JIT
        # or warm-up): priced that high, no exploration from k = 0 fits the budget, so none measures it
        # again. Charge it at most a warm proposal (the guess before any was measured) meanwhile.
        catch_up_doubt = cold_start and self.costs.catch_up_cost.weight < _DOUBT_SAMPLES
        if doubt:
            step_loss = min(step_loss, est.step_seconds[best])
        expected = steps * step_loss
        if self.catches_up():
            if cold_start and self.costs.unseen_tokens != 0:
                catch_up = self.costs.catch_up_seconds(self.costs.unseen_tokens, est.propose_seconds[k])
                expected += min(catch_up, est.propose_seconds[k]) if catch_up_doubt else catch_up
            elif k == 0 and best > 0:
                expected += self.costs.catch_up_seconds(float(b * steps), est.propose_seconds[best])
        if expected <= 0:
            return True  # predicted to gain: past losses do not matter
        spent = 0.0 if doubt or catch_up_doubt else self.exploration_loss_seconds
        # the time the budget is a share of: what was observed over the window, or, while the window is
        # still filling, what it will hold at the best k's pace (a young controller explores too)
        window_seconds = self.observed_seconds
        if self.costs.num_observed < s.budget_window:
            window_seconds = max(window_seconds, s.budget_window * est.step_seconds[best])
        return spent + expected <= s.explore_budget * window_seconds

    def _promising(self, est: ControllerEstimates) -> int | None:
        """The k predicted to beat the best by more than the switch margin where this bucket has no fresh
        data (so it may not be chosen on the prediction alone), if any."""
        rates, bar = est.tokens_per_s, (1.0 + self.settings.switch_margin) * est.tokens_per_s[est.best_k]
        untrusted = [k for k in range(1, self.max_k + 1) if k not in est.trusted and rates[k] > bar]
        return max(untrusted, key=rates.__getitem__) if untrusted else None

    def _neighbour(self, est: ControllerEstimates, slot: int, promising: int | None) -> int:
        """The k to try at exploration slot `slot`: `promising` (see _promising), if any; else alternately
        above and below the best k, and from k = 0 alternately 1 and K (verify costs are not smooth in k:
        K may replay a CUDA graph where 1 runs eagerly, so "1 does not pay" does not mean "nothing
        pays")."""
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
        if (self.costs.num_observed + 1) % _EPOCH == 0:
            # Acceptance fades in time too, not only with new samples: after a long time without drafts
            # (all its samples old) it drifts back toward the optimistic prior, and exploring measures it
            # again; otherwise a controller that stopped drafting when acceptance was low would go on
            # believing it long after it recovered.
            keep = math.exp(-_EPOCH / self.settings.acceptance_horizon)
            self.acceptance.age(keep)
            self.calibration.age(keep)
            self.fill.age(keep)
            self._drafting_version += 1
        self.costs.observe(step, choice is not None and choice.cold, choice is not None and choice.after_prompt,
                           None if choice is None else choice.unseen_tokens)
        self.acceptance.add(step.reached_per_pos, step.accepted_per_pos)
        if p is not None and p.num_seqs > 0 and p.num_speculative_tokens > 0:
            self.fill.add(p.asked_per_pos, p.drafted_per_pos)
        if choice is not None and choice.k > 0 and step.num_draft_tokens > 0 and step.batch_size > 0:
            # what this step's drafts got against what the windows predicted for them, at this load
            self.calibration.add(batch_bucket(step.batch_size), choice.predicted_extra,
                                 sum(step.accepted_per_pos) / step.batch_size, step.batch_size)
        self._account(step, p, choice)

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
            if best_rate > 0:
                tokens = step.batch_size + sum(step.accepted_per_pos)
                loss = cycle - tokens / best_rate
                self.exploration_loss_seconds += loss
                self._extend_burst(choice, loss, cycle)

    def _extend_burst(self, choice: _Choice, loss: float, cycle: float) -> None:
        """An exploration from k = 0 whose warm steps so far clearly beat no drafts goes on for another
        step (up to `explore_every` more): the catch-up is paid, measuring more costs nothing, and a
        belief built while not drafting (acceptance measured long ago, costs from another batch size)
        is corrected in one exploration instead of one step per budget period."""
        if choice.k == 0 or choice.best_k != 0 or choice.cold:
            return
        s = self.settings
        self._burst_loss, self._burst_cycle = self._burst_loss + loss, self._burst_cycle + cycle
        if (self._burst_loss < -s.switch_margin * self._burst_cycle and self._burst_exploring
                and self._burst_k == choice.k and self._burst_left == 0 and self._burst_extra < s.explore_every):
            self._burst_left, self._burst_extra = 1, self._burst_extra + 1
