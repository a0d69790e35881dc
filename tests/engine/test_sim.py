"""The simulator: goodput is a fraction, and -- with the selector's model exact -- the adaptive
policy is at least as good as the fixed ones on the same failure schedule.  With model error the
cluster follows a perturbed true model: what that costs is measured, not assumed away."""

from __future__ import annotations

import pytest

from chameleon_ft.sim.simulator import FIXED, POLICY_NAMES, PRESETS, TrueModel, draw_events, model_error_cost, simulate

TOL = 1e-9  # float noise only: "at least as high"


@pytest.fixture(scope="module", params=[0, 1, 2])
def small(request):
    return simulate(PRESETS["small"], seed=request.param, model_error=0.0)


def test_small_goodputs_are_fractions(small):
    assert set(small) == set(POLICY_NAMES) - {"oracle"}
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
    res = simulate(PRESETS["llama3-16k"], days=2, model_error=0.0)
    g = {k: v.goodput for k, v in res.items()}
    assert all(0.0 < v <= 1.01 for v in g.values()), g
    for fixed in ("reroute", "replan", "restart"):
        assert g["adaptive"] >= g[fixed] - TOL, (fixed, g)
    assert res["adaptive"].failures > 0


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError):
        simulate(PRESETS["small"], policies=("adaptive", "pray"), days=0.01)


# -- model error ------------------------------------------------------------------------
def test_exact_model_true_goodput_is_the_believed_one(small):
    for name, res in small.items():
        assert res.samples == res.believed_samples and res.goodput == res.believed_goodput, name
    assert model_error_cost(small) is None  # no oracle without model error


def test_true_model_is_seeded_and_log_normal():
    exact = TrueModel.perturbed(0.0, 5, 1.0)
    assert exact.exact
    a, b = TrueModel.perturbed(0.2, 5, 1.0), TrueModel.perturbed(0.2, 5, 1.0)
    assert a == b and not a.exact and a != TrueModel.perturbed(0.2, 6, 1.0)
    with pytest.raises(ValueError):
        TrueModel.perturbed(-0.1, 0, 1.0)


def test_the_true_model_keeps_the_pipeline_costs_it_does_not_perturb():
    from chameleon_ft.engine.perf import Coefficients

    believed = Coefficients(1.0, 1.0, 0.0, task_overhead_s=0.002, optimizer_s_per_param=1e-7, hop_overhead_s=0.005)
    exact = TrueModel()
    assert exact.coefficients(believed) == believed
    true = TrueModel(compute=2.0, comm=0.5, overhead_s=0.1).coefficients(believed)
    assert (true.compute_scale, true.comm_scale, true.step_overhead_s) == (2.0, 0.5, 0.1)
    assert (true.task_overhead_s, true.optimizer_s_per_param, true.hop_overhead_s) == (0.002, 1e-7, 0.005)


@pytest.mark.parametrize("seed", [0, 1])
def test_model_error_costs_the_adaptive_policy_and_the_oracle_does_not_pay_it(seed):
    res = simulate(PRESETS["small"], seed=seed, days=1, model_error=0.2,
                   policies=("adaptive", "reroute", "restart", "oracle"))
    for name in ("adaptive", "reroute", "restart"):
        assert res[name].goodput != pytest.approx(res[name].believed_goodput, rel=1e-9), name
    # the oracle decides with the model the cluster follows: its prediction is what happens
    assert res["oracle"].goodput == pytest.approx(res["oracle"].believed_goodput, rel=1e-12)
    assert res["oracle"].goodput >= res["adaptive"].goodput - TOL
    assert model_error_cost(res) == res["oracle"].goodput - res["adaptive"].goodput
