"""The selector: candidates, feasibility, scoring, the reroute/replan crossover, JSON."""

from __future__ import annotations

import math

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chameleon_ft.engine.failures import Event, EventKind
from chameleon_ft.engine.plan import Pipeline, Plan
from chameleon_ft.engine.planner import SearchSpace, plan_search
from chameleon_ft.engine.rehab import LossTrend
from chameleon_ft.engine.decision import crossover_mttf, score
from chameleon_ft.engine.reroute import reroute_load, unreplicated
from chameleon_ft.engine.selector import POLICIES, JobState, SelectorConfig, select
from chameleon_ft.engine.workload import Layer, Workload

from .conftest import ENGINE, chain, cluster

FAIL = EventKind.FAIL_STOP


def decide(plan, w, c, event, alive=None, **cfg):
    mttf = cfg.pop("mttf", 1e6)
    loss = cfg.pop("loss", None)
    state = JobState(w, c, plan, frozenset(c.ids if alive is None else alive), loss=loss)
    return select(event, state, SelectorConfig(**cfg), mttf_s=mttf)


def without_timing(d) -> dict:
    out = d.to_json()
    out.pop("decide_s")
    out.pop("search_s")
    return out


# -- reroute feasibility vs an independent oracle --------------------------------------
@st.composite
def reroute_cases(draw):
    n_layers = draw(st.integers(1, 4))
    templates = [(0, n_layers)]
    if n_layers > 1:
        templates.append((0, draw(st.integers(1, n_layers - 1)), n_layers))
    k = draw(st.sampled_from([1, 1, 2]))
    groups = draw(st.integers(1, 4))
    pipes, dev = [], 0
    for _ in range(groups):
        bounds = draw(st.sampled_from(templates))
        for _ in range(k):
            depth = len(bounds) - 1
            pipes.append(Pipeline(tuple(range(dev, dev + depth)), bounds, draw(st.integers(0, 4))))
            dev += depth
    plan = Plan(tuple(pipes), k)
    n = dev + draw(st.integers(0, 2))  # a few idle spares
    devices = list(range(n))
    earlier = draw(st.sets(st.sampled_from(devices), max_size=min(2, n - 1)))  # died before, rerouted around
    left = sorted(set(devices) - earlier)
    now = draw(st.sets(st.sampled_from(left), min_size=1, max_size=min(3, len(left))))
    w = chain([1.0] * n_layers, microbatches=max(plan.num_microbatches, 1))
    return w, cluster(n), plan, earlier, now


def oracle_reroute_feasible(plan: Plan, dead: set[int]) -> bool:
    """Rerouting works iff every dead device of the plan has an alive device in the same stage of
    another pipeline with the same layer split and shard index."""
    k = plan.shard_degree
    for j, pipe in enumerate(plan.pipelines):
        for s, d in enumerate(pipe.devices):
            if d not in dead:
                continue
            peers = [q.devices[s] for i, q in enumerate(plan.pipelines)
                     if i != j and q.bounds == pipe.bounds and i % k == j % k]
            if not any(p not in dead for p in peers):
                return False
    return True


@settings(ENGINE, max_examples=200)
@given(reroute_cases())
def test_reroute_infeasible_exactly_when_a_stage_lost_all_replicas(case):
    w, c, plan, earlier, now = case
    alive_before = set(c.ids) - earlier
    if not alive_before - now:
        return  # nobody left at all
    d = decide(plan, w, c, Event(FAIL, tuple(now)), alive=alive_before, allowed={"reroute"})
    dead = (earlier | now) & set(plan.devices)
    want = oracle_reroute_feasible(plan, dead)
    opt = d.option("reroute")
    assert opt.feasible == want, (plan, sorted(dead), opt.reason)
    if want:
        # the dead devices' micro-batches land on their same-stage peers, exactly
        k = plan.shard_degree
        assert not set(opt.extra) & dead
        for j, pipe in enumerate(plan.pipelines):
            for s in range(pipe.depth):
                group = [i for i, q in enumerate(plan.pipelines) if q.bounds == pipe.bounds and i % k == j % k]
                if group[0] != j:
                    continue
                moved = sum(plan.pipelines[i].microbatches for i in group if plan.pipelines[i].devices[s] in dead)
                got = sum(opt.extra.get(plan.pipelines[i].devices[s], 0) for i in group)
                assert got == moved
        assert d.chosen == "reroute"
        assert not unreplicated(plan, set(c.ids) - dead)
    else:
        assert "replica" in opt.reason
        assert d.chosen is None


