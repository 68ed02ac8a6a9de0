"""The decayed-window estimators the adaptive controller learns with (spec/estimators.py, spec/regression.py)."""
from __future__ import annotations

import pytest

from specserve.spec.estimators import (
    LocalFits,
    PositionRates,
    batch_bucket,
)
from specserve.spec.regression import DecayedRegression


def test_regression_fits_a_line_and_stays_flat_when_it_cannot_tell() -> None:
    fit = DecayedRegression(2, window=50, ridge=(0.0, 1e-3))
    for x in (10, 20, 30, 40) * 10:
        fit.add((1.0, x), 0.004 + 0.0002 * x)
    a, b = fit.coefficients()
    assert a == pytest.approx(0.004, rel=0.02) and b == pytest.approx(0.0002, rel=0.02)
    flat = DecayedRegression(2, window=50, ridge=(0.0, 1e-3))
    for _ in range(20):
        flat.add((1.0, 64.0), 0.01)  # one token count only: no slope to be seen
    assert flat.predict((1.0, 640.0)) == pytest.approx(0.01, rel=1e-2)  # optimistic: verify as cheap as decode
    assert DecayedRegression(2, 50, (0.0, 0.0)).predict_many([(1.0, 1.0)]) is None
    clipped = DecayedRegression(2, window=50, ridge=(0.0, 1e-3))
    for _ in range(10):
        clipped.add((1.0, 8.0), 0.01)
    clipped.add((1.0, 8.0), 5.0)  # a JIT pause does not wreck the fit
    assert clipped.predict((1.0, 8.0)) < 0.05


def test_position_rates_start_at_the_prior_and_forget() -> None:
    rates = PositionRates(2, prior=0.8, prior_weight=4, window=200)
    assert rates.rates() == [0.8, 0.8]
    for _ in range(100):
        rates.add((10, 0), (1, 0))
    assert rates.rates()[0] == pytest.approx(0.1, abs=0.03) and rates.rates()[1] == 0.8
    for _ in range(100):
        rates.add((10, 0), (9, 0))
    assert rates.rates()[0] == pytest.approx(0.9, abs=0.03)


def test_one_step_of_fresh_requests_does_not_erase_a_large_batch_history() -> None:
    rates = PositionRates(1, prior=0.8, prior_weight=4, window=100)
    for _ in range(20):
        rates.add((256,), (230,))  # 256 requests a step, 90% filled
    rates.add((256,), (0,))  # a step of new requests: n-gram lookups find nothing yet
    assert rates.rates()[0] > 0.75
    for _ in range(60):
        rates.add((256,), (0,))
    assert rates.rates()[0] < 0.05  # but a lasting change is followed within a few windows (16 steps each)


def test_a_fit_fed_rarely_follows_a_changed_cost_at_once() -> None:
    """A fit re-solves every few observations; one far from its prediction must count at once (a k the
    controller explores now and then: one fast step after a slow warm-up is all it gets)."""
    for slow_steps in range(60, 64):  # wherever the fit is in its re-solve cycle
        fit = DecayedRegression(2, window=32, ridge=(0.0, 1e-4))
        for _ in range(slow_steps):
            fit.add((1.0, 20.0), 0.040)  # eager, before CUDA graphs
        assert fit.predict((1.0, 20.0)) == pytest.approx(0.040)
        fit.add((1.0, 20.0), 0.003)
        assert fit.predict((1.0, 20.0)) < 0.010, slow_steps  # relative errors: the fast step weighs (40/3)^2 more


