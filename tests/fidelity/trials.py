"""Randomised fidelity trials: does a run with a worker killed mid-training stay on the
failure-free trajectory?

    python -m tests.fidelity.trials --trials 100 --frameworks elastic,lightning,accelerate --seed 0

Each trial draws a training set-up and a failure, runs it under ``chameleon-ft run`` with 4
real worker processes (gloo), kills one worker with a real SIGKILL, and compares the run with
its failure-free twin (same set-up, no kill, no forced allocation):

* set-up: framework (``ElasticTrainer``, Lightning + ``FaultToleranceCallback``, Accelerate +
  ``FaultTolerantAccelerator``), optimizer with momentum (SGD momentum 0.9 or AdamW), a StepLR
  stepped every step, shuffling on, micro-batch size, gradient accumulation (Accelerate's
  ``gradient_accumulation_steps``, Lightning's ``accumulate_grad_batches``, the trainer's
  global batch), a dataset size that the global batch does not divide (uneven last batch,
  sometimes with fewer samples than micro-batch slots), and an optional forced allocation
  (``tests/_helpers/allocation.py``: one member gets no micro-batch, or one fewer), and in a
  quarter of the trials a straggler (a worker 4x slow from the first step) that the detector
  is flagging when the kill lands (step 1-2);
* failure: the victim (any worker, rank 0 included), the step (2 .. last - 2) and the moment:
  an outside SIGKILL by PID once the step started (plus 0-30 ms), or the fault injector's kill
  (``chameleon_ft/runtime/faults.py``) before the compute (``step_start``), in the backward,
  on entering the all-reduce, after the all-reduce before the update (``optimizer``: peers may
  have committed the step), or at the epoch boundary (the last step's update or the next
  epoch's start);
* checks: every epoch's sample ids exactly once (from the event log), bitwise-equal surviving
  replicas (parameters and optimizer state), the same committed steps and learning rate as the
  twin, and the final weights' relative distance to the twin's (``rel_diff``; pass: < 1e-5).

A trial in which the drawn kill did not fire (an injected kill in a phase the victim never
reached, e.g. a backward when it had no micro-batch) is reported as ``fired: false`` and still
checked as a failure-free run.  ``--out`` keeps the run directories and writes one JSON line
per trial (``trials.jsonl``) plus the summary.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers
from _helpers.recovery import (ScriptJob, assert_exactly_once, assert_replicas_equal,  # noqa: E402
                               rel_diff)

TESTS = Path(__file__).resolve().parents[1]
SCRIPTS = {
    "elastic": TESTS / "runtime" / "_workers" / "mlp_worker.py",
    "lightning": TESTS / "lightning" / "_workers" / "lit_train.py",
    "accelerate": TESTS / "accelerate" / "_workers" / "acc_train.py",
}
FRAMEWORKS = tuple(SCRIPTS)
WORKERS = 4
EPOCHS = 2
TOLERANCE = 1e-5  # relative distance of the final weights to the failure-free twin
STRAGGLER_P = 0.25
# Lightning with a straggler being flagged when the kill lands can hang in the next epoch (seen
# on b79230b too: seed 70 of tests/fidelity/test_trials.py, trial 1); not fixed here, so the
# draw leaves Lightning without stragglers unless --lightning-stragglers (docs/reliability.md).
LIGHTNING_STRAGGLERS = False
PHASES = ("outside", "step_start", "backward", "allreduce", "optimizer", "epoch_boundary")


@dataclass(frozen=True)
class Setup:
    """What the twin shares with the killed run."""

    framework: str
    optimizer: str
    micro_batch: int
    accum: int
    dataset: int
    lr_step: int

    @property
    def global_batch(self) -> int:
        return WORKERS * self.micro_batch * self.accum

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.dataset / self.global_batch)

    def args(self) -> list[str]:
        common = ["--epochs", str(EPOCHS), "--optimizer", self.optimizer, "--lr-step", str(self.lr_step),
                  "--dataset", str(self.dataset)]
        if self.framework == "elastic":
            return common + ["--global-batch", str(self.global_batch), "--micro-batch", str(self.micro_batch)]
        if self.framework == "lightning":
            return common + ["--batch-size", str(self.micro_batch), "--accumulate", str(self.accum)]
        return common + ["--batch-size", str(self.micro_batch), "--accum", str(self.accum)]


@dataclass(frozen=True)
class Trial:
    index: int
    setup: Setup
    victim: int
    step: int
    phase: str
    force: Optional[str]
    delay_s: float
    straggler: Optional[int] = None  # a worker 4x slow from the first step

    def launch_args(self) -> list[str]:
        faults = [f"slow:rank={self.straggler}:factor=4"] if self.straggler is not None else []
        fault = self.fault()
        if fault:
            faults.append(fault[0])
        return ["--faults", ";".join(faults)] if faults else []

    def worker_args(self) -> list[str]:
        extra = ["--force-alloc", self.force] if self.force else []
        # emulated compute, so that the straggler's slowness is measurable (math unchanged)
        return extra + (["--mb-sleep", "0.01"] if self.straggler is not None else [])

    def fault(self) -> Optional[tuple[str, int, str]]:
        """(spec, step, phase) of an injected kill, or None for an outside SIGKILL."""
        if self.phase == "outside":
            return None
        step, phase = self.step, self.phase
        if phase == "epoch_boundary":
            spe = self.setup.steps_per_epoch
            step, phase = (spe - 1, "optimizer") if self.step % 2 else (spe, "step_start")
        return f"kill:rank={self.victim}:step={step}:phase={phase}", step, phase


def draw_setup(rng: random.Random, framework: str) -> Setup:
    micro = rng.choice([2, 4, 8, 16])
    accum = rng.choice([1, 2]) if framework != "elastic" else rng.choice([1, 2, 3])
    gb = WORKERS * micro * accum
    slots = gb // micro
    # Uneven last batch: sometimes fewer samples than micro-batch slots (empty slots, ghosts).
    rest = rng.randrange(1, slots) if rng.random() < 0.3 else rng.randrange(1, gb)
    steps = rng.randint(4, 7)
    return Setup(framework, rng.choice(["sgd", "adamw"]), micro, accum, gb * (steps - 1) + rest,
                 rng.randint(2, 5))


def draw(rng: random.Random, index: int, setup: Setup) -> Trial:
    total = EPOCHS * setup.steps_per_epoch
    kinds = [None, "uneven", "zero"] if setup.framework != "lightning" else [None, "uneven"]
    kind = rng.choice(kinds)
    force = f"{kind}:{rng.randrange(WORKERS)}" if kind else None
    victim = rng.randrange(WORKERS)
    step = rng.randint(2, total - 2)
    straggler = None
    if rng.random() < STRAGGLER_P:
        # A failure while the detector is flagging a straggler (3 slow steps in a row: steps
        # 0-2), so the recovery lands between two of its scores.
        straggler = rng.choice([w for w in range(WORKERS) if w != victim])
        step = rng.randint(1, 2)
        if setup.framework == "lightning" and not LIGHTNING_STRAGGLERS:
            straggler = None  # known hang, see LIGHTNING_STRAGGLERS (the draw stays the same)
    return Trial(index, setup, victim, step, rng.choice(PHASES), force, rng.uniform(0.0, 0.03), straggler)


class FidelityJob(ScriptJob):
    def __init__(self, run_dir: Path, setup: Setup, extra=(), launch_args=()):
        super().__init__(SCRIPTS[setup.framework], run_dir, *setup.args(), *extra, nproc=WORKERS,
                         launch_args=launch_args)


_TWINS: dict[Setup, dict] = {}


def twin(setup: Setup, root: Path) -> dict:
    """The failure-free run of ``setup`` (cached): lowest worker's final state."""
    if setup not in _TWINS:
        job = FidelityJob(root / f"twin-{len(_TWINS)}", setup)
        finals = job.run_to_end(timeout=180)
        assert sorted(finals) == list(range(WORKERS)), f"twin ended with workers {sorted(finals)}"
        assert_exactly_once(job.events(), dataset=setup.dataset, steps_per_epoch=setup.steps_per_epoch,
                            epochs=EPOCHS)
        _TWINS[setup] = assert_replicas_equal(finals)
    return _TWINS[setup]


