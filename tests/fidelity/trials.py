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
  is flagging when the kill lands (step 1-2).  Also (``--frameworks pipeline,sharded,trainer``)
  an ``ElasticTrainer`` DP x PP job (2 pipelines x 2 stages, micro-batch 2/4/8), a sharded one
  (FSDP over 4 or HSDP 2 x 2, snapshots every 5 steps) and the HF ``Trainer`` script (its
  evaluations and checkpoints every 4 steps): their scripts' own data, no forced allocation or
  straggler;
* failure: the victim (any worker, rank 0 included), the step (2 .. last - 2) and the moment:
  an outside SIGKILL by PID once the step started (plus 0-30 ms), or the fault injector's kill
  (``chameleon_ft/runtime/faults.py``) before the compute (``step_start``), in the backward,
  on entering the all-reduce, after the all-reduce before the update (``optimizer``: peers may
  have committed the step), or at the epoch boundary (the last step's update or the next
  epoch's start);
* checks: every epoch's sample ids exactly once (from the event log), bitwise-equal surviving
  replicas (parameters and optimizer state; the pipeline: each block's holders; sharded: the
  gathered parameters), the same committed steps and learning rate as the twin, and the final
  weights' relative distance to the twin's (``distance``; pass: < 1e-5) -- except where a
  sharded job rehabilitated a lost row (off the twin by design): there the final loss within
  10 % of the twin's.

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
import shlex
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
from _helpers.recovery import ScriptJob, UserLaunchedJob, assert_exactly_once, rel_diff  # noqa: E402
import torch  # noqa: E402

from chameleon_ft.runtime.env import RESTART_EXIT_CODE  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]
SCRIPTS = {
    "elastic": TESTS / "runtime" / "_workers" / "mlp_worker.py",
    "lightning": TESTS / "lightning" / "_workers" / "lit_train.py",
    "accelerate": TESTS / "accelerate" / "_workers" / "acc_train.py",
    "pipeline": TESTS / "runtime" / "_workers" / "pipe_worker.py",
    "sharded": TESTS / "runtime" / "_workers" / "shard_worker.py",
    "trainer": TESTS / "transformers" / "_workers" / "hf_train.py",
}
FRAMEWORKS = tuple(SCRIPTS)
DATA_PARALLEL = ("elastic", "lightning", "accelerate")  # the set-ups drawn freely (module doc)
WORKERS = 4
EPOCHS = 2
TOLERANCE = 1e-5  # relative distance of the final weights to the failure-free twin
STRAGGLER_P = 0.25
PHASES = ("outside", "step_start", "backward", "allreduce", "optimizer", "epoch_boundary")
# Fault kinds (``--kinds``): what the victim meets at the drawn step, and what the trial expects.
#   kill   SIGKILL (outside, or the injector's at a phase): lost; the survivors end on the twin
#   term   SIGTERM from outside: leaves at a step boundary, announced (a ``preemption`` record,
#          no step redone); on the twin
#   stop   SIGSTOP from outside: a hang, found by the heartbeats, the process killed by its
#          launcher; the survivors end on the twin
#   kill2  SIGKILL of the victim, then of a second worker one step later; on the twin
#   nan    the victim's loss NaN in the drawn step: skipped everywhere (a ``nonfinite`` record),
#          every worker finishes, replicas equal and finite; off the twin by one global batch
#          (data-parallel set-ups only: the pipeline and sharded executors do not check losses)
#   kill_recovery  SIGKILL of the victim, then of a second worker as soon as the first failure
#          is recorded: a failure during the recovery; on the twin
#   kill_partial  gloo's partial completion, as a SIGKILL inside the commit leaves it: the
#          drawn step's commit completes everywhere, one or two other workers report it failed
#          (a ``drop`` fault: they adopt it) and the victim dies right after its own (injected
#          at its ``optimizer`` phase); on the twin
#   kill_save  (ElasticTrainer, checkpoint every SAVE_EVERY steps) rank 0, the checkpoint's
#          writer, SIGKILLed inside a save, its data in the temporary file and not yet renamed:
#          the survivors end on the twin and the checkpoint they leave loads, at the last step
KINDS = ("kill", "term", "stop", "kill2", "nan", "kill_recovery", "kill_save", "kill_partial")
SAVE_EVERY = 4
# The fault points ``ElasticTrainer``'s sharded step passes (its forward and backward are one
# pass: ``forward``); the drawn step_start, backward and epoch boundary map to its forward.
SHARDED_PHASES = ("outside", "forward", "allreduce", "optimizer")


