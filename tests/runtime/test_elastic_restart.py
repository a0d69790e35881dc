"""Checkpoint-restart end to end: the engine may only choose ``restart``; a worker is SIGKILLed
from outside; every worker exits 75; ``chameleon-ft run --max-restarts 1`` relaunches all of
them, they resume from the script's checkpoint, and the run ends on the failure-free trajectory.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).with_name("_workers")))
from elastic_job import Job, assert_replicas_equal, max_relative_diff, reference  # noqa: E402

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def test_restart_policy_relaunches_and_resumes_from_checkpoint(tmp_path, tmp_path_factory):
    ckpt = tmp_path / "run.ckpt"
    job = Job(tmp_path, mb_sleep=0.01, launch_args=["--max-restarts", "1"],
              worker_args=["--no-stragglers", "--allowed", "restart", "--checkpoint", str(ckpt),
                           "--checkpoint-every", "2"])
    try:
        job.start()
        job.wait_step(7)
        job.kill(2)
        assert job.wait(150) == [0], job.output()
        evs = job.events()
        chosen = [e["decision"]["chosen"] for e in evs if e["event"] == "decision"]
        assert chosen and chosen[0] == "restart", chosen
        assert "relaunching every worker" in job.output()
        starts = [e for e in evs if e["event"] == "run_start" and "worker" in e]
        assert len(starts) >= 8, "every worker should have started twice"
        finals = job.final()
        assert sorted(finals) == [0, 1, 2, 3]  # the relaunch brings the slot back
        assert_replicas_equal(finals, [0, 1, 2, 3])
        assert finals[0]["step"] == 16
        ref = reference(tmp_path_factory.mktemp("ref"), 2)
        assert max_relative_diff(finals[0], ref) < 1e-5
    finally:
        job.cleanup()
