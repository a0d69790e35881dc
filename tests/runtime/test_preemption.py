"""Preemption announced (``runtime/preemption.py``): ``chameleon-ft run`` with 4 gloo workers on
CPU; SIGTERM -- a spot machine's, Kubernetes' or SLURM's notice -- sent from outside by PID to a
worker, or to the launcher, while they train.

What must hold: the worker leaves at the end of the step it is in, announced in that step's
commit (exit 143, a ``preemption`` record, not a crash found later); its peers reconfigure right
after that commit and redo no step (every member's ``step`` record appears once per step); every
sample once, replicas bitwise equal and the failure-free trajectory within 1e-5.  A SIGTERM to
the launcher of a one-node job ends every worker at a step boundary (exit 143) within seconds.
"""

from __future__ import annotations

import signal
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).with_name("_workers")))
from elastic_job import (Job, assert_exactly_once, assert_replicas_equal,  # noqa: E402
                         max_relative_diff, reference)

pytestmark = [pytest.mark.timeout(120)]
EPOCHS = 2


def _events(evs, kind):
    return [e for e in evs if e["event"] == kind]


def _no_step_redone(evs) -> None:
    attempts = Counter((e["worker"], e["step"]) for e in _events(evs, "step") if "worker" in e)
    again = {k: n for k, n in attempts.items() if n > 1}
    assert not again, f"steps attempted more than once: {again}"


def test_a_sigterm_leaves_at_the_step_boundary_and_nothing_is_redone(tmp_path, tmp_path_factory):
    job = Job(tmp_path, mb_sleep=0.02)
    try:
        launcher = job.start()
        job.wait_step(5)
        t = job.kill(1, signal.SIGTERM)
        assert job.wait(90) == [0], job.output()
        evs, finals, out = job.events(), job.final(), job.output()
    finally:
        job.cleanup()
    assert launcher.returncode == 0
    assert "worker 1: SIGTERM: leaving the job at the end of the current step" in out
    assert "worker 1 (pid" in out and "left the job on SIGTERM" in out
    failures = _events(evs, "failure")
    assert [(f["workers"], f["kind"]) for f in failures] == [([1], "preemption")], failures
    ends = [e for e in _events(evs, "run_end") if e.get("left") == "preempted"]
    assert [e["worker"] for e in ends] == [1]
    left_at = ends[0]["step"]
    # The peers' next generation starts from the step worker 1 committed last: nothing redone.
    _no_step_redone(evs)
    assert max(e["step"] for e in _events(evs, "step") if e.get("worker") == 1) == left_at - 1
    rec = [e for e in _events(evs, "recovery") if e["ts"] > t]
    # The peers reconfigure without it right after that commit, once.
    assert [(e["members"], e["kind"]) for e in rec] == [([0, 2, 3], "leave")], rec
    print(f"left after step {left_at}; the peers' first step {rec[-1]['mttr']['total']:.3f} s after the commit")
    assert sorted(finals) == [0, 2, 3]
    assert_replicas_equal(finals, [0, 2, 3])
    assert_exactly_once(evs, EPOCHS)
    assert max_relative_diff(finals[0], reference(tmp_path_factory.mktemp("ref"), EPOCHS)) < 1e-5


@pytest.mark.parametrize("notice", ["TERM", "USR1"])
def test_a_notice_to_the_launcher_ends_every_worker_at_a_step_boundary(tmp_path, notice):
    """SIGTERM, or SLURM's ``--signal=USR1@90`` with ``--preempt-signal USR1``."""
    job = Job(tmp_path, mb_sleep=0.02, epochs=4,
              launch_args=("--preempt-signal", "USR1") if notice == "USR1" else ())
    try:
        launcher = job.start()
        job.wait_step(3)
        t = time.monotonic()
        launcher.send_signal(getattr(signal, f"SIG{notice}"))
        assert launcher.wait(30) == 128 + signal.SIGTERM
        took = time.monotonic() - t
        evs = job.events()
    finally:
        job.cleanup()
    ends = [e for e in _events(evs, "run_end") if e.get("left") == "preempted"]
    assert sorted(e["worker"] for e in ends) == [0, 1, 2, 3]
    # Each at the first commit after its notice: the signal reaches the four processes at
    # slightly different moments, so some may announce one step later (their peers having
    # reconfigured without the first ones in between): never a crash, never a step redone.
    steps = sorted({e["step"] for e in ends})
    assert len(steps) <= 2 and steps[-1] - steps[0] <= 1, steps
    assert all(f["kind"] == "preemption" for f in _events(evs, "failure")), _events(evs, "failure")
    _no_step_redone(evs)
    assert took < 10, took  # not the 30 s grace: they left at the step boundary


def test_a_whole_job_preempted_under_slurm_saves_where_it_left_and_its_requeued_run_resumes_there(tmp_path):
    """SLURM's conventions: ``sbatch --signal=USR1@90 --requeue`` and ``chameleon-ft run
    --preempt-signal USR1 --requeue``.  USR1 reaches the job at step 5: every worker leaves at a
    step boundary; the last of them (every member of its generation leaving at once) writes the
    checkpoint at that step; node 0's launcher exits 143 after ``scontrol requeue $SLURM_JOB_ID``
    (a stand-in ``scontrol`` on PATH records the call: no SLURM here).  The requeued run -- the
    same command, no signal -- resumes at that step: no step redone or lost across the two runs,
    every sample once per epoch, and the failure-free weights within 1e-5."""
    from chameleon_ft.runtime.codec import load_checkpoint

    bin_dir, called = tmp_path / "bin", tmp_path / "scontrol.calls"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {called}\n")
    (bin_dir / "scontrol").chmod(0o755)
    ckpt, run = tmp_path / "ckpt.pt", tmp_path / "run"
    env = {"PATH": f"{bin_dir}:{__import__('os').environ['PATH']}", "SLURM_JOB_ID": "4242"}
    args = dict(mb_sleep=0.02, epochs=4, worker_args=("--checkpoint", str(ckpt)), env=env)
    job = Job(run, launch_args=("--preempt-signal", "USR1", "--requeue"), **args)
    try:
        launcher = job.start()
        job.wait_step(5)
        launcher.send_signal(signal.SIGUSR1)
        assert launcher.wait(30) == 128 + signal.SIGTERM, job.output()[-3000:]
        out, evs = job.output(), job.events()
    finally:
        job.cleanup()
    assert called.read_text().split() == ["requeue", "4242"]
    assert "job 4242 requeued (scontrol requeue)" in out
    ends = [e for e in _events(evs, "run_end") if e.get("left") == "preempted"]
    assert sorted(e["worker"] for e in ends) == [0, 1, 2, 3]
    left_at = max(e["step"] for e in ends)
    assert [e.get("whole_job") for e in ends if e["step"] == left_at] == [True] * sum(e["step"] == left_at for e in ends)
    saved = load_checkpoint(ckpt)
    assert saved["step"] == left_at, (saved["step"], left_at)
    # The requeued job: the same command in the same run directory, resumed from the checkpoint.
    again = Job(run, **args)
    try:
        again.start()
        assert again.wait(90) == [0], again.output()[-3000:]
        evs, finals = again.events(), again.final()
    finally:
        again.cleanup()
    first = min(e["step"] for e in _events(evs, "step") if e["ts"] > max(e["ts"] for e in ends))
    assert first == left_at, (first, left_at)
    _no_step_redone(evs)
    assert_exactly_once(evs, 4)
    assert_replicas_equal(finals, [0, 1, 2, 3])
    assert max_relative_diff(finals[0], reference(tmp_path / "ref", 4)) < 1e-5
