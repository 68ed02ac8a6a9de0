"""Adaptive speculation (issue 7): each step, the k in 0..K that maximizes expected tokens per second.

Goodput model (TurboSpec-style), per request in a batch of B:
  E[tokens | k]   = 1 + sum_{j<k} fill_j * prod_{i<=j} alpha_i
  tokens verified = 1 + sum_{j<k} fill_j
  cost(k)         = t_verify(B * tokens verified) + t_propose(k, B);   cost(0) = t_decode(B)
  choose          argmax_k  B * E[tokens | k] / cost(k)
alpha_i is the acceptance of draft position i given that every earlier one was accepted; fill_j is
how often the proposer produced a draft at position j when asked for one (n-gram lookups come back
short or empty). Everything is measured here, over moving windows:
  - alpha and fill: exponentially decayed counts per position, with an optimistic prior (so a fresh
    controller drafts K and measures, rather than never trying);
  - t_verify, t_decode: linear fits a + b * decode tokens + c * prefill tokens over recent steps
    with and without drafts (prefill chunks that share a step are costed apart, and predictions are
    for pure decode steps); b is pulled toward 0 (memory-bound, the optimistic guess) until the data
    can tell it;
  - t_propose: a non-negative fit over k, k*B and B (draft models cost ~k forwards; n-gram ~B lookups).
Every `explore_every`-th choice tries a neighbour of the best k on a fixed schedule (no randomness), so
the cost slope and the acceptance of positions just beyond the best k stay measured; a neighbour
predicted to cost more than `explore_max_loss` of the throughput is tried only every
`explore_backoff`-th time.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

from specserve.config import SpeculativeConfig


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

    @classmethod
    def measure(cls, k: int, budgets: Sequence[int], num_drafted: Sequence[int], seconds: float) -> ProposalStats:
        return cls(len(budgets), k, count_above(budgets, k), count_above(num_drafted, k), seconds)


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


class DecayedRegression:
    """Non-negative least squares y ~ theta . x over an exponentially decayed window of observations.

    `ridge[j]`, relative to feature j's weighted second moment, pulls theta_j toward 0 where the data
    cannot separate it from the other features (e.g. every step had the same token count). Plain
    Python floats: with 2-3 features numpy's per-call overhead would dominate a step's bookkeeping."""

    def __init__(self, num_features: int, window: float, ridge: Sequence[float], outlier_factor: float = 5.0) -> None:
        self.decay = 1.0 - 1.0 / window
        self.ridge = [float(r) for r in ridge]
        self.outlier_factor = outlier_factor
        self.xtx = [[0.0] * num_features for _ in range(num_features)]
        self.xty = [0.0] * num_features
        self.weight = 0.0
        self._theta: list[float] | None = None

    def add(self, x: Sequence[float], y: float) -> None:
        """Add one observation; y above `outlier_factor` x the prediction (JIT, GC pauses) is clipped."""
        if self.weight >= 5.0:
            pred = self.predict(x)
            if pred > 0:
                y = min(y, self.outlier_factor * pred)
        d = self.decay
        for i, xi in enumerate(x):
            row = self.xtx[i]
            for j, xj in enumerate(x):
                row[j] = d * row[j] + xi * xj
            self.xty[i] = d * self.xty[i] + xi * y
        self.weight = d * self.weight + 1.0
        self._theta = None

    def coefficients(self) -> list[float]:
        if self._theta is None:
            self._theta = self._solve()
        return self._theta

    def _solve(self) -> list[float]:
        n = len(self.xty)
        theta = [0.0] * n
        active = list(range(n))
        while active:  # active-set NNLS: drop the most negative coefficient and refit
            a = [[self.xtx[i][j] + (self.ridge[i] * self.xtx[i][i] + 1e-12 if i == j else 0.0) for j in active]
                 for i in active]
            sol = _solve_small(a, [self.xty[i] for i in active])
            if min(sol) >= 0:
                for i, v in zip(active, sol):
                    theta[i] = v
                break
            active.pop(sol.index(min(sol)))
        return theta

    def predict(self, x: Sequence[float]) -> float:
        return sum(t * v for t, v in zip(self.coefficients(), x))

    def predict_many(self, xs: Sequence[Sequence[float]], min_weight: float = 1.0) -> list[float] | None:
        """The fitted y at each x, or None before `min_weight` (decayed) observations."""
        if self.weight < min_weight:
            return None
        return [self.predict(x) for x in xs]


def _solve_small(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting for a tiny symmetric positive-definite system."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        if m[col][col] == 0.0:
            continue
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        acc = m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))
        x[r] = acc / m[r][r] if m[r][r] != 0.0 else 0.0
    return x


class PositionRates:
    """A success rate per draft position over a decayed window of samples, with a prior."""

    def __init__(self, num_positions: int, prior: float, prior_weight: float, window: float) -> None:
        self.prior, self.prior_weight, self.window = prior, prior_weight, window
        self.hits = [0.0] * num_positions
        self.trials = [0.0] * num_positions

    def add(self, trials: Sequence[int], hits: Sequence[int]) -> None:
        for i, (n, h) in enumerate(zip(trials[:len(self.trials)], hits)):
            if n > 0:
                keep = math.exp(-n / self.window)  # older samples fade per new sample, not per step
                self.trials[i] = self.trials[i] * keep + n
                self.hits[i] = self.hits[i] * keep + h

    def rates(self) -> list[float]:
        pw, prior = self.prior_weight, self.prior
        return [(h + prior * pw) / (n + pw) for h, n in zip(self.hits, self.trials)]


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


class AdaptiveController:
    """Chooses k in 0..num_speculative_tokens each step from batch size, acceptance and measured costs."""

    def __init__(self, cfg: SpeculativeConfig, settings: AdaptiveSettings | None = None) -> None:
        s = self.settings = settings or AdaptiveSettings()
        self.max_k = cfg.num_speculative_tokens
        self.acceptance = PositionRates(self.max_k, s.acceptance_prior, s.prior_weight, s.acceptance_window)
        self.fill = PositionRates(self.max_k, 1.0, s.prior_weight, s.acceptance_window)
        # features (1, decode tokens, prefill tokens)
        self.verify_cost = DecayedRegression(3, s.cost_window, (0.0, s.slope_ridge, s.slope_ridge))
        self.decode_cost = DecayedRegression(3, s.cost_window, (0.0, s.slope_ridge, s.slope_ridge))
        self.propose_cost = DecayedRegression(3, s.cost_window, (s.slope_ridge,) * 3)
        self.num_choices = 0
        self.best_k = self.max_k
        self.last_choice = self.max_k
        self.last: ControllerEstimates | None = None

    # -- the model ---------------------------------------------------------------------------
    def _forward_seconds(self, num_tokens: list[float], with_drafts: bool) -> list[float]:
        """Target step time at each num_tokens; the other model stands in until this one has data."""
        first, second = (self.verify_cost, self.decode_cost) if with_drafts else (self.decode_cost, self.verify_cost)
        for model in (first, second):
            t = model.predict_many([(1.0, x, 0.0) for x in num_tokens])
            if t is not None:
                return [max(v, 1e-9) for v in t]
        return [1.0] * len(num_tokens)  # nothing measured: every k costs the same, the prior decides

    def estimate(self, batch_size: int) -> ControllerEstimates:
        """Expected tokens/s for every k at this batch size (no exploration, no state change)."""
        b = float(max(batch_size, 1))
        alpha, fill = self.acceptance.rates(), self.fill.rates()
        expected, verified = [1.0], [1.0]
        survive = 1.0
        for a, f in zip(alpha, fill):
            survive *= a
            expected.append(expected[-1] + f * survive)
            verified.append(verified[-1] + f)
        seconds = self._forward_seconds([b], False) + self._forward_seconds([b * v for v in verified[1:]], True)
        propose = self.propose_cost.predict_many([(k, k * b, b) for k in range(1, self.max_k + 1)])
        for k, t in enumerate(propose or [], start=1):
            seconds[k] += max(t, 0.0)
        rates = [b * e / t for e, t in zip(expected, seconds)]
        best = max(range(len(rates)), key=rates.__getitem__)
        if rates[self.best_k] >= (1.0 - self.settings.switch_margin) * rates[best]:
            best = self.best_k  # hysteresis: near-ties do not flip k back and forth
        return ControllerEstimates(int(b), best, best, tuple(alpha), tuple(fill), tuple(expected), tuple(seconds),
                                   tuple(rates))

    # -- the interface the decoder calls ------------------------------------------------------
    def choose(self, batch_size: int) -> int:
        """k for the next proposal: the best k, or on schedule a neighbour of it."""
        est = self.estimate(batch_size)
        self.best_k = k = est.best_k
        self.num_choices += 1
        every = self.settings.explore_every
        if every and self.num_choices % every == 0:
            k = self._neighbour(est, self.num_choices // every)
        self.last_choice = k
        self.last = replace(est, chosen_k=k)
        return k

    def _neighbour(self, est: ControllerEstimates, slot: int) -> int:
        """The k to try at exploration slot `slot`: alternately above and below the best k."""
        best, s = est.best_k, self.settings
        step = 1 if slot % 2 == 1 else -1
        if not 0 <= best + step <= self.max_k:
            step = -step
        k = min(max(best + step, 0), self.max_k)
        costly = est.tokens_per_s[k] < (1.0 - s.explore_max_loss) * est.tokens_per_s[best]
        if costly and (slot // 2) % s.explore_backoff != 0:
            return best  # measured often enough: this neighbour is far from paying
        return k

    def observe(self, step: SpecStepStats) -> None:
        """Learn from one finished step: its cost, the acceptance of its drafts, its proposal's cost."""
        if step.step_seconds > 0 and step.num_batched_tokens > 0:
            model = self.verify_cost if step.num_draft_tokens > 0 else self.decode_cost
            decode = step.batch_size + step.num_draft_tokens  # one token per request, plus its drafts
            prefill = max(step.num_batched_tokens - decode, 0)  # the rest: prompt chunks
            model.add((1.0, float(decode), float(prefill)), step.step_seconds)
        self.acceptance.add(step.reached_per_pos, step.accepted_per_pos)
        p = step.proposal
        if p is not None and p.num_seqs > 0 and p.num_speculative_tokens > 0:
            self.fill.add(p.asked_per_pos, p.drafted_per_pos)
            k, b = p.num_speculative_tokens, p.num_seqs
            self.propose_cost.add((k, k * b, b), p.seconds)
