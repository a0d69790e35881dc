"""Sharded (FSDP2) benchmark: rehabilitate vs recompute after a kill, the engine's pick, buddy
snapshots' memory, and failure-free overhead against plain FSDP2.

    python benchmarks/sharded_bench.py [--seeds 5] [--steps 60] [--k 10] [--repeats 2]
        [--json benchmarks/results/sharded.json] [--markdown docs/benchmarks-sharded.md]

Every run is ``benchmarks/_shard_bench.py``: 4 CPU workers, an MLP regression with Adam, FSDP2
over all 4, in accelerator-emulation mode (``--sample-sleep`` seconds of forward per sample).

* **Recovery** (per seed): a failure-free run, then worker 2 SIGKILLed from outside (by PID)
  *early* in the snapshot interval (1 step after the snapshot of step ``2k``) and *late* (``k-1``
  steps after it).  At each position one run lets the engine choose (all paths allowed) and one
  forces the other path, so both rehabilitate and recompute are measured on the same kill.
  Lost time to the target loss (the failure-free run's moving average of ``--window`` steps,
  ``--window`` steps before its end) = (steps computed until the run's moving average reaches
  it, redone steps included - the failure-free run's) x the failure-free step time + the
  recovery pause (``lost_time``): on 2 shared cores a dead worker makes the others' steps
  faster, so raw wall time would flatter every failure.  The
  engine picked right when its choice lost no more time than the other path (+ ``--tie``
  steps).  Rehabilitation's predicted heal steps (the engine's point estimate of the progress
  the rehabilitated run lags behind) vs the measured ones: its lost steps to the target.  Final loss at the failure-free run's last step against the spread
  of the failure-free final losses over the seeds.
* **Memory**: peak RSS per worker with buddy snapshots every ``k`` steps and without snapshots,
  on a larger model (``--mem-hidden``).
* **Overhead**: steady steps/s of ours (snapshots every ``k``, and at Young/Daly's interval) and
  of plain FSDP2 under torchrun (torch's collectives on a gloo default group), alternating,
  median of ``--repeats``.

Limits, honestly: a shared 2-core machine; read medians and ratios.  The metric functions
(``steps_to_target``, ``lost_time``, ``loss_at``, ``steady_step_s``) are pure and tested.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "_shard_bench.py"
sys.path.insert(0, str(ROOT))

from chameleon_ft.cli.localjob import LocalJob  # noqa: E402
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness.systems import free_port  # noqa: E402


# ------------------------------------------------------------------ metrics (pure)
def smooth(rows: Sequence[Sequence[float]], window: int) -> list[tuple[int, float, float]]:
    """(step, time, moving-average loss) of the final trajectory, by step: each step's last
    attempt (a rollback redoes steps; the average looks back along the trajectory it is on)."""
    last = {s: (s, t, v) for s, t, v in smooth_attempts(rows, window)}
    return [last[s] for s in sorted(last)]


def steps_to_target(rows, target: float, window: int) -> Optional[int]:
    """Steps *computed* (redone ones included: every committed row in time order) until the
    first whose moving-average loss <= target; None if never."""
    sm = smooth_attempts(rows, window)
    for i, (s, _, v) in enumerate(sm, start=1):
        if s >= window and v <= target:
            return i
    return None


def smooth_attempts(rows, window: int) -> list[tuple[int, float, float]]:
    """Per committed row in time order: (step, time, moving average over the trajectory it is
    on -- a redone step replaces what came after its earlier attempt)."""
    kept: list[Sequence[float]] = []
    out = []
    for r in sorted(rows, key=lambda r: r[1]):
        while kept and kept[-1][0] >= r[0]:
            kept.pop()
        kept.append(r)
        w = [x[2] for x in kept[-window:]]
        out.append((int(r[0]), float(r[1]), sum(w) / len(w)))
    return out


def pause_s(rows) -> float:
    """The recovery pause: the longest gap between committed steps less the median gap."""
    ts = sorted(r[1] for r in rows)
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    return max(gaps) - statistics.median(gaps) if len(gaps) > 2 else 0.0


def lost_time(rows, ref_rows, target: float, window: int, transfer_s: float = 0.0,
              warmup: int = 5) -> Optional[dict]:
    """Time-to-target lost against the failure-free run, insensitive to the step time changing
    with the world size on a shared CPU: (steps computed to the target - the failure-free
    run's) x the failure-free step time + the path's own measured re-shard (``transfer_s``).
    The rest of the recovery pause (detection, membership, group) is the same whatever the
    path; it is reported apart (``pause_s``)."""
    n, n_ref = steps_to_target(rows, target, window), steps_to_target(ref_rows, target, window)
    if n is None or n_ref is None:
        return None
    step_s = steady_step_s(ref_rows, warmup)
    return {"steps": n - n_ref, "pause_s": pause_s(rows),
            "lost_s": (n - n_ref) * step_s + transfer_s, "step_s": step_s}


def loss_at(rows, step: int, window: int) -> Optional[float]:
    return next((v for s, _, v in smooth(rows, window) if s == step), None)


def steady_step_s(rows, warmup: int) -> float:
    rs = sorted(rows, key=lambda r: r[1])[warmup:]
    return (rs[-1][1] - rs[0][1]) / max(1, len(rs) - 1)


# ------------------------------------------------------------------ runs
def _ours(out: Path, args: Sequence[str], kill: Optional[tuple[int, int]] = None, nproc: int = 4) -> dict:
    job = LocalJob(out, WORKER, ["--out", str(out), *args], nproc=nproc, hang_timeout=10,
                   env={"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    try:
        job.start()
        if kill is not None:
            job.wait_step(kill[1])
            job.kill(kill[0])
        rc = job.wait(600)
        if rc != [0]:
            raise RuntimeError(f"run {out} failed ({rc}):\n{job.output()[-3000:]}")
    finally:
        job.cleanup()
    return _finals(out)


def _plain(out: Path, args: Sequence[str], nproc: int = 4) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                             "--master-port", str(free_port()),
                             str(WORKER), "--mode", "plain", "--out", str(out), *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0:
        raise RuntimeError(f"plain FSDP2 run failed:\n{text[-3000:]}")
    return _finals(out)


def _finals(out: Path) -> dict:
    return {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in out.glob("final_*.json")}


def recovery(work: Path, seeds: Sequence[int], steps: int, k: int, window: int, tie: float,
             common: list[str]) -> dict:
    extra = 20  # steps a killed run may use to reach the target
    cells = []
    for seed in seeds:
        sargs = [*common, "--seed", str(seed), "--snapshot-every", str(k)]
        ref = _ours(work / f"ref{seed}", [*sargs, "--steps", str(steps)])[0]
        target = smooth(ref["rows"], window)[-window][2]
        for pos, at in (("early", 2 * k + 1), ("late", 3 * k - 1)):
            runs = {}
            auto = _ours(work / f"auto{seed}{pos}", [*sargs, "--steps", str(steps + extra)], kill=(2, at))
            first = auto[min(auto)]
            chosen = (first.get("decision") or {}).get("chosen")
            runs[chosen] = first
            other = "recompute" if chosen == "rehabilitate" else "rehabilitate"
            forced = _ours(work / f"{other}{seed}{pos}", [*sargs, "--steps", str(steps + extra),
                                                          "--paths", f"{other},restart"], kill=(2, at))
            runs[other] = forced[min(forced)]
            cell = {"seed": seed, "position": pos, "kill_step": at, "chosen": chosen,
                    "candidates": (first.get("decision") or {}).get("candidates")}
            for path in ("rehabilitate", "recompute"):
                r = runs.get(path)
                if r is None:
                    continue
                d = r.get("decision") or {}
                lost = lost_time(r["rows"], ref["rows"], target, window, d.get("transfer_s") or 0.0) or {}
                cell[path] = {"carried_out": d.get("chosen"), "lost_s": lost.get("lost_s"),
                              "lost_steps": lost.get("steps"), "pause_s": lost.get("pause_s"),
                              "failure_step": d.get("step"),
                              "predicted_lost_s": (d.get("candidates") or {}).get(path, {}).get("lost_s"),
                              "transfer_s": d.get("transfer_s"),
                              "final_loss": loss_at(r["rows"], steps, window)}
                if path == "rehabilitate" and d.get("chosen") == "rehabilitate":
                    cell[path]["predicted_heal_steps"] = d.get("predicted_heal_steps")
                    cell[path]["measured_heal_steps"] = lost.get("steps")
            a, b = (cell.get(chosen) or {}).get("lost_s"), (cell.get(other) or {}).get("lost_s")
            step_s = steady_step_s(ref["rows"], 5)
            cell["picked_faster"] = None if a is None or b is None else a <= b + tie * step_s
            cell["ref_final_loss"] = smooth(ref["rows"], window)[-1][2]
            cells.append(cell)
            print(json.dumps({k2: v for k2, v in cell.items() if k2 != "candidates"}), flush=True)
    return {"cells": cells, "k": k, "steps": steps, "window": window}


def memory(work: Path, k: int, hidden: int, steps: int, common: list[str]) -> dict:
    out = {}
    for name, snap in (("no snapshots", "0"), (f"snapshots every {k}", str(k))):
        f = _ours(work / f"mem{snap}", [*common, "--hidden", str(hidden), "--steps", str(steps),
                                        "--snapshot-every", snap])
        out[name] = statistics.median(v["rss_mb"] for v in f.values())
    # The survivors of a kill re-shard 4 -> 3 (rows streamed one at a time, no full copy).
    f = _ours(work / "memkill", [*common, "--hidden", str(hidden), "--steps", str(steps),
                                 "--snapshot-every", str(k)], kill=(2, k + 3))
    out[f"snapshots every {k}, kill at step {k + 3} (re-shard 4 -> 3)"] = statistics.median(
        v["rss_mb"] for v in f.values())
    f = _plain(work / "memplain", [*common, "--hidden", str(hidden), "--steps", str(steps)])
    out["plain FSDP2"] = statistics.median(v["rss_mb"] for v in f.values())
    return out


def overhead(work: Path, k: int, steps: int, repeats: int, common: list[str]) -> dict:
    res: dict[str, list[float]] = {"plain FSDP2": [], f"ours, K={k}": [], "ours, K=Young/Daly": []}
    for i in range(repeats):
        res["plain FSDP2"].append(steady_step_s(_plain(work / f"ovp{i}", [*common, "--steps", str(steps)])[0]["rows"], 10))
        f = _ours(work / f"ovk{i}", [*common, "--steps", str(steps), "--snapshot-every", str(k)])
        res[f"ours, K={k}"].append(steady_step_s(f[0]["rows"], 10))
        f = _ours(work / f"ovy{i}", [*common, "--steps", str(steps)])
        res["ours, K=Young/Daly"].append(steady_step_s(f[0]["rows"], 10))
        res.setdefault("young_daly_k", []).append(f[0]["k"])
    med = {name: statistics.median(v) for name, v in res.items()}
    base = med["plain FSDP2"]
    return {"step_s": med, "runs": res,
            "ratio": {name: base / v for name, v in med.items() if name not in ("plain FSDP2", "young_daly_k")}}


def markdown(res: dict, cmd: str) -> str:
    cmds = res.get("commands") or {}
    made = (f"Produced by `{cmd}` ({res['date']})" if len(set(cmds.values())) <= 1 else
            "Produced by " + "; ".join(f"{part}: `{c}`" for part, c in cmds.items()))
    lines = ["# Sharded training (FSDP2): rehabilitate vs recompute", "",
             f"{made}; 4 CPU workers, FSDP2 over all 4, accelerator "
             "emulation; see `benchmarks/sharded_bench.py` for the method.", ""]
    rec = res.get("recovery")
    if rec:
        lines += ["## Lost time after one kill (median over seeds)", "",
                  f"Snapshots every K = {rec['k']} steps; early = kill 1 step after a snapshot, "
                  f"late = {rec['k'] - 1} steps after.", "",
                  "| position | rehabilitate lost s | recompute lost s | ratio rehab/recompute | engine chose | picked the faster |",
                  "|---|---|---|---|---|---|"]
        for pos in ("early", "late"):
            cs = [c for c in rec["cells"] if c["position"] == pos]
            rh = [c["rehabilitate"]["lost_s"] for c in cs if c.get("rehabilitate", {}).get("lost_s") is not None]
            rc = [c["recompute"]["lost_s"] for c in cs if c.get("recompute", {}).get("lost_s") is not None]
            mr = statistics.median(rh) if rh else None
            mc = statistics.median(rc) if rc else None
            ratio = f"{mr / mc:.2f}" if mr is not None and mc else "n/a"
            chose = ", ".join(f"{c['chosen']}" for c in cs)
            ok = sum(1 for c in cs if c["picked_faster"]) 
            lines.append(f"| {pos} | {_f(mr)} | {_f(mc)} | {ratio} | {chose} | {ok}/{len(cs)} |")
        lines += ["", "Per run:", "", "| seed | position | path | carried out | lost steps | pause s | lost s | predicted lost s | loss at the ref's last step (ref) | heal steps predicted / measured |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for c in rec["cells"]:
            for path in ("rehabilitate", "recompute"):
                r = c.get(path)
                if not r:
                    continue
                heal = (f"{_f(r.get('predicted_heal_steps'))} / {r.get('measured_heal_steps')}"
                        if "predicted_heal_steps" in r else "")
                lines.append(f"| {c['seed']} | {c['position']} | {path} | {r['carried_out']} | {r.get('lost_steps')} | "
                             f"{_f(r.get('pause_s'))} | {_f(r['lost_s'])} | "
                             f"{_f(r['predicted_lost_s'])} | {_f4(r['final_loss'])} ({c['ref_final_loss']:.4f}) | {heal} |")
    if rec:
        refs = [c["ref_final_loss"] for c in rec["cells"] if c["position"] == "early"]
        spread = max(refs) - min(refs) if len(refs) > 1 else None
        lines += ["", f"Failure-free final losses over the seeds: {', '.join(f'{x:.4f}' for x in refs)} "
                  f"(spread {_f4(spread)})."]
        rh = [(c["rehabilitate"]["final_loss"] - c["ref_final_loss"]) for c in rec["cells"]
              if c.get("rehabilitate", {}).get("final_loss") is not None]
        if rh and spread is not None:
            inside = sum(1 for x in rh if abs(x) <= spread)
            lines.append(f"Rehabilitated runs' final loss - their seed's failure-free one: "
                         f"{', '.join(f'{x:+.4f}' for x in rh)}; within the spread: {inside}/{len(rh)}.")
        hp = [(c["rehabilitate"].get("predicted_heal_steps"), c["rehabilitate"].get("measured_heal_steps"))
              for c in rec["cells"] if "predicted_heal_steps" in c.get("rehabilitate", {})]
        if hp:
            ok = sum(1 for p_, m in hp if p_ is not None and m is not None and 0.5 * p_ <= m <= 1.5 * p_)
            lines.append(f"Heal steps (progress the rehabilitated run lags behind), predicted / measured: "
                         f"{', '.join(f'{_f(p_)} / {m}' for p_, m in hp)}; within +-50 %: {ok}/{len(hp)}.")
    mem = res.get("memory")
    if mem:
        lines += ["", "## Peak RSS per worker (median, MB)", "", "| setting | MB |", "|---|---|"]
        lines += [f"| {k} | {v:.0f} |" for k, v in mem.items()]
    ov = res.get("overhead")
    if ov:
        lines += ["", "## Failure-free overhead against plain FSDP2", "",
                  "| system | s/step (median) | plain / ours |", "|---|---|---|"]
        for name, v in ov["step_s"].items():
            if name == "young_daly_k":
                continue
            ratio = ov["ratio"].get(name)
            lines.append(f"| {name} | {v:.4f} | {'' if ratio is None else f'{ratio:.3f}'} |")
        lines.append(f"\nYoung/Daly's K in those runs: {ov['runs'].get('young_daly_k')}.")
    return "\n".join(lines) + "\n"


def _f4(x) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def _f(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--window", type=int, default=5)
    p.add_argument("--tie", type=float, default=1.0, help="steps within which two paths tie")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--mem-hidden", type=int, default=1024)
    p.add_argument("--sample-sleep", type=float, default=0.002)
    p.add_argument("--parts", default="recovery,memory,overhead")
    p.add_argument("--update", action="store_true",
                   help="rerun only --parts and keep the other parts' results in --json")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "sharded.json"))
    p.add_argument("--markdown", default=str(ROOT / "docs" / "benchmarks-sharded.md"))
    a = p.parse_args(argv)
    parts = set(a.parts.split(","))
    common = ["--sample-sleep", str(a.sample_sleep), "--lr", "3e-4"]
    work = Path(tempfile.mkdtemp(prefix="cft_sharded_"))
    cmd = ("python benchmarks/sharded_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    res: dict = {}
    if a.update and Path(a.json).exists():  # keep the parts not rerun, with their own commands
        res = json.loads(Path(a.json).read_text())
        res.setdefault("commands", {p_: res.get("command", "python benchmarks/sharded_bench.py")
                                    for p_ in ("recovery", "memory", "overhead") if p_ in res})
    res.setdefault("commands", {})
    res.update({"date": time.strftime("%Y-%m-%d"), "args": vars(a)})
    res["commands"].update({p_: f"{cmd} ({res['date']})" for p_ in parts})
    try:
        if "recovery" in parts:
            res["recovery"] = recovery(work, range(a.seeds), a.steps, a.k, a.window, a.tie, common)
        if "memory" in parts:
            res["memory"] = memory(work, a.k, a.mem_hidden, 30, common)
            print(json.dumps(res["memory"]), flush=True)
        if "overhead" in parts:
            res["overhead"] = overhead(work, a.k, a.steps, a.repeats, common)
            print(json.dumps(res["overhead"]["step_s"]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(res, indent=1))
    Path(a.markdown).write_text(markdown(res, cmd))
    print(f"wrote {a.json} and {a.markdown}")
    return 0


def bench_main(argv) -> int:
    """``chameleon-ft bench --sharded [flags]``."""
    return main([a for a in argv if a != "--sharded"])


if __name__ == "__main__":
    sys.exit(main())
