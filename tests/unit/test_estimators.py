"""The decayed-window estimators the adaptive controller learns with (specserve/spec/estimators.py)."""
from __future__ import annotations

import pytest

from specserve.spec.estimators import DecayedRegression, PositionRates


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
    for _ in range(40):
        rates.add((256,), (0,))
    assert rates.rates()[0] < 0.05  # but a lasting change is followed within a few steps
