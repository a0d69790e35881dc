"""Benchmark matrix: chameleon-ft against the baselines users would otherwise pick (issue 6).

    python benchmarks/matrix.py                         # the full matrix (FULL_PLAN: 72 runs, 1320 s on 2 cores, 2026-12-01)
    python benchmarks/matrix.py --short                 # 4 workers x {failure-free, kill} x systems (-> docs/benchmarks-short.md)
    python benchmarks/matrix.py --reduced               # REDUCED_PLAN: the core of the full plan, ~30 min on a loaded machine
    python benchmarks/matrix.py --systems chameleon-ft,torchft+fix --scenarios kill --repeats 3
    python benchmarks/matrix.py --setup-torchft         # the newest torchft into benchmarks/.venv-torchft

Every system trains the same script shape (``benchmarks/baselines/common.py``: the MLP, data,
batch and optimizer of ``benchmarks/_train_bench.py``).  Accelerator-emulation mode (default):
each micro-batch's forward+backward is padded to ``--mb-sleep`` s, so throughput follows the
worker count although 4-8 workers share 2 cores; ``--mb-sleep 0`` is plain CPU mode (the full
plan has a CPU section).  Faults are sent from this process by PID (``harness/scenarios.py``).
Results go to ``--json`` (default ``benchmarks/results/matrix[-short].json``); unless
``--no-report``, ``docs/benchmarks.md`` and its plots are regenerated from that JSON.

CLI hook: ``bench_main(argv)`` (for ``chameleon-ft bench``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from harness import metrics  # noqa: E402
from harness.scenarios import SCENARIOS, SHORT, victim_ranks  # noqa: E402
from harness.systems import ROOT, SYSTEMS, TORCHFT_VENV, Job, torchft_version  # noqa: E402

SHORT_SYSTEMS = ("chameleon-ft", "torchrun-restart", "torchrun-restart+fix", "torchft", "torchft+fix",
                 "torchft-tuned", "lightning-ddp")
GLOBAL_BATCH = 64
EMULATION = 0.025


@dataclass(frozen=True)
class Cell:
    system: str
    scenario: str
    nproc: int = 4
    mb_sleep: float = EMULATION
    repeats: int = 1
    timeout: float = 240.0   # a hung run costs this much; a loaded 2-core machine needs the margin


def _cells(systems, scenario, **kw) -> list[Cell]:
    return [Cell(s, scenario, **kw) for s in systems]


FIXED = ("chameleon-ft[reroute]", "chameleon-ft[replan]", "chameleon-ft[shrink]", "chameleon-ft[restart]")
FIXED_BASELINES = ("torchrun-restart+fix", "torchft+fix", "torchft-tuned")
# The full matrix.  Baselines as shipped run where they are known to differ from their
# workaround (a kill); plain Lightning where it can finish (it has no hang detection: with
# gloo's 30-minute default timeout a hang would take the whole budget).
FULL_PLAN: list[Cell] = [
    *_cells(SHORT_SYSTEMS, "failure-free"),
    Cell("chameleon-ft", "kill", repeats=3), *_cells(FIXED, "kill"),
    Cell("torchrun-restart", "kill", timeout=45), *_cells(FIXED_BASELINES[:2], "kill"),
    Cell("torchft-tuned", "kill", repeats=3),
    Cell("torchft", "kill", repeats=2), Cell("lightning-ddp", "kill"),
    *_cells(("chameleon-ft", "chameleon-ft[shrink]", "chameleon-ft[restart]", *FIXED_BASELINES), "two-kills"),
    *_cells(("chameleon-ft", *FIXED, *FIXED_BASELINES), "node-loss"),
    Cell("chameleon-ft", "hang"), Cell("torchrun-restart+fix", "hang", timeout=45), Cell("torchft+fix", "hang"),
    Cell("torchft-tuned", "hang"),
    *_cells(("chameleon-ft", *FIXED_BASELINES, "lightning-ddp"), "straggler"),
    *_cells(("chameleon-ft", *FIXED_BASELINES), "replacement"),
    *[c for sc in ("failure-free", "kill", "node-loss")
      for c in _cells(("chameleon-ft", *FIXED_BASELINES), sc, nproc=8, mb_sleep=2 * EMULATION)],
    *[c for sc in ("failure-free", "kill")
      for c in _cells(("chameleon-ft", *FIXED_BASELINES, "lightning-ddp"), sc, mb_sleep=0.0)],
]


# What fits ~30 minutes when the 2 cores are shared (runs take ~5x their idle time): the kill with
# repeats for chameleon-ft and tuned TorchFT (MTTR against MTTR), the shrink and restart policies,
# node loss, a hang, and the plain-CPU kill.
REDUCED_PLAN: list[Cell] = [
    *_cells(SHORT_SYSTEMS, "failure-free"),
    Cell("chameleon-ft", "kill", repeats=3), Cell("torchft-tuned", "kill", repeats=3),
    *_cells(("torchft+fix", "torchft", "torchrun-restart+fix", "lightning-ddp", "chameleon-ft[shrink]",
             "chameleon-ft[restart]"), "kill"),
    Cell("torchrun-restart", "kill", timeout=45),
    *_cells(("chameleon-ft", "torchft-tuned", "torchft+fix", "torchrun-restart+fix"), "node-loss"),
    *_cells(("chameleon-ft", "torchft-tuned"), "hang"),
    *[Cell("chameleon-ft", sc, mb_sleep=0.0) for sc in ("failure-free", "kill")],
]


def mode_of(mb_sleep: float) -> str:
    return (f"accelerator emulation ({mb_sleep * 1e3:.0f} ms per micro-batch, {GLOBAL_BATCH // 8} micro-batches "
            "per step)" if mb_sleep > 0 else "plain CPU (no padding: workers time-share 2 cores)")


def chameleon_events(run_dir: Path, t0: float) -> dict:
    """The MTTR breakdowns and the engine's decisions (chosen policy, predicted step time)."""
    ev = run_dir / "events.jsonl"
    if not ev.exists():
        return {}
    from chameleon_ft.runtime.eventlog import read_events

    evs = read_events(ev)
    out: dict = {"breakdowns": [], "decisions": []}
    # Every member logs the same decision: keep the lowest worker's copy.
    first = min((x.get("worker", 0) for x in evs if x["event"] == "decision"), default=0)
    for e in evs:
        if e["event"] == "recovery" and e.get("mttr"):
            m = e["mttr"]
            out["breakdowns"].append({"where": "inside" if m.get("detect", 0) > 0.002 else "between", **m})
        elif e["event"] == "decision" and e.get("worker") == first:
            d = e["decision"]
            chosen = next((c for c in d.get("candidates", []) if c["policy"] == d.get("chosen")), {})
            out["decisions"].append({"t": round(e["ts"] - t0, 4), "chosen": d.get("chosen"),
                                     "kind": d.get("event", {}).get("kind"),
                                     "predicted_step_s": chosen.get("step_time_s")})
    return out


