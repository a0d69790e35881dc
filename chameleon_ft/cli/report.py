"""``chameleon-ft report RUN_DIR``: render a run's event log.

Prints the headline figures (failures, recoveries with their MTTR breakdown, final world size,
throughput before and after the first failure), every Decision with all of its candidates, and
writes a throughput-timeline plot with failure and decision markers.  The demo and the
benchmark harness use the same functions.

Step records: each worker logs its own micro-batch samples per step attempt; an attempt that a
failure interrupted is logged too, so per step only the committed (last) attempt counts.

Throughput is global samples committed per wall-clock second: a step's samples are those of
all members' records of its committed attempt, its time the latest of them (each member logs
just before the step's all-reduce, so consecutive steps are one step time apart).  Before the
first failure: the committed steps logged before it, from the first to the last; after: the
steps logged after it, from the first (the step the recovery redid) to the end, so the
recovery's downtime is in the MTTR, not in either figure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Iterable, Mapping

from rich.console import Console
from rich.table import Table

from chameleon_ft.runtime.eventlog import committed_attempts, read_events, summarize

EVENTS_FILE = "events.jsonl"


def find_log(path: str | Path) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / EVENTS_FILE
    if not p.is_file():
        raise FileNotFoundError(f"no event log at {p} (expected a run directory holding {EVENTS_FILE})")
    return p


def committed_steps(events: Iterable[Mapping]) -> list[dict]:
    """One record per step: global samples of its committed attempt and when it ended."""
    return [{"step": step, "ts": max(r["ts"] for r in recs),
             "samples": sum(int(r.get("samples", 0)) for r in recs),
             "world_size": max(int(r.get("world_size", 0)) for r in recs)}
            for step, recs in sorted(committed_attempts(events).items())]


def _rate(steps: list[dict]) -> float | None:
    """Samples of ``steps[1:]`` over the wall time from ``steps[0]`` to ``steps[-1]``."""
    if len(steps) < 2 or steps[-1]["ts"] <= steps[0]["ts"]:
        return None
    return sum(s["samples"] for s in steps[1:]) / (steps[-1]["ts"] - steps[0]["ts"])


def wall_throughput(events: list[Mapping]) -> dict:
    """Global samples per wall-clock second: over the run, before and after the first failure."""
    steps = committed_steps(events)
    fails = [e["ts"] for e in events if e["event"] == "failure"]
    t_fail = min(fails) if fails else None
    return {"throughput": _rate(steps),
            "throughput_before_failure": _rate([s for s in steps if t_fail is None or s["ts"] < t_fail]),
            "throughput_after_failure": _rate([s for s in steps if s["ts"] >= t_fail]) if fails else None}


def throughput_series(events: list[Mapping], window: int = 5) -> tuple[list[float], list[float]]:
    """(seconds since start, samples/s over the last ``window`` steps)."""
    steps = committed_steps(events)
    if len(steps) < 2:
        return [], []
    t0 = min(e["ts"] for e in events)
    xs, ys = [], []
    for i in range(1, len(steps)):
        j = max(0, i - window)
        dt = steps[i]["ts"] - steps[j]["ts"]
        if dt > 0:
            xs.append(steps[i]["ts"] - t0)
            ys.append(sum(s["samples"] for s in steps[j + 1:i + 1]) / dt)
    return xs, ys


def describe_layout(plan) -> str:
    """A pipeline plan's JSON (``Plan.to_json``) in one line: each pipeline's workers, the
    blocks each stage holds, and its micro-batches.  Other values pass through as text."""
    if not isinstance(plan, Mapping) or "pipelines" not in plan:
        return str(plan)
    pipes = plan["pipelines"]
    return f"{len(pipes)} pipeline(s): " + "; ".join(
        " | ".join(f"w{d}:{a}-{b - 1}" for d, a, b in zip(p["devices"], p["bounds"], p["bounds"][1:]))
        + f" x{p.get('microbatches', '?')}mb" for p in pipes)


def decision_table(decision: Mapping, title: str | None = None) -> Table:
    ev = decision.get("event", {})
    table = Table(title=title or f"decision for {ev.get('kind', '?')} of {ev.get('devices', [])}: "
                  f"[bold]{decision.get('chosen')}[/] (D = {decision.get('mttf_s', 0):.3g} s)")
    for col in ("candidate", "step time", "transition", "samples/s", "score", "why / how"):
        table.add_column(col, justify="right" if col not in ("candidate", "why / how") else "left")
    for c in decision.get("candidates", []):
        chosen = c["policy"] == decision.get("chosen")
        fmt = (lambda v, unit="s": "-" if v is None else f"{v:.4g} {unit}".strip())
        table.add_row(("→ " if chosen else "  ") + c["policy"],
                      fmt(c.get("step_time_s")), fmt(c.get("transition_s")),
                      fmt(c.get("throughput"), ""), f"{c.get('score', 0):.6g}" if c["feasible"] else "ruled out",
                      c.get("reason", "") or (c["plan"] if isinstance(c.get("plan"), str) else ""),
                      style="bold green" if chosen else (None if c["feasible"] else "dim"))
    return table


def mttr_table(recoveries: list[Mapping]) -> Table:
    phases = ["detect", "membership", "rebuild", "state_transfer", "first_step", "total"]
    table = Table(title="recoveries (seconds)")
    table.add_column("step", justify="right")
    for p in phases:
        table.add_column(p, justify="right")
    for r in recoveries:
        m = r.get("mttr", {})
        table.add_row(str(r.get("step", "")), *[f"{m.get(p, 0.0):.3f}" for p in phases])
    return table


def plot_timeline(events: list[Mapping], path: str | Path, title: str = "throughput") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs, ys = throughput_series(events)
    t0 = min(e["ts"] for e in events)
    fig, ax = plt.subplots(figsize=(9, 3.6))
    ax.plot(xs, ys, lw=1.5, label="global samples/s, wall clock (5-step window)")
    for e in events:
        if e["event"] == "failure":
            ax.axvline(e["ts"] - t0, color="tab:red", ls="--", lw=1)
            ax.annotate(f"{e.get('kind', 'failure')} {e.get('workers', '')}", (e["ts"] - t0, ax.get_ylim()[1]),
                        fontsize=7, color="tab:red", rotation=90, va="top", ha="right")
        elif e["event"] == "decision":
            ax.axvline(e["ts"] - t0, color="tab:green", ls=":", lw=1)
            chosen = e.get("decision", {}).get("chosen")
            ax.annotate(str(chosen), (e["ts"] - t0, 0), fontsize=7, color="tab:green", rotation=90, va="bottom")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("samples / s")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render(run: str | Path, console: Console | None = None, plot: str | Path | None = None) -> dict:
    console = console or Console()
    log = find_log(run)
    events = read_events(log)
    if not events:
        raise ValueError(f"{log} holds no events")
    summary = {**summarize(events), **wall_throughput(events)}
    steps = committed_steps(events)
    summary["committed_steps"] = len(steps)
    summary["committed_samples"] = sum(s["samples"] for s in steps)
    seen: set[str] = set()
    for e in events:
        if e["event"] == "decision":
            key = json.dumps(e.get("decision", {}).get("event", {}), sort_keys=True) + str(e.get("step"))
            if key not in seen:  # every member logs the same decision
                seen.add(key)
                console.print(decision_table(e["decision"]))
    recoveries = [e for e in events if e["event"] == "recovery"]
    if recoveries:
        console.print(mttr_table(recoveries))
    table = Table(title=f"run summary ({log})")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for k in ("failures", "recoveries", "mttr_median", "final_world_size", "committed_steps",
              "committed_samples", "throughput_before_failure", "throughput_after_failure", "wall_time"):
        v = summary.get(k)
        label = k + (" (global samples/s, wall clock)" if k.startswith("throughput") else "")
        table.add_row(label, "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v)))
    console.print(table)
    if plot is not False:
        out = plot_timeline(events, plot or log.with_name("throughput.png"), title=f"throughput ({log.parent.name})")
        console.print(f"throughput plot: {out}")
        summary["plot"] = str(out)
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="chameleon-ft report", description="Render a run's event log.")
    ap.add_argument("run", help=f"run directory (holding {EVENTS_FILE}) or the log file itself")
    ap.add_argument("--plot", help="where to write the throughput plot (default: beside the log)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON instead of tables")
    args = ap.parse_args(argv)
    try:
        if args.json:
            events = read_events(find_log(args.run))
            print(json.dumps({**summarize(events), **wall_throughput(events)}, indent=2))
            return 0
        render(args.run, plot=args.plot)
    except (FileNotFoundError, ValueError) as e:
        print(f"chameleon-ft report: {e}", file=sys.stderr)
        return 2
    return 0
