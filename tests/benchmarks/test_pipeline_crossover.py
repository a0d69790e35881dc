"""The crossover and accuracy figures of the pipeline benchmark, from synthetic runs (pure)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import pipeline_crossover as xo  # noqa: E402

B = 64


def run(t_dec: float, transition: float, step: float, pred_step: float, pred_trans: float, policy: str,
        end: float = 60.0) -> dict:
    """Steps every ``step`` s from ``t_dec + transition`` on; one decision at ``t_dec``."""
    stamps, t, k = [], t_dec + transition, 1
    before = [[i, t_dec - 0.5 * (10 - i)] for i in range(10)]
    while t <= t_dec + end:
        stamps.append([10 + k, t])
        k += 1
        t += step
    cands = [{"policy": "reroute", "feasible": True, "step_time_s": 1.5, "transition_s": 0.2},
             {"policy": "replan", "feasible": True, "step_time_s": 1.0, "transition_s": 2.2}]
    for c in cands:
        if c["policy"] == policy:
            c["step_time_s"], c["transition_s"] = pred_step, pred_trans
    events = [{"event": "decision", "ts": t_dec,
               "decision": {"event": {"kind": "fail_stop"}, "chosen": policy, "candidates": cands}}]
    return {"stamps": before + stamps, "events": events}


def test_goodput_curve_counts_samples_after_the_decision():
    r = run(100.0, 1.0, 0.5, 0.5, 1.0, "reroute", end=10)
    g = xo.goodput_curve(r["stamps"], 100.0, B, [0.99, 2.0, 5.0, 20.0])
    assert g[0] == 0.0  # nothing committed before the transition ends
    assert g[1] == pytest.approx(B * 3 / 2.0)  # commits at 101.0, 101.5, 102.0
    assert g[2] == pytest.approx(B * 9 / 5.0)
    assert g[3] is None  # the run ended before


def test_measured_crossover_matches_the_analytic_one():
    # reroute: 1.5 s steps after 0.2 s; replan: 1.0 s after 2.2 s -> D* = (2.2 - 0.2/1.5) / (1 - 1/1.5) = 6.2 s
    runs = {"reroute": run(50.0, 0.2, 1.5, 1.5, 0.2, "reroute"),
            "replan": run(80.0, 2.2, 1.0, 1.0, 2.2, "replan")}
    curves = xo.analyse(runs, B, xo.log_grid(0.5, 50.0, 60))
    assert curves["d_star_predicted"] == pytest.approx(6.2)
    # Discrete steps make the measured curves saw-toothed: within two step times.
    assert curves["d_star_measured"] == pytest.approx(6.2, abs=3.0)
    assert xo.ordering_agrees(curves, 1.5) is True  # short D: reroute ahead, as predicted
    assert xo.ordering_agrees(curves, 30.0) is True  # long D: replan ahead
    assert xo.goodput_curve_at(curves, "replan", 1.0) == 0.0
    assert xo.ordering_agrees(curves, 0.15) is None  # neither committed a step yet: a tie


def test_predicted_crossover_from_two_fixed_runs():
    # Each fixed run priced only its own policy: D* from the two chosen candidates.
    runs = {"reroute": run(50.0, 0.2, 1.5, 1.5, 0.2, "reroute"),
            "replan": run(80.0, 2.2, 1.0, 1.0, 2.2, "replan")}
    for name, other in (("reroute", "replan"), ("replan", "reroute")):
        for c in runs[name]["events"][0]["decision"]["candidates"]:
            if c["policy"] == other:
                c["feasible"] = False
    curves = xo.analyse(runs, B, xo.log_grid(0.5, 50.0, 20))
    assert curves["reroute"]["d_star_predicted"] is None
    assert curves["d_star_predicted"] == pytest.approx(6.2)


def test_crossover_point_edges():
    ds = [1.0, 2.0, 3.0, 4.0]
    assert xo.crossover_point(ds, [5, 5, 5, 5], [1, 2, 6, 7]) == pytest.approx(2.75)
    assert xo.crossover_point(ds, [5, 5, 5, 5], [1, 2, 3, 4]) is None  # never pays
    assert xo.crossover_point(ds, [1, 1, 1, 1], [2, 2, 2, 2]) is None  # pays from the start
    assert xo.crossover_point(ds, [5, 5, None, None], [1, 6, None, None]) == pytest.approx(1.8)


def test_ordering_disagrees_when_the_prediction_is_wrong():
    # The engine thinks re-planning steps at 1.0 s; the run measures 1.6 s (slower than reroute).
    runs = {"reroute": run(50.0, 0.2, 1.5, 1.5, 0.2, "reroute"),
            "replan": run(80.0, 2.2, 1.6, 1.0, 2.2, "replan")}
    curves = xo.analyse(runs, B, xo.log_grid(0.5, 50.0, 40))
    assert curves["d_star_measured"] is None
    assert xo.ordering_agrees(curves, 40.0) is False


def test_accuracy_summary():
    recs = [{"step_error": 0.02, "transition_error": -0.3}, {"step_error": -0.04, "transition_error": None},
            {"step_error": 0.10, "transition_error": 0.1}]
    acc = xo.accuracy(recs)
    assert acc["step"] == {"n": 3, "median": pytest.approx(0.04), "max": pytest.approx(0.10)}
    assert acc["transition"]["n"] == 2 and acc["transition"]["max"] == pytest.approx(0.3)


def test_markdown_and_plots(tmp_path):
    runs = {"reroute": run(50.0, 0.2, 1.5, 1.5, 0.2, "reroute"),
            "replan": run(80.0, 2.2, 1.0, 1.0, 2.2, "replan")}
    curves = xo.analyse(runs, B, xo.log_grid(0.5, 50.0, 20))
    recs = [{"run": "r", "chosen": "replan", "predicted_step_s": 1.0, "measured_step_s": 1.02, "step_error": -0.02,
             "predicted_transition_s": 2.2, "measured_transition_s": 2.0, "transition_error": 0.1}]
    md = "\n".join(xo.markdown(curves, [{"mttf": 2.0, "chosen": "reroute", "d_star": 6.0,
                                         "goodput": {"reroute": 30.0, "replan": 10.0}, "agrees": True}], recs, "emu"))
    assert "predicted D\\* = **6.20 s**" in md and "| 2 s | reroute | 6.0 s | 30.0 / 10.0 | True |" in md
    assert "| step time | 1 | 2.0 % | 2.0 % |" in md
    xo.plot_crossover(curves, tmp_path / "x.png", "t")
    xo.plot_accuracy(recs, tmp_path / "a.png", "t")
    assert (tmp_path / "x.png").stat().st_size > 1000 and (tmp_path / "a.png").stat().st_size > 1000


def test_every_system_at_the_same_d():
    """The adaptive runs' D given to each fixed policy too: goodput over D after each run's own
    decision, the ratio to the better fixed one and the plans chosen."""
    ad, rr, rp = (run(10.0, 0.6, 0.8, 0.8, 0.6, "replan"), run(10.0, 0.2, 1.5, 1.5, 0.2, "reroute"),
                  run(10.0, 3.0, 0.8, 0.8, 3.0, "replan"))
    ad["events"][0]["decision"]["candidates"][1]["plan"] = {"pipelines": [{"devices": [4, 5, 6, 7]}, {"devices": [0, 2, 3]}]}
    g = {n: xo.goodput_over(r["stamps"], r["events"], B, 8.0) for n, r in (("adaptive", ad), ("reroute", rr), ("replan", rp))}
    assert g["adaptive"] == pytest.approx(B * 10 / 8.0)  # commits at 10.6, 11.4, ... <= 18.0
    assert g["reroute"] == pytest.approx(B * 6 / 8.0) and g["replan"] == pytest.approx(B * 7 / 8.0)
    assert xo.goodput_over(rr["stamps"], [], B, 8.0) is None  # no decision
    summary = xo.plan_summary(xo.decision_of(ad["events"]))
    assert summary == {"policy": "replan", "pipelines": [[4, 5, 6, 7], [0, 2, 3]], "step_s": 0.8,
                       "transition_s": 0.6, "score": None}
    at_d = {**g, "adaptive_decision": summary, "replan_decision": xo.plan_summary(xo.decision_of(rp["events"]))}
    md = "\n".join(xo.markdown(None, [{"mttf": 8.0, "factor": 1.3, "chosen": "replan", "d_star": 6.0,
                                        "goodput": {}, "agrees": None, "at_d": at_d}], [], "emu"))
    assert "| 8 s (1.3 x predicted D*) | 80.0 | 48.0 | 56.0 | 1.43 | replan [[4, 5, 6, 7], [0, 2, 3]], transition 0.60 s |" in md