def run_one(system: str, scenario: str, run_dir: Path, *, nproc: int, steps: int, mb_sleep: float,
            rng: random.Random, timeout: float) -> dict:
    sysdef, sc = SYSTEMS[system], SCENARIOS[scenario]
    steps = max(steps, sc.steps or 0)
    job = Job(run_dir, nproc, steps, mb_sleep, replace=sc.replace, env=sc.slow_env(nproc))
    t_faults, note = [], ""
    t0 = time.time()
    try:
        sysdef.start(job)
        try:
            for f in sc.faults:
                job.wait_step(f.at_step, timeout)
                time.sleep(rng.uniform(0, 3 * max(mb_sleep, 0.01)))
                victims = victim_ranks(f.victims, nproc)
                sent = [job.signal(v, f.signal) for v in victims]
                t_faults.append(sent[0])
                if sc.replace and sysdef.replace:
                    for v in victims:
                        job.wait_exit(v)
                        sysdef.replace(job, v)
        except (TimeoutError, RuntimeError) as e:
            note = f"fault not injected: {str(e).splitlines()[0]}"
        codes = job.wait(max(1.0, timeout - (time.time() - t0)))
        if codes is None:
            note = (note + "; " if note else "") + f"timed out after {timeout:.0f} s (hung)"
        wall = time.time() - t0
        records = job.records()
        if sysdef.family == "chameleon-ft" and (run_dir / "events.jsonl").exists():
            from chameleon_ft.runtime.eventlog import read_events

            records += metrics.attempts_from_events(read_events(run_dir / "events.jsonl"))
        m = metrics.run_metrics(records, nproc=nproc, steps=steps, global_batch=GLOBAL_BATCH,
                                t_faults=t_faults, exit_codes=codes, wall_s=wall,
                                split_step=sc.slow[2] if sc.slow else None)
        m["fault_times"] = [round(t - m["t0"], 4) for t in t_faults]
        m["startup_s"] = m["t0"] - t0 if m["t0"] else None   # start of the processes to the first step
        if sysdef.family == "chameleon-ft":
            m["chameleon"] = chameleon_events(run_dir, m["t0"])
            dec = [d for d in m["chameleon"].get("decisions", []) if d["predicted_step_s"]]
            if dec and m["step_time_after_s"]:
                m["predicted_step_s"] = dec[0]["predicted_step_s"]
        if m["crashed"]:
            tail = job.output()
            m["error_tail"] = tail[-1500:]
            for needle in ("assert fut._fut", "AssertionError", "Connection closed by peer", "Timed out",
                           "ChildFailedError", "RendezvousTimeoutError"):
                if needle in tail:
                    note = (note + "; " if note else "") + f"log shows: {needle}"
                    break
        return {"system": system, "family": sysdef.family, "variant": sysdef.variant, "scenario": scenario,
                "nproc": nproc, "mb_sleep": mb_sleep, "t_fault": t_faults[0] if t_faults else None,
                "note": note, **m}
    finally:
        job.cleanup()


