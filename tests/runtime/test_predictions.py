"""PredictionTracker: the chosen candidate's predicted step and transition beside what the job
then measured (pure Python; no processes)."""

from __future__ import annotations

import json

import pytest

from chameleon_ft.runtime.predictions import PredictionTracker


def decision(chosen="replan", step_s=1.2, transition_s=2.0, event="fail_stop", **extra):
    return {
        "event": event, "chosen": chosen, "mttf_s": 3600.0,
        "candidates": [
            {"policy": "reroute", "feasible": True, "step_time_s": 1.5, "transition_s": 0.1, "score": 0.6},
            {"policy": "replan", "feasible": True, "step_time_s": step_s, "transition_s": transition_s,
             "score": 0.8, "breakdown": {"compute": 1.0}},
            {"policy": "restart", "feasible": False, "step_time_s": None, "transition_s": None, "score": 0.0},
        ],
        **extra,
    }


MTTR = {"detect": 3.0, "agree": 0.7, "rebuild": 0.5, "state_transfer": 1.0}


def run(tracker, commits):
    """Commit (step, time) pairs in order; the list of what each commit returned."""
    return [tracker.commit(s, t) for s, t in commits]


def test_record_after_n_intervals_skipping_the_first():
    tr = PredictionTracker(steps=3)
    tr.start(10, [decision()], MTTR, now=100.0)
    assert tr.commit(10, 100.0) is None  # the recovery's own commit: not an interval
    # 100 -> 105: the first interval (warm-up, recovery tail) is skipped
    out = run(tr, [(11, 105.0), (12, 106.0), (13, 107.5), (14, 108.5)])
    assert out[:3] == [None, None, None]
    rec = out[3]
    assert rec is not None
    assert rec["measured_step_s"] == pytest.approx(1.0)  # median of 1.0, 1.5, 1.0
    assert rec["steps_measured"] == 3
    assert rec["predicted_step_s"] == 1.2
    assert rec["step_error"] == pytest.approx(1.2 / 1.0 - 1)
    assert rec["measured_transition_s"] == pytest.approx(0.5 + 1.0)  # rebuild + state transfer
    assert rec["predicted_transition_s"] == 2.0
    assert rec["transition_error"] == pytest.approx(2.0 / 1.5 - 1)
    assert rec["chosen"] == "replan" and rec["decision_step"] == 10
    assert rec["decision_event"] == "fail_stop" and rec["mttf_s"] == 3600.0
    assert rec["mttr"] == MTTR and "commits" not in rec
    assert rec["candidates"] == {
        "reroute": {"feasible": True, "step_time_s": 1.5, "transition_s": 0.1, "score": 0.6},
        "replan": {"feasible": True, "step_time_s": 1.2, "transition_s": 2.0, "score": 0.8},
        "restart": {"feasible": False, "step_time_s": None, "transition_s": None, "score": 0.0},
    }
    json.dumps(rec)  # the event log writes it
    # one record per decision
    assert tr.commit(15, 109.5) is None


def test_median_of_an_even_count_and_a_negative_error():
    tr = PredictionTracker(steps=4)
    tr.start(0, [decision(step_s=0.5)], MTTR, now=0.0)
    out = run(tr, [(1, 10.0), (2, 11.0), (3, 13.0), (4, 14.0), (5, 15.0)])
    rec = out[-1]
    assert out[:-1] == [None] * 4
    assert rec["measured_step_s"] == pytest.approx(1.0)  # median(1, 2, 1, 1)
    assert rec["step_error"] == pytest.approx(-0.5)


def test_missing_mttr_phases_give_no_transition_error():
    tr = PredictionTracker(steps=1)
    tr.start(0, [decision()], {"detect": 1.0}, now=0.0)
    rec = run(tr, [(1, 1.0), (2, 3.0)])[-1]
    assert rec["measured_transition_s"] == 0.0
    assert rec["transition_error"] is None
    assert rec["step_error"] == pytest.approx(1.2 / 2.0 - 1)


def test_the_last_decision_with_candidates_is_tracked():
    tr = PredictionTracker(steps=1)
    first = decision(chosen="reroute", event="fail_stop")
    second = decision(chosen="replan", step_s=0.9, event="join")
    tr.start(3, [first, second, {"event": "note", "chosen": "keep", "candidates": []}], MTTR, now=0.0)
    rec = run(tr, [(4, 1.0), (5, 2.0)])[-1]
    assert rec["chosen"] == "replan" and rec["decision_event"] == "join"
    assert rec["predicted_step_s"] == 0.9


def test_cancel_drops_the_open_record():
    tr = PredictionTracker(steps=2)
    tr.start(0, [decision()], MTTR, now=0.0)
    assert run(tr, [(1, 1.0), (2, 2.0)]) == [None, None]
    tr.cancel()
    assert run(tr, [(3, 3.0), (4, 4.0), (5, 5.0), (6, 6.0)]) == [None] * 4


def test_a_new_start_replaces_the_open_record():
    tr = PredictionTracker(steps=1)
    tr.start(0, [decision(step_s=5.0)], MTTR, now=0.0)
    tr.commit(1, 1.0)
    tr.start(2, [decision(step_s=2.0)], MTTR, now=2.0)
    assert tr.commit(2, 2.0) is None
    assert tr.commit(3, 10.0) is None  # first interval after the new start: skipped
    rec = tr.commit(4, 14.0)
    assert rec["decision_step"] == 2 and rec["predicted_step_s"] == 2.0
    assert rec["measured_step_s"] == pytest.approx(4.0)


@pytest.mark.parametrize("decisions", [
    [],
    [{"event": "fail_stop", "chosen": "reroute"}],  # no candidates
    [{"event": "fail_stop", "chosen": "reroute", "candidates": []}],
    [decision(chosen="wait")],  # the chosen candidate is not among them
    [decision(chosen="restart")],  # the chosen candidate has no step time
    [{"chosen": "replan", "candidates": [{"policy": "replan", "feasible": True}]}],  # no step_time_s key
], ids=["none", "no-candidates", "empty-candidates", "chosen-missing", "no-step-time", "no-step-key"])
def test_decisions_without_a_measurable_choice_give_no_record(decisions):
    tr = PredictionTracker(steps=1)
    tr.start(0, decisions, MTTR, now=0.0)
    assert run(tr, [(s, float(s)) for s in range(1, 6)]) == [None] * 5


def test_start_without_a_measurable_choice_closes_an_open_record():
    tr = PredictionTracker(steps=1)
    tr.start(0, [decision()], MTTR, now=0.0)
    tr.start(1, [], MTTR, now=1.0)
    assert run(tr, [(s, float(s)) for s in range(2, 6)]) == [None] * 4


def test_no_step_error_when_the_commits_took_no_time():
    tr = PredictionTracker(steps=2)
    tr.start(0, [decision()], MTTR, now=5.0)
    rec = run(tr, [(1, 6.0), (2, 6.0), (3, 6.0)])[-1]
    assert rec["measured_step_s"] == 0.0 and rec["step_error"] is None
