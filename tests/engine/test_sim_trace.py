"""Trace replay: every policy faces the same events; the adaptive choice between rerouting and
re-planning follows the selector's crossover; restart pays its cost; the Bamboo-like stand-in
takes over a lost stage and falls back to a restart on adjacent losses; traces scale and
round-trip through JSON; the CLI replays a stored file."""

from __future__ import annotations

import json
import math

import pytest

from chameleon_ft.cli import main
from chameleon_ft.engine.perf import Coefficients, estimate
from chameleon_ft.engine.planner import SearchSpace, plan_search
from chameleon_ft.engine.decision import crossover_mttf
from chameleon_ft.sim.trace import (
    Trace, TraceEvent, TraceSetup, cluster_from_json, cluster_to_json, default_redundant_overhead, replay,
    scale_trace, takeover_plan, trace_setting, workload_from_json, workload_to_json,
)

from .conftest import chain, cluster

REBUILD, RESTART, CKPT = 1.0, 30.0, 200.0


@pytest.fixture(scope="module")
def job():
    """2x PP4 on two nodes of four: 8 equal layers (1 s each), 2e7 parameters a layer (a
    re-plan migrates seconds of state over the 1e8 B/s inter-node link), memory for 4 layers."""
    w = chain([1.0] * 8, params=[20_000_000] * 8, outs=[1_000_000] * 8, microbatches=8)
    return trace_setting(w, cluster(8, per_node=4, memory=1.5e9), 8, 4)


def run(job, trace, policies, **kw):
    w, c, plan = job
    kw = {"rebuild_s": REBUILD, "restart_s": RESTART, "checkpoint_every_s": CKPT, "search_space": SearchSpace(), **kw}
    return replay(trace, w, c, plan, policies, **kw)


def one_fail(horizon_s: float, devices=(1,)) -> Trace:
    return Trace((TraceEvent(100.0, "fail", devices),), horizon_s, "one-fail")


