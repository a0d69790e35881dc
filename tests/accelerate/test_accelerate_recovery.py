"""accelerate_ft under ``chameleon-ft run``: 4 real worker processes on CPU run a plain Accelerate
loop (accumulate, backward, clip_grad_norm_, optimizer/scheduler step, dropout, gather_for_metrics
evaluation, a tracker); workers are killed or stopped from outside by PID.

Each run is checked against a failure-free run of the same script: the same committed steps and
user-visible step count, every training sample of every epoch exactly once (the workers' logged
ids), bitwise-equal survivors (parameters and momentum), final weights within 1e-5 relative under
reroute, and every evaluation sample gathered exactly once, in order, after the recovery.
"""

from __future__ import annotations

import json
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
SCRIPT = Path(__file__).with_name("_workers") / "acc_train.py"
DATASET, STEPS_PER_EPOCH, EPOCHS, EVAL = 256, 8, 2, 100


class AccJob(LocalJob):
    def __init__(self, run_dir: Path, *args: str, nproc: int = 4, hang_timeout: float = 5.0):
        env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        super().__init__(run_dir, SCRIPT, ["--out", str(run_dir), *args], nproc=nproc,
                         hang_timeout=hang_timeout, env=env)

    def final(self) -> dict[int, dict]:
        return {int(p.stem.split("_")[1]): torch.load(p, weights_only=True)
                for p in self.run_dir.glob("final_*.pt")}

    def tracker(self) -> list[dict]:
        path = self.run_dir / "tracker.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_to_end(job: AccJob, timeout: float = 90.0) -> dict[int, dict]:
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
        for k in ("step", "completed", "lr", "eval_ids", "val_acc", "num_processes"):
            assert finals[w][k] == ref[k], k
    # process_index and is_main_process follow the live membership
    assert sorted(f["process_index"] for f in finals.values()) == list(range(len(ws)))
    assert [f["is_main"] for _, f in sorted(finals.items())] == [True] + [False] * (len(ws) - 1)
    return ref


def eval_exactly_once(final: dict) -> None:
    for ids in final["eval_ids"]:
        assert ids == list(range(EVAL)), f"{len(ids)} ids, {len(set(ids))} distinct"


def rel_diff(a: dict, b: dict) -> float:
    return max(float((x - y).norm() / y.norm()) for x, y in zip(a["params"], b["params"]))


def check(job: AccJob, finals: dict, survivors: list[int], reference: dict) -> dict:
    assert sorted(finals) == survivors
    evs = job.events()
    exactly_once(evs)
    got = replicas_equal(finals)
    eval_exactly_once(got)
    assert got["step"] == got["completed"] == EPOCHS * STEPS_PER_EPOCH
    assert got["num_processes"] == len(survivors)
    assert got["lr"] == reference["lr"]
    chosen = [d["decision"]["chosen"] for d in evs if d["event"] == "decision"
              if d["decision"]["event"]["kind"] != "straggler"]
    if set(chosen) <= {"reroute", "replan", "keep"}:
        assert rel_diff(got, reference) < 1e-5
        assert got["val_acc"] == reference["val_acc"]
    return got


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = AccJob(tmp_path_factory.mktemp("reference"))
    try:
        finals = run_to_end(job)
    finally:
        job.cleanup()
    assert sorted(finals) == [0, 1, 2, 3]
    exactly_once(job.events())
    ref = replicas_equal(finals)
    eval_exactly_once(ref)
    assert ref["step"] == ref["completed"] == EPOCHS * STEPS_PER_EPOCH
    assert any("ft/world_size" in r for r in job.tracker())
    return ref


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """One worker SIGKILLed from outside at a random step of epoch 0; saves state at step 10."""
    rng = random.Random()
    victim, step = rng.randrange(4), rng.randrange(2, 7)
    job = AccJob(tmp_path_factory.mktemp("killed"), "--mb-sleep", "0.01", "--save-at", "10")
    try:
        job.start()
        job.wait_step(step)
        time.sleep(rng.uniform(0.0, 0.03))
        job.kill(victim)
        assert job.wait(90) == [0], job.output()[-4000:]
        return job, victim, job.final()
    finally:
        job.cleanup()


