"""How many tokens to draft per request in the next step: the `Controller` interface and its implementations.

`choose(batch_size)` returns 0..max_k once per proposal; `observe(record)` gets each step's measurements, in order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

from specserve.config import SpeculativeConfig


@dataclass(frozen=True)
class StepRecord:
    """What one engine step and the proposal that fed it measured."""

    batch_size: int  # requests scheduled in the step
    k: int  # the controller's choice for this step (0: the step verified no drafts)
    # per draft position j < k: requests whose draft at j was verified with every earlier one accepted
    reached: tuple[int, ...]
    accepted: tuple[int, ...]  # per draft position j < k: requests whose drafts at 0..j were all accepted
    step_seconds: float  # the target's forward + sampling/verification, host wall time
    propose_seconds: float  # the proposal that fed this step (0.0 when none ran)
    catch_up_tokens: int = 0  # tokens the proposer fed beyond its drafting (a draft model catching up)
    # requests the proposal asked for drafts (None: reached[0]); one asked that got no draft is a rejection
    num_asked: int | None = None


class StepCostTable(Protocol):
    """The target's step cost by shape, measured at start-up (`runner/step_costs.py`)."""

    def seconds(self, batch_size: int, query_len: int) -> float:
        """Seconds of one target step of `batch_size` requests of `query_len` tokens each."""
        ...


class Controller(ABC):
    """Chooses k in 0..max_k per step. `follows_load`: whether k depends on the load (not the same every step)."""

    follows_load: bool = True

    def __init__(self, max_k: int) -> None:
        self.max_k = max_k

    @abstractmethod
    def choose(self, batch_size: int) -> int:
        """Drafts per request for the next step of `batch_size` running requests."""

    def observe(self, record: StepRecord) -> None:
        """What the step just run measured; called once per step, in order."""


class FixedController(Controller):
    """k = max_k every step."""

    follows_load = False

    def choose(self, batch_size: int) -> int:
        return self.max_k


class TableController(Controller):
    """vLLM's `num_speculative_tokens_per_batch_size`: the k of the first row whose [min_batch, max_batch] holds the
    batch size, capped at max_k; 0 where no row does."""

    def __init__(self, max_k: int, table: tuple[tuple[int, int, int], ...]) -> None:
        super().__init__(max_k)
        self.table = table

    def choose(self, batch_size: int) -> int:
        for lo, hi, k in self.table:
            if lo <= batch_size <= hi:
                return min(k, self.max_k)
        return 0


