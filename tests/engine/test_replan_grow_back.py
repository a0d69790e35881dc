"""A pipeline re-plan while a replacement is expected is scored like ``wait``: over the
re-planned phase and the grown-back one, so the choice between them compares like for like."""

from __future__ import annotations

import math

import pytest

from chameleon_ft.engine.cluster import homogeneous
from chameleon_ft.engine.failures import Event
from chameleon_ft.engine.plan import Pipeline, Plan
from chameleon_ft.engine.planner import SearchSpace, balance_layers
from chameleon_ft.engine.decision import phased_score
from chameleon_ft.engine.selector import JobState, SelectorConfig, select
from chameleon_ft.engine.workload import Layer, Workload


def job(speeds=None):
    w = Workload(tuple(Layer(1000, 0.01, 0.02, 0) for _ in range(8)), global_batch=64, micro_batch=4)
    c = homogeneous(8, per_node=8).with_speeds(speeds or {})
    bounds = balance_layers(w, [1.0] * 4)
    plan = Plan((Pipeline((0, 1, 2, 3), bounds, 8), Pipeline((4, 5, 6, 7), bounds, 8)))
    return JobState(w, c, plan, frozenset(range(8)))


def decide(state, eta, mttf):
    cfg = SelectorConfig(allowed=frozenset({"reroute", "replan", "wait"}), replacement_eta_s=eta,
                         space=SearchSpace(dp_min=2, min_microbatches=1))
    return select(Event("fail_stop", (1,), 0.0), state, cfg, mttf)


def test_replan_is_scored_over_the_grown_back_phase():
    d = decide(job(), eta=10.0, mttf=1000.0)
    rp, wait = d.option("replan"), d.option("wait")
    assert rp.phases is not None and len(rp.phases) == 2
    (s0, e0, t0, _), (s1, e1, t1, _) = rp.phases
    assert s0 == pytest.approx(rp.transition_s) and e0 == pytest.approx(10.0) and math.isinf(e1)
    assert t0 == pytest.approx(rp.step_time)
    assert t1 == pytest.approx(wait.phases[1][2])  # the same healed plan as wait's
    assert s1 > 10.0 + rp.migration.seconds  # growing back migrates and heals after the arrival
    assert rp.score == pytest.approx(phased_score(rp.phases, 1000.0))
    # Both end on the same plan: the difference is the first 10 s (re-planned vs rerouted).
    assert (rp.score > wait.score) == (rp.step_time < d.option("reroute").step_time)


def test_without_a_replacement_the_replan_is_one_phase():
    d = decide(job(), eta=None, mttf=1000.0)
    assert d.option("replan").phases is None


def test_a_replan_faster_than_the_old_plan_stays():
    # Device 6 at a third of the speed: the old plan is slow, the re-plan avoids it.
    d = decide(job({6: 1 / 3}), eta=10.0, mttf=1000.0)
    rp = d.option("replan")
    assert rp.phases is None and d.chosen == "replan"