def test_sigkill_at_random_step_exactly_once_bitwise_replicas_same_trajectory(killed_run, reference):
    job, victim, finals = killed_run
    check(job, finals, sorted(set(range(4)) - {victim}), reference)
    evs = job.events()
    failures = [e for e in evs if e["event"] == "failure" and e.get("kind") != "collective"]
    assert failures and failures[0]["workers"] == [victim]
    # The trackers got the fault-tolerance metrics, including the recovery (from the live rank 0).
    rows = job.tracker()
    assert any("ft/mttr_s" in r for r in rows) and any(k.startswith("ft/policy/") for r in rows for k in r)
    assert rows[-1]["ft/world_size"] == 3.0


def test_state_saved_after_recovery_resumes_on_two_workers(killed_run, reference, tmp_path):
    job, _, _ = killed_run
    ckpt = job.run_dir / "ckpt"
    assert (ckpt / "chameleon_ft_state.pt").exists()
    resumed = AccJob(tmp_path, "--resume", str(ckpt), nproc=2)
    try:
        finals = run_to_end(resumed)
    finally:
        resumed.cleanup()
    ids = {s: [i for r in recs for i in r["ids"]] for s, recs in committed_attempts(resumed.events()).items()}
    assert sorted(ids) == list(range(10, EPOCHS * STEPS_PER_EPOCH))
    rest = [i for s in ids for i in ids[s]]
    assert len(rest) == len(set(rest)) == 6 * 32  # the rest of epoch 1, each sample once
    got = replicas_equal(finals)
    assert got["step"] == EPOCHS * STEPS_PER_EPOCH and got["num_processes"] == 2
    assert rel_diff(got, reference) < 1e-5
    assert got["eval_ids"][-1] == list(range(EVAL))


def test_two_failures_including_rank0_and_wrapped_accelerator(tmp_path, reference):
    """wrap(Accelerator(...)); worker 0 (the tracker's rank 0) and worker 2 die in turn."""
    job = AccJob(tmp_path, "--mb-sleep", "0.01", "--wrap")
    try:
        job.start()
        job.wait_step(3)
        job.kill(0)
        job.wait_for(lambda evs: any(e["event"] == "recovery" for e in evs), 30, "first recovery")
        first = max(e["step"] for e in job.events() if e["event"] == "step")
        job.wait_step(first + 2)
        job.kill(2)
        assert job.wait(90) == [0], job.output()[-4000:]
        finals = job.final()
    finally:
        job.cleanup()
    check(job, finals, [1, 3], reference)
    rows = job.tracker()
    assert {r["worker"] for r in rows} >= {0, 1}  # worker 1 took the trackers over
    assert rows[-1]["ft/world_size"] == 2.0


def test_sigstop_hang_detected_and_survived(tmp_path, reference):
    hang_timeout = 2.0
    job = AccJob(tmp_path, "--mb-sleep", "0.01", hang_timeout=hang_timeout)
    try:
        job.start()
        job.wait_step(4)
        t_stop = job.kill(1, signal.SIGSTOP)
        evs = job.wait_for(lambda evs: any(e["event"] == "failure" and e.get("kind") == "hang"
                                           for e in evs), 30, "the hang to be detected")
        failure = next(e for e in evs if e["event"] == "failure" and e.get("kind") == "hang")
        assert failure["workers"] == [1]
        assert failure["ts"] - t_stop < hang_timeout + 1.5
        assert job.wait(90) == [0], job.output()[-4000:]
        finals = job.final()
    finally:
        job.cleanup()
    check(job, finals, [0, 2, 3], reference)
