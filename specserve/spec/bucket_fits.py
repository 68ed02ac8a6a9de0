"""Step-cost fits per batch-size bucket, and how a bucket prices what it has not measured (beyond the batch
sizes it saw: local_price; a k between the k it measured: between_measured), for the adaptive controller's
cost model (estimators.py)."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from specserve.spec.regression import DecayedRegression


def batch_bucket(batch_size: float) -> int:
    """0 for batch 1, 1 for 2, 2 for 3-4, 3 for 5-8, ...: the kernels (GEMV at one row, GEMM above),
    the CUDA graph sizes and the memory/compute balance change with the batch in steps, so step costs
    are not one smooth curve across batch sizes. (Memoized: ~20 calls per step, on the critical path.)"""
    bucket = _BUCKETS.get(batch_size)
    if bucket is None:
        bucket = (max(math.ceil(batch_size), 1) - 1).bit_length()
        if len(_BUCKETS) < 4096:
            _BUCKETS[batch_size] = bucket
    return bucket


_BUCKETS: dict[float, int] = {}


class LocalFits:
    """Cost fits per (batch-size bucket, key), each fed only the steps of its bucket, created on first use.

    A fit is `fresh` while it has data (weight >= 1) and was updated within `stale_after` observations:
    what a bucket measured long ago (warm-up, other load) is a guess, like a prediction carried over
    from another batch size, until it is measured again (then the fit starts over)."""

    def __init__(self, make: Callable[[], DecayedRegression], stale_after: float) -> None:
        self._make, self.stale_after = make, stale_after
        self._fits: dict[tuple[int, int], DecayedRegression] = {}
        self._stamps: dict[tuple[int, int], int] = {}
        self._counts: dict[tuple[int, int], int] = {}
        self._off: dict[tuple[int, int], int] = {}  # the last observation above (1) or below (-1) restart_ratio

    def add(self, batch_size: float, key: int, x: Sequence[float], y: float, now: int,
            restart_ratio: float | None = None) -> None:
        """One observation of the bucket of batch_size; a stale fit starts over (its data was a guess),
        and so does one that mispredicts y by more than restart_ratio times the same way twice in a row
        (the step cost changed: what it held was measured in a disturbance, warm-up say, and would
        outweigh rare new measurements for a whole window)."""
        slot = (batch_bucket(batch_size), key)
        fit = self._fits.get(slot)
        fresh = now - self._stamps.get(slot, now) <= self.stale_after
        if fit is not None and fresh and restart_ratio is not None and fit.weight >= 1.0:
            predicted = fit.predict_recent(x)
            off = 0 if predicted / restart_ratio <= y <= predicted * restart_ratio else (1 if y > predicted else -1)
            # two in a row, the same way: one outlier (a hiccup, a step timed at its launch) only averages in
            fresh = off == 0 or self._off.get(slot) != off
            self._off[slot] = off
        if fit is None or not fresh:
            fit = self._fits[slot] = self._make()
        self._counts[slot] = (self._counts.get(slot, 0) if fresh else 0) + 1
        fit.add(x, y)
        self._stamps[slot] = now

    def samples(self, batch_size: float, key: int, now: int) -> int:
        """How many observations the bucket's fit for key took since it was last stale (0: none, or stale)."""
        slot = (batch_bucket(batch_size), key)
        return self._counts.get(slot, 0) if self.fresh(batch_size, key, now) else 0

    def get(self, batch_size: float, key: int) -> DecayedRegression | None:
        """The bucket's fit for key if it has data (fresh or not)."""
        fit = self._fits.get((batch_bucket(batch_size), key))
        return fit if fit is not None and fit.weight >= 1.0 else None

    def fresh(self, batch_size: float, key: int, now: int) -> bool:
        slot = (batch_bucket(batch_size), key)
        return self.get(batch_size, key) is not None and now - self._stamps[slot] <= self.stale_after

    def age(self, batch_size: float, key: int, now: int) -> int | None:
        """Observations since the bucket's fit for key was last updated (None: never)."""
        stamp = self._stamps.get((batch_bucket(batch_size), key))
        return None if stamp is None else now - stamp


