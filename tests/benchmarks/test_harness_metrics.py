"""The harness's figures from synthetic progress logs (pure logic: no processes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "baselines"))

from harness import metrics  # noqa: E402
from harness.scenarios import SCENARIOS, victim_ranks  # noqa: E402


def steps(seq, dt=0.1, t0=100.0):
    """``seq``: (step, world, samples, restart[, batch]) per execution, one every ``dt``."""
    out = []
    for i, s in enumerate(seq):
        step, world, samples, restart, *batch = s
        out.append({"kind": "step", "step": step, "world": world, "samples": samples, "restart": restart,
                    "batch": batch[0] if batch else 64, "ts": t0 + i * dt, "pid": 1, "rss_kb": 1024})
    return out


def run(recs, **kw):
    args = dict(nproc=4, steps=10, global_batch=64, t_faults=[], exit_codes=[0], wall_s=1.0)
    args.update(kw)
    return metrics.run_metrics(recs, **args)


def test_reroute_kill_mttr_survivors_nothing_lost():
    recs = steps([(s, 4, 64, 0) for s in range(5)] + [(s, 3, 64, 0) for s in range(5, 10)])
    m = run(recs, t_faults=[100.45])
    assert m["mttr_s"] == pytest.approx(0.05)
    assert m["survivors"] == 3 and m["samples_lost"] == 0 and m["samples_duplicated"] == 0
    assert m["fault_offset_s"] == pytest.approx(0.05) and not m["crashed"]


def test_restart_counts_duplicates_and_mttr_from_the_new_round():
    recs = steps([(s, 4, 64, 0) for s in range(6)] + [(s, 4, 64, 1) for s in range(4, 10)])
    m = run(recs, t_faults=[100.55])
    assert m["mttr_s"] == pytest.approx(0.05)          # the first step of restart round 1
    assert m["samples_duplicated"] == 2 * 64           # steps 4 and 5 ran twice
    assert m["samples_lost"] == 0 and m["survivors"] == 4


def test_dropped_shard_counts_as_lost_and_two_faults_each_get_an_mttr():
    recs = steps([(s, 4, 64, 0) for s in range(4)] + [(s, 3, 48, 0) for s in range(4, 7)]
                 + [(s, 2, 32, 0) for s in range(7, 10)])
    m = run(recs, t_faults=[100.35, 100.65])
    assert m["samples_lost"] == 3 * 16 + 3 * 32
    assert m["mttrs_s"] == [pytest.approx(0.05), pytest.approx(0.05)]
    assert m["survivors"] == 2   # the world after the last recovery


def test_shrunk_batch_is_not_lost():
    recs = steps([(s, 4, 64, 0) for s in range(5)] + [(s, 3, 48, 0, 48) for s in range(5, 10)])
    assert run(recs, t_faults=[100.45])["samples_lost"] == 0


def test_replacement_back_to_full_strength_and_crash_when_steps_missing():
    recs = steps([(s, 4, 64, 0) for s in range(3)] + [(s, 3, 64, 0) for s in range(3, 6)]
                 + [(s, 4, 64, 0) for s in range(6, 10)])
    m = run(recs, t_faults=[100.25])
    assert m["full_strength_s"] == pytest.approx(0.35) and m["survivors"] == 4
    m = run(recs[:7], t_faults=[100.25])
    assert m["crashed"] and not m["completed"] and m["samples_lost"] is None


def test_straggler_split_by_step():
    recs = steps([(s, 4, 64, 0) for s in range(10)])
    m = run(recs, split_step=6)
    assert m["throughput_before"] and m["throughput_after"] and m["survivors"] == 4


def test_scenarios_victims_and_slow_knob(monkeypatch):
    assert victim_ranks("half", 4) == [2, 3] and victim_ranks("half", 8) == [4, 5, 6, 7]
    assert victim_ranks((-1,), 8) == [7]
    assert SCENARIOS["straggler"].slow_env(4) == {"BENCH_SLOW": "3:3:15"}
    import common

    monkeypatch.setenv("BENCH_SLOW", "3:3:15")
    assert common.compute_s(3, 15, 0.02) == pytest.approx(0.06)
    assert common.compute_s(3, 14, 0.02) == pytest.approx(0.02)
    assert common.compute_s(2, 20, 0.02) == pytest.approx(0.02)