class AdaptiveController(Controller):
    """k = argmax over 0..max_k of expected tokens per second for a batch of b requests:

        rate(b, k) = b * E[tokens | k] / cost(b, k),  E[tokens | k] = 1 + m * sum_{j<k} prod_{i<=j} alpha_i
        cost(b, 0) = T(b, 1),  cost(b, k) = u * T(b, k + 1) + (1 - u) * T(b, 1) + D(b, k) + S(b) / switch_horizon

    m: the share of requests asked for drafts that got one (an n-gram lookup may find nothing; a draft model
    always drafts); u = 1 - (1 - m)^b, the chance that a step verifies any draft (a step where no request
    got one is a plain decode step). alpha_j: acceptance at position j of requests that got a draft. m and
    alpha_j are decayed counts over an optimistic prior (m's is 1, so a proposer that always drafts has
    m = 1 exactly) that drift back to it while unmeasured (drift_steps) when below it. T: the measured cost
    table only. D(b, k) = k * a moving average of warm seconds per draft step, per power-of-two batch bucket.
    S(b): a draft model's one-off catch-up when drafting resumes after k = 0, amortized over switch_horizon
    steps (n-gram pays none). Ties go to the smaller k.
    """

    def __init__(
        self,
        max_k: int,
        costs: StepCostTable,
        *,
        prior: float = 0.8,
        prior_weight: float = 2.0,
        window_steps: float = 32.0,
        drift_steps: float = 500.0,
        switch_horizon: float = 100.0,
    ) -> None:
        super().__init__(max_k)
        if not 0.0 < prior <= 1.0:
            raise ValueError(f"prior must be in (0, 1], got {prior!r}")
        positive = {"prior_weight": prior_weight, "window_steps": window_steps, "drift_steps": drift_steps}
        for name, value in {**positive, "switch_horizon": switch_horizon}.items():
            if not value > 0.0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        self.costs = costs
        self.prior, self.prior_weight, self.switch_horizon = prior, prior_weight, switch_horizon
        self._keep = 1.0 - 1.0 / max(window_steps, 1.0)  # per step that measured it
        self._drift = 1.0 - 1.0 / max(drift_steps, 1.0)  # per step that did not
        # index 0: requests that got a first draft of those asked (m); j + 1: acceptance at draft position j
        self._hits = [0.0] * (max_k + 1)  # decayed per step that measured the rate
        self._trials = [0.0] * (max_k + 1)
        self._idle = [0] * (max_k + 1)  # steps since the rate was last measured
        self._priors = (1.0,) + (prior,) * max_k  # index as _hits
        self._match = 1.0
        self._alpha = (prior,) * max_k
        self._expected = self._expected_by_k()
        self._draft: dict[int, tuple[float, float]] = {}  # bucket -> decayed (seconds per draft step, steps)
        self._catch_up = (0.0, 0.0)  # decayed (seconds beyond a draft step and the warm proposal, tokens)
        self._skipped = 0  # tokens computed since the last drafting step (what a draft model catches up on)
        self._last_observed_k: int | None = None
        self.last_choice: int | None = None

    def acceptance(self) -> tuple[float, ...]:
        """alpha_j for draft positions j = 0..max_k - 1 (of requests that got a draft)."""
        return self._alpha

    def match_rate(self) -> float:
        """m: the share of requests asked for drafts that got one."""
        return self._match

    def expected_tokens(self, k: int) -> float:
        """E[tokens | k] per request per step."""
        return self._expected[k]

    def draft_seconds(self, batch_size: int, k: int) -> float:
        """D(b, k): a warm proposal of k drafts for batch_size requests."""
        if k <= 0 or not self._draft:
            return 0.0
        want = _bucket(batch_size)
        nearest = min(self._draft, key=lambda b: (abs(b.bit_length() - want.bit_length()), -b))
        seconds, weight = self._draft[nearest]
        return k * seconds / weight

    def switch_seconds(self, batch_size: int) -> float:
        """S(b): what starting to draft now costs once (0 while drafting, or for a proposer that never caught up).
        Drafting stands still where the last choice (or, before any, the last step) was 0."""
        seconds, tokens = self._catch_up
        idle = self.last_choice if self.last_choice is not None else self._last_observed_k
        if idle != 0 or tokens <= 0.0:
            return 0.0
        return self.draft_seconds(batch_size, 1) + self._skipped * seconds / tokens

    def expected_rate(self, batch_size: int, k: int) -> float:
        """rate(b, k), tokens per second, as choose() compares them now."""
        return self.expected_rates(batch_size)[k]

    def expected_rates(self, batch_size: int) -> list[float]:
        """rate(b, k) for k = 0..max_k."""
        b = max(batch_size, 1)
        per_draft = self.draft_seconds(b, 1)
        switch = self.switch_seconds(b) / self.switch_horizon
        m, plain = self._match, self.costs.seconds(b, 1)
        verifies = 1.0 - (1.0 - m) ** b
        rates = [b / plain]
        for k in range(1, self.max_k + 1):
            cost = verifies * self.costs.seconds(b, k + 1) + (1.0 - verifies) * plain + k * per_draft + switch
            rates.append(b * (1.0 + m * (self._expected[k] - 1.0)) / cost)
        return rates

    def choose(self, batch_size: int) -> int:
        rates = self.expected_rates(batch_size)
        self.last_choice = max(range(self.max_k + 1), key=lambda k: (rates[k], -k))  # ties: the smaller k
        return self.last_choice

    def observe(self, record: StepRecord) -> None:
        if record.batch_size <= 0:
            return
        k = min(record.k, self.max_k)
        cold = self._last_observed_k in (None, 0)
        self._last_observed_k = k
        self._observe_acceptance(record, k)
        if k == 0:
            self._skipped += record.batch_size
            return
        per_step = record.propose_seconds / k
        if not cold:
            self._add_draft_step(record.batch_size, per_step)
        elif record.catch_up_tokens > 0 and self._draft:
            # a resumed proposal: what it took beyond the warm proposal and one draft step, per token fed
            warm = self.draft_seconds(record.batch_size, k + 1)
            keep = self._keep
            seconds, tokens = self._catch_up
            self._catch_up = (
                seconds * keep + max(record.propose_seconds - warm, 0.0),
                tokens * keep + record.catch_up_tokens,
            )
        self._skipped = 0

    def _observe_acceptance(self, record: StepRecord, k: int) -> None:
        drafted = _at(record.reached, 0)  # requests that got a first draft
        asked = record.num_asked if record.num_asked is not None else drafted
        for i in range(self.max_k + 1):
            trials, hits = 0, 0
            if i == 0 and k > 0:
                trials, hits = asked, drafted
            elif 0 < i <= k:  # requests that drafted position j = i - 1 had every earlier draft accepted
                trials = _at(record.accepted, i - 2) if i > 1 else drafted
                hits = _at(record.accepted, i - 1)
            if trials > 0:
                self._hits[i] = self._hits[i] * self._keep + min(hits, trials)
                self._trials[i] = self._trials[i] * self._keep + trials
                self._idle[i] = 0
            else:
                self._idle[i] += 1
        w, counts = self.prior_weight, zip(self._hits, self._trials, self._idle, self._priors)
        rates = []
        for h, n, idle, p in counts:
            s = self._drift**idle if h < p * n else 1.0  # below the prior and unmeasured: drift back to it
            rates.append((h * s + p * w) / (n * s + w))
        self._match, self._alpha = rates[0], tuple(rates[1:])
        self._expected = self._expected_by_k()

    def _expected_by_k(self) -> list[float]:
        expected, survive = [1.0], 1.0
        for a in self._alpha:
            survive *= a
            expected.append(expected[-1] + survive)
        return expected

    def _add_draft_step(self, batch_size: int, seconds: float) -> None:
        bucket = _bucket(batch_size)
        total, weight = self._draft.get(bucket, (0.0, 0.0))
        self._draft[bucket] = (total * self._keep + seconds, weight * self._keep + 1.0)


def _at(counts: tuple[int, ...], i: int) -> int:
    return counts[i] if i < len(counts) else 0


def _bucket(batch_size: int) -> int:
    """The power of two at or above batch_size: draft costs are averaged per bucket."""
    return 1 << max(batch_size - 1, 0).bit_length()


def build_controller(cfg: SpeculativeConfig, costs: StepCostTable | None) -> Controller:
    """A table if given, else adaptive (`cfg.adaptive` with a measured cost table), else fixed.
    `disable_by_batch_size` is the decoder's."""
    k = cfg.num_speculative_tokens
    if cfg.num_speculative_tokens_per_batch_size:
        return TableController(k, cfg.num_speculative_tokens_per_batch_size)
    if cfg.adaptive and costs is not None:
        return AdaptiveController(k, costs)
    return FixedController(k)
