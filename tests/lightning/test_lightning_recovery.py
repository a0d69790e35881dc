"""Lightning with ``FaultToleranceCallback`` under ``chameleon-ft run``: 4 real worker processes
on CPU train an ordinary LightningModule (torchmetrics Accuracy, ModelCheckpoint, CSVLogger,
StepLR, accumulate_grad_batches=2, dropout); a worker is killed from outside by PID.

Each run is checked against a failure-free run of the same script: the same number of
optimizer steps and the same Lightning loop (``current_epoch``/``batch_idx``/``global_step``
at every batch end), every sample of every epoch exactly once (the workers' logged ids),
bitwise equal survivors, final weights within 1e-6 relative under reroute, the same
validation metrics over all 1024 validation samples.  The kills: at a random step (then a
checkpoint written after the recovery resumes on 3 workers onto the same trajectory, and
``trainer.test()`` after the fit runs on the survivors with the failure-free test metrics);
inside the validation loop (the survivors rerun it); in the epoch-end window (rank 0, while
``on_train_epoch_end`` runs: the new rank 0 writes the epoch's checkpoint); of rank 0 with a
CSVLogger (the new rank 0 continues the same run) and with TensorBoardLogger +
precision="bf16-mixed" + ``trainer.test()``; a SIGSTOP hang; a straggler (``--faults slow``)
flagged and rebalanced onto the same trajectory.  A mid-epoch checkpoint resumes exactly on 3
workers, and Lightning's warnings that are wrong under the strategy are replaced.  The
reference and the killed runs log ``train_loss`` with ``sync_dist=True`` on step.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import random
import signal
import struct
import time
from pathlib import Path

import pytest

from chameleon_ft.runtime.eventlog import committed_attempts

from _helpers.recovery import (LIGHTNING_PRELOAD, ScriptJob, UserLaunchedJob,  # noqa: E402
                               assert_exactly_once, assert_replicas_equal, kill_at_random_step, rel_diff,
                               srun_tasks, stop_and_survive)

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

SCRIPT = Path(__file__).with_name("_workers") / "lit_train.py"
DATASET, GLOBAL_BATCH, STEPS_PER_EPOCH, EPOCHS, TEST = 256, 32, 8, 2, 120
VAL = 1024  # validation samples: 32 batches of 8 per worker, long enough to kill a worker inside
# Lightning's advice that is wrong under the fault-tolerant strategy (replaced by lightning_ft).
SAMPLER_ADVICE = "Using `DistributedSampler` with the dataloaders"
RESUME_ADVICE = "resuming from a checkpoint that ended before the epoch ended"
TB_BACKEND = next((m for m in ("tensorboard", "tensorboardX") if importlib.util.find_spec(m)), None)


class LitJob(ScriptJob):
    def __init__(self, run_dir: Path, *args: str, launch_args=(), **kwargs):
        # Lightning scripts: the template imports Lightning once (docs/lightning.md).
        super().__init__(SCRIPT, run_dir, "--val-size", str(VAL), *args,
                         launch_args=[*LIGHTNING_PRELOAD, *launch_args], **kwargs)

    def cleanup(self) -> None:
        """Before killing a job that is still running (a test failed or timed out): every
        live worker prints its threads' stacks into the output (``faulthandler`` on SIGUSR1)."""
        if self.running():
            for pid in self.worker_pids().values():
                try:
                    os.kill(pid, signal.SIGUSR1)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(2.0)
        super().cleanup()

    # Four workers importing Lightning on two shared cores can take a minute to start (and
    # seconds to exit) when other jobs load the machine.
    def wait_step(self, step: int, timeout: float = 120.0) -> None:
        super().wait_step(step, timeout)

    def run_to_end(self, timeout: float = 180.0) -> dict[int, dict]:
        return super().run_to_end(timeout)


