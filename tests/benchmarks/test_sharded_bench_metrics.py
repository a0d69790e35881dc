"""The sharded matrix's figures from synthetic loss curves (pure functions of
``benchmarks/sharded_matrix.py``)."""

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import sharded_matrix as sm  # noqa: E402


def curve(n=64, lag=0.0, start=0):
    """loss(s) = exp(-0.03 (s - lag)): a run ``lag`` steps behind from ``start`` on."""
    return {s: math.exp(-0.03 * (s - (lag if s > start else 0.0))) for s in range(1, n + 1)}


def test_the_lag_of_a_run_behind_by_two_steps_is_two():
    ref = curve()
    est = sm.lag_estimate(curve(lag=2.0, start=20), ref, 20, 16)
    assert est["slope"] == pytest.approx(-0.03) and est["lag"] == pytest.approx(2.0) and est["informative"]
    assert sm.measured_lag(ref, ref, 20, 16) == pytest.approx(0.0)
    flat = {s: 1.0 for s in range(1, 65)}  # no slope: not measured
    assert sm.measured_lag(flat, flat, 20, 16) is None


def test_on_a_noisy_plateau_the_lag_is_not_defined_and_a_noisy_slope_cannot_tell():
    # Seen in the MLP cells: a flat, noisy loss made the old local-slope lag swing by +-10 steps.
    import random

    rng = random.Random(0)
    noise = {s: rng.gauss(0.0, 0.05) for s in range(1, 65)}
    ref = {s: math.exp(noise[s]) for s in range(1, 65)}
    run = {s: math.exp(noise[s] + (0.01 if s > 36 else 0.0)) for s in range(1, 65)}
    est = sm.lag_estimate(run, ref, 36, 16)
    assert est["plateau"] and est["lag"] is None and est["gap"] == pytest.approx(0.01)
    # a run two steps behind: on a shallow slope under the same noise measured but too
    # uncertain to test a prediction; on a steeper one measured and told apart
    for slope, told in ((0.006, False), (0.02, True)):
        ref2 = {s: math.exp(-slope * s + noise[s]) for s in range(1, 65)}
        run2 = {s: ref2[s] * math.exp(2 * slope if s > 36 else 0.0) for s in range(1, 65)}
        est2 = sm.lag_estimate(run2, ref2, 36, 16)
        assert est2["lag"] == pytest.approx(2.0, abs=0.5) and est2["informative"] is told
        assert sm.agrees(2.0, est2["lag"], est2["informative"]) is (True if told else None)


def test_trajectory_keeps_each_steps_last_attempt():
    rows = [[1, 0.0, 5.0], [2, 1.0, 4.0], [3, 2.0, 3.0], [2, 3.0, 4.5], [3, 4.0, 3.5]]  # a rollback to 1
    assert sm.trajectory(rows) == {1: 5.0, 2: 4.5, 3: 3.5}


def test_agreement_and_kill_positions():
    assert sm.agrees(2.0, 1.1) and sm.agrees(2.0, 2.9) and not sm.agrees(2.0, 3.1) and not sm.agrees(2.0, 0.9)
    assert sm.agrees(0.5, 0.9) and sm.agrees(None, 1.0) is None
    assert sm.kill_positions(8) == [("first", "before the first snapshot", 7),
                                    ("early", "early", 9), ("early", "mid", 12), ("early", "late", 15),
                                    ("mid", "early", 33), ("mid", "mid", 36), ("mid", "late", 39),
                                    ("late", "early", 49), ("late", "mid", 52), ("late", "late", 55)]


def test_path_cost_and_the_engines_pick():
    ref = curve()
    rehab = {"chosen": "rehabilitate", "step": 20, "transfer_s": 0.2}
    cost = sm.path_cost(rehab, curve(lag=2.0, start=20), ref, step_s=0.1, k=8)
    assert cost["redone"] == 0 and cost["lag"] == pytest.approx(2.0)
    assert cost["lost_s"] == pytest.approx(2.0 * 0.1 + 0.2)
    rec = sm.path_cost({"chosen": "recompute", "step": 20, "rollback_to": 16, "transfer_s": 0.2}, ref, ref, 0.1, 8)
    assert rec["redone"] == 4 and rec["lost_s"] == pytest.approx(0.6)
    cell = {"auto": {**cost, "chosen": "rehabilitate", "fallback": False,
                     "candidates": {"recompute": {"steps": 4}}}}
    f = sm.figures(cell, step_s=0.1)
    assert f["recompute"]["lost_steps"] == 4 and f["recompute"]["lost_s"] == pytest.approx(0.6)
    assert f["ratio"] == pytest.approx(0.4 / 0.6) and f["engine_ok"]


