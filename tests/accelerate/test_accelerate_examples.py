"""Issue 11: the loop logic of Accelerate's own examples (``checkpointing.py``, ``tracking.py``,
the evaluation of ``nlp_example.py``; see ``_workers/acc_examples.py``) runs as if nothing
failed when a worker is SIGKILLed from outside: the same items per epoch and counters, the
checkpoint folders named and filled as in the failure-free run, a resume from one of them that
ends where the failure-free run ends, the logged loss within 5 %, and an evaluation hit by the
kill that still gathers every sample exactly once -- with only the dead worker removed.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch

from chameleon_ft.runtime.codec import load_checkpoint

from _helpers.recovery import (ScriptJob, assert_exactly_once, assert_replicas_equal,  # noqa: E402
                               committed_ids, rel_diff)

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

SCRIPT = Path(__file__).with_name("_workers") / "acc_examples.py"
DATASET, GLOBAL_BATCH, STEPS, EPOCHS = 256, 32, 8, 2
SAVES = [3, 6, 9, 12, 15]  # --checkpointing-steps 3 over 16 items per worker


class ExJob(ScriptJob):
    def __init__(self, run_dir: Path, *args: str, **kwargs):
        super().__init__(SCRIPT, run_dir, *args, **kwargs)

    def tracker(self) -> list[dict]:
        path = self.run_dir / "tracker.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def exactly_once(job: ExJob, first_step: int = 0) -> None:
    assert_exactly_once(job.events(), dataset=DATASET, steps_per_epoch=STEPS, epochs=EPOCHS,
                        global_batch=GLOBAL_BATCH, first_step=first_step)


def only_failure(job: ExJob, victim: int) -> None:
    """The dead worker is the only one ever reported or left out of a generation."""
    evs = job.events()
    failures = [e for e in evs if e["event"] == "failure" and e.get("kind") != "collective"]
    assert failures and all(f["workers"] == [victim] for f in failures), failures
    # A failed collective's own record names nobody or the victim, never a healthy worker.
    assert all(set(e["workers"]) <= {victim} for e in evs if e["event"] == "failure"), failures
    healthy = set(range(4)) - {victim}
    for e in evs:
        if e["event"] == "membership":
            assert healthy <= set(e["members"]), f"a healthy worker left a generation: {e}"


def folder_params(folder: Path) -> list[torch.Tensor]:
    from safetensors.torch import load_file
    return list(load_file(str(folder / "model.safetensors")).values())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = ExJob(tmp_path_factory.mktemp("ref"), "--checkpointing-steps", "3", "--eval-size", "256")
    finals = job.run_to_end()
    exactly_once(job)
    ref = assert_replicas_equal(finals, same=("overall_step", "items", "saved", "eval_ids"), tensors=("params",))
    assert ref["saved"] == SAVES and ref["items"] == ref["overall_step"] == EPOCHS * STEPS
    job.finals = finals
    return job, ref


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Worker 0 (the trackers' main process) or another, SIGKILLed mid-epoch from outside."""
    rng = random.Random()
    victim, step = rng.choice([0, 0, 1, 2, 3]), rng.randrange(3, 12)
    print(f"victim {victim} at step {step}")
    job = ExJob(tmp_path_factory.mktemp("killed"), "--checkpointing-steps", "3", "--eval-size", "256",
                "--mb-sleep", "0.01")
    try:
        job.start()
        job.wait_step(step, timeout=150)
        time.sleep(rng.uniform(0.0, 0.02))
        job.kill(victim)
        assert job.wait(120) == [0], job.output()[-4000:]
        finals = job.final()
    finally:
        job.cleanup()
    return job, victim, finals


def test_checkpointing_example_counters_folders_and_contents_as_failure_free(killed, reference):
    job, victim, finals = killed
    ref_job, ref = reference
    assert sorted(finals) == sorted(set(range(4)) - {victim})
    exactly_once(job)
    only_failure(job, victim)
    got = assert_replicas_equal(finals, same=("overall_step", "items", "saved", "eval_ids"), tensors=("params",))
    # The loop's shape: same items per epoch, same len(), same counters, same save points.
    assert got["len"] == ref["len"] == STEPS
    assert got["items"] == got["overall_step"] == ref["overall_step"]
    assert got["saved"] == ref["saved"] == SAVES
    assert got["num_processes"] == 3
    # Folders named and filled as in the failure-free run: the runtime state says the same step,
    # and the weights match (same samples, same per-micro-batch seeds: summation order only).
    for n in SAVES:
        st = load_checkpoint(job.run_dir / f"step_{n}" / "chameleon_ft_state.pt")
        assert st["step"] == n, f"step_{n} holds step {st['step']}"
        a, b = folder_params(job.run_dir / f"step_{n}"), folder_params(ref_job.run_dir / f"step_{n}")
        assert max(float((x - y).norm() / y.norm()) for x, y in zip(a, b)) < 1e-5, f"step_{n}"
    assert rel_diff(got, ref) < 1e-5
    for e in range(EPOCHS):
        assert got["eval_ids"][e] == list(range(256))


