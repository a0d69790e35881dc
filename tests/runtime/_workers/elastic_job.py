"""Test harness: run ``python -m chameleon_ft.cli.launch ... mlp_worker.py`` and inspect the run.

Everything the tests kill is found by PID from the event log (workers log their pid in
``run_start``); ``cleanup`` kills the launcher's and every worker's process group, so a test
leaves nothing behind even when it fails half-way.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import torch

from chameleon_ft.cli.localjob import LocalJob

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the shared helpers
from _helpers import recovery as _recovery  # noqa: E402

WORKER = Path(__file__).with_name("mlp_worker.py")
DATASET, GLOBAL_BATCH, STEPS_PER_EPOCH = 256, 32, 8


class Job(LocalJob):
    """The tests' job: ``mlp_worker.py`` on 4 workers with the tests' defaults."""

    def __init__(self, run_dir: Path, *, nproc: int = 4, epochs: int = 2, mb_sleep: float = 0.01,
                 hang_timeout: float = 5.0, max_replacements: int = 0, launch_args=(),
                 worker_args=(), env: Optional[dict] = None):
        super().__init__(run_dir, WORKER, ["--out", str(run_dir), "--epochs", str(epochs),
                                           "--mb-sleep", str(mb_sleep), *worker_args],
                         nproc=nproc, hang_timeout=hang_timeout, max_replacements=max_replacements,
                         launch_args=launch_args, env=env)

    def final(self) -> dict[int, dict]:
        return {int(p.stem.split("_")[1]): torch.load(p, weights_only=True)
                for p in self.run_dir.glob("final_*.pt")}


# -------------------------------------------------------------------- checks
def assert_exactly_once(events: list[dict], epochs: int) -> None:
    _recovery.assert_exactly_once(events, dataset=DATASET, steps_per_epoch=STEPS_PER_EPOCH,
                                  epochs=epochs, global_batch=GLOBAL_BATCH)


def assert_replicas_equal(finals: dict[int, dict], members) -> None:
    _recovery.assert_replicas_equal({w: finals[w] for w in members}, same=("step", "members"))


max_relative_diff = _recovery.rel_diff


_REFERENCE: dict = {}


def reference(tmp_root: Path, epochs: int = 2) -> dict:
    """Final state of a failure-free 4-worker run (computed once per test session)."""
    if epochs not in _REFERENCE:
        job = Job(tmp_root / f"reference-{epochs}", epochs=epochs, mb_sleep=0.0)
        try:
            job.start()
            assert job.wait(60) == [0], job.output()
            _REFERENCE[epochs] = job.final()[0]
        finally:
            job.cleanup()
    return _REFERENCE[epochs]
