"""Benchmark matrix: chameleon-ft against the baselines users would otherwise pick (issue 6).

    python benchmarks/matrix.py --short                 # 4 workers x {failure-free, kill} x systems
    python benchmarks/matrix.py --systems chameleon-ft,torchft+fix --scenarios kill --repeats 3

Every system trains the same script shape (``benchmarks/baselines/common.py``: the MLP, data,
batch and optimizer of ``benchmarks/_train_bench.py``) in accelerator-emulation mode (each
micro-batch's forward+backward padded to ``--mb-sleep`` s, so throughput follows the worker
count although the workers share 2 cores).  Faults are sent from this process by PID.
Results go to ``--json`` (default ``benchmarks/results/matrix[-short].json``); unless
``--no-report``, ``docs/benchmarks.md`` and its plots are regenerated from that JSON.

CLI hook: ``bench_main(argv)`` (for ``chameleon-ft bench``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import metrics  # noqa: E402
from harness.scenarios import SCENARIOS, SHORT  # noqa: E402
from harness.systems import ROOT, SYSTEMS, Job  # noqa: E402

SHORT_SYSTEMS = ("chameleon-ft", "torchrun-restart", "torchrun-restart+fix", "torchft", "torchft+fix",
                 "lightning-ddp")
GLOBAL_BATCH = 64


def chameleon_breakdown(run_dir: Path) -> dict | None:
    ev = run_dir / "events.jsonl"
    if not ev.exists():
        return None
    from chameleon_ft.runtime.eventlog import read_events

    recs = [e for e in read_events(ev) if e["event"] == "recovery"]
    if not recs:
        return None
    m = recs[0]["mttr"]
    return {"where": "inside" if m.get("detect", 0) > 0.002 else "between", **m}


def run_one(system: str, scenario: str, run_dir: Path, *, nproc: int, steps: int, mb_sleep: float,
            rng: random.Random, timeout: float) -> dict:
    sysdef, sc = SYSTEMS[system], SCENARIOS[scenario]
    job = Job(run_dir, nproc, steps, mb_sleep)
    t_fault, note = None, ""
    t0 = time.time()
    try:
        sysdef.start(job)
        if sc.signal:
            try:
                job.wait_step(sc.at_step, timeout)
                time.sleep(rng.uniform(0, 3 * mb_sleep))
                for v in sc.victims:
                    t_fault = job.signal(v % nproc, sc.signal)
            except (TimeoutError, RuntimeError) as e:
                note = f"fault not injected: {str(e).splitlines()[0]}"
        codes = job.wait(max(1.0, timeout - (time.time() - t0)))
        if codes is None:
            note = (note + "; " if note else "") + f"timed out after {timeout:.0f} s (hung)"
        wall = time.time() - t0
        m = metrics.run_metrics(job.records(), nproc=nproc, steps=steps, global_batch=GLOBAL_BATCH,
                                t_fault=t_fault, exit_codes=codes, wall_s=wall)
        if sysdef.family == "chameleon-ft" and t_fault:
            m["chameleon_mttr_breakdown"] = chameleon_breakdown(run_dir)
        if m["crashed"]:
            tail = job.output()
            m["error_tail"] = tail[-1500:]
            for needle in ("assert fut._fut", "AssertionError", "Connection closed by peer", "Timed out",
                           "ChildFailedError", "RendezvousTimeoutError"):
                if needle in tail:
                    note = (note + "; " if note else "") + f"log shows: {needle}"
                    break
        return {"system": system, "family": sysdef.family, "variant": sysdef.variant, "scenario": scenario,
                "t_fault": t_fault, "note": note, **m}
    finally:
        job.cleanup()


def run_matrix(systems, scenarios, *, nproc: int, steps: int, mb_sleep: float, repeats: int, seed: int,
               timeout: float, work: Path, log=print) -> dict:
    rng = random.Random(seed)
    runs = []
    for r in range(repeats):
        for sc in scenarios:
            for s in systems:
                d = work / f"{s}-{sc}-{r}"
                t = time.time()
                row = run_one(s, sc, d, nproc=nproc, steps=steps, mb_sleep=mb_sleep, rng=rng, timeout=timeout)
                row["repeat"] = r
                runs.append(row)
                log(f"{s:22s} {sc:13s} crashed={row['crashed']!s:5s} mttr={row['mttr_s']} "
                    f"thr={row['throughput']} ({time.time() - t:.0f} s) {row['note']}")
    ff = {}
    for row in runs:
        if row["scenario"] == "failure-free" and row["throughput"] and not row["crashed"]:
            ff.setdefault(row["system"], []).append(row["throughput"])
    for row in runs:
        base = ff.get(row["system"])
        row["failure_free_throughput"] = sorted(base)[len(base) // 2] if base else None
        row["efficiency"] = metrics.efficiency(row["throughput_after"], row["failure_free_throughput"] or
                                               row["throughput_before"], row["survivors"], nproc)
    return {"runs": runs}


def machine() -> str:
    import os
    import platform

    import torch

    return (f"{platform.node() or 'host'}: {os.cpu_count()} CPU cores, {platform.machine()}, "
            f"Linux {platform.release()}, Python {platform.python_version()}, torch {torch.__version__}")


def bench_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="chameleon-ft bench", description=__doc__.splitlines()[0])
    ap.add_argument("--short", action="store_true", help="the CI subset: 4 workers, failure-free + one kill")
    ap.add_argument("--systems", help=f"comma-separated, of {', '.join(SYSTEMS)}")
    ap.add_argument("--scenarios", help=f"comma-separated, of {', '.join(SCENARIOS)}")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--mb-sleep", type=float, default=0.025)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=150, help="seconds per run before it counts as hung")
    ap.add_argument("--json", help="results file")
    ap.add_argument("--doc", default=str(ROOT / "docs" / "benchmarks.md"))
    ap.add_argument("--no-report", action="store_true")
    a = ap.parse_args(argv)
    systems = a.systems.split(",") if a.systems else list(SHORT_SYSTEMS if a.short else SYSTEMS)
    scenarios = a.scenarios.split(",") if a.scenarios else list(SHORT if a.short else SCENARIOS)
    for name, table in ((systems, SYSTEMS), (scenarios, SCENARIOS)):
        bad = [n for n in name if n not in table]
        if bad:
            ap.error(f"unknown {bad}; known: {', '.join(table)}")
    out = Path(a.json or ROOT / "benchmarks" / "results" / f"matrix{'-short' if a.short else ''}.json")
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="chameleon-bench-") as tmp:
        res = run_matrix(systems, scenarios, nproc=a.nproc, steps=a.steps, mb_sleep=a.mb_sleep,
                         repeats=a.repeats, seed=a.seed, timeout=a.timeout, work=Path(tmp))
    res.update({"command": "python benchmarks/matrix.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                "date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": machine(), "nproc": a.nproc,
                "steps": a.steps, "global_batch": GLOBAL_BATCH, "mb_sleep": a.mb_sleep,
                "mode": f"accelerator emulation ({a.mb_sleep * 1e3:.0f} ms per micro-batch, 2 per worker per step)",
                "systems": {s: {"family": SYSTEMS[s].family, "variant": SYSTEMS[s].variant, "note": SYSTEMS[s].note}
                            for s in systems},
                "scenarios": {s: SCENARIOS[s].description for s in scenarios},
                "duration_s": time.time() - started})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"results: {out}")
    if not a.no_report:
        from harness.report import write_report

        print(f"report: {write_report(res, Path(a.doc))}")
    return 0


if __name__ == "__main__":
    sys.exit(bench_main())
