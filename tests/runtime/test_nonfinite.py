"""Bad numbers (``ElasticConfig.nonfinite``): ``chameleon-ft run`` with 4 gloo workers on CPU
whose worker 1's loss becomes NaN (the ``nan`` fault: one bad batch, or a diverged run).

What must hold: the flag rides in the step's commit, so every member decides alike; the step is
applied nowhere (the replicas stay bitwise equal and finite, the job trains on); the event log
names the worker and its micro-batches; ``nonfinite_limit`` such steps in a row stop the job on
every member with a clear error (exit 1), nothing left running.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).with_name("_workers")))
from elastic_job import Job, assert_exactly_once, assert_replicas_equal, max_relative_diff, reference  # noqa: E402

pytestmark = [pytest.mark.timeout(120)]
EPOCHS = 2


def _events(evs, kind):
    return [e for e in evs if e["event"] == kind]


def test_one_nan_batch_is_skipped_everywhere_and_training_goes_on(tmp_path, tmp_path_factory):
    job = Job(tmp_path, launch_args=("--faults", "nan:rank=1:step=5:phase=backward"))
    try:
        job.start()
        assert job.wait(90) == [0], job.output()
        evs, finals, out = job.events(), job.final(), job.output()
    finally:
        job.cleanup()
    bad = _events(evs, "nonfinite")
    assert {e["worker"] for e in bad} == {0, 1}  # the member whose loss it was, and rank 0's record
    mine = [e for e in bad if e["worker"] == 1][0]
    assert mine["step"] == 5 and mine["workers"] == [1] and mine["action"] == "skip" and mine["microbatches"]
    assert len(mine["samples"]) > 0
    assert "step 5: the loss of worker(s) [1] was not finite" in out
    assert not _events(evs, "failure") and not _events(evs, "recovery")
    assert sorted(finals) == [0, 1, 2, 3]
    assert_replicas_equal(finals, [0, 1, 2, 3])
    assert all(bool(torch.isfinite(p).all()) for p in finals[0]["params"])
    assert_exactly_once(evs, EPOCHS)  # the skipped batch counts as consumed: no sample twice
    # One global batch's update missing: near the failure-free run, not on it.
    diff = max_relative_diff(finals[0], reference(tmp_path_factory.mktemp("ref"), EPOCHS))
    assert 0 < diff < 0.5, diff


def test_nan_steps_in_a_row_stop_the_job_on_every_member(tmp_path):
    job = Job(tmp_path, launch_args=("--faults", "nan:rank=2:from=3:to=40:phase=backward"))
    try:
        job.start()
        codes = job.wait(90)
        evs, out = job.events(), job.output()
        leftover = [pid for pid in job.worker_pids().values() if Path(f"/proc/{pid}").exists()]
    finally:
        job.cleanup()
    assert codes == [1], out[-3000:]
    stops = [e for e in _events(evs, "nonfinite") if e["action"] == "stop"]
    assert stops and {e["step"] for e in stops} == {5} and stops[0]["in_a_row"] == 3, _events(evs, "nonfinite")
    assert "3 steps in a row; nothing of it was applied; the job stops" in out
    assert not leftover
