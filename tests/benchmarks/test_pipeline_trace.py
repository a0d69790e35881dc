"""The pipeline failure-trace runner: its metrics on synthetic stamps and events (pure), the
trace/results JSON round trip, and one short real run (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import pipeline_trace as pt  # noqa: E402


def stamps(times, first=1):
    return [[first + i, t] for i, t in enumerate(times)]


def test_avg_throughput_counts_net_progress():
    st = stamps([float(t) for t in range(11)])  # steps 1..11 at 1 step/s
    assert pt.avg_throughput(st, batch=64) == pytest.approx(64.0)
    assert pt.avg_throughput(st, batch=64, warmup=6) == pytest.approx(64.0)
    # A restart: steps 6..11 committed at t=0..5, killed, steps 11..15 redone... net progress only.
    restart = [[s, float(s - 1)] for s in range(1, 11)] + [[s, 20.0 + s - 8] for s in range(8, 16)]
    # step 1 at t=0 -> step 15 at t=27: 14 steps in 27 s
    assert pt.avg_throughput(restart, batch=1) == pytest.approx(14 / 27)
    assert pt.avg_throughput([[1, 0.0]], batch=64) is None


def test_timeline_and_mttr():
    st = stamps([0.0, 1.0, 2.0, 3.0, 10.0, 11.0])
    tl = pt.timeline(st, batch=2, window=2)
    assert [round(r, 3) for _, r in tl] == [2.0, 2.0, 2 * 2 / 8, 2 * 2 / 8]
    assert pt.mttr(st, 3.5) == pytest.approx(6.5)
    # After a restart the first commits redo old steps: MTTR waits for a new one.
    redo = [[1, 0.0], [2, 1.0], [3, 2.0], [2, 9.0], [3, 10.0], [4, 11.0]]
    assert pt.mttr(redo, 2.5) == pytest.approx(8.5)
    assert pt.timeline(redo, batch=1, window=1)[2][1] == 0.0  # going back is no progress
    assert pt.mttr(st, 20.0) is None


def test_fault_metrics_gap_and_steady_rate():
    # 1 step/s, a kill at 10.5, recovery at 13, then 0.5 steps/s; a straggler at 30.5 -> 0.25 steps/s.
    times = [float(t) for t in range(11)] + [13.0 + 2 * i for i in range(9)] + [33.0 + 4 * i for i in range(5)]
    st = stamps(times)
    faults = [{"step": 11, "kind": "kill", "worker": 1, "t": 10.5}, {"step": 20, "kind": "slow", "worker": 6, "t": 30.5}]
    m = pt.fault_metrics(st, faults, ff_rate=1.0, settle=1)
    assert m[0]["mttr_s"] == pytest.approx(2.5)
    # A recovery event later than the first commit after the kill (a step that was all but done
    # still committed) bounds the MTTR; one after the next fault does not.
    assert pt.fault_metrics(st, faults, 1.0, 1, recoveries=[12.0, 31.0])[0]["mttr_s"] == pytest.approx(2.5)
    assert pt.fault_metrics(st, faults, 1.0, 1, recoveries=[14.0])[0]["mttr_s"] == pytest.approx(3.5)
    assert m[0]["rate_after"] == pytest.approx(0.5)
    assert m[0]["gap"] == pytest.approx(0.5)
    assert m[1]["mttr_s"] is None
    assert m[1]["rate_after"] == pytest.approx(0.25)
    assert m[1]["gap"] == pytest.approx(0.75)


def test_markers_dedupe_decisions_and_copy_calibration():
    cand = [{"policy": "reroute", "feasible": True, "step_time_s": 0.5, "score": 10.0, "reason": ""}]
    events = [
        {"event": "decision", "ts": 10.0, "decision": {"chosen": "reroute", "candidates": cand, "event": {"kind": "fail_stop"}}},
        {"event": "decision", "ts": 10.1, "decision": {"chosen": "reroute", "candidates": cand}},  # another member
        {"event": "decision", "ts": 30.0, "decision": {"chosen": "heal", "candidates": []}},
        {"event": "recovery", "ts": 11.0, "mttr": {"total": 1.0}},
        {"event": "migration", "ts": 0.5, "step": 0, "phase": "end", "bytes": 9},
        {"event": "migration", "ts": 31.0, "step": 40, "phase": "end", "bytes": 100},
        {"event": "calibration", "ts": 5.0, "coefficients": {"a": 1}},
        {"event": "prediction", "ts": 6.0, "step_time_s": 0.4},
        {"event": "step", "ts": 7.0, "step": 3},
    ]
    mk = pt.markers(events)
    assert [d["chosen"] for d in mk["decisions"]] == ["reroute", "heal"]
    assert mk["decisions"][0]["kind"] == "fail_stop"
    assert mk["decisions"][0]["candidates"][0]["step_time_s"] == 0.5
    assert len(mk["recoveries"]) == 1 and [m["bytes"] for m in mk["migrations"]] == [100]
    assert [e["event"] for e in mk["copied"]] == ["calibration", "prediction"]
    assert pt.decision_counts(mk["decisions"]) == {"reroute": 1, "heal": 1}


def test_system_metrics_and_ratios():
    ff = stamps([float(t) for t in range(20)])  # 1 step/s failure-free
    run = {"stamps": stamps([float(t) for t in range(11)] + [13.0 + 2 * i for i in range(9)]),
           "faults": [{"step": 11, "kind": "kill", "worker": 1, "t": 10.5}], "events": [],
           "restarts": [12.0]}
    m = pt.system_metrics(run, ff, batch=10, warmup=2, settle=1, window=2)
    assert m["ff_throughput"] == pytest.approx(10.0)
    assert m["decisions"][0]["chosen"] == "restart"
    assert m["faults"][0]["gap"] == pytest.approx(0.5)
    r = pt.ratios({"adaptive": {"throughput": 30.0}, "restart": {"throughput": 20.0}, "x": {"throughput": None}})
    assert r == {"adaptive": 1.0, "restart": 1.5, "x": None}


def test_traces_validate_and_round_trip(tmp_path):
    for tr in pt.TRACES.values():
        assert pt.Trace.from_json(json.loads(json.dumps(tr.to_json()))) == tr
        tr.replacements()
    real = pt.TRACES["realistic"]
    assert real.replacements() == 1 and real.slow_arg() == "6:2:80"
    bad = pt.Trace("bad", 50, (pt.Fault(10, "kill", 1), pt.Fault(20, "kill", 2, replaced=True)))
    with pytest.raises(ValueError):
        bad.replacements()


def test_results_json_renders_markdown_and_plot(tmp_path):
    ff = stamps([float(t) for t in range(20)])
    run = {"stamps": stamps([float(t) for t in range(11)] + [13.0 + 2 * i for i in range(9)]),
           "faults": [{"step": 11, "kind": "kill", "worker": 1, "t": 10.5}],
           "events": [{"event": "decision", "ts": 11.0, "decision": {"chosen": "reroute", "candidates": []}}]}
    a = pt.build_parser().parse_args(["--warmup", "2", "--settle", "1", "--window", "2"])
    res = {"command": "x", "date": "d", "machine": "m", "load": "0.1", "mode": pt.MODE,
           "config": vars(a), "trace": pt.TRACES["tiny"].to_json(), "wall_s": 1.0, "systems": {}}
    for s in ("adaptive", "restart"):
        res["systems"][s] = {"config": s, "completed": True, "error": None, "stamps": run["stamps"],
                             "faults": run["faults"], "metrics": pt.system_metrics(run, ff, 64, 2, 1, 2)}
    # --from-json recomputes from the stored events: a recovery logged 4 s after the kill bounds the MTTR.
    res["systems"]["adaptive"].update(ff_stamps=ff, events=run["events"] + [{"event": "recovery", "ts": 14.5}])
    res["ratios"] = pt.ratios({k: v["metrics"] for k, v in res["systems"].items()})
    path = tmp_path / "r.json"
    path.write_text(json.dumps(res))
    out = pt.run(["--from-json", str(path), "--plot", str(tmp_path / "p.png"), "--markdown", str(tmp_path / "t.md")])
    assert (tmp_path / "p.png").stat().st_size > 1000
    md = (tmp_path / "t.md").read_text()
    assert pt.MODE in md and "| adaptive (adaptive) | yes |" in md and "reroute" in md
    assert out["ratios"]["restart"] == pytest.approx(1.0)
    assert out["systems"]["adaptive"]["metrics"]["faults"][0]["mttr_s"] == pytest.approx(4.0)
    assert out["systems"]["restart"]["metrics"]["faults"][0]["mttr_s"] == pytest.approx(2.5)
    assert json.loads(path.read_text())["systems"]["adaptive"]["metrics"]["faults"][0]["mttr_s"] == pytest.approx(4.0)


@pytest.mark.slow
@pytest.mark.chaos
def test_tiny_trace_real_run(tmp_path):
    """8 real workers, 20 steps, worker 1 SIGKILLed at step 8, adaptive only, after a 12-step
    failure-free run: ~2.5 min on 2 loaded cores, hence a chaos run (``pytest -m chaos``)."""
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "pipeline_trace.py"), "--trace", "tiny",
                           "--systems", "adaptive", "--ff-steps", "12", "--warmup", "3", "--settle", "1",
                           "--json", str(out), "--plot", str(tmp_path / "p.png"), "--timeout", "300"],
                          cwd=root, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    s = res["systems"]["adaptive"]
    assert s["completed"] and max(st for st, _ in s["stamps"]) == 20
    kill = [f for f in s["metrics"]["faults"] if f["kind"] == "kill"]
    assert len(kill) == 1 and kill[0]["mttr_s"] is not None  # recovered: a new step after the kill
    assert s["metrics"]["throughput"] > 0 and s["metrics"]["ff_throughput"] > 0
    assert s["metrics"]["decisions"] and s["metrics"]["timeline"]


def test_why_lines_count_the_decisions_where_a_fixed_system_differs():
    def dec(chosen, kind="fail_stop", cands=()):
        return {"ts": 0.0, "chosen": chosen, "kind": kind,
                "candidates": [{"policy": p, "feasible": True, "score": sc} for p, sc in cands]}
    res = {"systems": {
        "adaptive": {"metrics": {"decisions": [dec("replan", cands=[("replan", 150.0), ("reroute", 80.0)]),
                                               dec("reroute", cands=[("replan", 90.0), ("reroute", 110.0)])]}},
        "replan": {"metrics": {"decisions": [dec("replan"), dec("replan")]}},
        "reroute": {"metrics": {"decisions": [dec("reroute")]}},
        "restart": {"metrics": {"decisions": [dec("restart")]}}}}
    rows = pt.choice_rows(res)
    assert [r["fixed"] for r in rows] == [{"replan": "replan", "reroute": "reroute"},
                                         {"replan": "replan", "reroute": None}]
    text = "\n".join(pt.why_lines(res))
    assert "adaptive chose **replan** (scores replan 150, reroute 80)" in text
    assert "always-replan chose differently at 1 of 2 decisions" in text
    assert "always-reroute chose differently at 2 of 2 decisions" in text
    assert pt.why_lines({"systems": {}}) == []