def test_batch_buckets_and_local_fits() -> None:
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 256)] == [0, 1, 2, 2, 3, 3, 4, 4, 5, 8]
    fits = LocalFits(lambda: DecayedRegression(2, 32, (0.0, 1e-4)), stale_after=100)
    assert fits.get(4, 1) is None and not fits.fresh(4, 1, now=0) and fits.samples(4, 1, now=0) == 0
    fits.add(4, 1, (1.0, 8.0), 0.002, now=10)
    fits.add(3, 1, (1.0, 6.0), 0.002, now=11)  # same bucket as 4
    assert fits.get(3, 1) is fits.get(4, 1) and fits.samples(4, 1, now=11) == 2
    assert fits.get(8, 1) is None and fits.get(4, 2) is None  # other bucket, other key
    assert fits.fresh(4, 1, now=111) and not fits.fresh(4, 1, now=112)  # stale: a guess again
    assert fits.get(4, 1) is not None and fits.samples(4, 1, now=112) == 0
    fits.add(4, 1, (1.0, 8.0), 0.002, now=200)
    assert fits.samples(4, 1, now=200) == 1  # counted again from the stale point
    assert fits.age(4, 1, now=230) == 30 and fits.age(4, 2, now=230) is None


def test_a_local_fit_restarts_when_the_cost_changed() -> None:
    """A decode fit measured in a disturbance (3x slow) starts over at the first step that it mispredicts
    by more than the ratio, instead of outweighing it for a window; small deviations are averaged."""
    fits = LocalFits(lambda: DecayedRegression(2, 32, (0.0, 1e-4)), stale_after=1000)
    for now in range(5):
        fits.add(2, 0, (1.0, 2.0), 0.015, now, restart_ratio=1.5)
    fits.add(2, 0, (1.0, 2.0), 0.012, 5, restart_ratio=1.5)  # within 1.5x: averaged in
    assert 0.012 < fits.get(2, 0).predict((1.0, 2.0)) < 0.015 and fits.samples(2, 0, now=5) == 6
    fits.add(2, 0, (1.0, 2.0), 0.005, 6, restart_ratio=1.5)  # one low outlier: averaged in
    assert fits.samples(2, 0, now=6) == 7
    fits.add(2, 0, (1.0, 2.0), 0.030, 7, restart_ratio=1.5)  # off the other way: still no restart
    assert fits.samples(2, 0, now=7) == 8
    fits.add(2, 0, (1.0, 2.0), 0.004, 8, restart_ratio=1.5)
    fits.add(2, 0, (1.0, 2.0), 0.004, 9, restart_ratio=1.5)  # twice low in a row: the cost changed
    assert fits.get(2, 0).predict((1.0, 2.0)) == pytest.approx(0.004, rel=1e-3)
    assert fits.samples(2, 0, now=9) == 1
    fits.add(2, 0, (1.0, 2.0), 0.020, 10)  # no ratio given (verify fits): never restarts
    fits.add(2, 0, (1.0, 2.0), 0.020, 11)
    assert fits.samples(2, 0, now=11) == 3


def test_position_rates_fade_toward_the_prior_in_time() -> None:
    rates = PositionRates(1, prior=0.8, prior_weight=4, window=100)
    for _ in range(50):
        rates.add((10,), (0,))
    assert rates.rates()[0] < 0.05
    for _ in range(20):
        rates.age(0.8)  # time passing without samples
    assert 0.5 < rates.rates()[0] < 0.8


def test_a_fit_predicts_the_mean_of_costs_that_vary_and_still_follows_a_drop() -> None:
    """Relative least squares alone fits 3 and 9 ms alternating to ~3.6 ms; throughput pays the mean, 6."""
    fit = DecayedRegression(2, window=32, ridge=(0.0, 1e-4))
    for i in range(200):
        fit.add((1.0, 1.0), 0.003 if i % 2 else 0.009)
    assert abs(fit.predict((1.0, 1.0)) - 0.006) < 0.0005, fit.predict((1.0, 1.0))
    assert abs(fit.predict_many([(1.0, 1.0)])[0] - fit.predict((1.0, 1.0))) < 1e-12
    steady = DecayedRegression(2, window=32, ridge=(0.0, 1e-4))
    for _ in range(50):
        steady.add((1.0, 1.0), 0.002)
    assert abs(steady.predict((1.0, 1.0)) - 0.002) < 1e-6  # a constant cost stays exact
    # a cost that drops (JIT done: 250 ms, then 2 ms) is followed within a few observations
    jit = DecayedRegression(2, window=32, ridge=(0.0, 1e-4))
    for y in [0.25] * 6 + [0.002] * 6:
        jit.add((1.0, 1.0), y)
    assert jit.predict((1.0, 1.0)) < 0.004, jit.predict((1.0, 1.0))


