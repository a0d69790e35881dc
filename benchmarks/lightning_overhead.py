"""Failure-free overhead of ``FaultToleranceCallback`` against plain ``strategy="ddp"``, and MTTR.

    python benchmarks/lightning_overhead.py [--runs 3] [--nproc 4] [--mb-sleep 0.02] [--epochs 2]
        [--sharded]

``--sharded``: the same with Lightning's FSDP2 recipe (``tests/lightning/_workers/lit_sharded.py``:
``ModelParallelStrategy(data_parallel_size=4, tensor_parallel_size=1)``, ``fully_shard`` in
``configure_model``; plain = Lightning's own strategy, a default process group over torchrun).

Runs ``tests/lightning/_workers/lit_train.py`` (a small LightningModule, CSVLogger,
ModelCheckpoint, StepLR, accumulate_grad_batches=2) with 4 CPU workers:

* plain: ``torchrun --nproc-per-node 4 lit_train.py --plain`` (strategy="ddp", no callback);
* ft:    ``chameleon-ft run --nproc-per-node 4 lit_train.py`` (the same plus the callback).

The figure is the time of ``trainer.fit`` (slowest worker; process start and imports are
excluded), median of ``--runs`` alternating runs, and the ratio ft/plain.  Accelerator
emulation: each micro-batch's ``training_step`` sleeps ``--mb-sleep`` seconds, so compute
scales with workers as on accelerators instead of time-sharing 2 CPU cores; ``--mb-sleep 0``
is plain CPU mode.  MTTR: one more ft run in which a worker is SIGKILLed at step 5; the
runtime's breakdown (failed collective -> first step committed after it) from the event log.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from chameleon_ft.cli.localjob import LocalJob  # noqa: E402

SCRIPT = ROOT / "tests" / "lightning" / "_workers" / "lit_train.py"
SHARDED = ROOT / "tests" / "lightning" / "_workers" / "lit_sharded.py"


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                OMP_NUM_THREADS="1")


def _fit_seconds(out: Path) -> float:
    finals = [torch.load(p, weights_only=True) for p in out.glob("final_*.pt")]
    if not finals:
        raise RuntimeError(f"no results in {out}")
    return max(f["fit_s"] for f in finals)


def run_plain(a, out: Path) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.nproc),
           "--master-port", str(29500 + os.getpid() % 1000), str(a.script), "--plain", "--out", str(out),
           "--epochs", str(a.epochs), "--mb-sleep", str(a.mb_sleep)]
    if not a.sharded:
        cmd += ["--devices", str(a.nproc)]
    subprocess.run(cmd, check=True, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=600)
    return _fit_seconds(out)


def run_ft(a, out: Path, kill_at: int | None = None) -> tuple[float, list[dict]]:
    extra = ["--snapshot-every", str(a.snapshot_every)] if a.sharded and a.snapshot_every is not None else []
    job = LocalJob(out, a.script, ["--out", str(out), "--epochs", str(a.epochs),
                                   "--mb-sleep", str(a.mb_sleep), *extra], nproc=a.nproc, env=_env())
    try:
        job.start()
        if kill_at is not None:
            job.wait_step(kill_at, timeout=120)
            job.kill(a.nproc - 1, signal.SIGKILL)
        if job.wait(600) != [0]:
            raise RuntimeError(job.output()[-3000:])
        return _fit_seconds(out), job.events()
    finally:
        job.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--mb-sleep", type=float, default=0.02, help="accelerator emulation (s per micro-batch)")
    p.add_argument("--sharded", action="store_true", help="Lightning's FSDP2 recipe (ModelParallelStrategy)")
    p.add_argument("--snapshot-every", type=int, default=None,
                   help="--sharded: steps between buddy snapshots (the script's default: 2; 0: none)")
    a = p.parse_args()
    a.script = SHARDED if a.sharded else SCRIPT
    name = "model_parallel (FSDP2)" if a.sharded else "ddp"
    mode = f"accelerator emulation ({a.mb_sleep * 1000:.0f} ms per micro-batch)" if a.mb_sleep else "plain CPU"
    plain, ft = [], []
    with tempfile.TemporaryDirectory(prefix="lightning-overhead-") as tmp:
        for i in range(a.runs):
            plain.append(run_plain(a, Path(tmp) / f"plain{i}"))
            ft.append(run_ft(a, Path(tmp) / f"ft{i}")[0])
            print(f"run {i}: plain {plain[-1]:.3f} s  ft {ft[-1]:.3f} s", flush=True)
        # Without snapshots a sharded job cannot recover a lost shard in memory (restart: exit 75).
        no_mttr = a.sharded and a.snapshot_every == 0
        events = [] if no_mttr else run_ft(a, Path(tmp) / "mttr", kill_at=5)[1]
    mp, mf = statistics.median(plain), statistics.median(ft)
    print(f"\n{a.nproc} CPU workers, {a.epochs} epochs x 8 steps, {mode}; trainer.fit seconds, "
          f"median of {a.runs}")
    print("| strategy | fit (s) | ratio |\n| --- | --- | --- |")
    print(f"| {name} (plain) | {mp:.3f} | 1.000 |")
    print(f"| {name} + FaultToleranceCallback | {mf:.3f} | {mf / mp:.3f} |")
    print(f"failure-free overhead: {100 * (mf / mp - 1):+.1f} %")
    for rec in (e for e in events if e["event"] == "recovery"):
        mttr = rec["mttr"]
        print("MTTR after a SIGKILL at step 5: " + ", ".join(
            f"{k} {1000 * v:.0f} ms" for k, v in mttr.items()))


if __name__ == "__main__":
    main()
