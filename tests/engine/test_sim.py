"""The simulator: goodput is a fraction, and the adaptive policy is at least as good as the
fixed ones on the same failure schedule."""

from __future__ import annotations

import pytest

from chameleon_ft.sim import FIXED, POLICY_NAMES, PRESETS, draw_events, simulate

TOL = 1e-9  # float noise only: "at least as high"


@pytest.fixture(scope="module", params=[0, 1, 2])
def small(request):
    return simulate(PRESETS["small"], seed=request.param)


def test_small_goodputs_are_fractions(small):
    assert set(small) == set(POLICY_NAMES)
    for name, res in small.items():
        assert 0.0 < res.goodput <= 1.01, (name, res.goodput)
        assert res.failures > 0, "the small preset's 200x failure rate must produce failures"
        assert res.downtime_s >= 0


def test_small_adaptive_beats_batch_keeping_fixed_policies(small):
    g = {k: v.goodput for k, v in small.items()}
    for fixed in ("reroute", "replan", "restart"):
        assert g["adaptive"] >= g[fixed] - TOL, (fixed, g)


def test_small_adaptive_with_shrink_beats_every_fixed_policy(small):
    g = {k: v.goodput for k, v in small.items()}
    for fixed in FIXED:
        assert g["adaptive+shrink"] >= g[fixed] - TOL, (fixed, g)
    # restarting on every failure is strictly worse than adapting in place
    assert g["restart"] < g["adaptive"]


def test_policies_face_the_same_failures():
    a = draw_events(PRESETS["small"], 3)
    assert a == draw_events(PRESETS["small"], 3)
    assert a != draw_events(PRESETS["small"], 4)


def test_llama3_16k_two_days():
    res = simulate(PRESETS["llama3-16k"], days=2)
    g = {k: v.goodput for k, v in res.items()}
    assert all(0.0 < v <= 1.01 for v in g.values()), g
    for fixed in ("reroute", "replan", "restart"):
        assert g["adaptive"] >= g[fixed] - TOL, (fixed, g)
    assert res["adaptive"].failures > 0


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError):
        simulate(PRESETS["small"], policies=("adaptive", "pray"), days=0.01)
