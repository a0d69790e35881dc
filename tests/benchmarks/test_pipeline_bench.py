"""The pipeline benchmark's figures from a small synthetic event log (pure: no processes, no timing)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import pipeline_bench as pb  # noqa: E402


def stamps(times, first=1):
    return [[first + i, t] for i, t in enumerate(times)]


def test_rate_and_median_interval():
    s = stamps([0.0, 1.0, 2.0, 3.0, 5.0])
    assert pb.rate(s) == pytest.approx(4 / 5)
    assert pb.rate(s, skip=1) == pytest.approx(3 / 4)
    assert pb.rate(s, after=2.5) == pytest.approx(1 / 2)
    assert pb.rate(s, after=3.5) is None  # one stamp left
    assert pb.rate(s, after=0.5) == pytest.approx(3 / 4)
    assert pb.median_interval(s) == pytest.approx(1.0)
    assert pb.median_interval(s, lo=2.5) == pytest.approx(2.0)
    assert pb.median_interval([]) is None


def synthetic():
    """8 workers, 1 step/s; worker 1 killed at t=10.5; steps resume at t=12 at 7/8 speed...
    here 0.8 steps/s; a re-plan moved 3000 bytes between t=11 and 11.8."""
    before = [float(t) for t in range(0, 11)]  # steps 1..11 at t=0..10
    after = [12.0 + 1.25 * i for i in range(10)]
    st = stamps(before + after)
    events = [
        {"event": "step", "ts": 5.0, "step": 5},
        {"event": "decision", "ts": 11.0, "decision": {
            "chosen": "replan",
            "candidates": [
                {"policy": "reroute", "feasible": True, "step_time_s": 1.9, "score": 30.0, "reason": ""},
                {"policy": "replan", "feasible": True, "step_time_s": 1.2, "score": 50.0, "reason": "",
                 "plan": "1x PP3 + 1x PP4 on 7 devices", "extra_microbatches": None}]}},
        {"event": "migration", "ts": 0.2, "step": 0, "phase": "end", "bytes": 999, "transfers": 7, "rounds": 7},
        {"event": "migration", "ts": 11.1, "step": 11, "phase": "start", "rounds": [[[0, 2, 2, 3]]]},
        {"event": "migration", "ts": 11.5, "step": 11, "phase": "end", "bytes": 1000, "transfers": 1,
         "rounds": 2, "predicted_bytes": 3000, "predicted_s": 0.01, "seconds": 0.4},
        {"event": "migration", "ts": 11.8, "step": 11, "phase": "end", "bytes": 2000, "transfers": 2,
         "rounds": 2, "predicted_bytes": 3000, "predicted_s": 0.01, "seconds": 0.7},
        {"event": "migration", "ts": 11.6, "step": 11, "phase": "end", "bytes": 0, "transfers": 0,
         "rounds": 2, "predicted_bytes": 3000, "predicted_s": 0.01, "seconds": 0.5},
        {"event": "recovery", "ts": 12.0, "mttr": {"detect": 0.9, "membership": 0.1, "rebuild": 0.05,
                                                     "state_transfer": 0.7, "first_step": 0.35}},
    ]
    predicted = [[5, 0.9, "2x PP4 on 8 devices"], [11, 0.95, "2x PP4 on 8 devices"],
                 [12, 1.1, "1x PP3 + 1x PP4 on 7 devices"]]
    return events, st, predicted


def test_kill_metrics_from_a_synthetic_log():
    events, st, predicted = synthetic()
    m = pb.kill_metrics(events, st, t_kill=10.5, ff_rate=1.0, world=8, settle=2, warmup=3,
                        predicted=predicted)
    assert m["mttr_s"] == pytest.approx(1.5)
    assert m["mttr_log_s"] == pytest.approx(1.5)
    assert m["breakdown"]["state_transfer"] == pytest.approx(0.7)
    # Noticed 0.3 s after the kill, although the member's detect phase (from its step start) is 0.9.
    assert m["noticed_s"] == pytest.approx(0.3)
    # Only the migration after the kill counts; the start-up one (step 0) does not.
    assert m["migration"]["bytes"] == 3000 and m["migration"]["transfers"] == 3
    assert m["migration"]["predicted_bytes"] == 3000 and m["migration"]["rounds"] == 2
    assert m["to_new_layout_s"] == pytest.approx(1.3)  # the last member that moved state
    assert m["decision"]["chosen"] == "replan"
    assert m["decision"]["predicted_step_s"] == pytest.approx(1.2)
    assert m["decision"]["candidates"]["reroute"]["step_time_s"] == pytest.approx(1.9)
    assert m["predicted_ff_step_s"] == pytest.approx(0.95)  # the last prediction before the kill
    assert m["ff_plan"] == "2x PP4 on 8 devices" and m["plan_after"].startswith("1x PP3")
    assert m["measured_step_before_s"] == pytest.approx(1.0)
    assert m["measured_step_after_s"] == pytest.approx(1.25)
    assert m["rate_after"] == pytest.approx(0.8)
    assert m["efficiency"] == pytest.approx(0.8 / (7 / 8))
    assert m["efficiency_in_run"] == pytest.approx(0.8 / (7 / 8))


def test_kill_metrics_without_a_recovery():
    """A run that never committed after the kill: no MTTR, no efficiency -- and no crash."""
    st = stamps([0.0, 1.0, 2.0])
    m = pb.kill_metrics([], st, t_kill=5.0, ff_rate=None)
    assert m["mttr_s"] is None and m["efficiency"] is None and m["to_new_layout_s"] is None
    assert "decision" not in m and m["migration"]["bytes"] == 0


def test_markdown_has_the_command_the_mode_and_a_row_per_kill():
    events, st, predicted = synthetic()
    m = pb.kill_metrics(events, st, 10.5, 1.0, predicted=predicted)
    res = {"command": "python benchmarks/pipeline_bench.py --repeats 1", "date": "d", "machine": "m",
           "wall_s": 1.0, "notes": ["a note"],
           "config": {"block_sleep": 0.004, "global_batch": 64, "micro_batch": 4, "victim": 1,
                      "kill_step": 10, "kill_steps": 36, "settle": 2},
           "overhead": {"baseline": 2.0, "ft": 1.9, "ratio": 0.95, "rates": {"baseline": [2.0], "ft": [1.9]}},
           "kills": [{"allowed": "replan", "run": 0, "metrics": m}]}
    md = pb.markdown(res)
    assert "`python benchmarks/pipeline_bench.py --repeats 1`" in md
    assert md.count("accelerator emulation") >= 3  # the header and every table's title
    assert "| {replan} | replan | 1500 ms |" in md
    assert "0.950" in md and "a note" in md


def test_straggler_page_reads_worker_0s_straggler_decisions_and_ratios():
    import pipeline_straggler as ps

    def decision(step, chosen, mbs, worker=0, kind="straggler"):
        plan = {"pipelines": [{"devices": [0, 1, 2, 3], "bounds": [0, 2, 4, 6, 8], "microbatches": mbs[0]},
                              {"devices": [4, 5, 6, 7], "bounds": [0, 2, 4, 6, 8], "microbatches": mbs[1]}]}
        return {"event": "decision", "worker": worker, "step": step, "decision": {
            "event": {"kind": kind, "devices": [5], "slowdown": 3.5, "detail": "slow"}, "chosen": chosen,
            "candidates": [{"policy": "keep", "feasible": True, "step_time_s": 3.0, "plan": plan},
                           {"policy": chosen, "feasible": True, "step_time_s": 2.0, "plan": plan}]}}
    evs = [decision(11, "rebalance", (12, 4)), decision(11, "rebalance", (12, 4), worker=3),
           decision(20, "reroute", (8, 8), kind="fail_stop"), {"event": "step", "worker": 0}]
    got = ps.straggler_decisions(evs)
    assert [(d["step"], d["chosen"], d["microbatches"]) for d in got] == [(11, "rebalance", [12, 4])]
    res = {"command": "c", "date": "d", "machine": "m",
           "config": {"block_sleep": 0.01, "global_batch": 64, "micro_batch": 4, "slow": "5:4:5", "tail": 20, "steps": 50},
           "runs": [{"system": "torch", "rate": 0.5, "decisions": []},
                    {"system": "ft", "rate": 0.8, "decisions": got},
                    {"system": "keep", "rate": 0.4, "decisions": []}]}
    text = ps.markdown(res)
    assert "Rebalance on / off: **2.000x** steps/s; on / torch: **1.600x**" in text
    assert "11: rebalance [12, 4] (3.50x, devices [5])" in text