def test_trace_setting_deploys_pipelines_of_consecutive_devices(job):
    w, c, plan = job
    assert [p.devices for p in plan.pipelines] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [p.bounds for p in plan.pipelines] == [(0, 2, 4, 6, 8)] * 2
    assert [p.microbatches for p in plan.pipelines] == [4, 4]
    w32, c32, plan32 = trace_setting(w, c, 32, 4)
    assert w32.global_batch == 4 * w.global_batch and len(c32.devices) == 32
    assert [p.devices for p in plan32.pipelines] == [tuple(range(i, i + 4)) for i in range(0, 32, 4)]
    assert {p.microbatches for p in plan32.pipelines} == {4}
    assert [d.node for d in c32.devices] == [i // 4 for i in range(32)]
    with pytest.raises(ValueError):
        trace_setting(w, c, 12, 4)


def test_every_policy_sees_every_event(job):
    tr = Trace((TraceEvent(50, "fail", (1,)), TraceEvent(50, "fail", (1,)), TraceEvent(300, "slow", (6,), 2.0),
                TraceEvent(400, "join", (1,)), TraceEvent(500, "join", (1,))), 1000)
    policies = ("adaptive", "reroute", "replan", "restart", "redundant")
    res = run(job, tr, policies, mttf_s=500)
    for name, r in res.items():
        assert [(t, k) for t, k, *_ in r.decisions] == [(e.t_s, e.kind) for e in tr.events], name
        # a second failure of a dead device, and a join of a live one, change nothing
        assert r.decisions[1][2] == "ignored" and r.decisions[4][2] == "ignored", name
        assert r.decisions[2][2] == "keep", name  # a slowdown takes no decision
        assert 0 < r.goodput < 1, name
        assert r.timeline[0] == (0.0, pytest.approx(r.failure_free_throughput)) or name == "redundant"
    # the slowdown is priced: reroute runs with device 6 at half speed from t = 300 on
    r = res["reroute"]
    before = dict(r.timeline)
    assert min(x for t, x in r.timeline if 300 <= t < 400) < max(x for t, x in r.timeline if 50 < t < 300)
    assert before[300] == pytest.approx(8 / r.decisions[2][3])


@pytest.mark.parametrize("horizon,expected", [(110.0, "reroute"), (5000.0, "replan")])
def test_adaptive_picks_the_better_of_reroute_and_replan(job, horizon, expected):
    res = run(job, one_fail(horizon), ("adaptive", "reroute", "replan"), mttf_s=horizon - 100)
    reroute, replan = res["reroute"].decisions[0], res["replan"].decisions[0]
    assert (reroute[2], replan[2]) == ("reroute", "replan")
    assert replan[3] < reroute[3] and replan[4] > reroute[4]  # faster step, longer transition
    cross = crossover_mttf(reroute[3], replan[3], reroute[4], replan[4])
    assert 10 < cross < 4900  # the two horizons sit on either side of it
    assert res["adaptive"].decisions[0][2] == expected
    assert res["adaptive"].samples == pytest.approx(res[expected].samples, rel=1e-12)
    other = "replan" if expected == "reroute" else "reroute"
    assert res["adaptive"].throughput > res[other].throughput
    tp = {k: v.throughput for k, v in res.items()}
    assert tp["adaptive"] >= max(tp["reroute"], tp["replan"]) * (1 - 1e-9)


def test_default_mttf_is_horizon_over_failures(job):
    # the crossover of the first failure is ~23 s (see the test above)
    # one failure in 40 s: D = 40 s, past the crossover: re-plan
    assert run(job, Trace((TraceEvent(10, "fail", (1,)),), 40.0), ("adaptive",))["adaptive"].decisions[0][2] == "replan"
    # two failures in 40 s: D = 20 s, short of it: reroute
    two = Trace((TraceEvent(10, "fail", (1,)), TraceEvent(30, "fail", (5,))), 40.0)
    assert run(job, two, ("adaptive",))["adaptive"].decisions[0][2] == "reroute"


def test_restart_pays_restart_and_redone_steps(job):
    w, c, plan = job
    res = run(job, one_fail(1000.0), ("restart",), mttf_s=1000)
    r = res["restart"]
    t, kind, chosen, step, transition = r.decisions[0]
    ideal_step = estimate(plan, w, c).step_time
    redo = int(100.0 / ideal_step)  # steps since the checkpoint at t = 0
    survivors = c.without({1})
    best = plan_search(w, survivors, Coefficients(), SearchSpace(), base=plan).best.estimate.step_time
    assert chosen == "restart" and redo > 0
    assert step == pytest.approx(best)
    assert transition == pytest.approx(RESTART + redo * best)
    assert r.timeline[1] == (100.0, 0.0) and r.timeline[2][0] == pytest.approx(100 + transition)
    expected = 100 * 8 / ideal_step + (1000 - 100 - transition) * 8 / best
    assert r.samples == pytest.approx(expected, rel=1e-9)
    # a join is a membership change too: restart again (at t = 400, a checkpoint boundary: no redo)
    back = Trace((TraceEvent(100, "fail", (1,)), TraceEvent(400, "join", (1,))), 1000)
    join = run(job, back, ("restart",), mttf_s=1000)["restart"].decisions[1]
    assert join[1:3] == ("join", "restart") and join[4] == pytest.approx(RESTART)


def test_engine_restricted_policies_choose_within_their_sets(job):
    """The live benchmark's "fixed" systems, replayed: the engine over a restricted set (reroute
    may wait for an expected replacement; replan grows it back in)."""
    back = Trace((TraceEvent(100, "fail", (1,)), TraceEvent(160, "join", (1,)), TraceEvent(300, "fail", (5,))), 1000)
    res = run(job, back, ("engine-reroute", "engine-replan"), mttf_s=1000, replacement_eta_s=60.0)
    sets = {"engine-reroute": {"reroute", "wait", "heal", "restart", "keep"},
            "engine-replan": {"replan", "grow", "restart", "keep"}}
    for name, r in res.items():
        chosen = [c for _, _, c, _, _ in r.decisions]
        assert len(chosen) == 3 and set(chosen) <= sets[name], (name, chosen)
    assert res["engine-replan"].decisions[0][2] == "replan"


def test_a_device_back_during_the_relaunch_joins_it(job):
    """torchrun's restart admits a replaced node's workers in the same rendezvous: a join while
    the relaunch is still under way costs nothing more, and the job runs on every device after
    it; a join after the relaunch ended restarts again."""
    w, c, plan = job
    quick = Trace((TraceEvent(100, "fail", (1,)), TraceEvent(105, "join", (1,))), 1000)
    r = run(job, quick, ("restart",), mttf_s=1000)["restart"]
    assert r.counts == {"restart": 1}
    (_, k1, c1, _, t1), (_, k2, c2, step2, t2) = r.decisions[:2]
    assert (k1, c1, k2, c2) == ("fail", "restart", "join", "restart") and t1 > 5 and t2 == 0.0
    deployed = estimate(plan, w, c, Coefficients()).step_time
    assert step2 == pytest.approx(deployed)  # torchrun relaunches the deployed layout on all 8
    late = Trace((TraceEvent(100, "fail", (1,)), TraceEvent(900, "join", (1,))), 1000)
    assert run(job, late, ("restart",), mttf_s=1000)["restart"].counts == {"restart": 2}


def test_redundant_takes_over_a_lost_stage(job):
    w, c, plan = job
    res = run(job, one_fail(1000.0, (1,)), ("redundant", "reroute"), mttf_s=1000, redundant_overhead=1.2)
    r = res["redundant"]
    merged = takeover_plan(plan, set(range(8)) - {1})
    assert merged.pipelines[0].devices == (0, 2, 3) and merged.pipelines[0].bounds == (0, 4, 6, 8)
    assert merged.pipelines[1] == plan.pipelines[1]
    assert r.decisions[0][2] == "takeover" and r.decisions[0][4] == REBUILD
    assert r.decisions[0][3] == pytest.approx(1.2 * estimate(merged, w, c).step_time)
    # failure-free, it runs 1.2x slower than the plan it shadows
    assert r.timeline[0][1] == pytest.approx(r.failure_free_throughput / 1.2)
    # stage 0 is shadowed by stage 1
    first = takeover_plan(plan, set(range(8)) - {0})
    assert first.pipelines[0].devices == (1, 2, 3) and first.pipelines[0].bounds == (0, 4, 6, 8)
    # two non-adjacent losses in one pipeline: both taken over
    assert takeover_plan(plan, set(range(8)) - {1, 3}).pipelines[0].bounds == (0, 4, 8)


@pytest.mark.parametrize("lost", [(1, 2), (0, 1), (6, 7)])
def test_redundant_falls_back_to_restart_on_adjacent_losses(job, lost):
    w, c, plan = job
    assert takeover_plan(plan, set(range(8)) - set(lost)) is None
    res = run(job, one_fail(1000.0, lost), ("redundant", "restart"), mttf_s=1000, redundant_overhead=1.0)
    red, rst = res["redundant"].decisions[0], res["restart"].decisions[0]
    assert red[2] == "restart" and red[4] == pytest.approx(rst[4]) and red[4] > RESTART
    assert res["redundant"].samples == pytest.approx(res["restart"].samples, rel=1e-12)


def test_redundant_heals_a_joined_device_and_returns_after_a_fallback(job):
    tr = Trace((TraceEvent(100, "fail", (1,)), TraceEvent(200, "join", (1,)),
                TraceEvent(300, "fail", (1, 2)), TraceEvent(500, "join", (1, 2))), 1000)
    r = run(job, tr, ("redundant",), mttf_s=1000)["redundant"]
    assert [d[2] for d in r.decisions] == ["takeover", "heal", "restart", "restart"]
    w, c, plan = job
    assert r.decisions[1][3] == pytest.approx(estimate(plan, w, c).step_time)  # healed: the deployed plan again
    assert r.decisions[3][4] == pytest.approx(RESTART + 500 % CKPT)


def test_default_redundant_overhead_counts_what_the_bubble_cannot_hide():
    c = cluster(4)
    # 4 micro-batches: stage 1 re-runs the forward of stages 0 and 2 (2/3 s a micro-batch),
    # 2.67 s in all, and idles (4+3)*1 - 4*1 = 3 s: hidden.
    w, _, plan = trace_setting(chain([1.0] * 4, microbatches=4), c, 4, 4)
    assert default_redundant_overhead(plan, w, c) == 1.0
    # 32 micro-batches: 32*2/3 = 21.33 s of redundant forward against 3 s idle on stage 1
    w, _, plan = trace_setting(chain([1.0] * 4, microbatches=32), c, 4, 4)
    step = estimate(plan, w, c).step_time
    assert default_redundant_overhead(plan, w, c) == pytest.approx(1 + (32 * 2 / 3 - 3) / step)


def test_scale_trace_tiles_the_small_cluster():
    tr = Trace((TraceEvent(10, "fail", (1,)), TraceEvent(20, "slow", (6,), 3.0), TraceEvent(30, "join", (1,))),
               100, "t", "desc")
    big = scale_trace(tr, 8, 32)
    assert [e.devices for e in big.events] == [(1, 9, 17, 25), (6, 14, 22, 30), (1, 9, 17, 25)]
    assert [(e.t_s, e.kind, e.slowdown) for e in big.events] == [(e.t_s, e.kind, e.slowdown) for e in tr.events]
    # 2 of 2 pipelines x 4 stages -> the same stage of 4 of 8 pipelines: the same fraction is hit
    assert {d // 4 for d in big.events[0].devices} == {0, 2, 4, 6} and {d % 4 for d in big.events[0].devices} == {1}
    with pytest.raises(ValueError):
        scale_trace(tr, 8, 20)
    with pytest.raises(ValueError):
        scale_trace(Trace((TraceEvent(1, "fail", (9,)),), 10), 8, 32)


def test_32_device_replay_runs_the_scaled_trace(job):
    w, c, _ = job
    w32, c32, plan32 = trace_setting(w, c, 32, 4)
    res = replay(scale_trace(one_fail(5000.0), 8, 32), w32, c32, plan32, ("adaptive", "reroute", "replan"),
                 rebuild_s=REBUILD, restart_s=RESTART, checkpoint_every_s=CKPT, search_space=SearchSpace(),
                 mttf_s=4900)
    tp = {k: v.throughput for k, v in res.items()}
    assert res["reroute"].decisions[0][2] == "reroute" and res["replan"].decisions[0][2] == "replan"
    assert tp["adaptive"] >= max(tp["reroute"], tp["replan"]) * (1 - 1e-9)
    assert res["adaptive"].failure_free_throughput == pytest.approx(32 / estimate(plan32, w32, c32).step_time)


def test_trace_events_are_validated_and_ordered():
    with pytest.raises(ValueError):
        TraceEvent(1, "explode", (1,))
    with pytest.raises(ValueError):
        TraceEvent(1, "slow", (1,), 0.5)
    with pytest.raises(ValueError):
        TraceEvent(1, "fail", (1,), 2.0)
    with pytest.raises(ValueError):
        Trace((TraceEvent(10, "fail", (1,)),), 10)
    tr = Trace((TraceEvent(5, "join", (1,)), TraceEvent(2, "fail", (1,))), 10)
    assert [e.t_s for e in tr.events] == [2, 5]


def test_json_round_trips(job):
    w, c, plan = job
    tr = Trace((TraceEvent(1.5, "fail", (3, 1)), TraceEvent(2, "slow", (4,), 1.5), TraceEvent(3, "join", (1,))),
               10, "n", "d")
    assert Trace.from_json(json.loads(json.dumps(tr.to_json()))) == tr
    assert tr.events[0].devices == (1, 3)
    assert workload_from_json(json.loads(json.dumps(workload_to_json(w)))) == w
    c2 = cluster_from_json(json.loads(json.dumps(cluster_to_json(c))))
    assert c2 == c
    setup = TraceSetup(tr, w, c, Coefficients(1.1, 0.9, 0.01), 4, 0.5, 20.0, 300.0, 77.0, 1.1)
    assert TraceSetup.from_json(json.loads(json.dumps(setup.to_json()))) == setup
    res = run(job, one_fail(200.0), ("reroute",), mttf_s=100)
    data = json.loads(json.dumps(res["reroute"].to_json()))
    assert data["decisions"][0]["chosen"] == "reroute" and data["goodput"] == res["reroute"].goodput


def test_cli_replays_a_trace_file(job, tmp_path, capsys):
    w, c, _ = job
    setup = TraceSetup(Trace((TraceEvent(100, "fail", (1,)), TraceEvent(600, "join", (1,))), 2000, "cli-trace"),
                       w, c, stages=4, restart_s=RESTART, checkpoint_every_s=CKPT, mttf_s=1000)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(setup.to_json()))
    out = tmp_path / "out.json"
    assert main(["simulate", "--trace", str(path), "--json", str(out),
                 "--policies", "adaptive", "reroute", "replan", "redundant"]) == 0
    text = capsys.readouterr().out
    assert "cli-trace" in text and "vs best fixed" in text and "redundant" in text
    data = json.loads(out.read_text())
    assert data["devices"] == 8 and set(data["results"]) == {"adaptive", "reroute", "replan", "redundant"}
    direct = setup.run(None, ("adaptive",))["adaptive"]
    assert data["results"]["adaptive"]["samples"] == pytest.approx(direct.samples)
    best = max(("reroute", "replan", "redundant"), key=lambda p: data["results"][p]["throughput"])
    assert data["best_fixed"] == best
    out32 = tmp_path / "out32.json"
    assert main(["simulate", "--trace", str(path), "--devices", "32", "--json", str(out32),
                 "--policies", "adaptive", "reroute"]) == 0
    data32 = json.loads(out32.read_text())
    assert data32["devices"] == 32
    assert not math.isclose(data32["results"]["adaptive"]["samples"], data["results"]["adaptive"]["samples"])
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", str(path), "--policies", "oracle"])


def test_a_join_during_a_replans_migration_undoes_it_and_heals(job):
    """As the runtime does (``PipelineExecutor.source_payload``): a replacement that joins while
    a re-plan's state is still moving ends the migration; the re-plan is undone and the plan
    before it -- which names the joined device's slot -- gets that device's blocks back (a heal
    from the join); the time spent so far is lost.  A join after the migration finished is an
    ordinary join decision."""
    w, c, plan = job
    first = run(job, one_fail(1000), ("engine-replan",), mttf_s=1000)["engine-replan"].decisions[0]
    assert first[2] == "replan" and first[4] > 2.0  # seconds of migration over the slow link
    mid = 100 + first[4] / 2
    r = run(job, Trace((TraceEvent(100, "fail", (1,)), TraceEvent(mid, "join", (1,))), 1000),
            ("engine-replan",), mttf_s=1000)["engine-replan"]
    (_, _, c1, _, _), (t2, k2, c2, step2, heal_s) = r.decisions
    assert (c1, k2, c2, t2) == ("replan", "join", "heal", mid) and heal_s > 0
    assert step2 == pytest.approx(estimate(plan, w, c, Coefficients()).step_time)  # the deployed plan again
    assert r.timeline[-1][1] == pytest.approx(w.global_batch / step2)
    late = run(job, Trace((TraceEvent(100, "fail", (1,)), TraceEvent(100 + first[4] + 50, "join", (1,))), 1000),
               ("engine-replan",), mttf_s=1000)["engine-replan"]
    assert [d[2] for d in late.decisions][0] == "replan" and late.decisions[1][2] != "heal"


def test_limited_replacements_leave_no_wait_once_used(job):
    """``limited_replacements``: the trace's joins are all the replacements (a launcher's
    ``--max-replacements``).  The first failure may wait for one; once it came, a later failure
    has none to wait for -- as the live engine, which is told the launcher's budget."""
    back = Trace((TraceEvent(100, "fail", (1,)), TraceEvent(110, "join", (1,)), TraceEvent(300, "fail", (5,))), 1000)
    for limited in (False, True):
        r = run(job, back, ("engine-reroute",), mttf_s=1000, replacement_eta_s=10.0,
                limited_replacements=limited)["engine-reroute"]
        chosen = [d[2] for d in r.decisions]
        assert chosen[0] == "wait", chosen
        assert (chosen[2] == "wait") == (not limited), (limited, chosen)


def test_a_job_without_checkpoints_never_restarts_in_the_engines_policies(job):
    """``engine_restart=False``: the live pipeline benchmarks' chameleon-ft jobs write no
    checkpoint, so their engine finds restart infeasible; the replay must not restart either
    (a cheap restart made the simulated always-reroute restart twice where the live one rerouted).
    The torchrun system (``restart``) still restarts."""
    trace = Trace((TraceEvent(100, "fail", (1,)), TraceEvent(300, "fail", (2,))), 1000)
    kw = {"mttf_s": 1000, "restart_s": 0.01, "checkpoint_every_s": 100.0}
    cheap = run(job, trace, ("engine-reroute", "adaptive", "restart"), **kw)
    assert "restart" in [d[2] for d in cheap["engine-reroute"].decisions]  # restart is that cheap
    none = run(job, trace, ("engine-reroute", "adaptive", "restart"), engine_restart=False, **kw)
    for name in ("engine-reroute", "adaptive"):
        chosen = [d[2] for d in none[name].decisions]
        assert len(chosen) == 2 and "restart" not in chosen, (name, chosen)
    assert [d[2] for d in none["restart"].decisions] == ["restart", "restart"]


def test_a_fail_that_knows_its_steps_since_the_checkpoint_redoes_exactly_those(job):
    """``redo_steps``: a run that checkpoints every N steps, killed right after a checkpoint step,
    redoes nothing -- whatever the time grid (``checkpoint_every_s``) says at that instant (here
    199 of its 200 s: a whole interval)."""
    w, c, plan = job
    best = plan_search(w, c.without({1}), Coefficients(), SearchSpace(), base=plan).best.estimate.step_time
    for redo, extra in ((None, int(199.0 / estimate(plan, w, c).step_time)), (0, 0), (3, 3)):
        tr = Trace((TraceEvent(199.0, "fail", (1,), redo_steps=redo),), 1000)
        t, kind, chosen, step, transition = run(job, tr, ("restart",), mttf_s=1000)["restart"].decisions[0]
        assert chosen == "restart" and transition == pytest.approx(RESTART + extra * best), redo
    ev = TraceEvent(5.0, "fail", (2,), redo_steps=4)
    assert TraceEvent.from_json(ev.to_json()) == ev and "redo_steps" not in TraceEvent(5.0, "fail", (2,)).to_json()
    with pytest.raises(ValueError, match="redo_steps"):
        TraceEvent(5.0, "join", (2,), redo_steps=1)


def test_a_policy_that_rebalances_moves_microbatches_off_a_slow_device(job):
    """``rebalance`` (the live pipeline jobs' adaptive engine and always-reroute): a device 4x
    slow gets fewer micro-batches from the selector's straggler Decision, nothing moves; the
    others keep running the slowed plan."""
    tr = Trace((TraceEvent(100, "slow", (6,), 4.0),), 1000)
    res = run(job, tr, ("adaptive", "engine-reroute", "engine-replan"), mttf_s=1000,
              rebalance=("adaptive", "engine-reroute"))
    for name in ("adaptive", "engine-reroute"):
        (t, kind, chosen, step, trans), = res[name].decisions
        assert (t, kind, chosen) == (100, "slow", "rebalance") and trans == pytest.approx(0.0), name
    assert res["engine-replan"].decisions[0][2] == "keep"
    kept, moved = res["engine-replan"], res["adaptive"]
    assert moved.decisions[0][3] < kept.decisions[0][3]  # the rebalanced step is shorter
    assert moved.throughput > 1.2 * kept.throughput
    assert res["engine-reroute"].throughput == pytest.approx(moved.throughput)


def test_torchrun_relaunches_its_layout_with_a_straggler_in_its_slot(job):
    """The restart baseline (torchrun) knows no device speeds: relaunched on all its devices, a
    4x slow one keeps its slot and its micro-batches -- no plan search around it."""
    w, c, plan = job
    tr = Trace((TraceEvent(50, "slow", (6,), 4.0), TraceEvent(100, "fail", (1,)), TraceEvent(100.001, "join", (1,))), 1000)
    r = run(job, tr, ("restart",), mttf_s=1000)["restart"]
    step = r.decisions[-1][3]
    slowed = c.with_speeds({6: c[6].speed / 4})
    assert step == pytest.approx(estimate(plan, w, slowed, Coefficients()).step_time)
    assert step > plan_search(w, slowed, Coefficients(), SearchSpace(), base=plan).best.estimate.step_time
