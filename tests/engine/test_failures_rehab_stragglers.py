"""Failure-rate estimate (D) and the rehabilitation cost model (stragglers: test_stragglers.py)."""

from __future__ import annotations

import pytest

from chameleon_ft.engine.failures import LLAMA3_RATE_PER_DEVICE_S, Event, EventKind, FailureRateEstimator
from chameleon_ft.engine.rehab import LossTrend, rehab_cost


# -- D ---------------------------------------------------------------------------------
def test_prior_mttf_matches_public_figures():
    est = FailureRateEstimator()
    assert est.rate == pytest.approx(LLAMA3_RATE_PER_DEVICE_S)
    # 419 interruptions in 54 days on 16,384 GPUs: one every ~3.1 h at that scale
    assert est.mttf(16384) == pytest.approx(54 * 86400 / 419)
    assert est.mttf(1) == pytest.approx(1 / LLAMA3_RATE_PER_DEVICE_S)
    assert est.mttf(100) == pytest.approx(1 / (est.rate * 100))
    with pytest.raises(ValueError):
        est.mttf(0)


def test_posterior_moves_toward_observed_rate():
    prior = 1e-8
    est = FailureRateEstimator(prior_rate=prior, prior_device_s=1e9)
    observed = 1e-6  # 100x worse than the prior
    steps = []
    for _ in range(100):
        est.observe(devices=1000, seconds=1e6, failures=int(observed * 1000 * 1e6))
        steps.append(est.rate)
    assert all(a < b for a, b in zip(steps, steps[1:])), "each batch of evidence moves the rate up"
    assert prior < steps[0] < observed
    # alpha / beta of the Gamma posterior
    assert est.rate == pytest.approx((prior * 1e9 + est.failures) / (1e9 + est.device_s))
    assert est.rate == pytest.approx(observed, rel=0.02)  # 100x the prior's evidence
    # a quiet run moves it down
    quiet = FailureRateEstimator(prior_rate=1e-6, prior_device_s=1e6)
    quiet.observe(devices=100, seconds=1e6, failures=0)
    assert quiet.rate < 1e-6
    assert quiet.mttf(10) == pytest.approx(1 / (quiet.rate * 10))


def test_estimator_validation_and_state_dict():
    with pytest.raises(ValueError):
        FailureRateEstimator(prior_rate=0)
    est = FailureRateEstimator()
    with pytest.raises(ValueError):
        est.observe(-1, 10)
    est.observe(8, 3600, 1)
    again = FailureRateEstimator.from_state_dict(est.state_dict())
    assert again.rate == est.rate and again.failures == 1


def test_event_normalises_and_serialises():
    ev = Event("node_loss", (3, 1, 2), time_s=5.0)
    assert ev.kind is EventKind.NODE_LOSS and ev.devices == (1, 2, 3) and ev.removes_devices
    assert ev.to_json() == {"kind": "node_loss", "devices": [1, 2, 3], "time_s": 5.0}
    assert not Event(EventKind.JOIN, (1,)).removes_devices
    assert Event(EventKind.STRAGGLER, (1,), slowdown=2.0).to_json()["slowdown"] == 2.0


# -- rehab cost model ------------------------------------------------------------------
def test_recompute_costs_the_steps_since_the_snapshot():
    out = rehab_cost(100, 0.25, LossTrend(slope=-0.01, loss_now=2.0, loss_at_snapshot=3.0))
    assert out.recompute_steps == 100
    # gap = 0.25 x progress 1.0; heal = 1.5 x 0.25 / 0.01
    assert out.rehab_steps == pytest.approx(37.5)
    assert "lost fraction" in out.reason


def test_rehab_lag_does_not_divide_by_a_flat_or_noisy_slope():
    # a plateau (or a noisy slope that came out >= 0) prices the lag as on a steep curve
    for slope in (0.0, 0.01, -0.01):
        out = rehab_cost(100, 0.25, LossTrend(slope=slope, loss_now=2.0, loss_at_snapshot=2.0))
        assert out.heal_steps == pytest.approx(25.0) and out.rehab_steps == pytest.approx(37.5)
    assert rehab_cost(100, 0.25, None).rehab_steps == pytest.approx(37.5)
    out = rehab_cost(100, 0.25, LossTrend(slope=float("nan"), loss_now=2.0))
    assert out.rehab_steps is None and "not a finite number" in out.reason
    # a measured gap needs a decreasing loss to convert into steps
    out = rehab_cost(100, 0.25, LossTrend(slope=0.0, loss_now=2.0, measured_gap=0.1))
    assert out.rehab_steps is None and "not decreasing" in out.reason


def test_rehab_uses_the_measured_gap():
    out = rehab_cost(100, 0.25, LossTrend(slope=-0.02, loss_now=2.0, loss_at_snapshot=3.0, measured_gap=0.1))
    assert out.rehab_steps == pytest.approx(1.5 * 0.1 / 0.02)
    assert "measured gap" in out.reason
    # a gap above 90 % of the progress since the snapshot: recompute is safer
    out = rehab_cost(100, 0.25, LossTrend(slope=-0.02, loss_now=2.0, loss_at_snapshot=3.0, measured_gap=0.95))
    assert out.rehab_steps is None and "progress" in out.reason


def test_rehab_gap_from_slope_when_no_losses_given():
    out = rehab_cost(40, 0.5, LossTrend(slope=-0.05))
    assert out.rehab_steps == pytest.approx(1.5 * 0.5 * 40 * 0.05 / 0.05)


def test_rehab_lost_fraction_limit():
    trend = LossTrend(slope=-0.01, loss_now=2.0, loss_at_snapshot=3.0)
    assert rehab_cost(100, 0.5, trend).rehab_steps is not None
    out = rehab_cost(100, 0.51, trend)
    assert out.rehab_steps is None and "limit" in out.reason
    assert rehab_cost(100, 0.6, trend, max_lost_fraction=0.7).rehab_steps is not None


def test_rehab_nothing_to_heal_and_bad_input():
    assert rehab_cost(0, 0.3, None).rehab_steps == 0.0
    assert rehab_cost(50, 0.0, None).rehab_steps == 0.0
    with pytest.raises(ValueError):
        rehab_cost(-1, 0.3, None)
    with pytest.raises(ValueError):
        rehab_cost(10, 1.5, None)

