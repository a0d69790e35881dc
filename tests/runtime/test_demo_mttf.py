"""``--mttf`` from the launcher to the worker's engine, and ``chameleon-ft demo --mttf``: a
short D changes the engine's decision in a real run (local CPU workers, one SIGKILLed from
outside).  The default D comes from the failure-rate estimate
(days): ``wait`` for the replacement wins; with ``--mttf 3`` the next failure is expected before
the replacement (configured eta 5 s) could help, so waiting scores as rerouting and the engine
reroutes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _decision(run_dir):
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    return next(e["decision"] for e in events if e["event"] == "decision"
                and e["decision"]["event"]["kind"] == "fail_stop")


@pytest.mark.chaos  # the same decision on an in-process demo run: benchmarks/test_report_throughput.py
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_with_a_short_mttf_reroutes_instead_of_waiting(tmp_path):
    out = subprocess.run([sys.executable, "-m", "chameleon_ft.cli", "demo", "--mttf", "3", "--epochs", "1",
                          "--at-step", "4", "--run-dir", str(tmp_path), "--timeout", "240"],
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    d = _decision(tmp_path)
    assert d["mttf_s"] == 3.0 and d["chosen"] == "reroute"
    cand = {c["policy"]: c for c in d["candidates"]}
    assert cand["wait"]["feasible"] and cand["wait"]["score"] == pytest.approx(cand["reroute"]["score"])
    assert "D = 3" in out.stdout and "reroute" in out.stdout



def test_mttf_flag_reaches_the_worker_env_and_bad_values_are_refused():
    from chameleon_ft.cli.launch import LaunchError, Launcher, build_parser
    from chameleon_ft.runtime import env as E

    base = {E.STORE: "127.0.0.1:1", E.LIGHTHOUSE: "http://127.0.0.1:2", E.WORKER_ID: "0"}
    assert E.WorkerEnv.from_env(base).mttf_s is None
    assert E.WorkerEnv.from_env({**base, E.MTTF: "7.5"}).mttf_s == 7.5
    for bad in ("0", "-3", "soon"):
        with pytest.raises(E.EnvError, match="CHAMELEON_FT_MTTF"):
            E.WorkerEnv.from_env({**base, E.MTTF: bad})
    with pytest.raises(LaunchError, match="--mttf"):
        Launcher(build_parser().parse_args(["--mttf", "0", __file__]))
    assert build_parser().parse_args(["--mttf", "60", __file__]).mttf == 60.0