class PlainStepTimes:
    """Per batch-size bucket: the wall time of steps without drafts (the interval between two observations:
    prompt chunks, host work and all), over a decayed window. No plain decode step costs more than that
    on average, so it bounds a bucket's decode fit from above.

    A bucket's decode fit learns only from clean steps (no prompt chunk in the step or the one before),
    and where requests come and go those are rare. On the H200 pair at concurrency 256 (twentieth
    session) one in several hundred steps was clean, and those few (host work of a batch of finishing
    requests on their timers) priced a decode step at 17.7 ms for 800 observations, while steps without
    drafts took ~4 ms each, prompt chunks included: the controller drafted k = 12 at 0.69 of no drafting."""

    def __init__(self, window: float, stale_after: float, min_weight: float = 8.0) -> None:
        self._keep, self.stale_after, self.min_weight = 1.0 - 1.0 / window, stale_after, min_weight
        self._sums: dict[int, tuple[float, float, float]] = {}  # bucket -> (weight, seconds, batch) decayed
        self._stamps: dict[int, int] = {}

    def add(self, batch_size: float, seconds: float, now: int) -> None:
        bucket = batch_bucket(batch_size)
        w, s, b = self._sums.get(bucket, (0.0, 0.0, 0.0))
        if now - self._stamps.get(bucket, now) > self.stale_after:
            w = s = b = 0.0  # measured under another load: starts over
        keep = self._keep
        self._sums[bucket] = (w * keep + 1.0, s * keep + seconds, b * keep + batch_size)
        self._stamps[bucket] = now

    def bound(self, batch_size: float, now: int) -> float | None:
        """The mean plain step of this bucket, scaled up to batch_size where that is above the mean batch
        (a step's cost grows less than in proportion to its batch: still a bound); None without enough
        recent data."""
        bucket = batch_bucket(batch_size)
        sums = self._sums.get(bucket)
        if sums is None or sums[0] < self.min_weight or now - self._stamps[bucket] > self.stale_after:
            return None
        w, s, b = sums
        return s / w * max(1.0, batch_size * w / b)


# A bucket's fit prices decode-token counts up to this factor beyond the span it measured as it fits them;
# further out, by its price at the span's edge times the fit over every batch size's ratio (local_price).
_SPAN_SLACK = 1.1


def local_price(local: DecayedRegression, tokens: float, pooled: DecayedRegression) -> float:
    """A step of `tokens` decode tokens as a bucket's fit (features 1, decode tokens, prefill tokens) prices
    it: as fitted within its measured span (give or take _SPAN_SLACK); beyond, its price at the span's
    nearest edge times the ratio the fit over every batch size (`pooled`) gives between the two counts.

    A bucket's fit that saw one batch size cannot tell its slope from its intercept: the ridge makes it
    flat, and it prices every other size in the bucket as that one. On the H200 pair at 256 requests
    (twenty-seventh session) the 129-256 bucket's decode fit had seen only full batches (6.6 ms); in a
    part's fill, at 129-155 requests, it priced a decode step at 6.6 ms (one at 128 requests takes 2.4),
    drafting looked 1.3-2.0 times as fast, and the policy drafted in 148 choices there (0.88 of no drafts
    at that level)."""
    lo, hi = local.min_x, local.max_x
    if not lo <= hi or lo / _SPAN_SLACK <= tokens <= hi * _SPAN_SLACK:
        return local.predict((1.0, tokens, 0.0))
    edge = min(max(tokens, lo), hi)
    # (the fits are non-negative least squares: the ratio lies between 1, flat, and tokens / edge, proportional)
    ratio = pooled.predict_many([(1.0, tokens, 0.0), (1.0, edge, 0.0)])
    if ratio is None or ratio[0] <= 0.0 or ratio[1] <= 0.0:
        return local.predict((1.0, tokens, 0.0))
    return local.predict((1.0, edge, 0.0)) * ratio[0] / ratio[1]


def between_measured(prices: dict[int, float], k: int, tokens: Callable[[int], float]) -> float | None:
    """The price of k on the line between the nearest k below and above it that a bucket measured
    (`prices`: k -> price; `tokens(k)`: the position on the line, a step's token count), or None without
    a measured k on both sides.

    Verify steps and proposals cost about linearly in k at one batch size (more tokens through the same
    graphs, one draft forward per draft), and a bucket's own prices say far more about it than fits over
    every batch size do. On the H200 pair at 16 requests (twenty-eighth session) the bucket had measured
    no drafts, k = 8 and k = 10-12, the fits over every batch size (k = 4 measured at 1-4 requests) priced
    a k = 4 step at 8.73 ms, and fixed k = 4's steps took 7.1-7.6: drafting 4 never looked worth trying,
    and the controller drafted 10-12 and none at 0.92 of fixed k = 4. The line runs at or below a cost
    that is concave in k, so a k it prices well is tried (exploration measures it) rather than assumed.
    Only in a bucket that measured its plain decode step lately, on enough clean steps (estimators.
    StepCosts._anchored): where it has not (every step computes a prompt chunk, say), no drafts are priced
    on a guess too, and guesses that make drafting cheaper there only make it look better than no drafts
    (a simulated 128 requests, tests/unit/test_adaptive_arrivals.py, drafted at 0.93 of no drafts)."""
    lo = max((j for j in prices if j < k), default=None)
    hi = min((j for j in prices if j > k), default=None)
    if lo is None or hi is None:
        return None
    x_lo, x_hi = tokens(lo), tokens(hi)
    if x_hi <= x_lo:
        return prices[lo]
    return prices[lo] + (tokens(k) - x_lo) * (prices[hi] - prices[lo]) / (x_hi - x_lo)
