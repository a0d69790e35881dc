"""An exception in the user's code is a bug, not a lost worker (issue 24): the job stops on
every node with a non-zero exit naming the worker and the error, its traceback printed once;
``--on-worker-error continue`` makes it a lost worker instead.  Real launchers and workers
(``_workers/mlp_worker.py``), two nodes on loopback."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from _helpers.recovery import ScriptJob  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

WORKER = Path(__file__).resolve().parent / "_workers" / "mlp_worker.py"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_exception_after_fit_stops_the_job_and_says_so_once(tmp_path):
    """The lowest worker raises after ``fit()`` while saving the model: before, the job said
    "survivors carry on" and exited 0 with the file missing."""
    job = ScriptJob(WORKER, tmp_path, "--epochs", "1", "--raise-when-saving", "0", nproc=3)
    try:
        job.start()
        assert job.wait(120) == [70], job.output()[-3000:]
        out = job.output()
    finally:
        job.cleanup()
    assert out.count("Traceback (most recent call last)") == 1, out[-4000:]
    assert "OSError: [Errno 28] No space left on device" in out
    assert ("chameleon-ft run: error: worker 0 raised OSError: [Errno 28] No space left on device"
            in out), out[-2000:]
    assert "survivors carry on" not in out
    assert not (tmp_path / "final_0.pt").exists()


def test_an_exception_on_one_node_stops_every_node(tmp_path):
    """Two launchers (2 workers each); worker 3 (node 1) raises after step 4: node 1 stops its
    workers and tells the coordinator; node 0's launcher stops its own; both exit 70."""
    ep = f"127.0.0.1:{_port()}"
    job = ScriptJob(WORKER, tmp_path, "--epochs", "3", "--mb-sleep", "0.01", "--raise-at", "3:4", nproc=2)
    try:
        for rank in (0, 1):
            job.start(extra=["--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", ep])
        assert job.wait(120) == [70, 70], job.output()[-4000:]
        out = job.output()
    finally:
        job.cleanup()
    assert out.count("ValueError: bad value at step 4") >= 1 and out.count("Traceback") == 1, out[-4000:]
    assert "the job stopped: worker 3 (node 1) raised ValueError: bad value at step 4" in out, out[-3000:]
    assert not list(tmp_path.glob("final_*.pt"))


def test_on_worker_error_continue_treats_it_as_a_lost_worker(tmp_path):
    job = ScriptJob(WORKER, tmp_path, "--epochs", "2", "--mb-sleep", "0.005", "--raise-at", "1:3", nproc=3,
                    launch_args=("--on-worker-error", "continue"))
    try:
        job.start()
        assert job.wait(120) == [0], job.output()[-3000:]
        out = job.output()
    finally:
        job.cleanup()
    assert "ValueError: bad value at step 3" in out and "worker 1 (pid" in out and "survivors carry on" in out
    assert sorted(p.name for p in tmp_path.glob("final_*.pt")) == ["final_0.pt", "final_2.pt"]
