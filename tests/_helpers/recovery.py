"""Checks shared by the real-process recovery tests: run a worker script under
``chameleon-ft run``, read the final state each worker saved, and assert what every recovery
must keep -- each sample of each epoch exactly once, bitwise-equal replicas, and the distance
to a failure-free run."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch

from chameleon_ft.cli.localjob import LocalJob
from chameleon_ft.runtime.eventlog import committed_attempts

ROOT = Path(__file__).resolve().parents[2]
# What a Lightning script's launcher preloads (docs/lightning.md): Lightning is its longest import.
LIGHTNING_PRELOAD = ("--preload", "+lightning,lightning_ft")
# And a Trainer script's (``transformers_ft.trainer.TRAINER_PRELOAD``, kept equal by
# tests/transformers/test_trainer_launch.py; not imported here: it imports transformers).
TRAINER_PRELOAD = ("--preload", "+transformers.trainer,transformers_ft")


class ScriptJob(LocalJob):
    """``chameleon-ft run`` of a test worker ``script`` that takes ``--out DIR`` and writes
    ``DIR/final_<worker id>.pt`` at the end; the repository is on the workers' PYTHONPATH."""

    def __init__(self, script: Path, run_dir: Path, *args: str, nproc: int = 4,
                 hang_timeout: float = 5.0, launch_args: Sequence[str] = (),
                 env: Optional[dict] = None):
        env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {})}
        super().__init__(run_dir, script, ["--out", str(run_dir), *args], nproc=nproc,
                         hang_timeout=hang_timeout, launch_args=launch_args, env=env)

    def final(self) -> dict[int, dict]:
        """Each worker's saved final state, by worker id."""
        return {int(p.stem.split("_")[1]): torch.load(p, weights_only=True)
                for p in self.run_dir.glob("final_*.pt")}

    def run_to_end(self, timeout: float = 180.0) -> dict[int, dict]:
        """Start the job, wait for it to end cleanly, clean up; the final states."""
        try:
            self.start()
            assert self.wait(timeout) == [0], self.output()[-4000:]
            return self.final()
        finally:
            self.cleanup()

    def kill_on_marker(self, victim: int, marker: str, delay: tuple[float, float] = (0.0, 0.0),
                       timeout: float = 120.0) -> dict[int, dict]:
        """Start the job, SIGKILL ``victim`` from outside once a worker wrote
        ``<run dir>/markers/<marker>`` (after a random delay in ``delay``), wait for the
        survivors to end cleanly; their final states."""
        path = self.run_dir / "markers" / marker
        try:
            self.start()
            deadline = time.monotonic() + timeout
            while not path.exists():
                assert time.monotonic() < deadline and self.running(), self.output()[-4000:]
                time.sleep(0.01)
            time.sleep(random.uniform(*delay))
            self.kill(victim)
            assert self.wait(120) == [0], self.output()[-4000:]
            return self.final()
        finally:
            self.cleanup()


class UserLaunchedJob(ScriptJob):
    """The job started the way a framework's user starts it, not by ``chameleon-ft run``:
    ``python train.py`` (``prefix`` the interpreter), ``accelerate launch ... train.py`` or one
    process per task with SLURM's variables as ``srun`` sets them (``tasks``: each one's extra
    environment).  The adapter hands the job to our launcher (``runtime/relaunch.py``), whose run
    directory is ``run_dir`` (``CHAMELEON_FT_RUN_DIR``); ``wait`` returns every started process's
    exit code, the user's terminal output is ``output()``."""

    def __init__(self, script: Path, run_dir: Path, *args: str, prefix: Sequence[str] = (),
                 tasks: Sequence[dict] = ({},), env: Optional[dict] = None):
        super().__init__(script, run_dir, *args, env={"CHAMELEON_FT_RUN_DIR": str(run_dir), **(env or {})})
        self.argv = [*(prefix or [sys.executable]), str(script), "--out", str(run_dir), *args]
        self.tasks = list(tasks)

    def start(self, *_, **__) -> subprocess.Popen:
        for i, extra in enumerate(self.tasks):
            out = open(self.run_dir / f"launcher{i}.out", "wb")
            self.launchers.append(subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                                   env={**self.env, **extra}, start_new_session=True))
            out.close()
        return self.launchers[0]