def test_reroute_load_splits_evenly_over_peers():
    plan = Plan(tuple(Pipeline((d,), (0, 2), 3) for d in range(3)))
    extra, why = reroute_load(plan, {0}, {1, 2})
    assert why == "" and extra == {1: 2.0, 2: 1.0}
    extra, why = reroute_load(plan, {0, 1, 2}, set())
    assert extra == {} and "lost all of its replicas" in why


# -- the crossover ---------------------------------------------------------------------
# 12 equal layers, 2 pipelines of PP4 (3 layers a stage), 8 micro-batches each.  Losing a device
# doubles its same-stage peer's load: reroute step = (8+3)·3 + 8·3 = 57 s.  Re-planning over the
# 7 survivors reaches 36 s (e.g. PP4 + PP3 with 9 and 7 micro-batches) but has to migrate state.
# grad_bytes=0 makes the all-reduce exactly 0 so the step times are exact.
CROSS_W = Workload(tuple(Layer(20_000_000, 1 / 3, 2 / 3, 0) for _ in range(12)), global_batch=16, micro_batch=1,
                   grad_bytes=0)
CROSS_PLAN = Plan((Pipeline(tuple(range(4)), (0, 3, 6, 9, 12), 8), Pipeline(tuple(range(4, 8)), (0, 3, 6, 9, 12), 8)))


def cross_decide(mttf: float, **cfg):
    c = cluster(8)
    cfg.setdefault("rebuild_s", 0.0)
    return decide(CROSS_PLAN, CROSS_W, c, Event(FAIL, (5,)), mttf=mttf, **cfg)


def test_selector_picks_reroute_for_short_d_and_replan_for_long_d_at_the_analytic_crossover():
    d = cross_decide(1e6)
    rr, rp = d.option("reroute"), d.option("replan")
    assert rr.feasible and rp.feasible
    assert rr.step_time == pytest.approx(57.0)
    assert rp.step_time == pytest.approx(36.0)
    assert rr.transition_s == 0.0
    assert rp.transition_s > 0 and rp.migration.total_bytes > 0
    d_star = rp.transition_s / (1 - rp.step_time / rr.step_time)
    assert crossover_mttf(rr.step_time, rp.step_time, 0.0, rp.transition_s) == pytest.approx(d_star, rel=1e-12)

    assert cross_decide(d_star / 10).chosen == "reroute"
    assert cross_decide(d_star * 10).chosen == "replan"
    lo, hi = d_star / 10, d_star * 10
    for _ in range(60):
        mid = (lo + hi) / 2
        if cross_decide(mid).chosen == "reroute":
            lo = mid
        else:
            hi = mid
    assert (lo + hi) / 2 == pytest.approx(d_star, rel=0.01)
    # the replan target may depend on D (migration is priced per plan): the crossover must also
    # hold for the step and transition times the selector predicts at the switch itself
    at = cross_decide(hi)
    rr, rp = at.option("reroute"), at.option("replan")
    assert at.chosen == "replan"
    assert (lo + hi) / 2 == pytest.approx(rp.transition_s / (1 - rp.step_time / rr.step_time), rel=0.01)


def test_crossover_mttf_formula():
    assert crossover_mttf(57.0, 36.0, 0.0, 10.0) == pytest.approx(10.0 / (1 - 36 / 57))
    assert crossover_mttf(30.0, 36.0, 0.0, 10.0) == float("inf")  # replan slower: never worth it
    # equal scores at the crossover
    D = crossover_mttf(57.0, 36.0, 2.0, 10.0)
    assert score(16, 57.0, 2.0, D) == pytest.approx(score(16, 36.0, 10.0, D))


def test_score():
    assert score(16, 2.0, 0.0, 100.0) == pytest.approx(8.0)
    assert score(16, 2.0, 50.0, 100.0) == pytest.approx(4.0)
    assert score(16, 2.0, 200.0, 100.0) == 0.0