def test_tracking_example_logged_loss_within_5_percent_and_no_epoch_lost(killed, reference):
    job, victim, _ = killed
    ref_job, _ = reference
    rows = [r for r in job.tracker() if "train_loss" in r]
    ref_rows = [r for r in ref_job.tracker() if "train_loss" in r]
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == list(range(EPOCHS))
    for r, q in zip(rows, ref_rows):
        # The example logs the main process's own mean: compare with what that same worker
        # computed in the failure-free run (its items are the same; only the main changed).
        same_worker = ref_job.finals[r["worker"]]["train_loss"][r["step"]]
        assert abs(r["train_loss"] - same_worker) <= 0.05 * same_worker, (r, same_worker)
        assert r["accuracy"] == q["accuracy"]
    # The recovery's metrics ride on the user's own log() call, on the user's step axis.
    ft_rows = [r for r in job.tracker() if any(k.startswith("ft/") for k in r)]
    assert all(r["step"] in range(EPOCHS) for r in ft_rows)
    assert any("ft/mttr_s" in r for r in ft_rows)
    if victim == 0:
        assert {r["worker"] for r in rows} >= {0, 1} or rows[0]["worker"] == 1
    assert "accelerate_ft: recovered at step" in job.output()


def test_resume_from_a_folder_written_after_the_recovery_ends_as_failure_free(killed, reference, tmp_path):
    job, _, _ = killed
    _, ref = reference
    folder = job.run_dir / "step_12"
    resumed = ExJob(tmp_path, "--resume-from-checkpoint", str(folder), "--checkpointing-steps", "3",
                    "--eval-size", "256", nproc=3)
    finals = resumed.run_to_end()
    got = assert_replicas_equal(finals, same=("overall_step", "items", "saved"), tensors=("params",))
    # The example skips the first 4 items of epoch 1 (12 - 8) itself, counting them in
    # overall_step (which, as in the upstream example, restarts at 0): 4 skipped + 4 trained,
    # a save at overall_step 6 -- what plain Accelerate does with this script.  Only steps
    # 12-15 train.
    assert got["overall_step"] == 8 and got["items"] == 4 and got["saved"] == [6]
    assert got["step"] == EPOCHS * STEPS
    ids = committed_ids(resumed.events())
    assert sorted(ids) == [12, 13, 14, 15]
    rest = [i for s in ids for i in ids[s]]
    assert len(rest) == len(set(rest)) == 4 * GLOBAL_BATCH
    assert rel_diff(got, ref) < 1e-5


def test_kill_during_evaluation_removes_only_the_dead_and_covers_every_sample(tmp_path, reference):
    """A kill lands inside the evaluation (1,024 samples, 50 ms per batch): the survivors
    recover inside gather_for_metrics and re-split the rest; every survivor's gathered ids are
    the whole set once; training after it stays exactly once and on the trajectory."""
    _, ref = reference
    victim = random.Random().choice([1, 2, 3])
    job = ExJob(tmp_path, "--eval-size", "1024", "--eval-sleep", "0.05", "--checkpointing-steps", "3")
    try:
        job.start()
        job.wait_for(lambda evs: (tmp_path / "eval_start").exists(), 150, "the first evaluation")
        time.sleep(random.Random().uniform(0.1, 0.4))
        job.kill(victim)
        assert job.wait(120) == [0], job.output()[-4000:]
        finals = job.final()
    finally:
        job.cleanup()
    assert sorted(finals) == sorted(set(range(4)) - {victim})
    exactly_once(job)
    only_failure(job, victim)
    got = assert_replicas_equal(finals, same=("overall_step", "items", "saved", "eval_ids"), tensors=("params",))
    for e in range(EPOCHS):
        assert got["eval_ids"][e] == list(range(1024)), f"epoch {e}: {len(got['eval_ids'][e])} ids"
    assert got["saved"] == SAVES
    assert rel_diff(got, ref) < 1e-6
