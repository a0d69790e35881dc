"""Lightning with ``FaultToleranceCallback`` under ``chameleon-ft run``: 4 real worker processes
on CPU train an ordinary LightningModule (torchmetrics Accuracy, ModelCheckpoint, CSVLogger,
StepLR, accumulate_grad_batches=2, dropout); a worker is killed from outside by PID.

Each run is checked against a failure-free run of the same script: the same number of
optimizer steps, every sample of every epoch exactly once (the workers' logged ids), bitwise
equal survivors, final weights within 1e-5 relative under reroute, the same validation
accuracy; a checkpoint written after the recovery resumes on 3 workers onto the same
trajectory; a straggler (``--faults slow``) is flagged and rebalanced onto the same trajectory.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from chameleon_ft.localjob import LocalJob
from chameleon_ft.runtime.eventlog import committed_attempts

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("_workers") / "lit_train.py"
DATASET, GLOBAL_BATCH, STEPS_PER_EPOCH, EPOCHS = 256, 32, 8, 2


class LitJob(LocalJob):
    def __init__(self, run_dir: Path, *args: str, nproc: int = 4, hang_timeout: float = 5.0,
                 launch_args=()):
        env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        super().__init__(run_dir, SCRIPT, ["--out", str(run_dir), *args], nproc=nproc,
                         hang_timeout=hang_timeout, launch_args=launch_args, env=env)

    def final(self) -> dict[int, dict]:
        return {int(p.stem.split("_")[1]): torch.load(p, weights_only=True)
                for p in self.run_dir.glob("final_*.pt")}


def run_to_end(job: LitJob, timeout: float = 90.0) -> dict[int, dict]:
    job.start()
    assert job.wait(timeout) == [0], job.output()[-4000:]
    return job.final()


def exactly_once(events: list[dict], first_step: int = 0) -> None:
    ids = {s: [i for r in recs for i in r["ids"]] for s, recs in committed_attempts(events).items()}
    assert sorted(ids) == list(range(first_step, EPOCHS * STEPS_PER_EPOCH)), sorted(ids)
    for e in range(first_step // STEPS_PER_EPOCH, EPOCHS):
        seen = [i for s in range(e * STEPS_PER_EPOCH, (e + 1) * STEPS_PER_EPOCH) for i in ids[s]]
        assert sorted(seen) == list(range(DATASET)), f"epoch {e}: {len(seen)} ids, {len(set(seen))} distinct"


def replicas_equal(finals: dict[int, dict]) -> dict:
    ws = sorted(finals)
    ref = finals[ws[0]]
    for w in ws[1:]:
        for a, b in zip(finals[w]["params"] + finals[w]["momentum"], ref["params"] + ref["momentum"]):
            assert torch.equal(a, b), f"worker {w} differs from worker {ws[0]}"
        assert finals[w]["global_step"] == ref["global_step"]
        assert finals[w]["val_acc"] == ref["val_acc"]
    return ref


def rel_diff(a: dict, b: dict) -> float:
    return max(float((x - y).norm() / y.norm()) for x, y in zip(a["params"], b["params"]))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = LitJob(tmp_path_factory.mktemp("reference"))
    try:
        finals = run_to_end(job)
    finally:
        job.cleanup()
    assert sorted(finals) == [0, 1, 2, 3]
    exactly_once(job.events())
    ref = replicas_equal(finals)
    assert ref["global_step"] == EPOCHS * STEPS_PER_EPOCH and ref["epoch"] == EPOCHS
    return ref


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """A run with one worker SIGKILLed from outside in the middle of epoch 0."""
    rng = random.Random()
    victim, step = rng.randrange(4), rng.randrange(2, 7)
    job = LitJob(tmp_path_factory.mktemp("killed"), "--mb-sleep", "0.01")
    try:
        job.start()
        job.wait_step(step)
        time.sleep(rng.uniform(0.0, 0.03))
        job.kill(victim)
        assert job.wait(90) == [0], job.output()[-4000:]
        return job, victim, job.final()
    finally:
        job.cleanup()


def test_sigkill_mid_epoch_same_steps_samples_weights_and_metric(killed_run, reference):
    job, victim, finals = killed_run
    evs = job.events()
    assert sorted(finals) == sorted(set(range(4)) - {victim})
    failures = [e for e in evs if e["event"] == "failure" and e.get("kind") != "collective"]
    assert failures and failures[0]["workers"] == [victim]
    chosen = [d["decision"]["chosen"] for d in evs if d["event"] == "decision"
              if d["decision"]["event"]["kind"] != "straggler"]
    assert chosen and chosen[0] in ("reroute", "replan")
    exactly_once(evs)
    got = replicas_equal(finals)
    assert got["global_step"] == reference["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert got["epoch"] == reference["epoch"]
    assert got["lr"] == reference["lr"]
    assert rel_diff(got, reference) < 1e-5
    assert got["val_acc"] == reference["val_acc"]
    assert got["world_size"] == 3
    # The fault-tolerance metrics reached the CSV log, including the recovery.
    csv = next(job.run_dir.glob("logs/lit/version_*/metrics.csv")).read_text()
    assert "ft/world_size" in csv and "ft/mttr_s" in csv and "ft/policy/" in csv


def test_checkpoint_after_recovery_resumes_on_three_workers(killed_run, reference, tmp_path):
    job, victim, _ = killed_run
    recovered_at = min(e["step"] for e in job.events() if e["event"] == "recovery")
    ckpts = sorted((job.run_dir / "ckpt").glob("epoch=0-*.ckpt"))
    assert ckpts, "no checkpoint at the end of epoch 0"
    assert recovered_at <= STEPS_PER_EPOCH  # the checkpoint was written after the recovery
    resumed = LitJob(tmp_path, "--ckpt", str(ckpts[0]), nproc=3)
    try:
        finals = run_to_end(resumed)
    finally:
        resumed.cleanup()
    exactly_once(resumed.events(), first_step=STEPS_PER_EPOCH)
    got = replicas_equal(finals)
    assert got["global_step"] == EPOCHS * STEPS_PER_EPOCH and got["world_size"] == 3
    assert rel_diff(got, reference) < 1e-5
    assert got["val_acc"] == reference["val_acc"]


def test_sigstop_hang_detected_and_survived(tmp_path, reference):
    hang_timeout = 2.0
    job = LitJob(tmp_path, "--mb-sleep", "0.01", hang_timeout=hang_timeout)
    try:
        job.start()
        job.wait_step(4)
        t_stop = job.kill(2, signal.SIGSTOP)
        evs = job.wait_for(lambda evs: any(e["event"] == "failure" and e.get("kind") == "hang"
                                           for e in evs), 30, "the hang to be detected")
        failure = next(e for e in evs if e["event"] == "failure" and e.get("kind") == "hang")
        assert failure["workers"] == [2]
        assert failure["ts"] - t_stop < hang_timeout + 1.5
        assert job.wait(90) == [0], job.output()[-4000:]
        finals = job.final()
    finally:
        job.cleanup()
    assert sorted(finals) == [0, 1, 3]
    exactly_once(job.events())
    got = replicas_equal(finals)
    assert got["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert rel_diff(got, reference) < 1e-5
    assert "hung?" in job.output()


def test_straggler_flagged_and_rebalanced_same_trajectory(tmp_path, reference):
    """``--faults slow:rank=1:factor=4``: worker 1 pads every micro-batch's forward+backward to
    4x; the detector flags it from the step timings, the engine rebalances, and the fit ends
    with the failure-free steps, samples and weights."""
    job = LitJob(tmp_path, "--mb-sleep", "0.02", launch_args=["--faults", "slow:rank=1:factor=4"])
    try:
        finals = run_to_end(job)
    finally:
        job.cleanup()
    evs = job.events()
    assert sorted(finals) == [0, 1, 2, 3]
    stragglers = [e for e in evs if e["event"] == "decision"
                  and e["decision"]["event"]["kind"] == "straggler"]
    assert stragglers, "the slow worker was never flagged"
    first = stragglers[0]["decision"]
    assert first["event"]["devices"] == [1] and first["event"]["slowdown"] > 2, first["event"]
    assert first["chosen"] == "rebalance", first
    # Before the rebalance every worker ran the same share; afterwards worker 1 runs less.
    attempts = committed_attempts(evs)
    per_worker = {s: {r["worker"]: len(r["ids"]) for r in recs} for s, recs in attempts.items()}
    assert len(set(per_worker[0].values())) == 1, per_worker[0]
    # The rebalanced allocation holds from the decision's step until the next decision (a
    # noisy shared machine may flag someone else later).
    start = stragglers[0]["step"]
    until = min((d["step"] for d in evs if d["event"] == "decision" and d["step"] > start),
                default=EPOCHS * STEPS_PER_EPOCH)
    after = [s for s in per_worker if start <= s < until]
    assert after, "no step committed after the rebalance"
    for s in after:
        others = [n for w, n in per_worker[s].items() if w != 1]
        assert per_worker[s].get(1, 0) < min(others), (s, per_worker[s])
    exactly_once(evs)
    got = replicas_equal(finals)
    assert got["global_step"] == reference["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert got["lr"] == reference["lr"]
    assert rel_diff(got, reference) < 1e-5
    assert got["val_acc"] == reference["val_acc"]
