"""Lightning's FSDP2 recipe (``ModelParallelStrategy`` + ``fully_shard`` in ``configure_model``)
with ``FaultToleranceCallback()`` under ``chameleon-ft run``: 4 real worker processes, gloo, a
worker SIGKILLed from outside by PID.  Its shard has no other copy: the survivors restore it from
its buddy's snapshot (rehabilitate), re-shard over 3 and keep training in place; the user's loop
does not notice (every global step once, the same epochs, the checkpoint saved, validation
synced), and training ends near the failure-free run."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from _helpers.recovery import LIGHTNING_PRELOAD, ScriptJob  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

SCRIPT = Path(__file__).with_name("_workers") / "lit_sharded.py"
STEPS_PER_EPOCH, EPOCHS = 8, 3  # 256 samples, 4 workers x batch 8


def _job(run_dir: Path, *args: str) -> ScriptJob:
    return ScriptJob(SCRIPT, run_dir, "--mb-sleep", "0.05", *args, launch_args=LIGHTNING_PRELOAD)


def _user_view(finals: dict) -> None:
    """What the user's code saw, on every worker that finished: every global step's batch
    end once, the epochs, the synced validation loss per epoch, one whole checkpoint."""
    first = finals[min(finals)]
    for f in finals.values():
        assert f["global_step"] == STEPS_PER_EPOCH * EPOCHS and f["epoch"] == EPOCHS
        assert sorted(f["losses"]) == list(range(1, STEPS_PER_EPOCH * EPOCHS + 1))  # after each step
        assert f["val_losses"] == first["val_losses"] and len(f["val_losses"]) == EPOCHS
        assert all(f["params"][k].equal(first["params"][k]) for k in first["params"])
    assert {k: tuple(v.shape) for k, v in first["params"].items()} == {
        "model.w1.weight": (64, 32), "model.w2.weight": (32, 64), "model.w3.weight": (64, 32),
        "head.weight": (1, 32), "head.bias": (1,)}


def _kill(job: ScriptJob, victim: int, wait) -> dict:
    """Start ``job``, ``wait()``, SIGKILL ``victim`` from outside by PID; the survivors end
    cleanly and saw what the user's code expects (``_user_view``)."""
    try:
        job.start()
        wait()
        job.kill(victim)
        assert job.wait(240) == [0], job.output()[-4000:]
        finals = job.final()
    finally:
        job.cleanup()
    assert sorted(finals) == sorted(set(range(4)) - {victim}), job.output()[-3000:]
    _user_view(finals)
    return finals


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = _job(tmp_path_factory.mktemp("sharded_ref"))
    finals = job.run_to_end(240)
    assert sorted(finals) == [0, 1, 2, 3]
    _user_view(finals)
    return finals[0]


def test_sigkill_rehabilitates_the_lost_shard_and_the_loop_goes_on(tmp_path, reference):
    rng = random.Random()
    # Steps 9-13 of epoch 1 (steps 8-15): the kill lands in step 13 or 14, never in the commit of
    # the epoch's last step, after which the validation of a member that adopted that step is
    # partial (docs/lightning.md's limits; the kill-inside-validation test covers evaluation).
    victim, at = rng.randrange(4), rng.randrange(9, 14)
    job = _job(tmp_path, "--snapshot-every", "4")  # the snapshot is 0-3 steps stale
    finals = _kill(job, victim, lambda: job.wait_step(at, 180))
    events = job.events()
    rec = [e for e in events if e["event"] == "shard_recovery"]
    assert len(rec) == 1, rec
    d = rec[0]
    assert d["chosen"] == "rehabilitate", d
    assert d["lost_rows"] == [victim] and d["candidates"]["rehabilitate"]["feasible"], d
    assert "not allowed" in d["candidates"]["recompute"]["reason"]  # Lightning's loop never rolls back
    # the logging member's part of the repair (its new row may hold none of the lost elements)
    assert d["step"] - d["snapshot_step"] in range(4) and d["repair"]["warmup_steps"] == 10, d
    # the console said what was restored; the heal was checked at the predicted step (issue 23)
    assert f"shard rows [{victim}] lost: rehabilitate" in job.output()
    checks = [e for e in events if e["event"] == "heal_check" and e["kind"] == "check"]
    if "the heal is not checked" in job.output():  # the loss on a plateau there: no lag to measure
        assert not checks, checks
    else:
        assert len(checks) == 1 and checks[0]["predicted_heal_steps"] == d["predicted_heal_steps"], checks
    # every committed step once; the survivors ran 3-way after the kill
    steps = sorted({e["step"] for e in events if e["event"] == "step"})
    assert steps == list(range(STEPS_PER_EPOCH * EPOCHS))
    # near the failure-free run: the last validation loss within 10 % of it
    ref, got = reference["val_losses"][-1], finals[min(finals)]["val_losses"][-1]
    assert abs(got - ref) <= 0.1 * ref, (got, ref)


