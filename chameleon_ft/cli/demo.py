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
fixed with ``--mttf``).  With the estimate (days) waiting wins; with ``--mttf 3`` the next failure
is expected before the replacement can help, so ``wait`` scores the same as ``reroute`` and the
engine reroutes (equal scores go to the shorter transition).

``--pipeline``: the same kill on a DP x PP job (``examples/pipeline_train.py``, an 8-block MLP
with emulated compute per block; 8 workers as 2 pipelines x 4 stages; a middle-stage worker,
2 by default, killed by PID), run twice -- once with only ``reroute`` allowed (the dead stage's
micro-batches go to its same-stage peer in the other pipeline; no state moves) and once with
only ``replan`` (a new layout over the 7 survivors, blocks migrated point to point) -- each
rendered with the Decision, the MTTR breakdown, the bytes moved against the prediction, and
the steps/s before and after.  Limits: the choice is forced per run by the allowed policies;
on a few shared CPU cores the step times are the emulated compute plus noise.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.table import Table

from chameleon_ft.examples import demo_train, pipeline_train
from chameleon_ft.cli.localjob import LocalJob
from chameleon_ft.cli.report import describe_layout, render
from chameleon_ft.runtime.eventlog import read_events


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="chameleon-ft demo", description=__doc__.splitlines()[0])
    ap.add_argument("--pipeline", action="store_true",
                    help="DP x PP: 8 workers as 2 pipelines x 4 stages, run once with {reroute} and once "
                         "with {replan} allowed; no replacements")
    ap.add_argument("--workers", type=int, default=None, help="default 4 (8 with --pipeline)")
    ap.add_argument("--kill-rank", type=int, default=2, help="worker id to SIGKILL (-1: none)")
    ap.add_argument("--at-step", type=int, default=None,
                    help="kill once this many steps committed (default 12; 8 with --pipeline)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--block-sleep", type=float, default=0.01,
                    help="--pipeline: emulated compute per block forward (s)")
    ap.add_argument("--mb-sleep", type=float, default=0.02, help="emulated compute per micro-batch (s)")
    ap.add_argument("--run-dir", default=None, help="default: runs/demo-<time>")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--replacements", type=int, default=1, help="replacement workers the launcher may start")
    ap.add_argument("--mttf", type=float, default=None, metavar="SECONDS",
                    help="fix D, the expected time to the next failure (default: estimated)")
    args = ap.parse_args(argv)
    args.workers = args.workers or (8 if args.pipeline else 4)
    args.at_step = args.at_step if args.at_step is not None else (8 if args.pipeline else 12)
    if args.workers < 2:
        ap.error("--workers must be at least 2 (one of them dies)")
    if args.pipeline and (args.workers < 8 or args.workers % 4):
        ap.error("--pipeline needs --workers a multiple of 4, at least 8 (pipelines of 4 stages)")
    if args.kill_rank >= args.workers:
        ap.error(f"--kill-rank must be below --workers ({args.workers})")
    if args.mttf is not None and not args.mttf > 0:
        ap.error("--mttf must be a positive number of seconds")
    if args.replacements < 0:
        ap.error("--replacements must be >= 0")
    console = Console(width=None if sys.stdout.isatty() else 120)
    if args.pipeline:
        return pipeline_demo(args, console)
    run_dir = Path(args.run_dir or f"runs/demo-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    job = LocalJob(run_dir, demo_train.__file__, ["--epochs", str(args.epochs), "--mb-sleep", str(args.mb_sleep),
                                                  "--out", str(run_dir)], nproc=args.workers, hang_timeout=5,
                   max_replacements=args.replacements,
                   launch_args=[] if args.mttf is None else ["--mttf", repr(args.mttf)])
    console.print(f"[bold]chameleon-ft demo[/]: {args.workers} CPU workers train a small classifier; "
                  + (f"worker {args.kill_rank} gets SIGKILL from outside after step {args.at_step}."
                     if args.kill_rank >= 0 else "no failure injected."))
    console.print("$ chameleon-ft run " + " ".join(job.command()[3:]), style="dim")
    code = drive(job, console, args)
    if code is None:
        return 1
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


def drive(job: LocalJob, console: Console, args) -> Optional[int]:
    """Run ``job`` to its end with a live status line, SIGKILL ``args.kill_rank`` by PID after
    ``args.at_step`` committed steps; clean every process up.  None: timed out."""
    try:
        with console.status("starting workers...") as status:
            code = job.drive(args.kill_rank, args.at_step, args.timeout,
                             on_tick=lambda done, pids: status.update(f"{len(pids)} workers, step {done} committed"),
                             on_kill=lambda w, pid, done: console.print(
                                 f"[red]✗ SIGKILL[/] worker {w} (pid {pid}) after step {done}"))
    finally:
        job.cleanup()
    if code is None:
        console.print(f"[red]timed out after {args.timeout:g} s[/]")
    return code