def exactly_once(events: list[dict], first_step: int = 0) -> None:
    assert_exactly_once(events, dataset=DATASET, steps_per_epoch=STEPS_PER_EPOCH, epochs=EPOCHS,
                        first_step=first_step, global_batch=GLOBAL_BATCH)


def replicas_equal(finals: dict[int, dict], first_step: int = 0) -> dict:
    """Bitwise-equal survivors whose Lightning loop kept its failure-free shape: one
    ``on_train_batch_end`` per global step, with the same ``current_epoch``, ``batch_idx``,
    ``global_step`` and ``num_training_batches`` (from ``first_step`` on, for a resumed run)."""
    ref = assert_replicas_equal(finals, same=("global_step", "val_acc", "batch_log"))
    expected = [(s // STEPS_PER_EPOCH, s % STEPS_PER_EPOCH, s + 1, STEPS_PER_EPOCH)
                for s in range(first_step, EPOCHS * STEPS_PER_EPOCH)]
    assert [tuple(b) for b in ref["batch_log"]] == expected, ref["batch_log"]
    return ref


def only_victim_removed(events: list[dict], victim: int, workers: int = 4) -> None:
    """Exactly one worker left the job: every failure event names the victim alone and every
    membership generation holds every healthy worker (no survivor evicted, not even for one
    generation)."""
    failures = [e for e in events if e["event"] == "failure"]
    assert failures, "no failure recorded"
    assert all(set(e["workers"]) <= {victim} for e in failures), [(e["kind"], e["workers"]) for e in failures]
    assert any(e["workers"] == [victim] and e.get("kind") != "collective" for e in failures)
    everyone, survivors = list(range(workers)), sorted(set(range(workers)) - {victim})
    gens = [(e["generation"], e["members"]) for e in events if e["event"] == "membership"]
    assert all(m in (everyone, survivors) for _, m in gens), gens


def check_validation(finals: dict[int, dict], reference: dict, epochs=(0, 1)) -> None:
    """Every survivor reported each epoch's validation; each one is complete (every one of
    the VAL samples once, ``ft/eval_complete`` = 1) with the failure-free metrics."""
    ref_history = {h["epoch"]: h for h in reference["val_history"]}
    assert all(ref_history[e]["val_n"] == VAL for e in epochs)
    for w, f in finals.items():
        assert [h["epoch"] for h in f["val_history"]] == list(epochs), (w, f["val_history"])
        for h in f["val_history"]:
            ref = ref_history[h["epoch"]]
            assert h["complete"] == 1.0 and h["val_n"] == VAL, (w, h)
            assert h["val_acc"] == ref["val_acc"], (w, h, ref)
            assert abs(h["val_nll"] - ref["val_nll"]) <= 1e-5 * ref["val_nll"], (w, h, ref)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = LitJob(tmp_path_factory.mktemp("reference"), "--test", "--validate", "--sync-train-loss",
                 "--save-every-n-steps", "5")
    finals = job.run_to_end()
    assert sorted(finals) == [0, 1, 2, 3]
    exactly_once(job.events())
    ref = replicas_equal(finals)
    assert ref["global_step"] == EPOCHS * STEPS_PER_EPOCH and ref["epoch"] == EPOCHS
    # Every step of every epoch ran training_step on the batch Lightning loaded, through its
    # closure, and on_train_batch_end got its output (in epoch 1 too: the loader's items are
    # keyed by the step within the epoch, not the global step).
    assert all(f["no_outputs"] == [] for f in finals.values()), {w: f["no_outputs"] for w, f in finals.items()}
    check_test_loop(finals, 4)
    for f in finals.values():
        assert f["validate_n"] == VAL and f["validate_world_size"] == 4
    ref.update(run_dir=job.run_dir, output=job.output(), events=job.events())
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
    """A run with one worker SIGKILLed from outside in the middle of epoch 0, its Trainer given
    ``strategy=DDPStrategy(gradient_as_bucket_view=True, bucket_cap_mb=...)`` as an object (the
    callback carries it, its DDP settings with it)."""
    job = LitJob(tmp_path_factory.mktemp("killed"), "--mb-sleep", "0.01", "--test", "--sync-train-loss",
                 "--ddp-object")
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
    assert rel_diff(got, reference) < 1e-6
    assert got["val_acc"] == reference["val_acc"]
    assert got["world_size"] == 3
    # The DDPStrategy object was carried, its settings with it (gradients released into buckets
    # of 64 floats: several).
    assert all(f["strategy"] == "FaultTolerantDDPStrategy" and f["released"] is True and f["buckets"] > 1
               for f in finals.values()), [(f["strategy"], f.get("released"), f.get("buckets")) for f in finals.values()]
    # trainer.test() after the recovered fit: on the 3 survivors, the failure-free metrics.
    check_test_loop(finals, 3)
    assert got["test_acc"] == reference["test_acc"]
    assert abs(got["test_loss"] - reference["test_loss"]) <= 1e-5 * abs(reference["test_loss"])
    # The fault-tolerance metrics reached the CSV log, including the recovery.
    text = next(job.run_dir.glob("logs/lit/version_*/metrics.csv")).read_text()
    assert "ft/world_size" in text and "ft/mttr_s" in text and "ft/policy/" in text
    out = job.output()
    # One console line for the recovery, from the live rank 0.
    lines = [ln for ln in out.splitlines() if "lightning_ft: recovered at step" in ln]
    assert len(lines) == 1 and f"lost worker(s) [{victim}]" in lines[0] and "MTTR" in lines[0], lines
    # Lightning's one-device advice for trainer.test() is replaced by a line that is true here.
    assert SAMPLER_ADVICE not in out
    assert f"trainer.test() evaluates each of the {TEST} samples exactly once over the 3 live workers" in out


def test_a_member_that_adopted_a_step_redoes_a_share_that_is_not_its_own(tmp_path, reference):
    """gloo's partial completion, as a SIGKILL inside the commit leaves it: step 6's commit
    completes on workers 1 and 3 and fails on 0 and 2 (``drop`` faults), and worker 1 dies
    right after it.  Worker 3 goes on into step 7 (its ``sync_dist`` reduce fails: local value)
    and keeps its gradients when the step fails; 0 and 2 adopt step 6 from it and each
    redoes another member's micro-batches of step 7 (the lost one's and its neighbour's), so
    the batch Lightning prefetched for step 7 is not the first one they compute: the closure,
    which zeroes the gradients before its backward, must run that first one, and every
    micro-batch's gradient reaches the update (the failure-free weights within 1e-6).  The
    event log must show that sequence; it comes about in most runs (the commit's header may
    also fail on worker 1, which then adopts too), so up to three runs are made."""
    spec = "drop:rank=0,2:step=6:phase=commit;kill:rank=1:step=6:phase=optimizer"
    for attempt in range(3):
        job = LitJob(tmp_path / f"run{attempt}", "--mb-sleep", "0.01", "--sync-train-loss",
                     launch_args=["--faults", spec])
        finals = job.run_to_end()
        evs = job.events()
        ends = {e["worker"]: e for e in evs if e["event"] == "run_end" and "worker" in e}
        if sorted(finals) == [0, 2, 3] and all(ends[w]["adopted_steps"] == 1 for w in (0, 2)):
            break
    else:
        pytest.fail(f"no run had workers 0 and 2 adopt step 6 with worker 1 gone: {ends}")
    assert ends[3]["adopted_steps"] == 0 and ends[3]["redone_steps"] == 1, ends
    exactly_once(evs)
    got = replicas_equal(finals)
    assert got["global_step"] == reference["global_step"] and got["lr"] == reference["lr"]
    assert rel_diff(got, reference) < 1e-6


@pytest.mark.chaos  # tests/README.md
def test_new_rank_0_continues_the_csv_logger_run(tmp_path, reference):
    """Worker 0 (rank 0, the one that logs) is SIGKILLed mid-epoch 0.  The next lowest worker
    becomes rank 0 and continues the same ``CSVLogger`` run: one version directory, the rows
    written before the kill kept, every step Lightning logs present (but the row of the last
    step the dead rank 0 committed, when it died before writing it), the ``ft/*`` metrics at
    Lightning's step of their batch -- the rows of the user's ``train_loss`` -- and the
    recovery at its own; one console line says who was lost, what the engine chose, MTTR."""
    job = LitJob(tmp_path, "--mb-sleep", "0.01")
    try:
        job.start()
        job.wait_step(random.randrange(2, 6))
        time.sleep(random.uniform(0.0, 0.03))
        job.kill(0)
        assert job.wait(120) == [0], job.output()[-4000:]
        finals = job.final()
    finally:
        job.cleanup()
    evs = job.events()
    assert sorted(finals) == [1, 2, 3]
    only_victim_removed(evs, 0)
    exactly_once(evs)
    got = replicas_equal(finals)
    assert got["global_step"] == EPOCHS * STEPS_PER_EPOCH and got["world_size"] == 3
    assert rel_diff(got, reference) < 1e-6
    logs = job.run_dir / "logs" / "lit"
    assert sorted(p.name for p in logs.iterdir()) == ["version_0"]
    assert (logs / "version_0" / "hparams.yaml").is_file()
    with open(logs / "version_0" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))

    def steps(key: str) -> list[int]:
        return sorted({int(r["step"]) for r in rows if r.get(key)})

    # log_every_n_steps=2: Lightning logs the batches of global steps 2, 4, ... at its steps 1, 3, ...
    logged = list(range(1, EPOCHS * STEPS_PER_EPOCH, 2))
    recovery = next(e for e in evs if e["event"] == "recovery")
    redone = recovery["step"] - 1  # the Lightning step of the recovery's first committed batch
    assert set(logged) - set(steps("train_loss")) <= {redone - 1}, steps("train_loss")
    assert steps("ft/mttr_s") == [redone]
    assert set(steps("ft/world_size")) - {redone} <= set(logged)
    assert {int(r["step"]): float(r["ft/world_size"]) for r in rows if r.get("ft/world_size")} == {
        s: 4.0 if s < redone else 3.0 for s in steps("ft/world_size")}
    assert steps("val_acc") == [STEPS_PER_EPOCH - 1, EPOCHS * STEPS_PER_EPOCH - 1]
    lines = [ln for ln in job.output().splitlines() if "lightning_ft: recovered at step" in ln]
    assert len(lines) == 1 and "lost worker(s) [0]" in lines[0] and "MTTR" in lines[0], lines