@dataclass(frozen=True)
class Setup:
    """What the twin shares with the killed run.  ``variant``: the sharded set-up's ``full``
    (FSDP over 4) or ``hybrid`` (HSDP 2 x 2); the pipeline runs 2 pipelines x 2 stages."""

    framework: str
    optimizer: str
    micro_batch: int
    accum: int
    dataset: int
    lr_step: int
    variant: str = ""

    @property
    def global_batch(self) -> int:
        return WORKERS * self.micro_batch * self.accum

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.dataset / self.global_batch)

    def args(self) -> list[str]:
        fw = self.framework
        if fw == "trainer":  # the HF Trainer script's own set-up (classifier, eval and saves, 16 steps)
            return []
        if fw == "pipeline":
            return ["--epochs", str(EPOCHS), "--stages", "2", "--blocks", "4", "--block-sleep", "0.002",
                    "--global-batch", str(self.global_batch), "--micro-batch", str(self.micro_batch)]
        if fw == "sharded":
            return ["--steps", str(EPOCHS * self.steps_per_epoch), "--sharding", self.variant,
                    "--global-batch", str(self.global_batch), "--micro-batch", str(self.micro_batch),
                    "--snapshot-every", "5"]
        common = ["--epochs", str(EPOCHS), "--optimizer", self.optimizer, "--lr-step", str(self.lr_step),
                  "--dataset", str(self.dataset)]
        if fw == "elastic":
            return common + ["--global-batch", str(self.global_batch), "--micro-batch", str(self.micro_batch)]
        if fw == "lightning":
            return common + ["--batch-size", str(self.micro_batch), "--accumulate", str(self.accum)]
        return common + ["--batch-size", str(self.micro_batch), "--accum", str(self.accum)]

    @property
    def phases(self) -> tuple[str, ...]:
        return SHARDED_PHASES if self.framework == "sharded" else PHASES

    @property
    def kinds(self) -> tuple[str, ...]:
        """The fault kinds this set-up can meet (``KINDS``)."""
        return tuple(k for k in KINDS if (k != "nan" or self.framework not in ("pipeline", "sharded"))
                     and (k != "kill_save" or self.framework == "elastic"))


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
    kind: str = "kill"  # KINDS
    second: Optional[int] = None  # kill2: the worker killed one step after the victim
    launch: str = "run"  # "run": chameleon-ft run; "user": the framework's own way (USER_LAUNCH)
    dropped: tuple[int, ...] = ()  # kill_partial: the workers whose commit is reported failed

    def launch_args(self) -> list[str]:
        faults = [f"slow:rank={self.straggler}:factor=4"] if self.straggler is not None else []
        fault = self.fault()
        if fault:
            faults.append(fault[0])
        return ["--faults", ";".join(faults)] if faults else []

    def worker_args(self, run_dir: Optional[Path] = None) -> list[str]:
        extra = ["--force-alloc", self.force] if self.force else []
        if self.kind == "kill_save" and run_dir is not None:
            extra += ["--checkpoint", str(run_dir / "ckpt.pt"), "--checkpoint-every", str(SAVE_EVERY)]
        # emulated compute (math unchanged), so that the straggler's slowness is measurable and a
        # signal sent from outside at a step lands before the job's 1-2 ms steps ran to the end
        slow = self.straggler is not None or self.kind in ("term", "stop", "kill2", "kill_recovery", "kill_partial")
        fw = self.setup.framework
        if fw == "pipeline":  # its blocks' emulated compute is in the set-up
            return extra
        if fw == "sharded":
            return extra + ["--step-sleep", "0.01" if slow else "0.002"]
        return extra + (["--mb-sleep", "0.01"] if slow or fw == "trainer" else [])

    @property
    def lost(self) -> tuple[int, ...]:
        """The workers the trial ends without."""
        if self.kind == "nan":
            return ()
        return (self.victim,) if self.second is None else (self.victim, self.second)

    @property
    def signal_from_outside(self) -> bool:
        return self.fault() is None

    def fault(self) -> Optional[tuple[str, int, str]]:
        """(spec, step, phase) of an injected fault, or None for an outside signal."""
        if self.kind == "nan":
            return f"nan:rank={self.victim}:step={self.step}:phase=backward", self.step, "backward"
        if self.kind == "kill_partial":
            dropped = ",".join(map(str, self.dropped))
            return (f"drop:rank={dropped}:step={self.step}:phase=commit;"
                    f"kill:rank={self.victim}:step={self.step}:phase=optimizer"), self.step, "optimizer"
        if self.phase == "outside":
            return None
        step, phase = self.step, self.phase
        if phase == "epoch_boundary":
            spe = self.setup.steps_per_epoch
            step, phase = (spe - 1, "optimizer") if self.step % 2 else (spe, "step_start")
        return f"kill:rank={self.victim}:step={step}:phase={phase}", step, phase