def srun_tasks(ntasks: int, job_id: int = 4242) -> list[dict]:
    """The variables ``srun --ntasks-per-node=N python train.py`` gives each task on one node."""
    common = {"SLURM_JOB_ID": str(job_id), "SLURM_JOB_NAME": "train", "SLURM_NTASKS": str(ntasks),
              "SLURM_NTASKS_PER_NODE": str(ntasks), "SLURM_NNODES": "1", "SLURM_NODEID": "0",
              "SLURM_NODELIST": "127.0.0.1", "SLURM_JOB_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": str(ntasks)}
    return [{**common, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)} for i in range(ntasks)]


def kill_at_random_step(job: LocalJob, workers: int = 4, steps: tuple[int, int] = (2, 7),
                        rng: Optional[random.Random] = None) -> tuple[int, dict[int, dict]]:
    """SIGKILL a random worker, from outside by PID, at a random step in ``range(*steps)``
    (plus up to 30 ms); wait for the job to end cleanly.  Returns (victim, final states)."""
    rng = rng or random.Random()
    victim, step = rng.randrange(workers), rng.randrange(*steps)
    try:
        job.start()
        job.wait_step(step)
        time.sleep(rng.uniform(0.0, 0.03))
        job.kill(victim)
        assert job.wait(180) == [0], job.output()[-4000:]
        return victim, job.final()
    finally:
        job.cleanup()


def stop_and_survive(job: LocalJob, worker: int, hang_timeout: float, at_step: int = 4) -> dict[int, dict]:
    """SIGSTOP ``worker`` at ``at_step``: the hang must be detected (a ``hang`` failure naming
    it) within ``hang_timeout`` + 1.5 s and the job must end cleanly.  Returns the final states."""
    try:
        job.start()
        job.wait_step(at_step)
        t_stop = job.kill(worker, signal.SIGSTOP)
        evs = job.wait_for(lambda evs: any(e["event"] == "failure" and e.get("kind") == "hang"
                                           for e in evs), 30, "the hang to be detected")
        failure = next(e for e in evs if e["event"] == "failure" and e.get("kind") == "hang")
        assert failure["workers"] == [worker]
        assert failure["ts"] - t_stop < hang_timeout + 1.5
        assert job.wait(180) == [0], job.output()[-4000:]
        return job.final()
    finally:
        job.cleanup()


def committed_ids(events: list[dict]) -> dict[int, list[int]]:
    """Sample ids of each committed global step (its last attempt's records)."""
    return {step: [i for r in recs for i in r["ids"]] for step, recs in committed_attempts(events).items()}


def assert_exactly_once(events: list[dict], *, dataset: int, steps_per_epoch: int, epochs: int,
                        first_step: int = 0, global_batch: Optional[int] = None) -> None:
    """Steps ``first_step`` to the end committed once each, and every epoch from there saw
    each of the ``dataset`` samples exactly once (``global_batch`` per step, when given)."""
    ids = committed_ids(events)
    assert sorted(ids) == list(range(first_step, epochs * steps_per_epoch)), f"steps committed: {sorted(ids)}"
    for e in range(first_step // steps_per_epoch, epochs):
        seen = [i for s in range(e * steps_per_epoch, (e + 1) * steps_per_epoch) for i in ids[s]]
        assert sorted(seen) == list(range(dataset)), (
            f"epoch {e}: {len(seen)} ids, {len(set(seen))} distinct, "
            f"missing {sorted(set(range(dataset)) - set(seen))[:10]}")
    if global_batch is not None:
        for s, got in ids.items():
            assert len(got) == global_batch, f"step {s} processed {len(got)} samples"


def assert_replicas_equal(finals: dict[int, dict], same: Iterable[str] = (),
                          tensors: Sequence[str] = ("params", "momentum")) -> dict:
    """Every worker's ``tensors`` (lists of tensors) are bitwise equal to the lowest worker's,
    and so are its ``same`` entries; returns the lowest worker's final state."""
    ws = sorted(finals)
    ref = finals[ws[0]]
    same = tuple(same)
    for w in ws[1:]:
        for name in tensors:
            for a, b in zip(finals[w][name], ref[name]):
                assert torch.equal(a, b), f"worker {w}'s {name} differ from worker {ws[0]}'s"
        for k in same:
            assert finals[w][k] == ref[k], f"worker {w}: {k} = {finals[w][k]!r}, worker {ws[0]}: {ref[k]!r}"
    return ref


def rel_diff(a: dict, b: dict) -> float:
    """Largest relative distance ||a - b|| / ||b|| over the parameter tensors."""
    return max(float((x - y).norm() / y.norm()) for x, y in zip(a["params"], b["params"]))