def test_the_lag_is_measured_over_the_horizon_the_prediction_names():
    ref = curve()
    late = {s: v if s <= 28 else math.exp(-0.03 * (s - 2.0)) for s, v in ref.items()}  # 2 behind after 28
    d = {"chosen": "rehabilitate", "step": 20, "transfer_s": 0.0}
    assert sm.path_cost(d, late, ref, 0.1, k=8)["lag"] == pytest.approx(1.0)  # max(8, 2K) = 16: half of them
    assert sm.path_cost({**d, "heal_horizon": 8}, late, ref, 0.1, k=8)["lag"] == pytest.approx(0.0, abs=1e-9)


def test_reuse_keeps_only_runs_the_same_code_and_settings_finished(tmp_path, monkeypatch):
    # --reuse used to trust any finished run in the work dir, whatever code or settings made it.
    import chameleon_ft.cli.localjob as localjob

    class Ran(Exception):
        pass

    def no_job(*a, **kw):
        raise Ran()

    monkeypatch.setattr(localjob, "LocalJob", no_job)
    monkeypatch.setattr(sm, "REUSE", True)
    out = tmp_path / "run"
    with pytest.raises(Ran):  # nothing finished yet: it runs (and stamps the dir first)
        sm._run(out, "ours", "mlp", 0, None, kill=9)
    (out / "final_0.json").write_text(json.dumps({"loss": 1.0}))
    assert sm._run(out, "ours", "mlp", 0, None, kill=9) == {0: {"loss": 1.0}}  # same code, same settings
    with pytest.raises(Ran):  # other settings
        sm._run(out, "ours", "mlp", 0, None, kill=10)
    (out / "final_0.json").write_text(json.dumps({"loss": 1.0}))
    stamp = json.loads((out / sm.REUSE_STAMP).read_text())
    (out / sm.REUSE_STAMP).write_text(json.dumps({**stamp, "code": "another"}))
    with pytest.raises(Ran):  # other code
        sm._run(out, "ours", "mlp", 0, None, kill=10)
    (out / "final_0.json").write_text(json.dumps({"loss": 1.0}))
    (out / sm.REUSE_STAMP).unlink()
    with pytest.raises(Ran):  # a run from before the stamps
        sm._run(out, "ours", "mlp", 0, None, kill=10)


def test_the_controls_are_judged_as_the_rehabilitated_runs_and_merge_with_the_matrix():
    import sharded_controls as sc

    free = {f"ours-mlp-{s}": {"test_loss": x} for s, x in ((0, 1.00), (1, 1.02), (2, 1.04))}
    cell = {"engine": "ours", "kind": "mlp", "k_label": "default", "k": 8, "position": "mid", "interval": "late",
            "kill_step": 36, "seed": 2, "ref_test_loss": 1.04}
    cells = [{**cell, "auto": {"chosen": "rehabilitate", "fallback": False, "test_loss": 1.06}},
             {**cell, "kill_step": 39, "seed": 0, "auto": {"chosen": "rehabilitate", "fallback": False, "test_loss": 1.01}},
             {**cell, "seed": 1, "auto": {"chosen": "recompute", "fallback": False, "test_loss": 1.02}}]
    ctl = {"controls": [{"engine": "ours", "kind": "mlp", "seed": 2, "step": 36, "test_loss": 1.03},
                        {"engine": "ours", "kind": "mlp", "seed": 0, "step": 36, "test_loss": 0.99}],
           "controls_command": {"command": "python benchmarks/sharded_controls.py", "date": "d", "minutes": 1.0}}
    m = sm.merge([{"cells": cells, "free": free, "command": "c", "date": "d", "minutes": 1, "workdir": "w"}, ctl])
    assert m["controls"] == ctl["controls"] and len(m["cells"]) == 3
    by = sc.changes(m)[("ours", "mlp")]
    # (relative change against the seed's own failure-free loss, inside lo..hi, above the worst seed)
    assert by["control"] == [(pytest.approx(1.03 / 1.04 - 1), True, False, True), (pytest.approx(-0.01), False, False, True)]
    assert by["rehab"] == [(pytest.approx(1.06 / 1.04 - 1), False, True, True), (pytest.approx(0.01), True, False, True)]
    assert by["rehab_at"] == by["rehab"][:1]  # killed at a control's step, default interval
    text = "\n".join(sc.markdown(m))
    assert "| mlp (ElasticTrainer) | harmless change | 2 | 1 (50 %) | 0 | 2 |" in text
    assert "| mlp (ElasticTrainer) | rehabilitated, every kill | 2 | 1 (50 %) | 1 | 2 |" in text
    m["cells"][0]["auto"]["test_loss"] = 1.09  # a change of 0.05 against seed 2: over the spread's width (0.04)
    assert sc.changes(m)[("ours", "mlp")]["rehab"][0][3] is False
    assert sc.markdown({"cells": cells, "free": free}) == []  # no controls: no section
    assert sc.larger_p([0.1, 0.2, 0.3], [0.01, 0.02, 0.03]) < 0.06 < sc.larger_p([0.01, 0.02, 0.03], [0.1, 0.2, 0.3])