# -- policy restrictions ---------------------------------------------------------------
def test_shrink_only_with_allow_batch_change():
    d = cross_decide(1e9)
    sh = d.option("shrink")
    assert not sh.feasible and "allow_batch_change" in sh.reason
    assert d.chosen != "shrink"
    d = cross_decide(1e9, allow_batch_change=True, allowed={"shrink"})
    sh = d.option("shrink")
    assert sh.feasible and d.chosen == "shrink"
    assert sh.global_batch == 8 and sh.lr_scale == pytest.approx(0.5)
    assert sh.plan.num_microbatches == 8


def test_allowed_policies_restrict_the_choice():
    d = cross_decide(1e9, allowed={"reroute"})
    assert d.chosen == "reroute"
    assert d.option("replan").reason == "not in the allowed policies"
    d = cross_decide(1.0, allowed={"replan", "restart"})
    assert d.chosen in {"replan", "restart"} or d.chosen is None
    assert d.option("reroute").reason == "not in the allowed policies"
    assert {o.policy for o in d.options} <= set(POLICIES)


def test_restart_ruled_out_by_allowed_policies_says_so():
    d = cross_decide(1e9, allowed={"reroute"})
    assert d.option("restart").reason == "not in the allowed policies"


def test_wait_needs_replacement_eta():
    d = cross_decide(1e9)
    assert not d.option("wait").feasible and "replacement_eta_s" in d.option("wait").reason
    d = cross_decide(1e9, replacement_eta_s=30.0)
    wt = d.option("wait")
    # carried out as reroute until the replacement arrives: reroute's step time and transition
    assert wt.feasible and wt.transition_s == d.option("reroute").transition_s
    assert wt.step_time == pytest.approx((8 + 3) * 3 + 8 * 3)
    assert wt.phases[1][0] >= 30.0 and wt.phases[1][2] == pytest.approx((8 + 4 - 1) * 3)
    assert wt.global_batch == 16


def test_a_replacement_due_before_the_replans_migration_ends_undoes_it():
    """The runtime undoes a re-plan whose migration a join interrupts and heals the replacement
    into the old plan: priced so, nothing trains until then, and the re-planned layout never
    runs; a replacement due after the migration is the two-phase grow-back."""
    rp_alone = cross_decide(1e6).option("replan")
    soon = cross_decide(1e6, replacement_eta_s=rp_alone.transition_s / 2)
    rp, wt = soon.option("replan"), soon.option("wait")
    assert rp.feasible and len(rp.phases) == 1 and "undone" in rp.reason
    start, until, step, _ = rp.phases[0]
    assert start > rp_alone.transition_s / 2 and math.isinf(until)
    assert step == pytest.approx(wt.phases[-1][2])  # the healed old plan, as wait ends with
    assert soon.chosen == "wait"
    later = cross_decide(1e6, replacement_eta_s=rp_alone.transition_s * 2).option("replan")
    assert len(later.phases) == 2 and later.phases[0][2] == pytest.approx(rp_alone.step_time)


def test_restart_transition_includes_steps_since_checkpoint():
    d = cross_decide(1e9, restart_s=60.0, steps_since_checkpoint=10)
    rs = d.option("restart")
    assert rs.feasible
    assert rs.transition_s == pytest.approx(60.0 + 10 * rs.step_time)
    d0 = cross_decide(1e9, restart_s=60.0, steps_since_checkpoint=0)
    assert d0.option("restart").transition_s == pytest.approx(60.0)


# -- JSON and determinism --------------------------------------------------------------
def test_decision_json_round_trips_and_is_deterministic():
    a = cross_decide(500.0, replacement_eta_s=5.0)
    b = cross_decide(500.0, replacement_eta_s=5.0)
    ja = a.to_json()
    assert json.loads(json.dumps(ja)) == ja
    assert without_timing(a) == without_timing(b)
    assert json.dumps(without_timing(a), sort_keys=True) == json.dumps(without_timing(b), sort_keys=True)
    assert ja["chosen"] == a.chosen and len(ja["candidates"]) == len(a.options)
    for cand in ja["candidates"]:
        assert cand["feasible"] or cand["reason"], f"{cand['policy']} ruled out without a reason"
    # big plans are summarised, not listed
    small = a.to_json(max_plan_devices=2)
    assert all(isinstance(c.get("plan", ""), str) for c in small["candidates"])