def draw_launch(trial: Trial, p: float) -> Trial:
    """With probability ``p`` (its own stream, so the other draws stay as they were), start the
    trial the way the framework's users start it (``USER_LAUNCH``) instead of ``chameleon-ft run``."""
    from dataclasses import replace
    if trial.setup.framework in USER_LAUNCH and random.Random(trial.index * 7919 + 13).random() < p:
        return replace(trial, launch="user")
    return trial


def draw_setup(rng: random.Random, framework: str) -> Setup:
    if framework == "trainer":  # hf_train.py's one set-up: 256 samples, 4 x 4 x accumulation 2
        return Setup(framework, "adamw", 4, 2, 256, 0)
    if framework in ("pipeline", "sharded"):  # global batch 32 over the workers' fixed data
        micro, accum = rng.choice([(2, 4), (4, 2), (8, 1)])
        variant = rng.choice(["full", "hybrid"]) if framework == "sharded" else ""
        return Setup(framework, "adamw" if framework == "pipeline" else "adam", micro, accum,
                     256 if framework == "pipeline" else 512, 5, variant)
    micro = rng.choice([2, 4, 8, 16])
    accum = rng.choice([1, 2]) if framework != "elastic" else rng.choice([1, 2, 3])
    gb = WORKERS * micro * accum
    slots = gb // micro
    # Uneven last batch: sometimes fewer samples than micro-batch slots (empty slots, ghosts).
    rest = rng.randrange(1, slots) if rng.random() < 0.3 else rng.randrange(1, gb)
    steps = rng.randint(4, 7)
    return Setup(framework, rng.choice(["sgd", "adamw"]), micro, accum, gb * (steps - 1) + rest,
                 rng.randint(2, 5))