def migration_figures(events: list[dict]) -> dict:
    """State the recovery migrations moved (every member's share summed) and the prediction."""
    after = [e for e in events if e["event"] == "migration" and e["step"] > 0]
    ends = [e for e in after if e.get("phase") == "end"]
    return {"bytes": sum(e["bytes"] for e in ends), "transfers": sum(e["transfers"] for e in ends),
            "predicted_bytes": sum(e.get("predicted_bytes") or 0 for e in after if e.get("phase") == "start"),
            "seconds": max((e["seconds"] for e in ends), default=0.0)}


def pipeline_demo(args, console: Console) -> int:
    """The same kill twice on a DP x PP job: the engine may only reroute, then only re-plan."""
    base = Path(args.run_dir or f"runs/demo-pipeline-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    gb = 64
    console.print(f"[bold]chameleon-ft demo --pipeline[/]: {args.workers} CPU workers train an 8-block MLP as "
                  f"{args.workers // 4} pipelines x 4 stages; worker {args.kill_rank} gets SIGKILL from outside "
                  f"after step {args.at_step}, once with only [bold]reroute[/] allowed, once with only "
                  "[bold]replan[/].")
    rows, code_all = [], 0
    for policy in ("reroute", "replan"):
        run_dir = base / policy
        job = LocalJob(run_dir, pipeline_train.__file__,
                       ["--epochs", str(args.epochs), "--block-sleep", str(args.block_sleep), "--global-batch",
                        str(gb), "--allowed", policy, "--out", str(run_dir)],
                       nproc=args.workers, hang_timeout=5, max_replacements=0,
                       launch_args=[] if args.mttf is None else ["--mttf", repr(args.mttf)])
        console.rule(f"allowed policies: {{{policy}}}")
        console.print("$ chameleon-ft run " + " ".join(job.command()[3:]), style="dim")
        code = drive(job, console, args)
        console.print(f"launcher exited with {code}" + ("" if code == 0 else f" (see {run_dir / 'launcher0.out'})"))
        if code != 0:
            code_all = code_all or code or 1
            continue
        summary = render(run_dir, console)
        events = read_events(run_dir / "events.jsonl")
        mig = migration_figures(events)
        decisions = [e["decision"] for e in events if e["event"] == "decision"]
        chosen = [d["chosen"] for d in decisions]
        for d in decisions[-1:]:
            plan = next((c.get("plan") for c in d["candidates"] if c["policy"] == d["chosen"]), None)
            dead = d.get("event", {}).get("devices", [])
            console.print(f"layout after {d['chosen']} (worker:first-last block): {describe_layout(plan)}"
                          + (f"; dead {dead}: its micro-batches run on same-stage peers" if d["chosen"] == "reroute"
                             else ""))
        console.print(f"migration: {mig['bytes']:,} bytes moved in {mig['transfers']} transfers "
                      f"({mig['seconds']:.3f} s), predicted {mig['predicted_bytes']:,.0f} bytes"
                      if mig["predicted_bytes"] or mig["bytes"] else
                      "migration: none (rerouting moves no state: a same-stage peer takes the micro-batches)")
        final_p = run_dir / "final.json"
        final = json.loads(final_p.read_text()) if final_p.exists() else {}
        rec = [e for e in events if e["event"] == "recovery"]
        rows.append((policy, chosen[-1] if chosen else "-", rec[0]["mttr"]["total"] if rec else None, mig,
                     summary.get("throughput_before_failure"), summary.get("throughput_after_failure"),
                     final.get("loss"), final.get("members")))
    table = Table(title="reroute vs replan (the same kill)")
    for col in ("allowed", "chosen", "MTTR s", "bytes moved / predicted", "steps/s before", "steps/s after",
                "final loss", "workers at the end"):
        table.add_column(col, justify="left" if col in ("allowed", "chosen") else "right")
    fmt = (lambda v, f: "-" if v is None else format(v, f))
    for policy, chosen, mttr, mig, before, after, loss, members in rows:
        table.add_row(policy, chosen, fmt(mttr, ".3f"), f"{mig['bytes']:,} / {mig['predicted_bytes']:,.0f}",
                      fmt(before and before / gb, ".3g"), fmt(after and after / gb, ".3g"), fmt(loss, ".5f"),
                      str(len(members or [])))
    console.print(table)
    console.print(f"event logs: {base}/{{reroute,replan}}/events.jsonl")
    return code_all
