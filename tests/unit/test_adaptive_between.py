"""A k that a batch-size bucket has not measured, priced between the k it has (bucket_fits.between_measured).

On the H200 pair at 16 requests (twenty-eighth session) the bucket had measured no drafts, k = 8 and
k = 10-12; fits over every batch size, whose k = 4 data came from 1-4 requests, priced a k = 4 step at
8.73 ms where fixed k = 4's took 7.1-7.6. Drafting 4 never looked worth trying, and the controller
drafted 10-12 (and none) at 0.92 of fixed k = 4."""
from __future__ import annotations

import pytest

from specserve.spec.estimators import StepCosts
from specserve.spec.step_stats import ProposalStats, SpecStepStats

K = 12


def verify_s(b: int, k: int) -> float:
    return 0.0017 + 1.3e-5 * b * (k + 1)  # 3.15 ms at k = 6, 16 requests; 4.4 ms at k = 12


def decode_s(b: int) -> float:
    return verify_s(b, 0)


def propose_s(b: int, k: int) -> float:
    return (k + 1) * (0.0008 + 1e-5 * b)  # one draft forward per draft, and one to feed the accepted


def observe(costs: StepCosts, clock: list[float], b: int, k: int, seconds: float, propose: float) -> None:
    drafts = [k] * b if k else []
    clock[0] += seconds + propose
    costs.observe(SpecStepStats(b, b + sum(drafts), sum(drafts), seconds,
                                proposal=ProposalStats.measure(k, drafts, drafts, propose)), False, False, 0.0)


def measured_costs(small_batch_k4: float) -> StepCosts:
    """k = 4 measured at 2 requests only (at `small_batch_k4` x what the 16-request line says there), then
    16 requests: decode steps, k = 8 and k = 12."""
    clock = [0.0]
    costs = StepCosts(max_k=K, window=32.0, ridge=1e-4, stale_after=1000, arrivals_window=2000.0)
    costs.clock = lambda: clock[0]
    for _ in range(30):
        observe(costs, clock, 2, 4, small_batch_k4 * verify_s(2, 4), small_batch_k4 * propose_s(2, 4))
    for k in (0, 0, 0, 8, 12):  # warm proposals; decode steps after plain ones (timed to their ends)
        for _ in range(30):
            observe(costs, clock, 16, k, verify_s(16, k), propose_s(16, k))
    return costs


@pytest.mark.parametrize("small_batch_k4", [0.5, 3.0])
def test_an_unmeasured_k_is_priced_on_the_line_between_measured_ones(small_batch_k4: float) -> None:
    costs = measured_costs(small_batch_k4)
    verify, trusted = costs.verify_seconds(16.0, [16.0 * (k + 1) for k in range(1, K + 1)])
    assert trusted[8 - 1] and trusted[12 - 1] and not trusted[4 - 1]  # (a guess: explored before chosen)
    assert verify[8 - 1] == pytest.approx(verify_s(16, 8), rel=0.03)
    # between the decode step and k = 8, whatever k = 4 cost at 2 requests
    assert verify[4 - 1] == pytest.approx(verify_s(16, 4), rel=0.05)
    assert verify[10 - 1] == pytest.approx(verify_s(16, 10), rel=0.05)
    propose = costs.propose_seconds(16.0)
    assert propose[4 - 1] == pytest.approx(propose_s(16, 4), rel=0.25)  # (through no drafts at 0 s: a bit low)
    assert propose[4 - 1] <= propose_s(16, 4)
    assert propose[10 - 1] == pytest.approx(propose_s(16, 10), rel=0.05)


def test_beyond_the_measured_k_or_without_a_decode_step_the_guess_stays() -> None:
    """A bucket that has not measured its plain decode step: the fits over every batch size still guess,
    between measured k too. Once it has, k = 4 lies between k = 2 and 8, and k = 10 above every measured k
    is still a guess."""
    clock = [0.0]
    costs = StepCosts(max_k=K, window=32.0, ridge=1e-4, stale_after=1000, arrivals_window=2000.0)
    costs.clock = lambda: clock[0]
    for k in (2, 8):
        for _ in range(30):
            observe(costs, clock, 16, k, verify_s(16, k), propose_s(16, k))
    tokens = [16.0 * (k + 1) for k in range(1, K + 1)]
    pooled = costs.verify_cost.predict((1.0, tokens[4 - 1], 0.0))  # (k = 4's own: none)
    verify, _ = costs.verify_seconds(16.0, tokens)
    assert verify[4 - 1] == pytest.approx(pooled)  # no decode step at 16 requests measured
    for _ in range(30):
        observe(costs, clock, 16, 0, decode_s(16), 0.0)
    verify, _ = costs.verify_seconds(16.0, tokens)
    assert verify[4 - 1] == pytest.approx(verify_s(16, 4), rel=0.05)  # between k = 2 and 8 now
    assert verify[10 - 1] == pytest.approx(costs.verify_cost.predict((1.0, tokens[10 - 1], 0.0)))


def test_a_decode_price_of_one_clean_step_is_no_anchor() -> None:
    """On the H200 pair at 128 requests (twenty-ninth session) nearly every step computed a prompt chunk,
    and the bucket's decode fit held one clean step, of 6.6 ms where full batches took 2.4-3.2: no anchor
    for a line. With a single decode step measured the guesses stay those of the fits over every batch
    size; with enough, the line is drawn."""
    clock = [0.0]
    costs = StepCosts(max_k=K, window=32.0, ridge=1e-4, stale_after=1000, arrivals_window=2000.0)
    costs.clock = lambda: clock[0]
    for _ in range(30):  # k = 4 at 2 requests, at 3x the line: the guess for k = 4 elsewhere
        observe(costs, clock, 2, 4, 3.0 * verify_s(2, 4), 3.0 * propose_s(2, 4))
    for k in (2, 8):
        for _ in range(30):
            observe(costs, clock, 16, k, verify_s(16, k), propose_s(16, k))
    for _ in range(3):  # the first plain step after drafting is timed at its launch: no measurement
        observe(costs, clock, 16, 0, decode_s(16), 0.0)
    local = costs.local_cost.get(16.0, 0)
    assert local is not None and local.weight < 8.0
    tokens = [16.0 * (k + 1) for k in range(1, K + 1)]
    guess = costs.verify_cost_by_k[4].predict((1.0, tokens[4 - 1], 0.0))
    assert guess > 1.3 * verify_s(16, 4)  # (far from the line)
    assert costs.verify_seconds(16.0, tokens)[0][4 - 1] == pytest.approx(guess)
    for _ in range(30):
        observe(costs, clock, 16, 0, decode_s(16), 0.0)
    assert costs.verify_seconds(16.0, tokens)[0][4 - 1] == pytest.approx(verify_s(16, 4), rel=0.05)
    assert costs.propose_seconds(16.0)[4 - 1] == pytest.approx(propose_s(16, 4), rel=0.05)