def draw(rng: random.Random, index: int, setup: Setup, kinds=("kill",)) -> Trial:
    """One trial on ``setup``; with several ``kinds`` the fault kind is drawn last (a draw of
    kills only is the one it always was)."""
    trial = _draw_kill(rng, index, setup)
    if tuple(kinds) == ("kill",):
        return trial
    kind = rng.choice([k for k in kinds if k in setup.kinds] or ["kill"])
    total = EPOCHS * setup.steps_per_epoch
    changes: dict = {"kind": kind}
    if kind in ("term", "stop", "kill2", "kill_recovery"):
        changes["phase"] = "outside"  # a signal from outside, as a cluster manager sends it
    if kind in ("kill2", "kill_recovery"):
        changes["second"] = rng.choice([w for w in range(WORKERS) if w != trial.victim])
        changes["step"] = min(trial.step, total - 3)
    if kind in ("stop", "nan", "kill2", "kill_recovery", "kill_save", "kill_partial"):
        changes["straggler"] = None
    if kind == "kill_partial":
        others = [w for w in range(WORKERS) if w != trial.victim]
        changes.update(phase="optimizer", dropped=tuple(sorted(rng.sample(others, rng.randint(1, 2)))))
    if kind == "kill_save":  # rank 0 writes the checkpoint: killed in a save after step S
        changes.update(victim=0, phase="save", step=SAVE_EVERY * rng.randint(1, max(1, (total - 2) // SAVE_EVERY)))
    from dataclasses import replace
    return replace(trial, **changes)


def _draw_kill(rng: random.Random, index: int, setup: Setup) -> Trial:
    total = EPOCHS * setup.steps_per_epoch
    kinds = [None, "uneven", "zero"] if setup.framework != "lightning" else [None, "uneven"]
    kind = rng.choice(kinds)
    force = f"{kind}:{rng.randrange(WORKERS)}" if kind else None
    if setup.framework not in DATA_PARALLEL:
        force = None  # (the draw stays the same) only the data-parallel scripts force allocations
    victim = rng.randrange(WORKERS)
    step = rng.randint(2, total - 2)
    straggler = None
    if rng.random() < STRAGGLER_P:
        # A failure while the detector is flagging a straggler (3 slow steps in a row: steps
        # 0-2), so the recovery lands between two of its scores.
        straggler = rng.choice([w for w in range(WORKERS) if w != victim])
        step = rng.randint(1, 2)
        if setup.framework not in DATA_PARALLEL:
            straggler = None  # stragglers are the data-parallel trials' dimension
    phase = rng.choice(PHASES)
    if phase not in setup.phases:
        phase = "forward"  # (sharded: SHARDED_PHASES)
    return Trial(index, setup, victim, step, phase, force, rng.uniform(0.0, 0.03), straggler)


ACCELERATE_LAUNCH = [shutil.which("accelerate") or "accelerate", "launch", "--multi_gpu", "--num_processes",
                     str(WORKERS), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                     "--main_process_port", "0"]
# How each framework's users start a job: Lightning's ``python train.py`` with ``devices=4``
# (the process becomes our launcher), ``accelerate launch`` (torchrun's local rank 0 does).
USER_LAUNCH = {"lightning": ([sys.executable], ["--devices", str(WORKERS)]),
               "accelerate": (ACCELERATE_LAUNCH, []), "trainer": (ACCELERATE_LAUNCH, [])}


def make_job(trial: Trial, run_dir: Path) -> ScriptJob:
    """The trial's job, started by ``chameleon-ft run`` or as the framework's users start it
    (the launcher's flags -- the faults, the watchdog -- then travel in ``CHAMELEON_FT_RUN_ARGS``)."""
    setup = trial.setup
    if trial.launch == "run":
        return FidelityJob(run_dir, setup, trial.worker_args(run_dir), trial.launch_args())
    prefix, extra = USER_LAUNCH[setup.framework]
    env = {"CHAMELEON_FT_RUN_ARGS": shlex.join(["--hang-timeout", "5", *trial.launch_args()]),
           "HF_HOME": str(run_dir / "hf")}
    return UserLaunchedJob(SCRIPTS[setup.framework], run_dir, *setup.args(), *trial.worker_args(run_dir), *extra,
                           prefix=prefix, env=env)


class FidelityJob(ScriptJob):
    def __init__(self, run_dir: Path, setup: Setup, extra=(), launch_args=()):
        env = {"HF_HOME": str(run_dir / "hf")} if setup.framework == "trainer" else None
        if setup.framework == "pipeline":  # 4 processes of 2 stages on 2 loaded cores (test_pipeline_recovery)
            launch_args = ("--heartbeat-timeout", "3", *launch_args)
        super().__init__(SCRIPTS[setup.framework], run_dir, *setup.args(), *extra, nproc=WORKERS,
                         launch_args=launch_args, env=env)


_TWINS: dict[Setup, dict] = {}


def twin(setup: Setup, root: Path) -> dict:
    """The failure-free run of ``setup`` (cached): every worker's final state."""
    if setup not in _TWINS:
        job = FidelityJob(root / f"twin-{len(_TWINS)}", setup)
        finals = job.run_to_end(timeout=240)
        assert sorted(finals) == list(range(WORKERS)), f"twin ended with workers {sorted(finals)}"
        assert_exactly_once(job.events(), dataset=setup.dataset, steps_per_epoch=setup.steps_per_epoch,
                            epochs=EPOCHS)
        replicas(setup, finals)
        _TWINS[setup] = finals
    return _TWINS[setup]


def _step_key(framework: str) -> str:
    return "global_step" if framework in ("lightning", "trainer") else "step"


def _copies(setup: Setup, finals: dict[int, dict]) -> dict[str, list[tuple[int, list]]]:
    """What must be equal across workers, by name: [(worker, its tensors)].  Data parallel:
    the parameters and optimizer state; the pipeline: each block's, over the workers holding it;
    sharded: the gathered parameters."""
    out: dict[str, list] = {}
    for w, f in sorted(finals.items()):
        if setup.framework == "pipeline":
            for b, st in f["blocks"].items():
                out.setdefault(f"block {b}", []).append((w, st["params"] + st["optim"]))
        elif setup.framework == "sharded":
            out.setdefault("params", []).append((w, [f["params"][n] for n in sorted(f["params"])]))
        else:
            out.setdefault("params", []).append((w, f["params"] + f.get("momentum", [])))
    return out


def replicas(setup: Setup, finals: dict[int, dict]) -> None:
    """Every copy bitwise equal to the lowest worker's (AssertionError naming the first that is not)."""
    for name, copies in _copies(setup, finals).items():
        (w0, first), rest = copies[0], copies[1:]
        for w, ts in rest:
            assert len(ts) == len(first) and all(torch.equal(a, b) for a, b in zip(ts, first)), (
                f"{name}: worker {w}'s copy differs from worker {w0}'s")


def distance(setup: Setup, finals: dict[int, dict], ref: dict[int, dict]) -> float:
    """Largest relative distance of the parameters to the twin's (``rel_diff``)."""
    if setup.framework == "pipeline":  # each block's first holder against the twin's
        def held(fs):
            return {b: st["params"] for _, f in sorted(fs.items()) for b, st in reversed(list(f["blocks"].items()))}
        got, want = held(finals), held(ref)
        if sorted(got) != sorted(want):
            return math.inf
        return max(float((x - y).norm() / y.norm()) for b in want for x, y in zip(got[b], want[b]))
    a, b = finals[min(finals)], ref[min(ref)]
    if setup.framework == "sharded":
        return max(float((a["params"][n] - b["params"][n]).norm() / b["params"][n].norm()) for n in b["params"])
    return rel_diff(a, b)


def run_trial(trial: Trial, root: Path) -> dict:
    """Run ``trial`` and its twin; a JSON-able record of what was checked."""
    setup = trial.setup
    rec = {"trial": trial.index, **asdict(setup), "kind": trial.kind, "victim": trial.victim,
           "second": trial.second, "dropped": list(trial.dropped), "kill_step": trial.step, "phase": trial.phase, "force": trial.force,
           "straggler": trial.straggler, "launch": trial.launch, "ok": False, "problems": []}
    t0 = time.monotonic()
    try:
        ref = twin(setup, root)
        fault = trial.fault()
        job = make_job(trial, root / f"trial-{trial.index}")
        try:
            job.start()
            if fault is None:
                job.wait_step(trial.step, timeout=120)
                time.sleep(trial.delay_s)
                job.kill(trial.victim, _SIGNALS[trial.kind])
                if trial.kind == "kill_recovery":  # the survivors are recovering: the second dies
                    job.wait_for(lambda evs: any(e["event"] == "failure" for e in evs), 120, "a failure record")
                    job.kill(trial.second)
                elif trial.second is not None:
                    job.wait_step(trial.step + 1, timeout=120)
                    job.kill(trial.second)
            try:
                codes = job.wait(180)
            except subprocess.TimeoutExpired:
                codes = None
            pids = list(job.worker_pids().values())
            rec["leftover"] = [pid for pid in pids if _alive(pid)]
        finally:
            job.cleanup()
        finals, evs = job.final(), job.events()
        lost = set(trial.lost)
        if trial.kind == "nan":
            rec["fired"] = any(trial.victim in e.get("workers", ()) for e in evs if e["event"] == "nonfinite")
        else:
            rec["fired"] = trial.victim not in finals
        rec["exit"] = codes
        rec["adopted"] = sorted(e["worker"] for e in evs if e["event"] == "run_end" and e.get("adopted_steps"))
        decisions = [e["decision"]["chosen"] for e in evs if e["event"] == "decision"]
        rec["decisions"] = decisions
        recoveries = [e for e in evs if e["event"] == "recovery"]
        if recoveries:
            rec["mttr_s"] = recoveries[0]["mttr"]["total"]
        problems = rec["problems"]
        if rec["leftover"]:
            problems.append(f"worker processes left running after the job: {rec['leftover']}")
        problems += _kind_problems(trial, evs, rec["fired"])
        if trial.kind == "kill_save":
            problems += _save_problems(job.run_dir, finals, rec)
        survivors = sorted(set(range(WORKERS)) - ({w for w in lost if w not in finals}))
        # Workers that all wrote their final state but did not exit are a teardown hang, not a
        # fidelity failure: recorded apart (``exit_hang``) and checked like any finished run.
        rec["exit_hang"] = codes is None and sorted(finals) == survivors and len(finals) >= WORKERS - 1
        if len(lost) > 1 and codes == [RESTART_EXIT_CODE] and _nothing_survived(evs):
            # Both holders of some state lost (a pipeline's stage, an HSDP row pair): the case
            # calls for a checkpoint-restart, which the job asked its launcher for.
            rec["outcome"] = "restart"
            if "rerun the same command" not in job.output():
                problems.append("a checkpoint-restart without the launcher's message")
        elif codes != [0] and not rec["exit_hang"]:
            problems.append(f"launcher exit {codes}: {job.output()[-1500:]}")
        if rec.get("outcome") != "restart":  # (a restart stopped as the case calls for: nothing to compare)
            if sorted(finals) != survivors:
                problems.append(f"final states from {sorted(finals)}, expected {survivors}")
            problems += _against_twin(trial, finals, ref, evs, rec)
        rec["ok"] = not problems
    except Exception as exc:  # a harness error is a failed trial, with its reason
        rec["problems"].append(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}")
    rec["seconds"] = round(time.monotonic() - t0, 1)
    return rec


def _against_twin(trial: Trial, finals: dict, ref: dict, evs: list[dict], rec: dict) -> list[str]:
    """The common checks of a run that went on: exactly-once data, equal replicas, and the
    twin's weights (1e-5), steps and learning rate -- a skipped NaN step only finite weights,
    a rehabilitated sharded row the rehabilitation rule.  Fills ``rec``; returns the problems."""
    setup, problems = trial.setup, []
    for name, check in (
            ("exactly-once", lambda: assert_exactly_once(
                evs, dataset=setup.dataset, steps_per_epoch=setup.steps_per_epoch, epochs=EPOCHS)),
            ("replicas", lambda: replicas(setup, finals))):
        try:
            check()
        except AssertionError as exc:
            problems.append(f"{name}: {exc}")
    if not finals:
        return problems
    got, want = finals[min(finals)], ref[min(ref)]
    rec["rel_diff"] = distance(setup, finals, ref)
    rehab = [e for e in evs if e["event"] == "shard_recovery" and e.get("chosen") == "rehabilitate"]
    rec["rehabilitated"] = bool(rehab)
    if trial.kind == "nan" and rec["fired"]:  # one global batch skipped: off the twin, finite
        if not all(bool(torch.isfinite(p).all()) for p in got["params"]):
            problems.append("non-finite weights after a skipped NaN step")
    elif rehab:  # the rehabilitation rule: off the twin by design, its loss ends where the twin's does
        end, end_ref = got["loss"][-1][1], want["loss"][-1][1]
        if not abs(end - end_ref) < 0.1 * end_ref:
            problems.append(f"rehabilitated: final loss {end:.4g} vs the twin's {end_ref:.4g} (10 %)")
    elif not rec["rel_diff"] < TOLERANCE:
        problems.append(f"weights {rec['rel_diff']:.3g} from the twin (tolerance {TOLERANCE})")
    key = _step_key(setup.framework)
    if got[key] != want[key]:
        problems.append(f"{key} {got[key]} vs twin {want[key]}")
    if "lr" in want and got["lr"] != want["lr"]:
        problems.append(f"lr {got['lr']} vs twin {want['lr']}")
    rec["zero_alloc_steps"] = _idle_steps(evs)
    return problems


_SIGNALS = {"kill": signal.SIGKILL, "kill2": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP,
            "nan": None, "kill_recovery": signal.SIGKILL, "kill_partial": None}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _kind_problems(trial: Trial, evs: list[dict], fired: bool) -> list[str]:
    """What the fault kind itself promises (module doc, ``KINDS``), beyond the common checks."""
    failures = [e for e in evs if e["event"] == "failure"]
    out = []
    if trial.kind == "term" and fired:
        kinds = [(e["workers"], e["kind"]) for e in failures]
        if kinds != [([trial.victim], "preemption")]:
            out.append(f"a SIGTERM not announced as a leave: failure records {kinds}")
        attempts = [(e.get("worker"), e["step"]) for e in evs if e["event"] == "step"]
        if len(attempts) != len(set(attempts)):
            out.append("a step was redone after a SIGTERM")
    if trial.kind == "nan":
        if failures:
            out.append(f"a NaN step made failures: {[(e['workers'], e['kind']) for e in failures]}")
        bad = [e for e in evs if e["event"] == "nonfinite" and e.get("worker") == trial.victim]
        if fired and not all(e.get("action") == "skip" for e in bad):
            out.append(f"a single NaN step did not skip: {bad}")
    return out


def _save_problems(run_dir: Path, finals: dict, rec: dict) -> list[str]:
    """``kill_save``: the kill landed inside the save (the victim's temporary file is left),
    and the checkpoint the survivors leave -- and the one it replaced -- load, the newest at
    their last step (no torn file at the checkpoint's path, ever)."""
    from chameleon_ft.runtime.codec import load_checkpoint, previous_of

    out, path = [], run_dir / "ckpt.pt"
    rec["torn_tmp"] = sorted(p.name for p in run_dir.glob("ckpt.pt.tmp.*"))
    if rec["fired"] and not rec["torn_tmp"]:
        out.append("the victim was killed, but not inside a save (no temporary file of its write)")
    steps = []
    for p in (path, Path(previous_of(path))):
        if p != path and not p.exists():
            continue  # the survivors' first save replaced nothing
        try:
            steps.append(int(load_checkpoint(p, fallback=False)["step"]))
        except Exception as exc:  # CheckpointError, or missing
            out.append(f"{p.name} does not load: {exc}")
    rec["checkpoint_steps"] = steps
    last = max((int(f["step"]) for f in finals.values()), default=None)
    if steps and steps[0] != last:
        out.append(f"the checkpoint is at step {steps[0]}, the survivors ended at {last}")
    return out


def _nothing_survived(evs: list[dict]) -> bool:
    """The last Decision found no surviving copy of some state (a pipeline's layers, a sharded
    row and its snapshot): only a restart can go on."""
    decisions = [e["decision"] for e in evs if e["event"] == "decision"]
    if not decisions or decisions[-1].get("chosen") not in (None, "restart"):
        return False
    last = decisions[-1]
    reasons = [c.get("reason") or "" for c in last.get("candidates", ())]
    reasons += [c.get("reason") or "" for c in (last.get("shard") or {}).get("candidates", {}).values()]
    return any("no surviving" in r for r in reasons)


def _idle_steps(evs: list[dict]) -> int:
    """Committed-step records in which a member computed no micro-batch (ghost/idle)."""
    return sum(1 for e in evs if e["event"] == "step" and not e.get("ids"))


def summarise_kinds(records: list[dict]) -> dict:
    """By fault kind: trials, passed, fired, median and max MTTR (the first recovery's total)."""
    out = {}
    for kind in KINDS:
        rs = [r for r in records if r.get("kind", "kill") == kind]
        if not rs:
            continue
        mttr = [r["mttr_s"] for r in rs if "mttr_s" in r]
        out[kind] = {"trials": len(rs), "passed": sum(r["ok"] for r in rs), "fired": sum(bool(r.get("fired")) for r in rs),
                     "restarts": sum(r.get("outcome") == "restart" for r in rs),
                     "frameworks": sorted({r["framework"] for r in rs}),
                     "median_mttr_s": statistics.median(mttr) if mttr else None, "max_mttr_s": max(mttr) if mttr else None,
                     "failed": [r["trial"] for r in rs if not r["ok"]]}
    return out


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
                   "user_launched": sum(r.get("launch") == "user" for r in rs),
                   "max_rel_diff": max(diffs) if diffs else None,
                   "median_rel_diff": statistics.median(diffs) if diffs else None,
                   "failed": [r["trial"] for r in rs if not r["ok"]]}
    return out


def run_trials(n: int, frameworks, seed: int, root: Path, log=None, setups_per_framework: int = 3,
               kinds=("kill",), user_launch: float = 0.0) -> list[dict]:
    """``n`` trials, frameworks in turn; each framework's set-ups come from a pool of
    ``setups_per_framework`` (so failure-free twins are shared) and every trial draws its own
    failure (of ``kinds``) and forced allocation, and with probability ``user_launch`` is
    started the framework's own way (``draw_launch``)."""
    rng = random.Random(seed)
    pools = {fw: [draw_setup(rng, fw) for _ in range(setups_per_framework)] for fw in frameworks}
    records = []
    for i in range(n):
        fw = frameworks[i % len(frameworks)]
        rec = run_trial(draw_launch(draw(rng, i, rng.choice(pools[fw]), kinds), user_launch), root)
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
    p.add_argument("--setups", type=int, default=3, help="set-ups per framework (twins are shared)")
    p.add_argument("--out", default=None, help="keep run directories and trials.jsonl here")
    p.add_argument("--kinds", default="kill", help=f"fault kinds to draw from, of {','.join(KINDS)} (default kill)")
    p.add_argument("--user-launch", type=float, default=0.0,
                   help="share of Lightning/Accelerate/Trainer trials started the framework's own way "
                        "(python train.py, accelerate launch) instead of chameleon-ft run")
    p.add_argument("--markdown", default=None,
                   help="write the summary by fault kind and framework into this file's generated block "
                        "(docs/reliability.md)")
    a = p.parse_args(argv)
    kinds = tuple(k.strip() for k in a.kinds.split(",") if k.strip())
    if not kinds or set(kinds) - set(KINDS):
        p.error(f"--kinds: choose among {list(KINDS)}")
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
              f"ga={rec['accum']} n={rec['dataset']} {rec['kind']} w{rec['victim']}@{rec['kill_step']}:{rec['phase']} "
              f"force={rec['force']} slow={rec['straggler']} {rec['launch']} fired={rec.get('fired')} rel={rec.get('rel_diff', float('nan')):.2e} "
              f"{rec['seconds']}s {'EXIT-HANG ' if rec.get('exit_hang') else ''}{'; '.join(p[:300] for p in rec['problems'])}", flush=True)

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        records = run_trials(a.trials, frameworks, a.seed, root, log, a.setups, kinds, a.user_launch)
    finally:
        jsonl.close()
    summary = {"by_framework": summarise(records), "by_kind": summarise_kinds(records)}
    (root / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    if a.markdown:
        command = "python -m tests.fidelity.trials " + " ".join(argv if argv is not None else sys.argv[1:])
        write_markdown(Path(a.markdown), records, command, started)
    if not a.out:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if all(r["ok"] and not r.get("exit_hang") for r in records) else 1


BEGIN, END = "<!-- chaos summary: generated by tests/fidelity/trials.py --markdown -->", "<!-- end of chaos summary -->"


def markdown(records: list[dict], command: str, started: str) -> str:
    """The summary by fault kind and by framework, as the generated block of docs/reliability.md."""
    kinds, fws = summarise_kinds(records), summarise(records)
    fmt = lambda x: "-" if x is None else f"{x:.3f} s"  # noqa: E731
    lines = [BEGIN, f"`{command}` ({started}; {len(records)} trials, "
             f"{sum(r['ok'] for r in records)} passed).", "",
             "| fault kind | trials | passed | fired | restarts | frameworks | MTTR median | MTTR max | failed trials |",
             "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |"]
    for kind, k in kinds.items():
        lines.append(f"| {kind} | {k['trials']} | {k['passed']} | {k['fired']} | {k['restarts']} | {', '.join(k['frameworks'])} | "
                     f"{fmt(k['median_mttr_s'])} | {fmt(k['max_mttr_s'])} | {k['failed'] or '-'} |")
    lines += ["", "| framework | trials | passed | started the framework's way | max rel. diff (on-twin trials) | "
              "exit hangs | failed trials |", "| --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for fw, f in fws.items():
        on_twin = [r["rel_diff"] for r in records if r["framework"] == fw and "rel_diff" in r
                   and not (r.get("kind") == "nan" and r.get("fired")) and not r.get("rehabilitated")]
        worst = f"{max(on_twin):.1e}" if on_twin else "-"
        lines.append(f"| {fw} | {f['trials']} | {f['passed']} | {f['user_launched']} | {worst} | "
                     f"{f['exit_hangs'] or '-'} | {f['failed'] or '-'} |")
    return "\n".join(lines + ["", END])


def write_markdown(path: Path, records: list[dict], command: str, started: str) -> None:
    """Replace the generated block of ``path`` (or append one)."""
    write_block(path, markdown(records, command, started), BEGIN, END)


def write_block(path: Path, block: str, begin: str, end: str) -> None:
    """Replace the block between ``begin`` and ``end`` in ``path`` by ``block`` (or append it)."""
    text = path.read_text() if path.exists() else ""
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
