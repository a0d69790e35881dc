"""Lightning with ``FaultToleranceCallback`` under ``chameleon-ft run``: 4 real worker processes
on CPU train an ordinary LightningModule (torchmetrics Accuracy, ModelCheckpoint, CSVLogger,
StepLR, accumulate_grad_batches=2, dropout); a worker is killed from outside by PID.

Each run is checked against a failure-free run of the same script: the same number of
optimizer steps, every sample of every epoch exactly once (the workers' logged ids), bitwise
equal survivors, final weights within 1e-5 relative under reroute, the same validation
accuracy; a checkpoint written after the recovery resumes on 3 workers onto the same
trajectory; ``trainer.test()`` after the recovered fit runs on the survivors with the
failure-free test metrics; a straggler (``--faults slow``) is flagged and rebalanced onto the
same trajectory; TensorBoardLogger + precision="bf16-mixed" + ``trainer.test()`` survive a kill
of rank 0 (the new rank 0 writes the ``ft/*`` metrics to the event files); a kill inside the
validation loop: the survivors rerun it and report the failure-free metrics over every sample.
The reference and the killed runs log ``train_loss`` with ``sync_dist=True`` on step.
"""

from __future__ import annotations

import importlib.util
import random
import struct
import sys
import time
from pathlib import Path

import pytest

from chameleon_ft.runtime.eventlog import committed_attempts

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _helpers.recovery import (ScriptJob, assert_exactly_once, assert_replicas_equal,  # noqa: E402
                               kill_at_random_step, rel_diff, stop_and_survive)

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

SCRIPT = Path(__file__).with_name("_workers") / "lit_train.py"
DATASET, GLOBAL_BATCH, STEPS_PER_EPOCH, EPOCHS, TEST = 256, 32, 8, 2, 120
TB_BACKEND = next((m for m in ("tensorboard", "tensorboardX") if importlib.util.find_spec(m)), None)


class LitJob(ScriptJob):
    def __init__(self, run_dir: Path, *args: str, **kwargs):
        super().__init__(SCRIPT, run_dir, *args, **kwargs)


def exactly_once(events: list[dict], first_step: int = 0) -> None:
    assert_exactly_once(events, dataset=DATASET, steps_per_epoch=STEPS_PER_EPOCH, epochs=EPOCHS,
                        first_step=first_step, global_batch=GLOBAL_BATCH)