def test_mid_epoch_checkpoint_resumes_exactly_without_lightning_advice(reference, tmp_path):
    """The reference's checkpoint after step 5 of epoch 0 (``every_n_train_steps``) resumes on
    3 workers onto the failure-free trajectory, each remaining sample once.  Lightning's
    warnings that are wrong under the strategy are replaced: on that resume "You're resuming
    from a checkpoint that ended before the epoch ended ... unreliable results" (the sampler
    cursor is in the checkpoint), and for ``trainer.validate()``/``trainer.test()`` after the fit
    (the reference runs both) the advice to evaluate on one device (no DistributedSampler
    padding here).

    In the resumed job, worker 1's commit of step 9 -- after which StepLR (step_size 5)
    multiplies the LR by gamma -- is reported failed after its peers committed it (a ``drop``
    fault: gloo's partial completion, which a SIGKILL inside the all-reduce can leave).  It
    adopts the step from a peer whose Lightning loop has already stepped the scheduler, so it
    must take the optimizer's hyperparameters as they were at the commit: its own scheduler
    step then lands on the same LR (CI once saw the adopters one gamma off, their weights
    drifting apart)."""
    ref_out = reference["output"]
    assert SAMPLER_ADVICE not in ref_out
    for fn, n in (("validate", VAL), ("test", TEST)):
        assert f"trainer.{fn}() evaluates each of the {n} samples exactly once over the 4 live workers" in ref_out
    resumed = LitJob(tmp_path, "--ckpt", str(reference["run_dir"] / "ckpt" / "step5-0.ckpt"), nproc=3,
                     launch_args=("--faults", "drop:rank=1:step=9:phase=commit"))
    finals = resumed.run_to_end()
    ends = {e["worker"]: e for e in resumed.events() if e["event"] == "run_end" and "worker" in e}
    assert ends[1]["adopted_steps"] == 1, ends
    assert all(f["lr"] == reference["lr"] for f in finals.values()), [f["lr"] for f in finals.values()]
    before = [e for e in reference["events"] if e["event"] == "step" and e["step"] < 5]
    exactly_once(before + resumed.events())
    got = replicas_equal(finals, first_step=5)
    assert got["global_step"] == EPOCHS * STEPS_PER_EPOCH and got["world_size"] == 3
    assert rel_diff(got, reference) < 1e-6
    check_validation(finals, reference)
    out = resumed.output()
    assert RESUME_ADVICE not in out
    assert f"lightning_ft: resuming epoch 0 at step 5 of {STEPS_PER_EPOCH}" in out