def test_the_report_counts_the_recomputes_the_end_lag_rule_made_and_what_they_cost():
    traj = {str(s): 1.0 for s in range(1, 65)}
    free = {f"ours-lm-{s}": {"test_loss": 1.0 + s / 100, "test_acc": 0.5, "step_s": 0.1, "traj": traj} for s in range(3)}
    base = {"engine": "ours", "kind": "lm", "k_label": "default", "k": 8, "position": "late", "interval": "late in the interval",
            "kill_step": 55, "ref_test_loss": 1.0}
    rec = {"chosen": "recompute", "fallback": False, "k": 8, "test_loss": 1.0, "lost_steps": 7, "lost_s": 0.9,
           "candidates": {"rehabilitate": {"feasible": False, "steps": 1.5, "reason": f"restoring rows [2] from step 48 "
                                           f"leaves a lag that {sm.END_RULE}: over 0.5 steps"},
                          "recompute": {"feasible": True, "steps": 7, "reason": "roll back"}}}
    forced = {"chosen": "rehabilitate", "fallback": False, "test_loss": 1.002, "lost_steps": 1.0, "lost_s": 0.2,
              "predicted_heal_steps": 1.0, "lag": 1.0, "informative": True}
    cells = [{**base, "seed": s, "auto": rec, "forced": forced} for s in range(3)]
    text = "\n".join(sm.markdown({"cells": cells, "free": free, "command": "c", "date": "d", "minutes": 1.0}))
    assert ("it recomputed 3 because rehabilitating would have left the run over half a step behind at its end "
            "(quality before time: `shard_recovery.HEALED_LAG`), 3 of them losing more time than the forced "
            "rehabilitation (+ one step), by a median 0.70 s.") in text


def test_a_later_invocations_rows_replace_an_earlier_ones_and_keep_who_made_them():
    def res(date, groups, test_loss):
        cells = [{"engine": e, "kind": k, "k_label": "default", "seed": 0, "auto": {"test_loss": test_loss}}
                 for e, k in groups]
        return {"cells": cells, "free": {f"{e}-{k}-0": {"test_loss": test_loss} for e, k in groups},
                "errors": [], "command": f"run {date}", "date": date, "minutes": 1.0, "workdir": "w"}

    old = sm.merge([res("d1", [("ours", "mlp"), ("ours", "conv")], 1.0), res("d2", [("lightning", "mlp")], 2.0)])
    assert [i["date"] for i in old["invocations"]] == ["d1", "d2"]
    new = sm.merge([old, res("d3", [("ours", "conv")], 3.0)])  # d3 makes the CNN rows again
    made = {(c["engine"], c["kind"]): (c["made"], c["auto"]["test_loss"]) for c in new["cells"]}
    assert made == {("ours", "mlp"): ("d1", 1.0), ("ours", "conv"): ("d3", 3.0), ("lightning", "mlp"): ("d2", 2.0)}
    assert new["free"]["ours-conv-0"]["test_loss"] == 3.0 and len(new["cells"]) == 3
    assert [i["date"] for i in new["invocations"]] == ["d1", "d2", "d3"]
    gone = sm.merge([res("d1", [("ours", "conv")], 1.0), res("d3", [("ours", "conv")], 3.0)])
    assert [i["date"] for i in gone["invocations"]] == ["d3"]  # no row of d1's is left