def replicas_equal(finals: dict[int, dict]) -> dict:
    return assert_replicas_equal(finals, same=("global_step", "val_acc"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = LitJob(tmp_path_factory.mktemp("reference"), "--test", "--sync-train-loss")
    finals = job.run_to_end()
    assert sorted(finals) == [0, 1, 2, 3]
    exactly_once(job.events())
    ref = replicas_equal(finals)
    assert ref["global_step"] == EPOCHS * STEPS_PER_EPOCH and ref["epoch"] == EPOCHS
    check_test_loop(finals, 4)
    return ref


def check_test_loop(finals: dict[int, dict], world_size: int) -> None:
    """``trainer.test()`` ran on ``world_size`` workers, every test sample exactly once, and
    every worker got the same metrics."""
    seen = sorted(i for f in finals.values() for i in f["test_ids"])
    assert seen == list(range(TEST)), f"{len(seen)} test ids, {len(set(seen))} distinct"
    for f in finals.values():
        assert f["test_world_size"] == world_size
        assert (f["test_acc"], f["test_loss"]) == (finals[min(finals)]["test_acc"], finals[min(finals)]["test_loss"])


def tb_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files under ``log_dir``: tag -> [(step, value)]."""
    if TB_BACKEND == "tensorboard":
        from tensorboard.compat.proto.event_pb2 import Event
    else:
        from tensorboardX.proto.event_pb2 import Event
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(log_dir.rglob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos + 12 <= len(data):  # records: u64 length, u32 crc, payload, u32 crc
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            if pos + 16 + n > len(data):
                break  # cut short by a killed writer
            ev = Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 16 + n
            for v in ev.summary.value:
                out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """A run with one worker SIGKILLed from outside in the middle of epoch 0."""
    job = LitJob(tmp_path_factory.mktemp("killed"), "--mb-sleep", "0.01", "--test", "--sync-train-loss")
    victim, finals = kill_at_random_step(job)
    return job, victim, finals


def test_sigkill_mid_epoch_same_steps_samples_weights_and_metric(killed_run, reference):
    job, victim, finals = killed_run
    evs = job.events()
    # Every survivor finished (train_loss is logged with sync_dist=True on step: once the
    # survivors run 3, 3 and 2 micro-batches a step, those collectives must not pair up).
    assert sorted(finals) == sorted(set(range(4)) - {victim})
    assert "local value inside training_step" in job.output()
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
    # trainer.test() after the recovered fit: on the 3 survivors, the failure-free metrics.
    check_test_loop(finals, 3)
    assert got["test_acc"] == reference["test_acc"]
    assert abs(got["test_loss"] - reference["test_loss"]) <= 1e-5 * abs(reference["test_loss"])
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
    finals = resumed.run_to_end()
    exactly_once(resumed.events(), first_step=STEPS_PER_EPOCH)
    got = replicas_equal(finals)
    assert got["global_step"] == EPOCHS * STEPS_PER_EPOCH and got["world_size"] == 3
    assert rel_diff(got, reference) < 1e-5
    assert got["val_acc"] == reference["val_acc"]


def test_sigstop_hang_detected_and_survived(tmp_path, reference):
    hang_timeout = 2.0
    job = LitJob(tmp_path, "--mb-sleep", "0.01", hang_timeout=hang_timeout)
    finals = stop_and_survive(job, 2, hang_timeout)
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
    finals = job.run_to_end()
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


def test_tensorboard_bf16_and_test_loop_survive_a_kill_of_rank_0(tmp_path):
    """One run, three things Lightning users combine: TensorBoardLogger, precision="bf16-mixed"
    on CPU and ``trainer.test()`` after the fit.  Worker 0 (rank 0, the one that logs) is
    SIGKILLed mid-epoch: the survivors finish with the same steps and exactly-once samples, the
    new rank 0 writes the ``ft/*`` metrics of the recovery to the TensorBoard event files, and
    the test loop runs on the 3 survivors."""
    logger = "tb" if TB_BACKEND else "csv"
    job = LitJob(tmp_path, "--logger", logger, "--precision", "bf16-mixed", "--test",
                 "--mb-sleep", "0.01", "--sync-train-loss")
    try:
        job.start()
        job.wait_step(random.randrange(2, 6))
        job.kill(0)
        assert job.wait(90) == [0], job.output()[-4000:]
        finals = job.final()
    finally:
        job.cleanup()
    evs = job.events()
    assert sorted(finals) == [1, 2, 3]
    failures = [e for e in evs if e["event"] == "failure" and e.get("kind") != "collective"]
    assert failures and failures[0]["workers"] == [0]
    exactly_once(evs)
    got = replicas_equal(finals)
    assert got["global_step"] == EPOCHS * STEPS_PER_EPOCH and got["world_size"] == 3
    check_test_loop(finals, 3)
    assert 0.0 < got["test_acc"] <= 1.0
    recovered_at = min(e["step"] for e in evs if e["event"] == "recovery")
    if not TB_BACKEND:
        pytest.skip("TensorBoard part skipped: neither tensorboard nor tensorboardX is installed "
                    "(pip install tensorboardX); bf16-mixed and trainer.test() after the kill passed")
    scalars = tb_scalars(job.run_dir / "logs" / "lit")
    world = scalars.get("ft/world_size", [])
    assert (recovered_at, 3.0) in world or any(v == 3.0 and s >= recovered_at for s, v in world), world
    assert scalars.get("ft/mttr_s") and all(v > 0 for _, v in scalars["ft/mttr_s"])
    policies = {t.split("/")[-1] for t in scalars if t.startswith("ft/policy/")}
    assert policies & {"reroute", "replan"}, sorted(scalars)
    assert any(v > 0 for _, v in scalars.get("ft/throughput_samples_per_s", [])), sorted(scalars)
    assert "test_acc" in scalars and "val_acc" in scalars


def test_kill_during_validation_metric_recomputed_over_survivors(tmp_path, reference):
    """A worker is SIGKILLed while every worker is inside epoch 0's validation loop (timed by
    the marker its ``validation_step`` writes).  ``fit`` neither hangs nor crashes, and the
    validation metrics the survivors report for that epoch are the failure-free ones, over
    every validation sample (recomputed over the live members), or flagged incomplete."""
    victim = random.randrange(4)
    job = LitJob(tmp_path, "--val-sleep", "0.2")
    marker = tmp_path / "markers" / f"val_w{victim}_e0"
    try:
        job.start()
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert time.monotonic() < deadline and job.running(), job.output()[-4000:]
            time.sleep(0.02)
        job.kill(victim)
        assert job.wait(90) == [0], job.output()[-4000:]
        finals = job.final()
    finally:
        job.cleanup()
    evs = job.events()
    assert sorted(finals) == sorted(set(range(4)) - {victim})
    failures = [e for e in evs if e["event"] == "failure" and e.get("kind") != "collective"]
    assert failures and failures[0]["workers"] == [victim]
    exactly_once(evs)
    got = replicas_equal(finals)
    assert got["global_step"] == EPOCHS * STEPS_PER_EPOCH and got["world_size"] == 3
    assert rel_diff(got, reference) < 1e-5
    ref_history = {h["epoch"]: h for h in reference["val_history"]}
    assert [h["epoch"] for h in ref_history.values()] == [0, 1]
    assert all(h["val_n"] == 100 for h in ref_history.values())
    for w, f in finals.items():
        assert [h["epoch"] for h in f["val_history"]] == [0, 1], (w, f["val_history"])
        for h in f["val_history"]:
            if h["complete"] == 0.0:  # flagged: the metric covers only part of the samples
                continue
            assert h["val_n"] == 100, (w, h)
            ref = ref_history[h["epoch"]]
            assert h["val_acc"] == ref["val_acc"], (w, h, ref)
            assert abs(h["val_nll"] - ref["val_nll"]) <= 1e-4 * ref["val_nll"], (w, h, ref)
    assert any(h["complete"] == 1.0 for f in finals.values() for h in f["val_history"] if h["epoch"] == 0)