# -- state without a surviving replica: recompute vs rehabilitate -----------------------
HSDP_W = chain([1.0, 1.0], params=[1_000_000, 1_000_000], microbatches=8)
# 2 replicas x 2 shards: pipelines 0,1,2,3 hold shards 0,1,0,1 on devices 0,1,2,3
HSDP_PLAN = Plan(tuple(Pipeline((d,), (0, 2), 2) for d in range(4)), shard_degree=2)


def hsdp_decide(dead, **cfg):
    cfg.setdefault("space", SearchSpace(shard_degree=2))
    cfg.setdefault("steps_since_snapshot", 100)
    cfg.setdefault("steps_since_checkpoint", 100)
    return decide(HSDP_PLAN, HSDP_W, cluster(4), Event(FAIL, dead), **cfg)


def test_recompute_and_rehab_appear_only_when_state_has_no_surviving_replica():
    d = hsdp_decide((0,))
    policies = [o.policy for o in d.options]
    assert "recompute" not in policies and "rehabilitate" not in policies
    assert d.option("reroute").feasible
    d = hsdp_decide((0, 2))  # both copies of shard 0
    policies = [o.policy for o in d.options]
    assert "recompute" in policies and "rehabilitate" in policies
    assert not d.option("reroute").feasible and not d.option("replan").feasible
    assert "no surviving replica" in d.option("replan").reason


def test_rehabilitate_chosen_when_cheaper_than_recompute():
    trend = LossTrend(slope=-0.01, loss_now=2.0, loss_at_snapshot=3.0)
    d = hsdp_decide((0, 2), loss=trend)
    rc, rh = d.option("recompute"), d.option("rehabilitate")
    assert rc.feasible and rh.feasible
    # half the model's state lost: gap 0.5 of progress 1.0; heal 1.5 · 0.5 / 0.01 = 75 < 100 steps
    assert rh.transition_s < rc.transition_s
    assert rc.transition_s - rh.transition_s == pytest.approx(25 * rc.step_time)
    assert d.chosen == "rehabilitate"
    # a measured gap of 0.8 costs 120 steps: recompute wins
    d = hsdp_decide((0, 2), loss=LossTrend(slope=-0.01, loss_now=2.0, loss_at_snapshot=3.0, measured_gap=0.8))
    assert d.option("rehabilitate").transition_s > d.option("recompute").transition_s
    assert d.chosen == "recompute"
    # no loss trend: the lag is the lost fraction of the steps since the snapshot (as above)
    d = hsdp_decide((0, 2))
    assert d.option("rehabilitate").feasible and "lost fraction" in d.option("rehabilitate").reason
    assert d.option("rehabilitate").transition_s == pytest.approx(rh.transition_s)


def test_restart_is_the_fallback_when_nothing_in_place_works():
    w = chain([1.0, 1.0], params=[1_000_000, 1_000_000], microbatches=4)
    plan = Plan((Pipeline((0, 1), (0, 1, 2), 2), Pipeline((2, 3), (0, 1, 2), 2)))
    d = decide(plan, w, cluster(4), Event(FAIL, (0, 2)), allowed={"reroute", "restart"})
    assert not d.option("reroute").feasible
    assert d.chosen == "restart"


def test_single_pipeline_job_can_replan_after_losing_a_stage():
    w = chain([1.0] * 4, microbatches=4)
    plan = Plan((Pipeline((0, 1, 2, 3), (0, 1, 2, 3, 4), 4),))
    d = decide(plan, w, cluster(4), Event(FAIL, (0,)))
    assert d.option("replan").feasible or d.option("restart").feasible
    assert d.chosen is not None


# -- stragglers ------------------------------------------------------------------------
def straggler_setup():
    w = chain([1.0] * 4, params=[1_000_000] * 4, microbatches=16)
    c = cluster(4)
    plan = plan_search(w, c, space=SearchSpace(pp_max=1)).best.plan  # DP4, 4 micro-batches each
    return w, c, plan


