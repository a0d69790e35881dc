"""``benchmarks/trace_sim_sweep.py``: the traces it builds and the ratio it reports, on the
calibration of the committed ``slowlink`` run (a reduced grid)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import trace_sim_sweep as sweep
from benchmarks.trace_sim import setup_from_run

RUN = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "pipeline-trace-slowlink.json"


def test_the_trace_has_the_transient_kills_then_the_permanent_loss():
    base = setup_from_run(json.loads(RUN.read_text()), "adaptive")
    s = sweep.trace_setup(base, 2, n=2, delay=12.0, gap=10.0, tail=60.0)
    got = [(e.t_s, e.kind, e.devices) for e in s.trace.events]
    assert got == [(10.0, "fail", (1,)), (22.0, "join", (1,)), (32.0, "fail", (2,)), (44.0, "join", (2,)),
                   (54.0, "fail", (6,))]
    assert s.trace.horizon_s == 114.0 and s.stages == 2 and s.replacement_eta_s == 12.0


def test_the_reported_ratio_is_adaptive_over_the_better_fixed_policy(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(sweep, "TRANSIENT", (0, 1))
    monkeypatch.setattr(sweep, "DELAYS", (12.0,))
    monkeypatch.setattr(sweep, "GAPS", (10.0,))
    monkeypatch.setattr(sweep, "TAILS", (60.0,))
    out = tmp_path / "s.json"
    assert sweep.main(["--run", str(RUN), "--stages", "4", "--json", str(out)]) == 0
    (res,) = json.loads(out.read_text())
    assert res["stages"] == 4 and len(res["rows"]) == 2
    for r in res["rows"]:
        th = r["throughput"]
        assert r["ratio"] == pytest.approx(th["adaptive"] / max(th["engine-reroute"], th["engine-replan"]), rel=1e-3)
    assert res["best_ratio"] == max(r["ratio"] for r in res["rows"])
    assert "2 x PP4: failure-free" in capsys.readouterr().out