def run_matrix(plan: list[Cell], *, steps: int, seed: int, work: Path, log=print) -> dict:
    rng = random.Random(seed)
    runs = []
    for i, c in enumerate(plan):
        for r in range(c.repeats):
            d = work / f"{i}-{c.system}-{c.scenario}-{c.nproc}-{r}"
            t = time.time()
            row = run_one(c.system, c.scenario, d, nproc=c.nproc, steps=steps, mb_sleep=c.mb_sleep, rng=rng,
                          timeout=c.timeout)
            row["repeat"] = r
            runs.append(row)
            log(f"{c.system:22s} {c.scenario:13s} n={c.nproc} mb={c.mb_sleep:g} crashed={row['crashed']!s:5s} "
                f"mttr={row['mttr_s']} thr={row['throughput']} ({time.time() - t:.0f} s) {row['note']}", flush=True)
    ff: dict = {}
    for row in runs:
        if row["scenario"] == "failure-free" and row["throughput"] and not row["crashed"]:
            ff.setdefault((row["system"], row["nproc"], row["mb_sleep"]), []).append(row["throughput"])
            ff.setdefault((row["family"], row["nproc"], row["mb_sleep"]), []).append(row["throughput"])
    for row in runs:
        key = (row["nproc"], row["mb_sleep"])
        base = ff.get((row["system"], *key)) or ff.get((row["family"], *key))
        row["failure_free_throughput"] = sorted(base)[len(base) // 2] if base else None
        row["efficiency"] = metrics.efficiency(row["throughput_after"], row["failure_free_throughput"] or
                                               row["throughput_before"], row["survivors"], row["nproc"])
    return {"runs": runs}


def machine() -> str:
    import platform

    import torch

    return (f"{platform.node() or 'host'}: {os.cpu_count()} CPU cores, {platform.machine()}, "
            f"Linux {platform.release()}, Python {platform.python_version()}, torch {torch.__version__}")


def setup_torchft() -> int:
    """Create ``benchmarks/.venv-torchft`` (system site-packages, so it shares torch) with the newest
    ``torchft-nightly``; the package's own torchft 0.2.x (its Lighthouse) stays untouched."""
    import subprocess

    if not (TORCHFT_VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(TORCHFT_VENV)], check=True)
    rc = subprocess.run([str(TORCHFT_VENV / "bin" / "pip"), "install", "-U", "torchft-nightly"]).returncode
    print(torchft_version())
    return rc


