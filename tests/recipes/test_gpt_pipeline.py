"""The DP x PP recipe and demo with real processes and a real SIGKILL from outside by PID.

``recipes/gpt_pipeline.py`` (8 workers, 2 pipelines x 4 stages) with a middle-stage worker
killed ends within 1e-5 (relative) of its failure-free run: the pipeline runtime trains the
same micro-batches either way.  ``chameleon-ft demo --pipeline`` shows both recovery paths.
The recipe and the demo clean their workers up themselves (``LocalJob.cleanup``); each
subprocess is started in its own session and its group is killed if it overruns.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SHORT = ("--max-samples", "64", "--global-batch", "16", "--micro-batch", "2", "--epochs", "2")


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the recipe's own cleanup did not get to run
        out, _ = p.communicate()
        raise AssertionError(f"timed out after {timeout} s:\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, "")


def recipe(out: Path, *flags: str) -> dict:
    p = _run([sys.executable, str(ROOT / "recipes" / "gpt_pipeline.py"), "--out", str(out), *SHORT, *flags], 300)
    assert p.returncode == 0, p.stdout[-4000:]
    return {**json.loads((out / "result.json").read_text()), "stdout": p.stdout}


@pytest.mark.chaos  # ~2.5 min; default coverage: tests/README.md
@pytest.mark.timeout(600)
def test_gpt_pipeline_recipe_survives_a_middle_stage_kill_on_the_same_trajectory(tmp_path):
    ref = recipe(tmp_path / "ref")
    got = recipe(tmp_path / "kill", "--kill-worker", "2", "--at-step", "3", "--policy", "replan")
    assert ref["steps"] == got["steps"] == 8 and ref["recoveries"] == 0
    assert "SIGKILL worker 2" in got["stdout"] and "recovered at step" in got["stdout"]
    assert [d["chosen"] for d in got["decisions"] if d["event"]["kind"] == "fail_stop"] == ["replan"]
    assert sorted(got["members"]) == [0, 1, 3, 4, 5, 6, 7]
    # The migration moved exactly what the engine predicted.
    assert got["migration"]["bytes"] == got["migration"]["predicted_bytes"] > 0
    assert abs(got["final_loss"] / ref["final_loss"] - 1) < 1e-5, (got["final_loss"], ref["final_loss"])
    assert sorted(got["block_norms"]) == sorted(ref["block_norms"])
    for b, norm in ref["block_norms"].items():
        assert abs(got["block_norms"][b] / norm - 1) < 1e-5, (b, got["block_norms"][b], norm)


@pytest.mark.chaos  # ~3 min; default coverage: tests/README.md
@pytest.mark.timeout(600)
def test_pipeline_demo_shows_reroute_and_replan(tmp_path):
    p = _run([sys.executable, "-m", "chameleon_ft.cli", "demo", "--pipeline", "--epochs", "2", "--at-step", "4",
              "--run-dir", str(tmp_path), "--timeout", "200"], 480)
    assert p.returncode == 0, p.stdout[-4000:]
    chosen = {}
    for policy in ("reroute", "replan"):
        events = [json.loads(line) for line in (tmp_path / policy / "events.jsonl").read_text().splitlines()]
        ds = [e["decision"] for e in events if e["event"] == "decision"
              and e["decision"]["event"].get("kind") == "fail_stop"]
        chosen[policy] = ds[0]["chosen"]
        assert json.loads((tmp_path / policy / "final.json").read_text())["step"] == 16
    assert chosen == {"reroute": "reroute", "replan": "replan"}
    assert "reroute vs replan" in p.stdout and "bytes moved" in p.stdout and "MTTR" in p.stdout
