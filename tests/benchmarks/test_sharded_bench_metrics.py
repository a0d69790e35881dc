"""The sharded benchmark's figures from synthetic step logs (pure functions)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import sharded_bench as sb  # noqa: E402


def rows_of(losses, t0=0.0, dt=1.0, steps=None):
    steps = steps or list(range(1, len(losses) + 1))
    return [[s, t0 + i * dt, v] for i, (s, v) in enumerate(zip(steps, losses))]


def test_steps_to_target_counts_redone_steps():
    ref = rows_of([1.0 - 0.01 * i for i in range(60)])
    # a rollback after step 30 to step 25: steps 26..30 are computed twice
    losses = [1.0 - 0.01 * i for i in range(30)] + [1.0 - 0.01 * i for i in range(25, 60)]
    steps = list(range(1, 31)) + list(range(26, 61))
    run = rows_of(losses, steps=steps)
    target = 1.0 - 0.01 * 50
    assert sb.steps_to_target(ref, target, 1) == 51
    assert sb.steps_to_target(run, target, 1) == 56
    lost = sb.lost_time(run, ref, target, 1)
    assert lost["steps"] == 5 and lost["lost_s"] == pytest.approx(5.0)


def test_lost_time_adds_the_path_transfer_and_reports_the_pause():
    ref = rows_of([1.0 - 0.01 * i for i in range(60)])
    run = [[s, t + (3.0 if s > 20 else 0.0), v] for s, t, v in ref]  # a 3 s pause, same curve
    lost = sb.lost_time(run, ref, 0.5, 1, transfer_s=0.25)
    assert lost["steps"] == 0 and lost["pause_s"] == pytest.approx(3.0)
    assert lost["lost_s"] == pytest.approx(0.25)


def test_loss_at():
    run = rows_of([1.0] * 10 + [1.5, 1.3])
    assert sb.loss_at(run, 11, 1) == 1.5
    assert sb.loss_at(run, 12, 2) == pytest.approx(1.4)
    assert sb.loss_at(run, 99, 1) is None


def test_steady_step_s():
    assert sb.steady_step_s(rows_of([0.0] * 20, dt=0.5), 5) == pytest.approx(0.5)
