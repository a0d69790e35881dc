"""The pipeline profile's summary (pure): synthetic per-worker phase rows."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import pipeline_profile as pp  # noqa: E402


def rows(interval, phases, steps=10):
    return [{"step": s, "ts": s * interval, **phases} for s in range(1, steps + 1)]


def test_summary_averages_stages_and_keeps_the_untimed_rest():
    # 8 workers: stage = worker % 4; stage 0 computes longest, the others wait in the commit.
    run = {w: rows(0.75, {"pipeline": 0.70 - 0.05 * (w % 4), "grad reduce": 0.01,
                          "commit (step agreement)": 0.02 + 0.05 * (w % 4), "optimizer": 0.001,
                          "calibration (the engine's observe)": 0.0, "step bookkeeping": 0.002})
           for w in range(8)}
    got = pp.summarize([run], "ft", warmup=2)
    assert got["by_stage"][0]["interval"] == pytest.approx(0.75)
    assert got["by_stage"][3]["commit (step agreement)"] == pytest.approx(0.17)
    assert got["by_stage"][0]["the rest"] == pytest.approx(0.75 - 0.733)
    assert got["mean"]["pipeline"] == pytest.approx(0.70 - 0.05 * 1.5)


def test_warmup_steps_are_left_out_and_the_page_renders():
    slow_start = [{"step": 1, "ts": 0.0, "pipeline": 5.0}] + rows(0.5, {"pipeline": 0.45, "grad reduce": 0.01,
                                                                       "optimizer": 0.001})[1:]
    torch_sum = pp.summarize([{w: slow_start for w in range(8)}], "torch", warmup=1)
    assert torch_sum["mean"]["pipeline"] == pytest.approx(0.45)
    ft_sum = pp.summarize([{w: rows(0.52, {"pipeline": 0.45}) for w in range(8)}], "ft", warmup=1)
    res = {"command": "c", "date": "d", "machine": "m", "wall_s": 1.0,
           "config": {"repeats": 1, "steps": 10, "warmup": 1, "block_sleep": 0.01, "global_batch": 64,
                      "micro_batch": 4, "dim": 64},
           "systems": {"torch": torch_sum, "ft": ft_sum}, "notes": ["n"]}
    md = pp.markdown(res)
    assert "| **step interval (commit to commit)** | 500.0 | 520.0 | +20.0 |" in md
    assert "## Reading" in md