@pytest.mark.chaos  # tests/README.md
def test_a_commit_one_member_missed_goes_on_in_place_bitwise_as_failure_free(tmp_path):
    """Worker 1's commit of step 5 is reported failed after its peers committed it (a ``drop``
    fault: gloo's partial completion); no worker and no row is lost.  The job goes on in place
    (``heal`` with nothing to move, although Lightning's sharded paths are rehabilitate and
    restart) and ends bitwise where the failure-free run ends; it used to stop every worker for a
    restart (exit 75: "rows [] cannot be recovered in memory").  The user's StepLR steps per
    step and halves after step 5, the adopted one: worker 1's Lightning steps it once for that
    step, as in the failure-free run (its loop has stepped it before the recovery carries out
    the source's plan, so the plan's hyperparameters -- the source's, after its own scheduler
    step -- are already its own: measured, 0.0015 on every member)."""
    ref = _job(tmp_path / "ref", "--step-lr").run_to_end(240)
    job = ScriptJob(SCRIPT, tmp_path / "drop", "--mb-sleep", "0.05", "--step-lr",
                    launch_args=[*LIGHTNING_PRELOAD, "--faults", "drop:rank=1:step=5:phase=commit"])
    finals = job.run_to_end(240)
    assert sorted(finals) == [0, 1, 2, 3]
    _user_view(finals)
    rec = [e for e in job.events() if e["event"] == "shard_recovery"]
    assert [e["chosen"] for e in rec] in ([], ["heal"]), rec
    assert all(finals[0]["params"][k].equal(ref[0]["params"][k]) for k in ref[0]["params"])


@pytest.mark.chaos  # tests/README.md
def test_whole_checkpoint_resumes_on_three_workers_on_the_same_trajectory(tmp_path, reference):
    """``trainer.save_checkpoint`` writes the whole model and optimizer state (gathered from the
    shards; ``weights_only`` loadable); ``fit(ckpt_path=...)`` on 3 workers re-shards it and
    ends where the uninterrupted 4-worker run ends."""
    first = _job(tmp_path / "first", "--epochs", "2")
    f1 = first.run_to_end(240)
    assert all(f["global_step"] == 2 * STEPS_PER_EPOCH for f in f1.values())
    second = ScriptJob(SCRIPT, tmp_path / "second", "--mb-sleep", "0.05", "--ckpt",
                       str(tmp_path / "first" / "last.ckpt"), nproc=3, launch_args=LIGHTNING_PRELOAD)
    f2 = second.run_to_end(240)
    assert sorted(f2) == [0, 1, 2]
    for f in f2.values():
        assert f["global_step"] == STEPS_PER_EPOCH * EPOCHS and f["epoch"] == EPOCHS
        assert sorted(f["losses"]) == list(range(2 * STEPS_PER_EPOCH + 1, EPOCHS * STEPS_PER_EPOCH + 1))
    got = f2[0]
    assert abs(got["val_losses"][-1] - reference["val_losses"][-1]) <= 1e-4 * reference["val_losses"][-1]
    for k, v in reference["params"].items():
        assert (got["params"][k] - v).abs().max() <= 1e-4, k


@pytest.mark.chaos  # ~70 s; default coverage: tests/README.md
def test_kill_inside_validation_reruns_it_over_the_survivors(tmp_path, reference):
    """Evaluation unshards every unit once at its start (over the live group) and runs its
    forwards without collectives; a worker killed inside it: the survivors recover (rehabilitate
    the lost shard), then run that validation again over the 3 of them, and training goes on."""
    job = _job(tmp_path, "--val-sleep", "0.05", "--snapshot-every", "1")
    victim = random.randrange(4)
    marker = tmp_path / "markers" / f"val_w{victim}_e1"

    def inside_validation():
        job.wait_for(lambda ev: marker.exists(), 180, "the victim's second validation")
        time.sleep(random.uniform(0.05, 0.15))
    finals = _kill(job, victim, inside_validation)
    assert all(f["eval_reruns"] == 1 for f in finals.values()), [f["eval_reruns"] for f in finals.values()]
    rec = [e for e in job.events() if e["event"] == "shard_recovery"]
    assert [d["chosen"] for d in rec] == ["rehabilitate"] and rec[0]["lost_rows"] == [victim], rec
    ref, got = reference["val_losses"][-1], finals[min(finals)]["val_losses"][-1]
    assert abs(got - ref) <= 0.1 * ref, (got, ref)
