"""`DecayedRegression`: the step-cost fit of the adaptive controller's estimators (estimators.py).

Non-negative least squares with relative errors over a decayed window of observations, outliers
clipped where the fit has data, re-solved lazily, predictions rescaled to the mean of what was
observed. Plain Python floats: 2-3 features per fit.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Sequence

_RESOLVE_EVERY = 4  # observations between re-solves of a fit (see coefficients())
_SURPRISE = 0.25  # an observation this far (relative) from the fit's prediction re-solves it at once
_LEVEL_FROM = 5.0  # observations (decayed) before the fit's level is calibrated (and outliers clipped)


class DecayedRegression:
    """Non-negative least squares y ~ theta . x (relative errors) over a decayed window of observations.

    `ridge[j]`, relative to feature j's weighted second moment, pulls theta_j toward 0 where the data
    cannot separate it from the other features (e.g. every step had the same token count). Plain
    Python floats: with 2-3 features numpy's per-call overhead would dominate a step's bookkeeping."""

    def __init__(self, num_features: int, window: float, ridge: Sequence[float], outlier_factor: float = 5.0,
                 range_feature: int | None = None) -> None:
        self.decay = 1.0 - 1.0 / window
        self.ridge = [float(r) for r in ridge]
        self.outlier_factor = outlier_factor
        # the span of x[range_feature] over the window (decayed toward recent values): where the fit is data
        self.range_feature = range_feature
        self.min_x, self.max_x = math.inf, 0.0
        self.xtx = [[0.0] * num_features for _ in range(num_features)]
        self.xty = [0.0] * num_features
        self.weight = 0.0
        self._theta: list[float] | None = None
        self._unsolved = 0  # observations added since theta was solved
        # The level: decayed mean of observed / fitted y (within outlier_factor of each other), over
        # observations made once the fit had data; one pseudo-observation of 1 as its prior.
        self._level_sum, self._level_weight = 0.0, 0.0

    def add(self, x: Sequence[float], y: float) -> None:
        """Add one observation; y above `outlier_factor` x the prediction (JIT, GC pauses) is clipped,
        where the fit has data nearby (beyond, a large y is news, not an outlier)."""
        d = self.decay
        inside = True
        if self.range_feature is not None:
            v = x[self.range_feature]
            inside = self.covers(v)
            self.max_x = max(self.max_x * d, v)
            self.min_x = min(self.min_x / d, v)
        if self.weight >= _LEVEL_FROM:
            # judged by the theta solved last (a few observations old): solving here would re-solve every
            # few adds although nothing reads the fit (at high load, every step adds a plain decode step
            # to two fits, and the controller's host time is paid on every step)
            raw = self._raw_recent(x)
            pred = raw * self.level()
            if pred > 0 and inside:
                y = min(y, self.outlier_factor * pred)
            if abs(y - pred) > _SURPRISE * pred:
                self._theta = None  # far from the fit: solve again at once (see coefficients())
            # beyond outlier_factor either way the cost changed (JIT done) or hiccupped: no spread to learn
            if raw > 0 and 1.0 / self.outlier_factor < y / raw < self.outlier_factor:
                self._level_sum = d * self._level_sum + y / raw
                self._level_weight = d * self._level_weight + 1.0
        # Relative least squares (weight 1/y^2): timing noise is proportional to the time, and a 5%
        # wobble on a 250 ms step must not drown a 2 ms step's intercept. (It also follows costs that
        # drop, once JIT or graph capture is done, within a sample or two; the price is that a y far
        # too small weighs a lot: steps timed before their forward ended are kept out, adaptive.py.)
        w = 1.0 / max(y * y, 1e-18)
        xtx, xty = self.xtx, self.xty
        for i, xi in enumerate(x):  # (comprehensions: the same arithmetic as a double loop, faster)
            wxi = w * xi
            xtx[i] = [d * r + wxi * xj for r, xj in zip(xtx[i], x)]
            xty[i] = d * xty[i] + wxi * y
        self.weight = d * self.weight + 1.0
        self._unsolved += 1

    def covers(self, v: float, reach: float = 2.0) -> bool:
        """Whether v lies within `reach` x the span of the data (always, for a fit without a range)."""
        return self.range_feature is None or (self.min_x / reach <= v <= reach * self.max_x)

    def coefficients(self) -> list[float]:
        """theta, solved again once a few observations came in (every priced choice reads it; a fit a
        few samples old predicts as well as a fresh one, except while the window fills up, or when an
        observation was far from it: a fit fed rarely, say a k the controller explores now and then, must
        not keep a stale answer until a few more come). add() does not solve (predict_recent): on the
        H200 host, at 128-256 requests at k = 0, the controller's choose + observe went from ~125 to ~91
        us a step (twenty-fifth session)."""
        if self._theta is None or (self._unsolved and (self._unsolved >= _RESOLVE_EVERY or self.weight < 16.0)):
            self._theta = self._solve()
            self._unsolved = 0
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

    def level(self) -> float:
        """What the relative fit's predictions are scaled by: the mean of observed / fitted y. Relative
        least squares (weights 1 / y^2) fits y that vary at one x to sum(1 / y) / sum(1 / y^2), below
        their mean: a cost alternating 3 and 9 ms fits 3.6 ms, not 6. What throughput pays is the mean
        (on the H200 pair, concurrency 1, a draft model's k = 11 proposals fitted 4.4 ms and averaged
        6.6; the adaptive controller drafted 10-11 tokens where 8 were faster). Scaling by the mean
        ratio keeps the relative fit's shape over x and its quick following of a cost that drops."""
        return (self._level_sum + 1.0) / (self._level_weight + 1.0)

    def _raw(self, x: Sequence[float]) -> float:
        return sum(map(operator.mul, self.coefficients(), x))

    def _raw_recent(self, x: Sequence[float]) -> float:
        return sum(map(operator.mul, self._theta if self._theta is not None else self.coefficients(), x))

    def predict(self, x: Sequence[float]) -> float:
        return self._raw(x) * self.level()

    def predict_recent(self, x: Sequence[float]) -> float:
        """predict(x) by the theta solved last, unless there is none: for judging a new observation (an
        outlier, a changed cost), where a theta a few observations old does as well and re-solving on
        every add would cost the solves that only reads need."""
        return self._raw_recent(x) * self.level()

    def predict_many(self, xs: Sequence[Sequence[float]], min_weight: float = 1.0) -> list[float] | None:
        """The fitted y at each x, or None before `min_weight` (decayed) observations."""
        if self.weight < min_weight:
            return None
        theta, level = self.coefficients(), self.level()
        return [level * sum(map(operator.mul, theta, x)) for x in xs]


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


def non_decreasing(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """The weighted least-squares fit of `values` that never decreases (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [weighted sum, weight, count]
    for v, w in zip(values, weights):
        blocks.append([v * w, w, 1])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
            total, weight, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += weight
            blocks[-1][2] += count
    return [total / weight for total, weight, count in blocks for _ in range(int(count))]