def test_checkpoint_after_recovery_resumes_on_three_workers(killed_run, reference, tmp_path):
    job, victim, _ = killed_run
    recovered_at = min(e["step"] for e in job.events() if e["event"] == "recovery")
    ckpts = sorted((job.run_dir / "ckpt").glob("epoch=0-*.ckpt"))
    assert ckpts, "no checkpoint at the end of epoch 0"
    assert recovered_at <= STEPS_PER_EPOCH  # the checkpoint was written after the recovery
    resumed = LitJob(tmp_path, "--ckpt", str(ckpts[0]), nproc=3)
    finals = resumed.run_to_end()
    exactly_once(resumed.events(), first_step=STEPS_PER_EPOCH)
    got = replicas_equal(finals, first_step=STEPS_PER_EPOCH)
    assert got["global_step"] == EPOCHS * STEPS_PER_EPOCH and got["world_size"] == 3
    assert rel_diff(got, reference) < 1e-6
    assert got["val_acc"] == reference["val_acc"]


@pytest.mark.chaos  # the runtime's watchdog: test_elastic_recovery.py in CI (tests/README.md)
def test_sigstop_hang_detected_and_survived(tmp_path, reference):
    hang_timeout = 2.0
    job = LitJob(tmp_path, "--mb-sleep", "0.01", hang_timeout=hang_timeout)
    finals = stop_and_survive(job, 2, hang_timeout)
    assert sorted(finals) == [0, 1, 3]
    exactly_once(job.events())
    got = replicas_equal(finals)
    assert got["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert rel_diff(got, reference) < 1e-6
    assert "hung?" in job.output()


@pytest.mark.chaos  # test_elastic_straggler.py in CI (tests/README.md)
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
    assert rel_diff(got, reference) < 1e-6
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
        assert job.wait(120) == [0], job.output()[-4000:]
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
    assert sorted(p.name for p in (job.run_dir / "logs" / "lit").iterdir()) == ["version_0"]
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


def lost_one_on_trajectory(job, finals: dict, victim: int, reference: dict) -> list[dict]:
    """Only ``victim`` left; exactly-once data, equal replicas, the failure-free step count,
    weights within 1e-6 and every validation over every sample.  Returns the run's events."""
    evs = job.events()
    assert sorted(finals) == sorted(set(range(4)) - {victim})
    only_victim_removed(evs, victim)
    exactly_once(evs)
    got = replicas_equal(finals)
    assert got["global_step"] == EPOCHS * STEPS_PER_EPOCH and got["world_size"] == 3
    assert rel_diff(got, reference) < 1e-6
    check_validation(finals, reference)
    return evs


def test_kill_during_validation_metric_recomputed_over_survivors(tmp_path, reference):
    """A worker is SIGKILLed inside epoch 0's validation loop (1024 samples, 20 ms per batch;
    timed by the marker its first ``validation_step`` writes, plus up to 0.3 s).  Exactly that
    worker leaves; the survivors rerun the validation over the 3 of them: the metrics of
    every epoch cover the 1024 samples once with the failure-free values; training keeps its
    steps, samples and weights."""
    victim = random.randrange(4)
    job = LitJob(tmp_path, "--val-sleep", "0.02")
    finals = job.kill_on_marker(victim, f"val_w{victim}_e0", delay=(0.0, 0.3))
    lost_one_on_trajectory(job, finals, victim, reference)
    assert "runs again over the 3 survivors" in job.output()


def test_kill_between_epochs_in_train_epoch_end(tmp_path, reference):
    """Worker 0 (rank 0: it writes the checkpoints and the logs) is SIGKILLed in the window
    between epoch 0's last training step and epoch 1's first: while ``on_train_epoch_end``
    sleeps (1 s), before the ``ModelCheckpoint`` saves there (``save_on_train_epoch_end=True``).
    The survivors meet the failure in the epoch-end metric sync and recover at once, so the new
    rank 0 writes epoch 0's checkpoint; exactly that worker leaves, same steps, samples and
    weights, and both epochs' validations cover every sample once with the failure-free
    metrics."""
    victim = 0
    job = LitJob(tmp_path, "--epoch-end-sleep", "1.0", "--ckpt-on-train-epoch-end")
    finals = job.kill_on_marker(victim, f"epochend_w{victim}_e0", delay=(0.0, 0.5))
    evs = lost_one_on_trajectory(job, finals, victim, reference)
    recovered_at = min(e["step"] for e in evs if e["event"] == "recovery")
    assert recovered_at == STEPS_PER_EPOCH + 1  # its first committed step: epoch 1's first
    assert "recovered at once" in job.output()
    assert sorted(p.name for p in (job.run_dir / "ckpt").glob("*.ckpt")) == [
        f"epoch=0-step={STEPS_PER_EPOCH}.ckpt", f"epoch=1-step={EPOCHS * STEPS_PER_EPOCH}.ckpt"]


def test_a_sigterm_leaves_at_a_step_boundary_announced(tmp_path, reference):
    """Worker 2 gets SIGTERM (a preemption notice) from outside mid-epoch.  Lightning's own
    handler would end its ``fit`` at the next batch end, found by its peers as a crash a
    moment later; the strategy takes SIGTERM from Lightning instead: the worker leaves after
    the commit of the step it is in (exit 143, a ``preemption`` record), its peers reconfigure
    after that same commit and redo nothing, and the run ends on the failure-free trajectory."""
    job = LitJob(tmp_path, "--mb-sleep", "0.01", "--sync-train-loss")
    try:
        job.start()
        job.wait_step(5)
        job.kill(2, signal.SIGTERM)
        assert job.wait(120) == [0], job.output()[-4000:]
        finals = job.final()
    finally:
        job.cleanup()
    evs = lost_one_on_trajectory(job, finals, 2, reference)
    assert [(f["workers"], f["kind"]) for f in evs if f["event"] == "failure"] == [([2], "preemption")]
    ends = {e["worker"]: e for e in evs if e["event"] == "run_end" and "worker" in e}
    assert ends[2].get("left") == "preempted"
    assert all(ends[w].get("redone_steps") == 0 for w in (0, 1, 3)), ends
    assert "Received SIGTERM" not in job.output()


def test_a_stop_and_a_best_decided_apart_after_a_kill_are_agreed_on_the_next_commit(tmp_path):
    """Worker 2 is SIGKILLed while ``on_train_epoch_end`` sleeps in epoch 0; the survivors
    meet the failure in the metric sync that follows, so ``stop_signal`` and ``score`` are
    each worker's own: ``EarlyStopping`` would stop worker 1 alone and ``ModelCheckpoint``'s
    best would differ by worker.  The stop is deferred to the next commit (epoch 1's first
    step): every survivor stops after it, at the same step with equal replicas, and every one
    takes rank 0's checkpoint bookkeeping (best ``score`` 0.0) after it, so that at the stop
    (epoch 1's end, live again: the survivors' mean 4/3) every one saves the new best -- worker
    3, left with its own 3.0, would have refused it for all -- and ends naming the one file
    rank 0 wrote.  (Without a failure every worker stops after epoch 0: ``stop_signal`` is
    reduced with max.)"""
    job = LitJob(tmp_path, "--steer", "--epoch-end-sleep", "1.0", "--val-size", "64")
    finals = job.kill_on_marker(2, "epochend_w2_e0", delay=(0.0, 0.3))
    assert sorted(finals) == [0, 1, 3]
    ref = assert_replicas_equal(finals, same=("global_step", "epoch", "checkpoints", "stopped_epoch"))
    assert ref["global_step"] == STEPS_PER_EPOCH + 1, ref["global_step"]
    steering = [e for e in job.events() if e["event"] == "steering"]
    assert [(e["step"], e["stop_voters"]) for e in steering] == [(STEPS_PER_EPOCH + 1, [1])], steering
    assert steering[0]["held_by"] == [0, 1, 3]
    best = ref["checkpoints"][1]
    assert best["best_model_score"] == pytest.approx(4 / 3), best
    assert [p.name for p in (tmp_path / "best").iterdir()] == [f"best-epoch=1-step={STEPS_PER_EPOCH + 1}.ckpt"]
    assert Path(best["best_model_path"]).name == f"best-epoch=1-step={STEPS_PER_EPOCH + 1}.ckpt"
    assert ref["stopped_epoch"] == [1]


@pytest.mark.parametrize("how,victim", [
    ("python", 0), pytest.param("srun", 2, marks=pytest.mark.chaos),
    pytest.param("python", 2, marks=pytest.mark.chaos), pytest.param("srun", 0, marks=pytest.mark.chaos)])
def test_started_lightnings_own_way_survives_a_kill(tmp_path, reference, how, victim):
    """Issue 26: the script started as Lightning users start it -- ``python lit_train.py``
    with ``devices=4`` (Lightning would start 3 more processes itself), or 4 tasks with the
    variables ``srun --ntasks-per-node=4`` sets -- and no ``chameleon-ft run``.  The process the
    user started becomes our launcher (same PID; under srun, task 0 does and tasks 1-3 leave
    with 0), the workers are its children; worker ``victim`` (rank 0 included) is SIGKILLed
    from outside mid-epoch.  Every started process ends with 0, the user's terminal has the
    workers' final output and the recovery line, and the survivors end on the failure-free
    trajectory (steps, samples, weights, every validation)."""
    tasks = srun_tasks(4) if how == "srun" else [{}]
    job = UserLaunchedJob(SCRIPT, tmp_path, "--val-size", str(VAL), "--devices", "4", "--mb-sleep", "0.01",
                          tasks=tasks)
    try:
        job.start()
        job.wait_step(random.randrange(2, 6))
        launcher = job.launchers[0].pid
        assert launcher not in job.worker_pids().values()  # the user's process is the launcher
        job.kill(victim)
        assert job.wait(180) == [0] * len(tasks), job.output()[-4000:]
        finals = job.final()
    finally:
        job.cleanup()
    lost_one_on_trajectory(job, finals, victim, reference)
    out = job.output()
    assert "running this job under `chameleon-ft run`" in out
    assert sum(f"worker {w} done: step {EPOCHS * STEPS_PER_EPOCH}" in out for w in range(4)) == 3
    assert any("lightning_ft: recovered at step" in ln and f"lost worker(s) [{victim}]" in ln
               for ln in out.splitlines()), out[-3000:]
    if how == "srun":
        assert out.count("leaves its place to a worker") == 3