def bench_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="chameleon-ft bench", description=__doc__.splitlines()[0])
    ap.add_argument("--short", action="store_true", help="the CI subset: 4 workers, failure-free + one kill")
    ap.add_argument("--reduced", action="store_true", help="REDUCED_PLAN: the full matrix's core (~30 min on a "
                    "shared 2-core machine) -> docs/benchmarks.md")
    ap.add_argument("--systems", help=f"comma-separated, of {', '.join(SYSTEMS)} (with --scenarios: a cross product)")
    ap.add_argument("--scenarios", help=f"comma-separated, of {', '.join(SCENARIOS)}")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--mb-sleep", type=float, default=EMULATION, help="0: plain CPU mode")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120, help="seconds per run before it counts as hung")
    ap.add_argument("--json", help="results file")
    ap.add_argument("--doc", help="report file (default docs/benchmarks.md; with --short docs/benchmarks-short.md, "
                    "so that the CI subset does not replace the full matrix's report)")
    ap.add_argument("--no-report", action="store_true")
    ap.add_argument("--keep", help="keep every run's directory (logs, event logs) under this folder")
    ap.add_argument("--from-json", help="only regenerate the report from this results file")
    ap.add_argument("--setup-torchft", action="store_true",
                    help=f"install the newest torchft-nightly into {TORCHFT_VENV.relative_to(ROOT)} "
                    "(the TorchFT baselines run from it)")
    a = ap.parse_args(argv)
    if a.setup_torchft:
        return setup_torchft()
    # SIGTERM -> SystemExit, so that the running cell's ``finally`` kills its processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    a.doc = a.doc or str(ROOT / "docs" / ("benchmarks-short.md" if a.short else "benchmarks.md"))
    if a.from_json:
        from harness.report import write_report

        print(f"report: {write_report(json.loads(Path(a.from_json).read_text()), Path(a.doc))}")
        return 0
    for name, table in ((a.systems, SYSTEMS), (a.scenarios, SCENARIOS)):
        bad = [n for n in (name.split(",") if name else []) if n not in table]
        if bad:
            ap.error(f"unknown {bad}; known: {', '.join(table)}")
    if a.short or a.systems or a.scenarios:
        systems = a.systems.split(",") if a.systems else list(SHORT_SYSTEMS if a.short else SYSTEMS)
        scenarios = a.scenarios.split(",") if a.scenarios else list(SHORT if a.short else SCENARIOS)
        plan = [Cell(s, sc, a.nproc, a.mb_sleep, a.repeats, a.timeout) for sc in scenarios for s in systems]
    else:
        plan = [Cell(c.system, c.scenario, c.nproc, c.mb_sleep, c.repeats * a.repeats, c.timeout)
                for c in (REDUCED_PLAN if a.reduced else FULL_PLAN)]
    out = Path(a.json or ROOT / "benchmarks" / "results" / f"matrix{'-short' if a.short else ''}.json")
    started = time.time()
    tf = torchft_version() if any(SYSTEMS[c.system].family == "torchft" for c in plan) else ""
    with tempfile.TemporaryDirectory(prefix="chameleon-bench-") as tmp:
        res = run_matrix(plan, steps=a.steps, seed=a.seed, work=Path(a.keep or tmp))
    res.update({"command": "python benchmarks/matrix.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": machine(),
                "steps": a.steps, "global_batch": GLOBAL_BATCH, "micro_batch": 8, "cpu_count": os.cpu_count(),
                "modes": {str(m): mode_of(m) for m in dict.fromkeys(c.mb_sleep for c in plan)},
                "systems": {s: {"family": SYSTEMS[s].family, "variant": SYSTEMS[s].variant,
                                "note": ("; ".join(x for x in (SYSTEMS[s].note, tf) if x)
                                         if SYSTEMS[s].family == "torchft" else SYSTEMS[s].note)}
                            for s in dict.fromkeys(c.system for c in plan)},
                "scenarios": {s: SCENARIOS[s].description for s in dict.fromkeys(c.scenario for c in plan)},
                "duration_s": time.time() - started})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"results: {out}")
    if not a.no_report:
        from harness.report import write_report

        print(f"report: {write_report(res, Path(a.doc))}")
    return 0


if __name__ == "__main__":
    sys.exit(bench_main())