def test_straggler_keep_or_rebalance_by_gain_against_cost():
    w, c, plan = straggler_setup()
    ev = Event(EventKind.STRAGGLER, (3,), slowdown=3.0)
    cfg = dict(space=SearchSpace(pp_max=1), rebuild_s=5.0)
    d = decide(plan, w, c, ev, mttf=1e6, **cfg)
    keep, rb = d.option("keep"), d.option("rebalance")
    assert [o.policy for o in d.options] == ["keep", "rebalance"]
    assert keep.step_time == pytest.approx(4 * 4.0 * 3 + keep.breakdown["allreduce"])  # 4 mb x 4 s x 3
    assert rb.feasible and rb.step_time < keep.step_time
    share = {p.devices[0]: p.microbatches for p in rb.plan.pipelines}
    assert share.get(3, 0) < share[0]  # the slow device gets less
    assert sum(share.values()) == 16
    assert d.chosen == "rebalance"
    # rebalance wins exactly when its gain over D beats its transition
    for mttf in (1.0, 5.0, 6.0, 9.0, 10.0, 20.0, 1e3):
        d = decide(plan, w, c, ev, mttf=mttf, **cfg)
        keep, rb = d.option("keep"), d.option("rebalance")
        gain = 16 / rb.step_time * (mttf - rb.transition_s) / mttf > 16 / keep.step_time
        assert d.chosen == ("rebalance" if gain else "keep"), mttf
    assert decide(plan, w, c, ev, mttf=rb.transition_s, **cfg).chosen == "keep"


def test_no_slowdown_means_keep():
    w, c, plan = straggler_setup()
    d = decide(plan, w, c, Event(EventKind.STRAGGLER, (3,), slowdown=1.0), mttf=1e9, space=SearchSpace(pp_max=1))
    assert d.option("rebalance").step_time >= d.option("keep").step_time - 1e-9
    assert d.chosen == "keep"


# -- joins -----------------------------------------------------------------------------
def test_join_offers_keep_heal_grow():
    w, c, plan = straggler_setup()
    # device 3 died earlier and was rerouted around; it comes back
    d = decide(plan, w, c, Event(EventKind.JOIN, (3,)), alive=set(c.ids), mttf=1e6, space=SearchSpace(pp_max=1))
    assert [o.policy for o in d.options] == ["keep", "heal", "grow"]
    keep, heal, grow = (d.option(p) for p in ("keep", "heal", "grow"))
    assert keep.feasible and heal.feasible and grow.feasible
    assert keep.transition_s == 0.0
    assert heal.step_time < keep.step_time
    assert heal.global_batch == 16
    assert d.chosen in {"heal", "grow"}
    d = decide(plan, w, c, Event(EventKind.JOIN, (3,)), alive=set(c.ids), mttf=heal.transition_s / 2,
               space=SearchSpace(pp_max=1))
    assert d.chosen == "keep"


def test_join_after_shrink_heals_the_global_batch_back():
    w, c, _ = straggler_setup()
    shrunk = Plan(tuple(Pipeline((d,), (0, 4), 4) for d in range(3)))  # 12 of 16 micro-batches
    d = decide(shrunk, w, c, Event(EventKind.JOIN, (3,)), mttf=1e6, space=SearchSpace(pp_max=1))
    heal = d.option("heal")
    assert heal.feasible and heal.global_batch == 16
    assert d.option("keep").global_batch == 12


def test_join_while_another_device_is_still_down():
    w, c, plan = straggler_setup()
    # devices 0 and 3 died (rerouted); 0 is repaired and joins while 3 is still down
    d = decide(plan, w, c, Event(EventKind.JOIN, (0,)), alive={0, 1, 2}, mttf=1e6, space=SearchSpace(pp_max=1))
    assert d.option("heal").feasible


def test_keep_is_never_ruled_out_by_the_allowed_policies():
    """A job allowed only {replan, restart}: a straggler or a returning member is not a reason
    to restart -- going on with the running plan stays possible."""
    w, c, plan = straggler_setup()
    only = frozenset({"replan", "restart"})
    for ev, alive in ((Event(EventKind.STRAGGLER, (3,), slowdown=3.0), None),
                      (Event(EventKind.JOIN, (3,)), set(c.ids))):
        d = decide(plan, w, c, ev, alive=alive, mttf=1e6, allowed=only, space=SearchSpace(pp_max=1))
        assert d.option("keep").feasible, ev.kind
        assert d.chosen == "keep", (ev.kind, d.chosen)
        assert all(not o.feasible for o in d.options if o.policy not in only | {"keep"})