def _step_key(framework: str) -> str:
    return {"elastic": "step", "lightning": "global_step", "accelerate": "step"}[framework]


def run_trial(trial: Trial, root: Path) -> dict:
    """Run ``trial`` and its twin; a JSON-able record of what was checked."""
    setup = trial.setup
    rec = {"trial": trial.index, **asdict(setup), "victim": trial.victim, "kill_step": trial.step,
           "phase": trial.phase, "force": trial.force, "straggler": trial.straggler, "ok": False, "problems": []}
    t0 = time.monotonic()
    try:
        ref = twin(setup, root)
        fault = trial.fault()
        job = FidelityJob(root / f"trial-{trial.index}", setup, trial.worker_args(), trial.launch_args())
        try:
            job.start()
            if fault is None:
                job.wait_step(trial.step, timeout=120)
                time.sleep(trial.delay_s)
                job.kill(trial.victim)
            try:
                codes = job.wait(180)
            except subprocess.TimeoutExpired:
                codes = None
        finally:
            job.cleanup()
        finals, evs = job.final(), job.events()
        rec["fired"] = trial.victim not in finals
        rec["exit"] = codes
        decisions = [e["decision"]["chosen"] for e in evs if e["event"] == "decision"]
        rec["decisions"] = decisions
        problems = rec["problems"]
        survivors = sorted(set(range(WORKERS)) - ({trial.victim} if rec["fired"] else set()))
        # Workers that all wrote their final state but did not exit are a teardown hang, not a
        # fidelity failure: recorded apart (``exit_hang``) and checked like any finished run.
        rec["exit_hang"] = codes is None and sorted(finals) == survivors and len(finals) >= WORKERS - 1
        if codes != [0] and not rec["exit_hang"]:
            problems.append(f"launcher exit {codes}: {job.output()[-1500:]}")
        if sorted(finals) != survivors:
            problems.append(f"final states from {sorted(finals)}, expected {survivors}")
        for name, check in (
                ("exactly-once", lambda: assert_exactly_once(
                    evs, dataset=setup.dataset, steps_per_epoch=setup.steps_per_epoch, epochs=EPOCHS)),
                ("replicas", lambda: assert_replicas_equal(finals))):
            try:
                check()
            except AssertionError as exc:
                problems.append(f"{name}: {exc}")
        if finals:
            got = finals[min(finals)]
            rec["rel_diff"] = rel_diff(got, ref)
            if not rec["rel_diff"] < TOLERANCE:
                problems.append(f"weights {rec['rel_diff']:.3g} from the twin (tolerance {TOLERANCE})")
            key = _step_key(setup.framework)
            if got[key] != ref[key]:
                problems.append(f"{key} {got[key]} vs twin {ref[key]}")
            if got["lr"] != ref["lr"]:
                problems.append(f"lr {got['lr']} vs twin {ref['lr']}")
            rec["zero_alloc_steps"] = _idle_steps(evs)
        rec["ok"] = not problems
    except Exception as exc:  # a harness error is a failed trial, with its reason
        rec["problems"].append(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}")
    rec["seconds"] = round(time.monotonic() - t0, 1)
    return rec