def test_token_calibration_starts_at_1_and_follows_what_drafting_got() -> None:
    from specserve.spec.estimators import TokenCalibration

    cal = TokenCalibration()
    assert cal.ratio(3) == 1.0
    cal.add(3, predicted=0.6, realized=0.2, requests=8)  # one step: the prior of 16 requests still weighs most
    assert 0.6 < cal.ratio(3) < 1.0
    for _ in range(60):
        cal.add(3, predicted=0.6, realized=0.24, requests=8)
    # 0.4 measured over a window of 128 requests, shrunk toward 1 by the prior of 16
    assert cal.ratio(3) == pytest.approx((0.24 * 128 + 0.6 * 16) / (0.6 * 128 + 0.6 * 16), abs=0.01)
    assert cal.ratio(4) == 1.0  # per bucket: another load keeps its own
    for _ in range(60):
        cal.add(3, predicted=0.5, realized=2.0, requests=8)
    assert cal.ratio(3) == 1.5  # clamped
    for _ in range(200):
        cal.age(0.9)
    assert cal.ratio(3) == pytest.approx(1.0)  # no samples for a long time: back to 1


def test_token_calibration_window_is_requests_but_at_least_16_steps() -> None:
    """At batch 1 a step's realized drafts swing from 0 to k: 16 steps would let chance decide (the
    serving world's batch 1 fell to 0.86 and stopped drafting where it paid); 128 requests do not."""
    from specserve.spec.estimators import TokenCalibration

    one, sixteen = TokenCalibration(), TokenCalibration()
    for _ in range(200):
        one.add(0, predicted=3.0, realized=3.0, requests=1)
        sixteen.add(4, predicted=0.5, realized=0.5, requests=16)
    for _ in range(16):  # 16 bad steps
        one.add(0, predicted=3.0, realized=0.0, requests=1)
        sixteen.add(4, predicted=0.5, realized=0.0, requests=16)
    assert one.ratio(0) > 0.85  # 16 of a 128-step window
    assert sixteen.ratio(4) < 0.5  # 16 steps are the window at 16 requests a step


def test_a_fit_solves_when_read_not_on_every_add(monkeypatch: pytest.MonkeyPatch) -> None:
    """At high load two decode fits take an observation every step; solving them is for the reads (a priced
    choice), not for judging each new observation, which the last solved theta does as well."""
    solves = []
    fit = DecayedRegression(3, window=32, ridge=(0.0, 1e-4, 1e-4), range_feature=1)
    for b in (60, 62, 64) * 10:
        fit.add((1.0, float(b), 0.0), 0.002 + 1e-5 * b)
    before = fit.predict((1.0, 64.0, 0.0))
    original = DecayedRegression._solve
    monkeypatch.setattr(DecayedRegression, "_solve", lambda self: solves.append(1) or original(self))
    for b in (60, 62, 64) * 40:
        fit.add((1.0, float(b), 0.0), 0.002 + 1e-5 * b)
    assert solves == []  # nothing surprising came, nothing read the fit
    assert fit.predict_recent((1.0, 64.0, 0.0)) == pytest.approx(before, rel=1e-4)  # (the theta it has)
    assert fit.predict((1.0, 64.0, 0.0)) == pytest.approx(0.00264, rel=0.01) and len(solves) == 1
    fit.add((1.0, 64.0, 0.0), 0.004)  # far from the fit (+50%): solved again at the next add or read
    fit.add((1.0, 64.0, 0.0), 0.00264)
    assert len(solves) == 2
