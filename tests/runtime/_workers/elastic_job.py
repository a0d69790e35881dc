"""Test harness: run ``python -m chameleon_ft.launch ... mlp_worker.py`` and inspect the run.

Everything the tests kill is found by PID from the event log (workers log their pid in
``run_start``); ``cleanup`` kills the launcher's and every worker's process group, so a test
leaves nothing behind even when it fails half-way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from chameleon_ft.localjob import LocalJob
from chameleon_ft.runtime.eventlog import committed_attempts

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
def committed_ids(events: list[dict]) -> dict[int, list[int]]:
    """Sample ids of each committed global step (its last attempt's records)."""
    return {step: [i for r in recs for i in r["ids"]] for step, recs in committed_attempts(events).items()}


def assert_exactly_once(events: list[dict], epochs: int) -> None:
    ids = committed_ids(events)
    assert sorted(ids) == list(range(epochs * STEPS_PER_EPOCH)), f"steps committed: {sorted(ids)}"
    for e in range(epochs):
        seen = [i for s in range(e * STEPS_PER_EPOCH, (e + 1) * STEPS_PER_EPOCH) for i in ids[s]]
        assert sorted(seen) == list(range(DATASET)), (
            f"epoch {e}: {len(seen)} ids, {len(set(seen))} distinct, "
            f"missing {sorted(set(range(DATASET)) - set(seen))[:10]}")
    for s, got in ids.items():
        assert len(got) == GLOBAL_BATCH, f"step {s} processed {len(got)} samples"


def assert_replicas_equal(finals: dict[int, dict], members) -> None:
    ref = finals[members[0]]
    for w in members:
        f = finals[w]
        assert f["step"] == ref["step"] and f["members"] == ref["members"]
        for a, b in zip(f["params"] + f["momentum"], ref["params"] + ref["momentum"]):
            assert torch.equal(a, b), f"worker {w} differs from worker {members[0]}"


def max_relative_diff(a: dict, b: dict) -> float:
    return max(float((x - y).norm() / y.norm()) for x, y in zip(a["params"], b["params"]))


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
