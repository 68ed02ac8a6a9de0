"""Adaptive speculation (issue 7): each step, the k in 0..K that maximizes expected tokens per second.

Goodput model (TurboSpec-style), per request in a batch of B:
  E[tokens | k]   = 1 + sum_{j<k} fill_j * prod_{i<=j} alpha_i
  tokens verified = 1 + sum_{j<k} fill_j
  cost(k)         = t_verify,k(B * tokens verified) + t_propose(k, B);   cost(0) = t_decode(B)
  choose          argmax_k  B * E[tokens | k] / cost(k)
alpha_i is the acceptance of draft position i given that every earlier one was accepted; fill_j is
how often the proposer produced a draft at position j when asked for one (n-gram lookups come back
short or empty), times the share of the batch whose output room reaches j (requests a few tokens from
their max_tokens draft less: output_room.py). Everything else is measured here, over moving windows:
  - alpha and fill: exponentially decayed counts per position, with an optimistic prior (so a fresh
    controller drafts K and measures, rather than never trying); they also fade in time
    (`acceptance_horizon`), so what was measured below the prior long ago (while not drafting) drifts
    back to it (a rate measured above it stays: faded, it would keep the controller from drafting, so
    from measuring it again);
  - per batch-size bucket, the ratio of the drafts accepted per request to those predicted, over the
    bucket's drafting steps (estimators.TokenCalibration): it scales E[tokens | k] - 1 there, since
    the windows above follow the requests measured last and another load's may accept less;
  - costs per batch-size bucket (1, 2, 3-4, 5-8, ...: estimators.StepCosts): a plain decode step, a
    verify step per k, a (warm) proposal per k, each fitted on the steps of that bucket only (the
    proposals' then pooled where noise priced a larger k below a smaller one). Step
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
Exploration (which k to measure besides the best, within what budget): spec/exploration.py.
Observing late: while drafting steadily at the best k, a synchronous step is observed after the next
choice and proposal, once the forward they feed is launched (defer_observation; SpecDecoder.deliver_late),
so observe's host work runs while the GPU computes; the next choice's after-prompt flag and unseen tokens
are then set as observing first would have left them, and the observation's interval leaves out the
next proposal's host time (SpecStepStats.ahead_seconds).
The hold (spec/hold.py): where k = 0 is the best and every k > 0 is priced far below it, the choices up
to the next exploration slot repeat k = 0 without pricing.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import NamedTuple

from specserve.config import SpeculativeConfig
from specserve.spec.acceptance import PositionRates, TokenCalibration, predicted_accepted
from specserve.spec.adaptive_settings import AdaptiveSettings, ControllerEstimates
from specserve.spec.bucket_fits import batch_bucket
from specserve.spec.estimators import StepCosts
from specserve.spec.batch_growth import FILL_CHOICES, BatchGrowth
from specserve.spec.exploration import PROMISING_GAP, Exploration
from specserve.spec.hold import Hold, HoldMixin
from specserve.spec.output_room import reach_shares
from specserve.spec.regression import DecayedRegression
from specserve.spec.step_stats import (
    ProposalStats,
    SpecStepStats,
    count_above,
    verify_counts,
)

# The measurements and estimators live in step_stats.py, acceptance.py and estimators.py; their names
# stay importable from here (the decoder, the controller protocol, benches and tests import them here).
__all__ = [
    "AdaptiveController", "AdaptiveSettings", "ControllerEstimates", "DecayedRegression", "PositionRates",
    "ProposalStats", "SpecStepStats", "count_above", "verify_counts",
]

_EPOCH = 64  # observations between acceptance fading steps (and staleness checks of the cached terms)


class _Choice(NamedTuple):
    """A choice waiting for the step that verifies its proposal."""

    k: int
    exploring: bool  # its loss against the best k is booked to the exploration budget
    best_k: int  # the best k when this one was chosen
    cold: bool  # no drafts were proposed the step before (or never): a draft model catches up first
    after_prompt: bool  # the step before computed a prompt chunk: a draft model may feed that prompt first
    unseen_tokens: float | None  # tokens computed since the last proposal with drafts (None: never drafted)
    # per draft position i < k: drafts accepted per request asked for one there, as the windows (uncalibrated)
    # predicted (fill_i x alpha_0..alpha_i; TokenCalibration compares what the step got with their sum)
    increments: tuple[float, ...]


class _Terms(NamedTuple):
    """Everything about drafting at one batch size that only steps with drafts change (cached)."""

    alpha: list[float]
    fill: list[float]
    expected: list[float]  # k = 0..K, calibrated (estimators.TokenCalibration)
    raw_expected: list[float]  # k = 0..K, as the acceptance and fill windows predict (every request asked for k)
    seconds: list[float]  # k = 1..K: verify + proposal
    propose: list[float]  # k = 1..K
    trusted: list[bool]  # k = 0..K ([0]: always)
    verified: list[float]  # k = 0..K: tokens a step verifies per request (1 + the drafts it is predicted to get)


class AdaptiveController(Exploration, HoldMixin, BatchGrowth):
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
        self._last_promising = -PROMISING_GAP  # the choice that last explored a promising untrusted k
        self.best_k = self.max_k
        self.last_choice = self.max_k
        self.last: ControllerEstimates | None = None
        self._prev_k: int | None = None  # the k of the previous choice (None: none yet)
        self._pending: _Choice | None = None
        self._set_aside: _Choice | None = None  # the choice of a step to be observed late (defer_observation)
        self._burst_k, self._burst_left = 0, 0
        self._burst_extra = 0  # steps an exploration was extended by (see _extend_burst)
        self._burst_loss = self._burst_cycle = 0.0
        self._burst_exploring = False  # the burst in progress is booked to the exploration budget
        self._explored_plain: bool | None = None  # whether the last step booked as exploring drafted nothing
        self._resume_booked = False  # the next drafting choice resumes after an exploration of k = 0
        self._decode_wait = 0  # choices waiting for a decode measurement (see _wait_for_decode)
        self._bucket, self._bucket_since = -1, 0  # the batch bucket of the last choice, since which choice
        self._drafting_version = 0  # bumped by every observation that changes what drafting is predicted to give
        self._drafting_cache: tuple[tuple[float, int, int], _Terms] | None = None
        self._ahead: tuple[float, int, _Terms, tuple[int, int], ControllerEstimates] | None = None  # prepare()
        self._num_seen = 0  # observations of any kind (observe, observe_apart): what an estimate was made on
        self._hold: Hold | None = None
        self.num_held = 0  # choices the hold answered
        self._prev_batch = 0  # the batch size of the previous choice
        self._grew_at = -FILL_CHOICES  # the last choice whose batch was larger than the one before (batch_growth.py)
        self.arriving = 0  # requests queued to join the batch at the next choice (batch_growth.py)
        self.token_budget: int | None = None  # the scheduler's tokens per step (the engine sets it; _budget_shares)
        # the running requests' output rooms, read when a choice is priced (the engine sets it; output_room.py)
        self.output_room: Callable[[], Sequence[int]] | None = None

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

    def epoch(self) -> int:
        """The acceptance epoch: observations // _EPOCH (acceptance fades, cached terms are checked, once each)."""
        return self.costs.num_observed // _EPOCH

    # -- the model ---------------------------------------------------------------------------
    def _drafting_terms(self, b: float) -> _Terms:
        """At batch b: alpha and fill per position; expected tokens per request for k = 0..K; predicted
        seconds for k = 1..K; which k are priced on fresh data of this bucket. Only steps with drafts
        change them (and time, slowly: fading, staleness; and the batch's output rooms, where requests near
        their ends: output_room.py): while the controller sits at k = 0 they come from a cache (every
        step's bookkeeping runs this)."""
        reach = reach_shares(self.output_room(), self.max_k) if self.output_room is not None else None
        key = (b, self._drafting_version, self.epoch(), reach)
        if self._drafting_cache is not None and self._drafting_cache[0] == key:
            return self._drafting_cache[1]
        alpha, fill = self.acceptance.rates(), self.fill.rates()
        raw, expected, verified = [1.0], [1.0], [1.0]
        survive = 1.0
        for i, (a, f) in enumerate(zip(alpha, fill)):
            survive *= a
            raw.append(raw[-1] + f * survive)
            # a request whose output room ends before position i drafts nothing there (output_room.py)
            f *= reach[i] if reach is not None else 1.0
            expected.append(expected[-1] + f * survive)
            verified.append(verified[-1] + f)
        ratio = self.calibration.ratio(batch_bucket(b)) if self.settings.calibrate else 1.0
        expected = [1.0 + ratio * (e - 1.0) for e in expected]
        seconds, trusted = self.costs.verify_seconds(b, [b * v for v in verified[1:]])
        propose = self.costs.propose_seconds(b)
        if reach is not None:  # a proposal runs as deep as the deepest budget: k beyond it costs no more
            depth = sum(1 for r in reach if r > 0.0)
            propose = [propose[min(k, depth) - 1] if depth else 0.0 for k in range(1, self.max_k + 1)]
        # a draft model feeds every new request's prompt at its next proposal: per output token, a
        # recurring cost of drafting where requests come and go (the warm proposal fits leave it out)
        feed = b * self.costs.prompt_feed_seconds()
        seconds = [t + p + feed * e for t, p, e in zip(seconds, propose, expected[1:])]
        terms = _Terms(alpha, fill, expected, raw, seconds, propose, [True] + trusted, verified)
        if self.verify_cost.weight >= 1.0:  # before that, the decode fit (which changes) stands in
            self._drafting_cache = (key, terms)
        return terms

    def prepare(self, batch_size: int) -> None:
        """Work ahead, while the GPU runs a step: the drafting terms and estimates for the next choice at
        this batch size. choose() takes the terms if the batch size is the same and at most that step was
        observed since (one step behind, for acceptance and the cost fits, which re-solve every few steps
        anyway), the estimates only if nothing was observed since (the engine observes a steady drafting
        step before this, SpecDecoder.deliver_late), and skips ~3/4 of its host time: a synchronous step's
        choice is on the critical path."""
        b = float(max(batch_size, 1))
        terms = self._drafting_terms(b)
        key = (self._num_seen, self.best_k)  # (what the estimates depend on beyond the terms)
        self._ahead = (b, self.costs.num_observed, terms, key, self.estimate(batch_size, terms))

    def _prepared(self, b: float) -> tuple[_Terms, ControllerEstimates | None]:
        """The drafting terms for a choice at batch b, and its estimates where prepare() made them on the
        same observations and best k (else None)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead[0] != b or self.costs.num_observed - ahead[1] > 1:
            return self._drafting_terms(b), None
        return ahead[2], (ahead[4] if ahead[3] == (self._num_seen, self.best_k) else None)

    def estimate(self, batch_size: int, terms: _Terms | None = None) -> ControllerEstimates:
        """Expected tokens/s for every k at this batch size (no exploration, no state change); `terms`:
        the drafting terms to use (default: as of now)."""
        b = float(max(batch_size, 1))
        terms = self._drafting_terms(b) if terms is None else terms
        decode_s, decode_trusted = self.costs.decode_seconds(b)
        seconds = [decode_s] + terms.seconds
        rates = [b * e / t * f for e, t, f in zip(terms.expected, seconds, self._budget_shares(b, terms))]
        # A k is chosen on measurements of this batch bucket only: a guess carried over from another
        # batch size (or from long ago) is explored first, within budget, rather than acted on.
        eligible = [k for k in range(len(rates)) if terms.trusted[k]]
        best = self._among_near_ties(eligible, rates)
        return ControllerEstimates(int(b), best, best, tuple(terms.alpha), tuple(terms.fill),
                                   tuple(terms.expected), tuple(seconds), tuple(rates), tuple(eligible),
                                   (0.0,) + tuple(terms.propose), decode_trusted)

    def _budget_shares(self, b: float, terms: _Terms) -> list[float]:
        """Per k = 0..K: the share of the b requests a step can serve within the scheduler's token budget
        (`token_budget`, max_num_batched_tokens; None: all). Each request asks for the tokens it verifies,
        and the prompts of the requests that replace finished ones ask for theirs (prompt tokens per output
        token, as measured, times the tokens it is expected to make). Requests the budget leaves out sit the
        step out, and new ones wait to be admitted.

        The step prices leave this out: they are fitted at the token counts the steps had. On the H200 pair
        at 256 requests (twenty-ninth session, 2,048-token budget, ~172-token prompts, 128 output tokens)
        k = 10 was priced at 46k tokens/s against 33k for no drafts, and fixed k = 12 made 15.9k against
        28.5k: 256 requests of 11 verified tokens and ~13 prompt tokens each ask for 3x the budget."""
        budget, rho = self.token_budget, self.costs.prompt_tokens_per_output()
        if not budget or b * (terms.verified[-1] + rho * terms.expected[-1]) <= budget:
            return [1.0] * len(terms.expected)  # (K asks the most: every k fits)
        return [min(1.0, budget / max(b * (v + rho * e), 1e-9)) for v, e in zip(terms.verified, terms.expected)]

    def _among_near_ties(self, eligible: list[int], rates: list[float]) -> int:
        """The best k of `eligible` (ascending): the smallest priced within `prefer_fewer` of the fastest.
        Near the top the rate is flat in k while its price gets less certain with k (deeper positions
        have fewer samples; the fastest of noisy prices is priced high by chance, and deep acceptance is
        measured only in the stretches deep drafts were chosen in), and a smaller k does less work per
        token. Simulated (tests/unit/test_adaptive_stretches.py, batch 1-16): where acceptance changes in
        stretches, taking the fastest drafted 1.6-2.4 tokens too many (0.951-0.997 of the best fixed k);
        where it is flat, a 2% band drafted 1.3-3.0 too few (0.972-0.987); a 1% band ran at 0.981-1.007 in
        both. On the H200 pair (twenty-fourth session, 2% band) adaptive / best fixed went from 0.946 to
        1.00 at 2 requests and from 0.955 to 0.98 at 8, and at 1 it drafted 6 where 8 was best (0.94).
        Across drafting and not (k = 0 against k > 0, where a draft model pays a catch-up to start) the
        previous best stays while it is within switch_margin of the fastest (hysteresis)."""
        s = self.settings
        top = max(rates[k] for k in eligible)
        best = next(k for k in eligible if rates[k] >= (1.0 - s.prefer_fewer) * top)
        prev = self.best_k
        if ((prev == 0) != (best == 0) and prev in eligible
                and rates[prev] >= (1.0 - s.switch_margin) * top):
            return prev
        return best

    # -- the interface the decoder calls ------------------------------------------------------
    def choose(self, batch_size: int) -> int:
        """k for the next proposal: the best k; or, within budget, a k to measure (see the module doc)."""
        if self._hold is not None:
            if self._holds(self._hold, batch_size):
                k = self._repeat_zero()
                self._note_batch(batch_size)
                return k
            self._hold = None
        terms, est = self._prepared(float(max(batch_size, 1)))
        est = est or self.estimate(batch_size, terms)
        self.num_choices += 1
        bucket = batch_bucket(batch_size)
        if bucket != self._bucket:  # another load: what was being measured (a burst) is moot
            self._bucket, self._bucket_since, self._burst_left = bucket, self.num_choices, 0
        due = self._arrivals_due(batch_size)
        if due or self._not_worth_a_catch_up(est):
            est = replace(est, best_k=0, chosen_k=0)
        self.best_k = best = est.best_k
        k, exploring = best, False
        if due:
            self._burst_left = 0  # (an exploration in progress is moot: the batch it measured is going)
        elif self._burst_left > 0:
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
        raw = terms.raw_expected
        self._pending = _Choice(k, exploring, best, cold, self.costs.after_prompt, self.costs.unseen_tokens,
                                tuple(raw[i + 1] - raw[i] for i in range(k)))
        self._prev_k = self.last_choice = k
        self.last = est if k == best else replace(est, chosen_k=k)
        self._hold = self._hold_from(est, k, exploring, bucket)
        self._note_batch(batch_size)
        return k

    # -- the hold (spec/hold.py): k = 0 repeated while drafting is far behind ---------------------
    def _repeat_zero(self) -> int:
        """choose()'s bookkeeping for a held k = 0, as a priced choice of k = 0 as the best would leave it
        (the estimates in `last` stay those of the choice that was priced)."""
        self.num_choices += 1
        self.num_held += 1
        self._ahead = None  # (a prepared choice is for the next priced one)
        self._decode_wait = 0  # (the hold's decode price was fresh)
        self._resume_booked = False
        self._pending = _Choice(0, False, 0, True, self.costs.after_prompt, self.costs.unseen_tokens, ())
        self._prev_k = self.last_choice = 0
        return 0

    def _wait_for_decode(self, est: ControllerEstimates) -> bool:
        """Whether a proposer that catches up waits with exploring drafting from k = 0: until a step or
        two without drafts measured here what drafting has to beat (the decode cost carried over from
        another batch size is a guess, and a catch-up paid on it is lost), a few slots at most (a load
        where every step computes prompt chunks gives no plain decode step to measure)."""
        waiting = est.best_k == 0 and not est.decode_trusted and self.catches_up()
        self._decode_wait = self._decode_wait + 1 if waiting else 0
        return waiting and self._decode_wait <= 4 * self.settings.explore_every

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

    def observe_apart(self, prompt_tokens: int, new_prompts: int) -> None:
        """A step of prompt pieces alone, beside the waiting batch (see StepCosts.observe_apart)."""
        self._num_seen += 1
        self.costs.observe_apart(prompt_tokens, new_prompts)

    def defer_observation(self) -> bool:
        """Whether the step that just ran may be observed after the next choice, so that observing runs
        while the GPU computes (decoder.SpecDecoder.deliver_late); if so, its choice is set aside for it.
        Only while drafting steadily at the best k: an exploration, a probe or a burst decides its next
        step on what this one measured (_extend_burst)."""
        c = self._pending
        if (c is None or c.k == 0 or c.exploring or c.k != c.best_k or self._burst_left > 0
                or self._set_aside is not None):
            return False
        self._set_aside, self._pending = c, None
        return True

    def observe(self, step: SpecStepStats) -> None:
        """Learn from one finished step: its cost, the acceptance of its drafts, its proposal's cost."""
        p, self._num_seen = step.proposal, self._num_seen + 1
        choice, late = None, self._set_aside is not None
        if late:
            choice, self._set_aside = self._set_aside, None
        elif p is not None:
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
            horizon = self.settings.calibration_horizon if self.catches_up() else self.settings.acceptance_horizon
            self.calibration.age(math.exp(-_EPOCH / horizon))
            self.fill.age(keep)
            self._drafting_version += 1
        self.costs.observe(step, choice is not None and choice.cold, choice is not None and choice.after_prompt,
                           None if choice is None else choice.unseen_tokens)
        if late and self._pending is not None:
            # the next choice was made before this observation: what it would have read of this step
            self._pending = self._pending._replace(after_prompt=self.costs.after_prompt,
                                                   unseen_tokens=self.costs.unseen_tokens)
        self.acceptance.add(step.reached_per_pos, step.accepted_per_pos)
        if p is not None and p.num_seqs > 0 and p.num_speculative_tokens > 0:
            self.fill.add(p.asked_per_pos, p.drafted_per_pos)
        if choice is not None and choice.k > 0 and step.num_draft_tokens > 0 and step.batch_size > 0 and p is not None:
            # what this step's drafts got against what the windows predicted for them, at this load
            self.calibration.add(batch_bucket(step.batch_size),
                                 predicted_accepted(choice.increments, p, step.batch_size),
                                 sum(step.accepted_per_pos) / step.batch_size, step.batch_size)
        self._account(step, p, choice)

