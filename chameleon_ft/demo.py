"""``chameleon-ft demo``: watch a job survive a worker killed from outside.

A few local CPU workers train a small classifier (``chameleon_ft/examples/demo_train.py``,
embedded data, no services to start, no network) under ``chameleon-ft run``.  Mid-run the
demo sends SIGKILL to one worker's PID — from outside, like a crashed host would — then shows
the engine's Decision (every candidate with its predicted figures and the choice), the recovery
with its MTTR breakdown, and the end of training.  It writes the event log and a throughput
plot and says where.

By default the launcher may start one replacement (``--replacements 1``), expected within the
runtime's configured ``replacement_eta_s`` (5 s), so the engine weighs ``wait`` (reroute until
the replacement arrives, then heal it) against carrying on rerouted for good, over ``D``, the
expected time to the next failure (estimated from a per-device failure rate and this run, or
fixed with ``--mttf``).  With the estimate (days) waiting wins; with ``--mttf 5`` the next failure
is expected before the replacement can help, so ``wait`` scores the same as ``reroute`` and the
engine reroutes (equal scores go to the shorter transition).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path

from rich.console import Console

from .examples import demo_train
from .localjob import LocalJob
from .report import render


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="chameleon-ft demo", description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--kill-rank", type=int, default=2, help="worker id to SIGKILL (-1: none)")
    ap.add_argument("--at-step", type=int, default=12, help="kill once this many steps committed")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--mb-sleep", type=float, default=0.02, help="emulated compute per micro-batch (s)")
    ap.add_argument("--run-dir", default=None, help="default: runs/demo-<time>")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--replacements", type=int, default=1, help="replacement workers the launcher may start")
    ap.add_argument("--mttf", type=float, default=None, metavar="SECONDS",
                    help="fix D, the expected time to the next failure (default: estimated)")
    args = ap.parse_args(argv)
    if args.workers < 2:
        ap.error("--workers must be at least 2 (one of them dies)")
    if args.kill_rank >= args.workers:
        ap.error(f"--kill-rank must be below --workers ({args.workers})")
    if args.mttf is not None and not args.mttf > 0:
        ap.error("--mttf must be a positive number of seconds")
    if args.replacements < 0:
        ap.error("--replacements must be >= 0")
    console = Console(width=None if sys.stdout.isatty() else 120)
    run_dir = Path(args.run_dir or f"runs/demo-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    job = LocalJob(run_dir, demo_train.__file__, ["--epochs", str(args.epochs), "--mb-sleep", str(args.mb_sleep),
                                                  "--out", str(run_dir)], nproc=args.workers, hang_timeout=5,
                   max_replacements=args.replacements,
                   launch_args=[] if args.mttf is None else ["--mttf", repr(args.mttf)])
    console.print(f"[bold]chameleon-ft demo[/]: {args.workers} CPU workers train a small classifier; "
                  + (f"worker {args.kill_rank} gets SIGKILL from outside after step {args.at_step}."
                     if args.kill_rank >= 0 else "no failure injected."))
    console.print("$ chameleon-ft run " + " ".join(job.command()[4:]), style="dim")
    try:
        with console.status("starting workers...") as status:
            code = job.drive(args.kill_rank, args.at_step, args.timeout,
                             on_tick=lambda done, pids: status.update(f"{len(pids)} workers, step {done} committed"),
                             on_kill=lambda w, pid, done: console.print(
                                 f"[red]✗ SIGKILL[/] worker {w} (pid {pid}) after step {done}"))
        if code is None:
            console.print(f"[red]timed out after {args.timeout:g} s[/]")
            return 1
    finally:
        job.cleanup()
    console.print(f"launcher exited with {code}" + ("" if code == 0 else f" (see {run_dir / 'launcher0.out'})"))
    summary = render(run_dir, console)
    finals = [json.loads(p.read_text()) for p in sorted(run_dir.glob("final_*.json"))]
    for f in finals:
        console.print(f"worker {f['worker']}: {f['step']} steps, members {f['members']}, "
                      f"accuracy {f['accuracy']:.3f}, loss {f['loss']:.4f}")
    console.print(f"event log: {run_dir / 'events.jsonl'}")
    console.print(f"throughput plot: {summary.get('plot')}")
    if code != 0 or not finals:
        return code or 1
    return 0
