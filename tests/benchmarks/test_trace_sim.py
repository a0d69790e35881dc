"""The trace benchmark's run -> simulator bridge (pure: a synthetic result with a real engine's
calibration record; no processes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "runtime"))

import trace_sim  # noqa: E402
from test_policy_calibration import calibrated_policy  # noqa: E402


def synthetic_result() -> dict:
    pol = calibrated_policy()
    cal = {"event": "calibration", "ts": 105.0, **json.loads(json.dumps(pol.calibration_json()))}
    stamps = [[s, 100.0 + 0.5 * s] for s in range(1, 121)]
    faults = [{"step": 30, "kind": "kill", "worker": 1, "t": 115.2},
              {"step": 80, "kind": "slow", "worker": 6, "factor": 2.0, "t": 140.1}]
    join = {"event": "decision", "ts": 125.0, "decision": {"event": {"kind": "join", "devices": [1]},
                                                          "chosen": "heal", "mttf_s": 900.0}}
    fail = {"event": "decision", "ts": 115.9, "decision": {"event": {"kind": "fail_stop", "devices": [1]},
                                                          "chosen": "wait", "mttf_s": 900.0}}
    adaptive = {"stamps": stamps, "faults": faults, "events": [cal, fail, join], "metrics": {"throughput": 30.0}}
    restart = {"stamps": stamps, "faults": faults, "events": [],
               "metrics": {"throughput": 20.0, "ff_steps_per_s": 2.0,
                           "faults": [{"kind": "kill", "mttr_s": 30.0}, {"kind": "kill", "mttr_s": 34.0}]}}
    return {"trace": {"name": "synthetic"}, "config": {"warmup": 5, "ckpt_every": 10},
            "systems": {"adaptive": adaptive, "reroute": {"metrics": {"throughput": 28.0}},
                        "replan": {"metrics": {"throughput": 29.0}}, "restart": restart}}


def test_setup_from_run_takes_the_calibrated_job_and_the_measured_trace():
    res = synthetic_result()
    setup = trace_sim.setup_from_run(res)
    t0 = 100.0 + 0.5 * 5  # the first commit after warm-up
    evs = [(e.kind, e.devices, round(e.t_s, 3)) for e in setup.trace.events]
    assert evs == [("fail", (1,), round(115.2 - t0, 3)), ("join", (1,), round(125.0 - t0, 3)),
                   ("slow", (6,), round(140.1 - t0, 3))]
    assert setup.trace.horizon_s == pytest.approx(160.0 - t0)
    assert setup.replacement_eta_s == pytest.approx(125.0 - 115.2)
    assert setup.restart_s == pytest.approx(32.0)  # median of the torchrun MTTRs
    assert setup.checkpoint_every_s == pytest.approx(10 * 0.5)
    assert setup.mttf_s == 900.0
    pol = calibrated_policy()
    assert setup.workload == pol.workload()  # the engine's own inputs, as calibrated
    assert setup.cluster.devices[2].speed == pytest.approx(0.5)
    assert setup.coefficients == pol.coefficients()


def test_compare_rows_and_markdown():
    cmp = trace_sim.compare(synthetic_result())
    rows = {(r["devices"], r["policy"]): r for r in cmp["rows"]}
    assert set(rows) == {(n, p) for n in (8, 32) for p in ("adaptive", "reroute", "replan", "restart", "redundant")}
    assert rows[(8, "adaptive")]["measured"] == 30.0 and "measured" not in rows[(32, "adaptive")]
    for r in cmp["rows"]:
        assert r["simulated"] > 0
    # Every policy faces the same fail and join; the simulated adaptive is never below both
    # fixed policies by more than noise-free rounding (the engine picks the best-scored).
    for n in (8, 32):
        assert rows[(n, "adaptive")]["simulated"] >= min(rows[(n, "reroute")]["simulated"],
                                                         rows[(n, "replan")]["simulated"]) - 1e-9
    md = "\n".join(trace_sim.markdown(cmp, "emulation"))
    assert "| 8 | adaptive |" in md and "| 32 | redundant |" in md and "adaptive / better fixed" in md


def test_the_restart_row_replays_its_own_run_and_relaunch():
    """torchrun's run: its own fault times and span, the killed worker back with the relaunch
    (one restart, not two), and the relaunch is its MTTR less the steps it redid."""
    res = synthetic_result()
    rs = res["systems"]["restart"]
    rs["stamps"] = [[s, 100.0 + 0.5 * s] for s in range(1, 34)] + [[s, 140.0 + 0.5 * s] for s in range(31, 121)]
    rs["faults"] = [{"step": 33, "kind": "kill", "worker": 1, "t": 116.6}]
    rs["metrics"]["faults"] = [{"kind": "kill", "mttr_s": 40.0, "t": 116.6}]
    res["trace"]["faults"] = [{"step": 33, "kind": "kill", "worker": 1, "replaced": True}]
    assert trace_sim.relaunch_seconds(rs, 10, 0.5) == [pytest.approx(40.0 - 3 * 0.5)]  # steps 31-33 redone
    own = trace_sim.setup_from_run(res, replay="restart")
    t0 = 100.0 + 0.5 * 5
    assert [(e.kind, round(e.t_s, 3)) for e in own.trace.events] == [("fail", round(116.6 - t0, 3)),
                                                                   ("join", round(116.6 - t0 + 1e-3, 3))]
    assert own.trace.horizon_s == pytest.approx(200.0 - t0)
    got = trace_sim.at_step_time(own, 0.5).run(devices=8, policies=("restart",))["restart"]  # torchrun's own step
    assert got.counts == {"restart": 1}
    row = next(r for r in trace_sim.compare(res)["rows"] if (r["devices"], r["policy"]) == (8, "restart"))
    assert row["simulated"] == pytest.approx(got.throughput) and row["decisions"] == {"restart": 1}


def test_no_calibration_record_no_setup():
    res = synthetic_result()
    res["systems"]["adaptive"]["events"] = []
    assert trace_sim.setup_from_run(res) is None and trace_sim.compare(res) is None


def test_restart_is_the_engines_only_where_a_live_decision_found_it_feasible():
    res = synthetic_result()
    assert trace_sim.setup_from_run(res).engine_restart  # no candidates logged: not known, allowed
    fail = res["systems"]["adaptive"]["events"][1]["decision"]
    fail["candidates"] = [{"policy": "reroute", "feasible": True}, {"policy": "restart", "feasible": False}]
    assert trace_sim.engine_could_restart(res) is False
    assert trace_sim.setup_from_run(res).engine_restart is False
    assert trace_sim.setup_from_run(res).to_json()["settings"]["engine_restart"] is False
    fail["candidates"][1]["feasible"] = True
    assert trace_sim.setup_from_run(res).engine_restart


def test_a_replayed_kill_carries_its_steps_since_the_torchrun_checkpoint():
    res = synthetic_result()  # a kill after step 30, checkpoints every 10: nothing to redo
    fails = [e for e in trace_sim.setup_from_run(res).trace.events if e.kind == "fail"]
    assert [e.redo_steps for e in fails] == [0]
    res["systems"]["adaptive"]["faults"][0]["step"] = 37
    assert [e.redo_steps for e in trace_sim.setup_from_run(res).trace.events if e.kind == "fail"] == [7]
