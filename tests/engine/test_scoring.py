"""Decision scoring on what will really happen: ``wait`` over both of its phases, reroute spread
so the most loaded peer is as light as possible, and ``D`` from a prior sized to this job."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chameleon_ft.engine.failures import LLAMA3_RATE_PER_DEVICE_S, PRIOR_JOB_S, FailureRateEstimator
from chameleon_ft.engine.plan import Pipeline, Plan
from chameleon_ft.runtime.engine_bridge import EngineBridge
from chameleon_ft.engine.decision import phased_score, score
from chameleon_ft.engine.reroute import reroute_load
from chameleon_ft.engine.selector import heal_seconds

from .conftest import ENGINE, cluster
from .test_selector import CROSS_PLAN, CROSS_W, cross_decide



# -- 2. wait: rerouted until the replacement arrives, then healed ----------------------
def test_wait_is_scored_as_reroute_until_arrival_then_the_healed_plan():
    D, eta, rebuild = 1000.0, 30.0, 0.5
    d = cross_decide(D, replacement_eta_s=eta, rebuild_s=rebuild, allowed={"reroute", "wait"})
    wt, rr = d.option("wait"), d.option("reroute")
    heal = heal_seconds(CROSS_PLAN, {5}, CROSS_W, cluster(8))
    assert heal > 0
    # by hand: 57 s steps (the rerouted stage runs 8+3 micro-batches) from the rebuild until the
    # arrival, a pause to heal and re-form, then 33 s steps ((8 + 4 - 1) * 3) to the end of D
    samples = 16 / 57 * (eta - rebuild) + 16 / 33 * (D - eta - heal - rebuild)
    assert wt.score == pytest.approx(samples / D, rel=1e-12)
    assert wt.step_time == pytest.approx(57.0) and wt.transition_s == rebuild
    assert wt.extra == rr.extra and wt.dead == rr.dead == {5}  # the runtime carries this out
    assert "30 s" in wt.reason and "57 s/step" in wt.reason and "33 s/step" in wt.reason
    assert d.chosen == "wait" and wt.score > rr.score
    js = wt.to_json(with_plan=False)
    assert js["phases"][1]["step_time_s"] == pytest.approx(33.0) and js["phases"][1]["until_s"] is None


def test_wait_does_not_always_win_with_replacements():
    # short eta, but D too short for the heal pause to pay off
    d = cross_decide(10.0, replacement_eta_s=1.0, allowed={"reroute", "wait"})
    assert d.chosen == "reroute" and d.option("wait").score < d.option("reroute").score
    # the replacement would arrive after D: waiting is rerouting for the whole horizon
    d = cross_decide(1000.0, replacement_eta_s=1e4, allowed={"reroute", "wait"})
    assert d.option("wait").score == pytest.approx(d.option("reroute").score, rel=1e-12)
    assert d.chosen == "reroute" and "ends before" in d.option("wait").reason
    # and against re-planning, a replacement due late loses
    assert cross_decide(100.0, replacement_eta_s=30.0).chosen == "replan"


def test_phased_score_generalises_the_score():
    assert phased_score(((3.0, math.inf, 2.0, 16),), 100.0) == score(16, 2.0, 3.0, 100.0)
    assert phased_score(((0.0, 10.0, 2.0, 16), (12.0, math.inf, 1.0, 16)), 20.0) == pytest.approx(
        (16 / 2 * 10 + 16 * 8) / 20)


# -- 3. reroute spreads the work over each peer group ------------------------------------
def test_eight_workers_losing_four_reroute_to_two_each():
    plan = Plan(tuple(Pipeline((d,), (0, 2), 1) for d in range(8)))
    extra, why = reroute_load(plan, {4, 5, 6, 7}, {0, 1, 2, 3})
    assert why == "" and extra == {0: 1, 1: 1, 2: 1, 3: 1}
    loads = {w: 1 + extra.get(w, 0) for w in range(4)}
    assert max(loads.values()) == 2


def test_the_runtime_allocation_inherits_the_even_reroute():
    p = EngineBridge([100], global_batch=8, micro_batch=1, allowed={"reroute"})
    p.start(range(8))
    d = p.on_membership([0, 1, 2, 3], hang=False, step=5)[0]
    assert d.chosen == "reroute" and p.allocation == {0: 2, 1: 2, 2: 2, 3: 2}


@st.composite
def peer_groups(draw):
    n = draw(st.integers(2, 9))
    mbs = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    lost0 = draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n - 1))
    lost1 = draw(st.sets(st.integers(0, n - 1), max_size=n - 1))  # also at the other stage
    return n, mbs, lost0, lost1


@ENGINE
@given(peer_groups())
def test_reroute_max_load_is_minimal(case):
    n, mbs, lost0, lost1 = case
    plan = Plan(tuple(Pipeline((2 * i, 2 * i + 1), (0, 1, 2), m) for i, m in enumerate(mbs)))
    dead = {2 * i for i in lost0} | {2 * i + 1 for i in lost1}
    alive = set(range(2 * n)) - dead
    extra, why = reroute_load(plan, dead, alive)
    assert why == ""
    assert set(extra) <= alive
    for stage in (0, 1):
        peers = [i for i in range(n) if 2 * i + stage in alive]
        total = sum(mbs[i] for i in range(n) if 2 * i + stage in dead)
        got = {i: extra.get(2 * i + stage, 0) for i in peers}
        assert sum(got.values()) == total and all(v == int(v) for v in got.values())
        base = [mbs[i] for i in peers]
        assert max(mbs[i] + got[i] for i in peers) == _min_max(base, total)
    assert reroute_load(plan, dead, alive) == (extra, why)  # deterministic


def _min_max(base: list[int], total: int) -> int:
    """Brute force: the smallest L with sum(max(0, L - b)) >= total, at least max(base)."""
    level = max(base)
    while sum(max(0, level - b) for b in base) < total:
        level += 1
    return level


# -- 4. D: a prior sized to this job, moved by what it sees ------------------------------
def test_prior_is_worth_a_day_of_this_job_and_one_failure_moves_d():
    est = FailureRateEstimator.for_job(4)
    assert est.prior_device_s == 4 * PRIOR_JOB_S
    assert est.mttf(4) == pytest.approx(1 / (4 * LLAMA3_RATE_PER_DEVICE_S))  # ~4.6e7 s before evidence
    est.observe(4, 3600.0)
    est.observe(0, 0.0, failures=1)
    # (alpha0 + 1) / (beta0 + exposure): one failure in an hour brings D to about a day
    alpha0 = LLAMA3_RATE_PER_DEVICE_S * 4 * PRIOR_JOB_S
    assert est.mttf(3) == pytest.approx((4 * PRIOR_JOB_S + 4 * 3600) / (alpha0 + 1) / 3)
    assert est.mttf(3) < 2 * 86400


def test_engine_policy_sizes_the_prior_to_its_workers_and_observes_the_run():
    p = EngineBridge([1088, 260], global_batch=64, micro_batch=8)
    p.start(range(4))
    assert p.estimator.prior_device_s == 4 * PRIOR_JOB_S
    for s in range(10):
        p.observe_step({w: (0.04, 2, 0.002, 0.05) for w in range(4)}, s)
    assert p.estimator.device_s == pytest.approx(4 * 0.05 * 10)
    d = p.on_membership([0, 1, 3], hang=False, step=10)[0]
    assert p.estimator.failures == 1
    assert d.mttf_s == pytest.approx(p.estimator.mttf(3)) and d.mttf_s < 1e6
    again = EngineBridge([1088, 260], global_batch=64, micro_batch=8)
    again.load_state_dict(p.state_dict())
    assert again.estimator == p.estimator and again.search_s == p.search_s


def test_measured_search_time_is_charged_to_the_next_decision():
    p = EngineBridge([1088, 260], global_batch=64, micro_batch=8)
    p.start(range(4))
    assert p.selector_config(0).search_s == 0.0
    d = p.on_membership([0, 1, 3], hang=False, step=10)[0]
    assert d.search_s > 0 and p.search_s == d.search_s
    assert p.selector_config(0).search_s == d.search_s
    d2 = p.on_membership([0, 1], hang=False, step=20)[0]
    rp = d2.option("replan")
    assert rp.transition_s == pytest.approx(d.search_s + rp.migration.seconds + p.rebuild_s)


def _demo_policy(mttf_s=None) -> EngineBridge:
    """The demo's job: 4 workers, Linear(16,64)-ReLU-Linear(64,4), 64 samples in micro-batches
    of 8, ~20 ms per micro-batch, one replacement allowed (the runtime's configured 5 s eta)."""
    p = EngineBridge([16 * 64 + 64, 64 * 4 + 4], 64, 8, replacement_eta_s=5.0, mttf_s=mttf_s)
    p.start(range(4))
    for s in range(12):
        p.observe_step({w: (0.04, 2, 0.002, 0.045) for w in range(4)}, s)
    return p


def test_a_short_d_changes_the_demo_decision():
    d = _demo_policy().on_membership([0, 1, 3], hang=False, step=12)[0]
    assert d.chosen == "wait" and d.mttf_s > 1e4
    short = _demo_policy(mttf_s=5.0).on_membership([0, 1, 3], hang=False, step=12)[0]
    assert short.mttf_s == 5.0 and short.chosen == "reroute"
    # the figures that explain it: within 5 s the replacement never runs, so waiting is rerouting
    assert short.option("wait").score == pytest.approx(short.option("reroute").score)
    assert d.option("wait").score > d.option("reroute").score
    assert short.option("restart").score == 0.0 < d.option("restart").score