def test_keep_stays_feasible_when_the_memory_model_says_the_running_plan_does_not_fit():
    """The job runs its plan, so a memory model that over-estimates must not leave a straggler
    or a joiner with nothing feasible (which would end in a restart)."""
    w, _, _ = straggler_setup()
    tiny = cluster(4, memory=1e3)  # far below the model's weights: nothing "fits"
    plan = Plan.data_parallel(list(range(4)), w)
    for ev, alive in ((Event(EventKind.STRAGGLER, (3,), slowdown=3.0), None),
                      (Event(EventKind.JOIN, (3,)), set(tiny.ids))):
        d = decide(plan, w, tiny, ev, alive=alive, mttf=1e6, space=SearchSpace(pp_max=1))
        assert d.option("keep").feasible and d.option("keep").step_time > 0, ev.kind
        assert d.chosen == "keep", (ev.kind, d.chosen)
        assert all("memory" in o.reason for o in d.options if not o.feasible and o.policy in ("rebalance", "grow"))


# -- bad input -------------------------------------------------------------------------
def test_bad_input_raises_value_error():
    w, c, plan = straggler_setup()
    state = JobState(w, c, plan, frozenset(c.ids))
    with pytest.raises(ValueError, match="unknown devices"):
        select(Event(FAIL, (99,)), state, SelectorConfig(), mttf_s=10.0)
    with pytest.raises(ValueError, match="mttf"):
        select(Event(FAIL, (1,)), state, SelectorConfig())
    with pytest.raises(ValueError, match="mttf"):
        select(Event(FAIL, (1,)), state, SelectorConfig(), mttf_s=0.0)
    with pytest.raises(ValueError, match="unknown policies"):
        SelectorConfig(allowed={"reroute", "pray"})
    for field in ("rebuild_s", "restart_s", "snapshot_load_s", "search_s", "replacement_eta_s"):
        with pytest.raises(ValueError):
            SelectorConfig(**{field: -1.0})
    with pytest.raises(ValueError):
        Event(FAIL, ())
    with pytest.raises(ValueError):
        Event(EventKind.STRAGGLER, (1,), slowdown=0.5)
    with pytest.raises(ValueError):
        Event("meteor", (1,))


def test_config_mttf_overrides_the_argument():
    w, c, plan = straggler_setup()
    state = JobState(w, c, plan, frozenset(c.ids))
    d = select(Event(FAIL, (1,)), state, SelectorConfig(mttf_s=123.0), mttf_s=5.0)
    assert d.mttf_s == 123.0


def test_pipeline_straggler_without_relayout_moves_only_microbatches():
    """A runtime that cannot move state between two steps (the pipeline executor) gets a
    rebalance over its running pipelines: same devices and layer splits, fewer of the step's
    micro-batches through the slow device's pipeline, every pipeline keeping one; after a reroute
    (a dead device still in the plan) it has none to offer."""
    w = chain([1.0] * 8, params=[1_000_000] * 8, microbatches=16)
    c = cluster(8)
    plan = Plan((Pipeline((0, 1, 2, 3), (0, 2, 4, 6, 8), 8), Pipeline((4, 5, 6, 7), (0, 2, 4, 6, 8), 8)))
    ev = Event(EventKind.STRAGGLER, (5,), slowdown=4.0)
    d = decide(plan, w, c, ev, mttf=1e6, straggler_relayout=False, space=SearchSpace(min_microbatches=1))
    rb, keep = d.option("rebalance"), d.option("keep")
    assert rb.feasible and rb.step_time < keep.step_time and d.chosen == "rebalance"
    assert [(p.devices, p.bounds) for p in rb.plan.pipelines] == [(p.devices, p.bounds) for p in plan.pipelines]
    m = [p.microbatches for p in rb.plan.pipelines]
    assert m[1] < m[0] and sum(m) == 16 and min(m) >= 1
    assert rb.migration.total_bytes == 0 and not rb.migration.transfers
    # With relayout allowed the search may re-split the slow stage instead (a migration).
    free = decide(plan, w, c, ev, mttf=1e6, space=SearchSpace(min_microbatches=1)).option("rebalance")
    assert free.feasible and free.step_time <= rb.step_time + 1e-9
    # Rerouted (device 2 dead, its micro-batches through 6): no micro-batch rebalance.
    d = decide(plan, w, c, ev, alive=[0, 1, 3, 4, 5, 6, 7], mttf=1e6, straggler_relayout=False)
    assert not d.option("rebalance").feasible and "rerouted" in d.option("rebalance").reason