def _idle_steps(evs: list[dict]) -> int:
    """Committed-step records in which a member computed no micro-batch (ghost/idle)."""
    return sum(1 for e in evs if e["event"] == "step" and not e.get("ids"))


def summarise(records: list[dict]) -> dict:
    out = {}
    for fw in FRAMEWORKS:
        rs = [r for r in records if r["framework"] == fw]
        if not rs:
            continue
        diffs = [r["rel_diff"] for r in rs if "rel_diff" in r]
        out[fw] = {"trials": len(rs), "passed": sum(r["ok"] for r in rs),
                   "kills_fired": sum(bool(r.get("fired")) for r in rs),
                   "exit_hangs": [r["trial"] for r in rs if r.get("exit_hang")],
                   "max_rel_diff": max(diffs) if diffs else None,
                   "median_rel_diff": statistics.median(diffs) if diffs else None,
                   "failed": [r["trial"] for r in rs if not r["ok"]]}
    return out


def run_trials(n: int, frameworks, seed: int, root: Path, log=None, setups_per_framework: int = 3) -> list[dict]:
    """``n`` trials, frameworks in turn; each framework's set-ups come from a pool of
    ``setups_per_framework`` (so failure-free twins are shared) and every trial draws its own
    failure and forced allocation."""
    rng = random.Random(seed)
    pools = {fw: [draw_setup(rng, fw) for _ in range(setups_per_framework)] for fw in frameworks}
    records = []
    for i in range(n):
        fw = frameworks[i % len(frameworks)]
        rec = run_trial(draw(rng, i, rng.choice(pools[fw])), root)
        records.append(rec)
        if log is not None:
            log(rec)
    return records


def main(argv=None) -> int:
    import os

    os.environ.setdefault("CHAMELEON_FT_LOG_SAMPLES", "1")  # the exactly-once check reads the ids
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lightning-stragglers", action="store_true",
                   help="also draw stragglers for Lightning (a known hang, docs/reliability.md)")
    p.add_argument("--setups", type=int, default=3, help="set-ups per framework (twins are shared)")
    p.add_argument("--out", default=None, help="keep run directories and trials.jsonl here")
    a = p.parse_args(argv)
    global LIGHTNING_STRAGGLERS
    LIGHTNING_STRAGGLERS = a.lightning_stragglers
    frameworks = [f.strip() for f in a.frameworks.split(",") if f.strip()]
    bad = set(frameworks) - set(FRAMEWORKS)
    if bad or not frameworks:
        p.error(f"--frameworks: unknown {sorted(bad)}; choose among {list(FRAMEWORKS)}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the jobs' cleanup
    root = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="fidelity-"))
    root.mkdir(parents=True, exist_ok=True)
    jsonl = (root / "trials.jsonl").open("a")

    def log(rec):
        jsonl.write(json.dumps(rec) + "\n")
        jsonl.flush()
        status = "ok  " if rec["ok"] else "FAIL"
        print(f"{status} #{rec['trial']:3d} {rec['framework']:10s} {rec['optimizer']:5s} mb={rec['micro_batch']} "
              f"ga={rec['accum']} n={rec['dataset']} kill w{rec['victim']}@{rec['kill_step']}:{rec['phase']} "
              f"force={rec['force']} slow={rec['straggler']} fired={rec.get('fired')} rel={rec.get('rel_diff', float('nan')):.2e} "
              f"{rec['seconds']}s {'EXIT-HANG ' if rec.get('exit_hang') else ''}{'; '.join(p[:300] for p in rec['problems'])}", flush=True)

    try:
        records = run_trials(a.trials, frameworks, a.seed, root, log, a.setups)
    finally:
        jsonl.close()
    summary = summarise(records)
    (root / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    if not a.out:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if all(r["ok"] and not r.get("exit_hang") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
