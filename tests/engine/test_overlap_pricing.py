"""An overlapped re-plan (``SelectorConfig.overlap_migration``) is priced as the runtime carries
it out (``runtime/executors/pipeline/overlap.py``): the search and the rebuild are its transition,
its migration's seconds a phase on the rerouted layout, then the new plan."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from chameleon_ft.engine.cluster import Link

from chameleon_ft.engine.decision import phased_score, score
from chameleon_ft.engine.failures import Event
from chameleon_ft.engine.selector import SelectorConfig, select
from chameleon_ft.engine.planner import SearchSpace

from tests.engine.test_replan_grow_back import job


def decide(state, mttf, overlap, eta=None, allowed=("reroute", "replan", "wait"), search_s=0.05):
    cfg = SelectorConfig(allowed=frozenset(allowed), replacement_eta_s=eta, rebuild_s=0.1, search_s=search_s,
                         space=SearchSpace(dp_min=2, min_microbatches=1), overlap_migration=overlap)
    return select(Event("fail_stop", (1,), 0.0), state, cfg, mttf)


def slow_state():
    """``job()`` with a slow migration link (1 kB/s): its re-plan's state takes seconds to move."""
    st = job()
    return replace(st, cluster=replace(st.cluster, migration=Link(1e-3, 1e3)))


def test_overlapped_replan_runs_rerouted_while_its_state_moves():
    state = slow_state()
    paused, over = decide(state, 50.0, False), decide(state, 50.0, True)
    rp0, rp, rr = paused.option("replan"), over.option("replan"), over.option("reroute")
    assert rp.plan == rp0.plan and rp.migration.seconds == pytest.approx(rp0.migration.seconds)
    assert rp0.transition_s == pytest.approx(0.05 + rp0.migration.seconds + 0.1)
    assert rp.transition_s == pytest.approx(0.05 + 0.1)  # the un-overlapped part
    (a, b, t_run, n0), (c, e, t_new, n1) = rp.phases
    assert (a, b, c) == pytest.approx((0.15, 0.15 + rp.migration.seconds, 0.15 + rp.migration.seconds))
    assert math.isinf(e) and t_run == pytest.approx(rr.step_time) and t_new == pytest.approx(rp.step_time)
    assert rp.score == pytest.approx(phased_score(rp.phases, 50.0))
    assert rp.breakdown["overlapped_s"] == pytest.approx(rp.migration.seconds)
    # Never worse than pausing for the migration while the rerouted layout runs at all; and at
    # a D short enough for reroute to win against the paused re-plan, the overlapped one wins.
    assert rp.score > rp0.score
    d_star = rp0.transition_s / (1 - rp0.step_time / rr.step_time)
    assert rp.migration.seconds > 1.0 and d_star > 3 * rp.migration.seconds
    short = d_star / 2
    assert decide(state, short, False).chosen == "reroute"
    assert decide(state, short, True).chosen == "replan"


def test_a_fixed_replan_policy_is_priced_overlapped_too():
    """always-replan has no reroute among its policies; what runs while its state moves is the
    rerouted layout all the same."""
    rp = decide(job(), 50.0, True, allowed=("replan",)).option("replan")
    assert rp.phases is not None and rp.transition_s == pytest.approx(0.15)


def test_a_replacement_arriving_mid_migration_ends_it_but_the_job_trained_rerouted():
    state = slow_state()
    mig = decide(state, 1000.0, True).option("replan").migration.seconds
    rp = decide(state, 1000.0, True, eta=0.15 + mig / 2).option("replan")
    assert rp.breakdown.get("interrupted") == 1.0
    (a, b, t_run, _), (c, e, t_full, _) = rp.phases
    assert (a, b) == pytest.approx((0.15, 0.15 + mig / 2)) and c > b and math.isinf(e)
    paused = decide(state, 1000.0, False, eta=0.15 + mig / 2).option("replan")
    assert rp.score > paused.score  # the paused one trains nothing until the heal


def test_growing_back_after_an_overlapped_replan():
    # Re-planned while the replacement is away, then grown back (the re-plan is slower).
    state = slow_state()
    mig = decide(state, 1000.0, True).option("replan").migration.seconds
    rp = decide(state, 1000.0, True, eta=mig + 30.0).option("replan")
    (a, b, t_run, _), (b2, c, t_new, _), (c2, e, t_full, _) = rp.phases
    assert b == b2 and c == c2 and math.isinf(e)
    assert b == pytest.approx(0.15 + mig) and c > mig + 30.0
    assert t_new == pytest.approx(rp.step_time)


def test_without_transfers_nothing_is_overlapped():
    # A data-parallel plan: no pipeline, the re-plan is priced as before.
    from chameleon_ft.engine.cluster import homogeneous
    from chameleon_ft.engine.plan import Pipeline, Plan
    from chameleon_ft.engine.selector import JobState
    from chameleon_ft.engine.workload import Layer, Workload
    w = Workload(tuple(Layer(1000, 0.01, 0.02, 0) for _ in range(4)), global_batch=64, micro_batch=4)
    plan = Plan(tuple(Pipeline((d,), (0, 4), 4) for d in range(4)))
    st = JobState(w, homogeneous(4, per_node=4), plan, frozenset(range(4)))
    rp = decide(st, 100.0, True).option("replan")
    assert rp.phases is None
    assert rp.score == pytest.approx(score(64, rp.step_time, rp.transition_s, 100.0))


def test_a_heal_and_a_wait_are_priced_overlapped_too():
    """The replacement's copy moves while the running (rerouted) layout trains: a heal's
    transition is the rebuild, and wait's rerouted phase lasts until the healed plan runs."""
    from chameleon_ft.engine.selector import heal_seconds
    state = slow_state()
    cfg = dict(allowed=frozenset({"reroute", "replan", "wait", "heal", "keep", "grow"}), rebuild_s=0.1,
               space=SearchSpace(dp_min=2, min_microbatches=1))
    rerouted = replace(state, alive=frozenset(range(8)) - {1})
    join = Event("join", (1,), 0.0)
    paused = select(join, replace(rerouted, alive=frozenset(range(8))), SelectorConfig(**cfg), 100.0)
    over = select(join, replace(rerouted, alive=frozenset(range(8))),
                  SelectorConfig(**cfg, overlap_migration=True), 100.0)
    h0, h = paused.option("heal"), over.option("heal")
    heal = heal_seconds(state.plan, {1}, state.workload, state.cluster)
    assert heal > 1.0 and h0.transition_s == pytest.approx(heal + 0.1) and h.transition_s == pytest.approx(0.1)
    (a, b, t_run, _), (c, e, t_healed, _) = h.phases
    assert (a, b, c) == pytest.approx((0.1, 0.1 + heal, 0.1 + heal)) and math.isinf(e)
    assert t_run == pytest.approx(over.option("keep").step_time) and h.score > h0.score
    w0 = decide(state, 100.0, False, eta=5.0).option("wait")
    w = decide(state, 100.0, True, eta=5.0).option("wait")
    assert w0.phases[0][1] == pytest.approx(5.0) and w.phases[0][1] == pytest.approx(w.phases[1][0])
    assert w.score > w0.score
