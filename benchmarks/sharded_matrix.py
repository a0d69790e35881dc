"""Issue 23's matrix: rehabilitation against recompute after one kill of a sharded (FSDP2) job,
with every setting default and with a tuned snapshot interval, over model kinds, kill
positions and seeds; the final quality against the failure-free seed spread, the training time
each path loses, and the engine's predicted heal steps against the measured ones.

    python benchmarks/sharded_matrix.py [--models mlp,lm,conv] [--seeds 5] [--ks default,4]
        [--lightning mlp] [--jobs 2] [--workdir DIR] [--reuse] [--json F] [--markdown F]

(``python benchmarks/sharded_bench.py --parts matrix`` runs it into
``docs/benchmarks-sharded.md``.)

Every run is ``_shard_bench.py`` (``ElasticTrainer(..., sharding="full")``, ``ElasticConfig()``
defaults) or, for ``--lightning`` kinds, ``_shard_bench_lightning.py`` (Lightning's FSDP2
recipe + ``FaultToleranceCallback()``) under ``chameleon-ft run``: 4 CPU workers, AdamW,
``--steps`` (64) steps of 64 samples, accelerator emulation (1 ms per sample).  Worker 2 is
SIGKILLed from outside (by PID) once the kill step is under way.

* **Cells.**  K = the snapshot interval: ``default`` (none given: Young/Daly bounded by the run,
  64 / 8 = 8 steps) and a tuned one (``--ks``).  Kill positions: *before the first trained
  snapshot* (step K - 1: issue 23's own case), and early / mid / late *in the run* (the
  snapshot interval that starts at step 8, 32, 48) x early / mid / late *in the interval* (1,
  K / 2 and K - 1 steps after its snapshot).  Each cell runs ``--seeds`` seeds.
* **Both paths.**  Each killed run lets the engine choose; where it chose recompute, a second
  run forces rehabilitation (``--paths rehabilitate,restart``), so that every cell shows what
  rehabilitating there would have cost; where it chose rehabilitation, recompute's cost is its
  redone steps (a recompute ends on the failure-free trajectory: checked in every cell where
  the engine chose it).
* **Lost training time** (time to reach the failure-free run's losses): (redone steps + lag) x
  the failure-free step time + the path's measured re-shard.  The **lag** is measured on the
  same batches as the failure-free run of the same seed (the global batch of step ``s`` is the
  same samples whatever the membership): the mean over the steps after the failure -- the
  horizon the engine's prediction names (``heal_horizon``: 16 steps, at most the run's rest),
  else ``max(8, 2K)`` -- of (log loss - log failure-free loss), over -(the slope of the failure-free log loss,
  one least-squares line through 8 steps before to the end of those steps) -- how many steps of
  progress the run is behind (``lag_estimate``, with its 95 % interval); the engine's
  ``predicted_heal_steps`` is its estimate of that very quantity.  On a **plateau** (that slope
  not below zero by two standard errors) steps of progress are not defined: no lag, the gap is
  kept.  A prediction is *within +-50 %* when the measured lag lies in [0.5, 1.5] x predicted;
  both under one step count as agreeing (a step is the resolution); a run whose lag interval
  is wider than ``max(1, lag / 2)`` cannot tell (the runtime's ``HealCheck`` rule) and is not
  counted.  Per **cell**: the median lag of its runs that can tell against their median
  prediction.  (Until 2026-12-03 the lag was the median of per-step ratios over a *local*
  slope: on a plateau it divided noise by ~0.)
* **Quality.**  The test loss of the user's own model after ``fit()`` against the spread of the
  failure-free seeds (min..max, relative tolerance 1e-4: a recompute over 3 survivors sums in
  another order), and against the same seed's failure-free test loss (relative).

Limits, honestly: small models on a shared 2-core machine, 64-step runs; a lag on a plateau
is not measured (None).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WORKERS = {"ours": ROOT / "benchmarks" / "_shard_bench.py", "lightning": ROOT / "benchmarks" / "_shard_bench_lightning.py"}
STEPS, SAMPLE_SLEEP, RUN_STARTS = 64, 0.001, (("early", 8), ("mid", 32), ("late", 48))
VICTIM = 2
from chameleon_ft.engine.shard_recovery import NOT_HEALED_BY_THE_END as END_RULE  # noqa: E402  the end-lag rule's reason


# ------------------------------------------------------------------ metrics (pure)
def trajectory(rows: Sequence[Sequence[float]]) -> dict[int, float]:
    """Step -> loss of the final trajectory (each step's last attempt, in time order)."""
    out: dict[int, float] = {}
    for s, _, v in sorted(rows, key=lambda r: r[1]):
        out[int(s)] = float(v)
    return out


def lag_estimate(run: dict[int, float], ref: dict[int, float], after: int, horizon: int,
                 before: int = 8) -> dict:
    """Steps of progress ``run`` is behind ``ref`` (on the same batches) over steps ``after+1 ..
    after+horizon``, with its uncertainty: the mean log gap ``g = log run - log ref`` over those
    steps divided by -(the slope of log ``ref``, fitted by least squares over ``after-before ..
    after+horizon``).  ``half``: the half-width of the lag's 95 % interval (``2 x sqrt(se_g^2 +
    (lag x se_b)^2) / |b|``, the gap's and the slope's standard errors).  On a **plateau** (the
    slope not below zero by two standard errors) steps of progress are not defined: ``lag`` is
    None and only the gap is reported.  ``informative``: the interval narrow enough to test a
    prediction (``half <= max(1, lag / 2)``: the runtime's ``HealCheck`` rule)."""
    gaps = [math.log(run[s]) - math.log(ref[s]) for s in range(after + 1, after + horizon + 1)
            if s in run and s in ref and run[s] > 0 and ref[s] > 0]
    pts = [(t, math.log(v)) for t, v in ref.items() if after - before <= t <= after + horizon and v > 0]
    out = {"lag": None, "half": None, "gap": None, "slope": None, "plateau": False, "informative": False}
    if len(gaps) < 3 or len(pts) < 6:
        return out
    n = len(gaps)
    g = sum(gaps) / n
    se_g = math.sqrt(sum((x - g) ** 2 for x in gaps) / (n - 1) / n)
    m = len(pts)
    mt, mv = sum(t for t, _ in pts) / m, sum(v for _, v in pts) / m
    var = sum((t - mt) ** 2 for t, _ in pts)
    b = sum((t - mt) * (v - mv) for t, v in pts) / var
    resid = [v - (mv + b * (t - mt)) for t, v in pts]
    se_b = math.sqrt(sum(r * r for r in resid) / (m - 2) / var)
    out.update(gap=g, slope=b)
    if b + 2 * se_b >= 0:
        out["plateau"] = True
        return out
    lag = g / -b
    half = 2 * math.sqrt(se_g ** 2 + (lag * se_b) ** 2) / -b
    out.update(lag=lag, half=half, informative=bool(half <= max(1.0, 0.5 * abs(lag))))
    return out


def measured_lag(run: dict[int, float], ref: dict[int, float], after: int, horizon: int) -> Optional[float]:
    """``lag_estimate``'s lag (None on a plateau)."""
    return lag_estimate(run, ref, after, horizon)["lag"]


def agrees(predicted: Optional[float], measured: Optional[float], informative: bool = True) -> Optional[bool]:
    """Within +-50 % (both under one step: agreeing); None when either is missing or the
    measurement cannot tell (not ``informative``)."""
    if predicted is None or measured is None or not informative:
        return None
    if predicted < 1 and measured < 1:
        return True
    return 0.5 * predicted <= measured <= 1.5 * predicted


def kill_positions(k: int) -> list[tuple[str, str, int]]:
    """(run position, interval position, kill step) of a snapshot interval ``k``."""
    out = [("first", "before the first snapshot", k - 1)]
    for name, start in RUN_STARTS:
        s0 = start - start % k
        out += [(name, "early", s0 + 1), (name, "mid", s0 + max(1, k // 2)), (name, "late", s0 + k - 1)]
    return out


def steady_step_s(rows, warmup: int = 5) -> float:
    rs = sorted(rows, key=lambda r: r[1])[warmup:]
    return (rs[-1][1] - rs[0][1]) / max(1, len(rs) - 1)


def path_cost(d: dict, run: dict[int, float], ref: dict[int, float], step_s: float, k: int) -> dict:
    """What the path carried out in ``d`` (the run's last shard decision) lost: redone steps,
    the measured lag, and (redone + lag) x step + re-shard seconds."""
    chosen = d.get("chosen")
    redone = d["step"] - d["rollback_to"] if chosen == "recompute" and d.get("rollback_to") is not None else 0
    est = lag_estimate(run, ref, d["step"], d.get("heal_horizon") or max(8, 2 * k))
    lag = est["lag"]
    lost = redone + max(lag or 0.0, 0.0)
    return {"path": chosen, "redone": redone, "lag": lag, "lag_half": est["half"], "informative": est["informative"],
            "plateau": est["plateau"], "gap": est["gap"], "lost_steps": lost,
            "lost_s": lost * step_s + (d.get("transfer_s") or 0.0), "fallback": bool(d.get("fallback"))}


# ------------------------------------------------------------------ runs
REUSE = False
REUSE_STAMP = "matrix_run.json"  # what made a run: ``--reuse`` keeps it only when it matches


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A hash of the code a run executes (the packages and this benchmark's scripts): a run
    that other code finished is not reused."""
    h = hashlib.sha256()
    files = [f for d in ("chameleon_ft", "lightning_ft") for f in sorted((ROOT / d).rglob("*.py"))]
    files += sorted((ROOT / "benchmarks").glob("*shard*.py"))
    for f in files:
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def run(out: Path, engine: str, kind: str, seed: int, k: Optional[int], kill: Optional[int] = None,
        paths: Optional[str] = None, extra: Sequence[str] = ()) -> dict:
    """One job; its workers' final JSONs by worker id (``out`` kept: ``--reuse``).  A job that
    ends before the kill step (it did not start: seen once in ~200 runs on a loaded machine,
    no quorum formed) is run once more, and said so."""
    try:
        return _run(out, engine, kind, seed, k, kill, paths, extra)
    except StartError as exc:
        print(f"{out.name}: did not start, run again ({str(exc).splitlines()[-1][:200]})", flush=True)
        return _run(out, engine, kind, seed, k, kill, paths, extra)


class StartError(RuntimeError):
    pass


def _run(out: Path, engine: str, kind: str, seed: int, k: Optional[int], kill: Optional[int] = None,
         paths: Optional[str] = None, extra: Sequence[str] = ()) -> dict:
    from chameleon_ft.cli.localjob import LocalJob

    args = ["--out", str(out), "--kind", kind, "--seed", str(seed), "--steps", str(STEPS),
            "--sample-sleep", str(SAMPLE_SLEEP), *extra]
    stamp = {"engine": engine, "args": args, "kill": kill, "k": k, "paths": paths, "code": code_fingerprint()}
    if REUSE and list(out.glob("final_*.json")):
        try:
            same = json.loads((out / REUSE_STAMP).read_text()) == stamp
        except (OSError, ValueError):
            same = False
        if same:
            return _finals(out)
        print(f"{out.name}: finished by other code or settings, run again", flush=True)
    import shutil

    shutil.rmtree(out, ignore_errors=True)  # an unfinished earlier attempt's event log would mislead
    out.mkdir(parents=True, exist_ok=True)
    (out / REUSE_STAMP).write_text(json.dumps(stamp))
    if engine == "ours":
        args += ["--lr", "3e-3", "--default-config"]
    if k is not None:
        args += ["--snapshot-every", str(k)]
    if paths:
        args += ["--paths", paths]
    launch = ("--preload", "+lightning,lightning_ft") if engine == "lightning" else ()
    job = LocalJob(out, WORKERS[engine], args, nproc=4, hang_timeout=10, launch_args=launch,
                   env={"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'benchmarks'}"})
    try:
        job.start()
        if kill is not None:
            try:
                job.wait_step(kill, 300)
            except RuntimeError as exc:  # the job ended first
                raise StartError(str(exc)) from None
            job.kill(VICTIM)
        codes = job.wait(600)
        if codes != [0]:
            raise RuntimeError(f"run {out} ended with {codes}:\n{job.output()[-3000:]}")
    finally:
        job.cleanup()
    return _finals(out)


def _finals(out: Path) -> dict:
    return {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in out.glob("final_*.json")}


def matrix(work: Path, engines: dict[str, list[str]], seeds: int, ks: list[Optional[int]], jobs: int,
           first_seed: int = 0) -> dict:
    """Every cell's runs (``engines``: engine -> model kinds)."""
    pool = ThreadPoolExecutor(max(1, jobs))
    free, cells = {}, []
    for engine, kinds in engines.items():
        for kind in kinds:
            for seed in range(first_seed, first_seed + seeds):
                free[(engine, kind, seed)] = pool.submit(run, work / f"{engine}-{kind}-free{seed}", engine, kind, seed, None)
            for k in ks:
                kk = k or STEPS // 8
                for pos, ipos, at in kill_positions(kk):
                    for seed in range(first_seed, first_seed + seeds):
                        name = f"{engine}-{kind}-k{k or 'd'}-{pos}-{ipos.split()[0]}-s{seed}"
                        cells.append({"engine": engine, "kind": kind, "k_label": "default" if k is None else str(k),
                                      "k": kk, "position": pos, "interval": ipos, "kill_step": at, "seed": seed,
                                      "_auto": pool.submit(run, work / name, engine, kind, seed, k, at),
                                      "_name": name})
    forced = []
    errors = []  # a run that did not end cleanly is a finding, reported, not a crash of the matrix
    for c in cells:
        try:
            auto = c.pop("_auto").result()
        except RuntimeError as exc:
            errors.append({"run": c["_name"], "error": str(exc)[-1500:]})
            print(f"{c['_name']}: ERROR", flush=True)
            continue
        c["auto"] = auto
        d = auto[min(auto)].get("decision") or {}
        # Before the first trained snapshot the engine never rehabilitates (the lost rows would
        # restart from their initial values; issue 23 measured what that costs): no forced run.
        if (d.get("chosen") == "recompute" or d.get("fallback")) and c["position"] != "first":
            paths = "rehabilitate,restart"
            forced.append((c, pool.submit(run, work / (c["_name"] + "-rehab"), c["engine"], c["kind"], c["seed"],
                                          None if c["k_label"] == "default" else c["k"], c["kill_step"], paths)))
        print(f"{c['_name']}: {d.get('chosen')}", flush=True)
    for c, fut in forced:
        try:
            c["forced"] = fut.result()
        except RuntimeError as exc:
            errors.append({"run": c["_name"] + "-rehab", "error": str(exc)[-1500:]})
    refs = {}
    for key, fut in free.items():
        try:
            refs[key] = fut.result()
        except RuntimeError as exc:
            errors.append({"run": "-".join(map(str, key)) + " (failure-free)", "error": str(exc)[-1500:]})
    pool.shutdown()
    done = [c for c in cells if "auto" in c and (c["engine"], c["kind"], c["seed"]) in refs]
    return {"cells": [summarize(c, refs[(c["engine"], c["kind"], c["seed"])]) for c in done],
            "free": {f"{e}-{kd}-{s}": _free_summary(v) for (e, kd, s), v in refs.items()},
            "errors": errors}


def _free_summary(finals: dict) -> dict:
    w = finals[min(finals)]
    return {"test_loss": w.get("test_loss"), "test_acc": w.get("test_acc"), "k": w.get("k"),
            "step_s": steady_step_s(w["rows"]), "traj": _traj(w["rows"])}


def _traj(rows) -> dict:
    """The run's loss per step (kept in the JSON: the figures can be recomputed without runs)."""
    return {str(s): round(v, 7) for s, v in sorted(trajectory(rows).items())}


def _lowest(finals: dict) -> dict:
    return finals[min(finals)]


def summarize(c: dict, ref_finals: dict) -> dict:
    """A cell's figures from its runs (the lowest member's records: the global loss is the
    same on every member)."""
    ref = _lowest(ref_finals)
    ref_traj, step_s = trajectory(ref["rows"]), steady_step_s(ref["rows"])
    out = {key: c[key] for key in ("engine", "kind", "k_label", "k", "position", "interval", "kill_step", "seed")}
    out["ref_test_loss"] = ref.get("test_loss")
    for label in ("auto", "forced"):
        if label not in c:
            continue
        w = _lowest(c[label])
        d = w.get("decision") or {}
        first = d.get("failed_heal") and d  # a fallback's record keeps the rehabilitation's step
        cost = path_cost(d, trajectory(w["rows"]), ref_traj, step_s, w.get("k") or c["k"]) if d else {}
        check = next((h for h in w.get("heal_checks") or [] if h["kind"] == "check"), None)
        out[label] = {"chosen": d.get("chosen"), "fallback": bool(first), "k": w.get("k"),
                      "from": d.get("rollback_to") if d.get("chosen") == "recompute" else d.get("snapshot_step"),
                      "predicted_heal_steps": (d.get("failed_heal") or {}).get("predicted_heal_steps",
                                                                            d.get("predicted_heal_steps")),
                      "candidates": {p: {k2: v for k2, v in x.items() if k2 in ("feasible", "steps", "reason")}
                                     for p, x in (d.get("candidates") or {}).items()},
                      "test_loss": w.get("test_loss"), "test_acc": w.get("test_acc"),
                      "heal_on_track": None if check is None else check["on_track"],
                      "heal_lag_online": None if check is None else check["lag"], **cost,
                      "traj": _traj(w["rows"])}
    return out


# ------------------------------------------------------------------ report
def spread(free: dict, engine: str, kind: str) -> tuple[float, float]:
    xs = [v["test_loss"] for key, v in free.items() if key.startswith(f"{engine}-{kind}-")]
    return min(xs), max(xs)


def _inside(x, lo, hi):
    tol = 1e-4 * max(abs(hi), 1e-12)
    return lo - tol <= x <= hi + tol


def figures(c: dict, step_s: float) -> dict:
    """A run's comparison of the two paths: the rehabilitated run (the engine's, or the forced
    one), recompute's cost (the engine's run, or its redone steps x the step + the re-shard
    the rehabilitation measured), and whether the engine's choice lost no more than the other
    path (+ one step)."""
    a = c["auto"]
    rehab = a if a["chosen"] == "rehabilitate" and not a["fallback"] else c.get("forced")
    if a["chosen"] == "recompute":
        rec = a
    else:
        redo = (a["candidates"].get("recompute") or {}).get("steps")
        reshard = a["lost_s"] - a["lost_steps"] * step_s
        rec = None if redo is None else {"lost_steps": redo, "lost_s": redo * step_s + reshard}
    other = rec if a["chosen"] == "rehabilitate" else rehab
    ok = other is None or a["lost_s"] <= other["lost_s"] + step_s
    return {"rehab": rehab, "recompute": rec, "engine_ok": ok,
            "ratio": rehab["lost_s"] / rec["lost_s"] if rehab and rec and rec["lost_s"] else None}


def merge(results: list[dict]) -> dict:
    """Several invocations' results as one table (e.g. the ``ElasticTrainer`` rows and, made
    later, the Lightning rows): their cells, failure-free runs and errors together; each
    invocation's command, date and minutes are listed (``invocations``), and each cell keeps the
    date of the invocation that made it (``made``).  A later result's rows replace an earlier
    one's of the same engine, model and interval (a result merged before counts as its
    invocations); an invocation none of whose rows is left is not listed.  A
    ``sharded_controls.py`` result among them adds its control runs (``controls*``); a
    ``sharded_bench.py`` result (``benchmarks/results/sharded.json``) counts as its matrix."""
    results = [r["matrix"] if "matrix" in r and "cells" not in r else r for r in results]
    extra = {k: v for r in results for k, v in r.items() if k.startswith("control")}  # sharded_controls.py's
    results = [r for r in results if "cells" in r]
    if len(results) == 1 and "invocations" not in results[0]:
        return {**results[0], **extra}
    keep = ("command", "date", "minutes", "workdir")
    group = lambda c: (c["engine"], c["kind"], c["k_label"])  # noqa: E731
    cells: dict = {}
    free: dict = {}
    invocations: list = []
    for r in results:
        made = [c | {"made": c.get("made", r["date"])} for c in r["cells"]]
        for g in {group(c) for c in made}:
            cells[g] = [c for c in made if group(c) == g]
        free.update(r["free"])
        invocations += r.get("invocations") or [{k: r[k] for k in keep}]
    order = {"ours": 0, "lightning": 1, "mlp": 0, "lm": 1, "conv": 2, "default": 0}
    cells_ = [c for g in sorted(cells, key=lambda g: tuple(order.get(x, 9) for x in g) + g[2:]) for c in cells[g]]
    dates = {c["made"] for c in cells_}
    invocations = [i for i in invocations if i["date"] in dates]
    return {"cells": cells_, "free": free, "errors": [e for r in results for e in r.get("errors", [])],
            "invocations": invocations, **{k: results[-1][k] for k in keep}, **extra}


def markdown(res: dict) -> list[str]:
    cells, free = res["cells"], res["free"]
    made = "; ".join(
        f"`{r['command']}` ({r['date']}; {r['minutes']:.0f} min on a shared 2-core machine"
        + ("; `--reuse` keeps the runs an earlier invocation of the same code (a hash of the packages and the benchmark's scripts, checked per run) "
           "finished, and the minutes count this invocation's runs only" if "--reuse" in r["command"] else "") + ")"
        for r in res.get("invocations") or [res])
    lines = ["## Rehabilitate or recompute: the matrix (issue 23)", "",
             made + (" -- their rows merged" if res.get("invocations") else "") + ".  "
             "4 CPU workers, FSDP2 over all 4, AdamW, 64 steps of 64 samples, accelerator emulation "
             "(1 ms per sample); worker 2 SIGKILLed from outside once the kill step is under way; every "
             "setting default but the snapshot interval K where a tuned one is named.  Method and "
             "definitions: `benchmarks/sharded_matrix.py`.  *Lost steps* = redone steps + lag (steps of "
             "progress behind the failure-free run of the same seed, on the same batches); *lost s* adds "
             "the path's re-shard; *pred / meas*: the engine's predicted heal steps / the measured lag of "
             "the rehabilitated run (forced where the engine recomputed).", ""]
    t = {"cells": 0, "rehab": 0, "rehab_in": 0, "rehab_no_worse": 0, "rec": 0, "rec_exact": 0, "pred": 0,
         "pred_ok": 0, "late": [], "wrong": 0, "engine_ok": 0, "fallback": 0, "cell_pred": 0, "cell_pred_ok": 0,
         "cell_flat": 0, "rel": [], "above": {}, "end_rule": [], "end_rule_worse": 0}
    groups: dict = {}
    for c in cells:
        groups.setdefault((c["engine"], c["kind"], c["k_label"]), []).append(c)
    for (engine, kind, klabel), cs in groups.items():
        lo, hi = spread(free, engine, kind)
        accs = [v["test_acc"] for key, v in free.items() if key.startswith(f"{engine}-{kind}-")]
        who = "Lightning `ModelParallelStrategy` + `FaultToleranceCallback()`" if engine == "lightning" else "`ElasticTrainer`"
        made = sorted({c["made"] for c in cs if "made" in c})
        lines += [f"### {kind}, {who}, K {klabel} (K measured in the runs: {sorted({c['auto']['k'] for c in cs})})"
                  + (f"; made {', '.join(made)}" if res.get("invocations") and made else ""), "",
                  f"Failure-free over {len(accs)} seeds: test loss {lo:.4f}..{hi:.4f}, test accuracy "
                  f"{100 * min(accs):.1f}..{100 * max(accs):.1f} %.", "",
                  "| in the run | in the interval | kill at | engine chose (runs) | test loss in the spread | rehab pred / meas (median) | pred within +-50 %: runs, cell | lost steps: rehabilitate / recompute (median) | lost s: rehab / recompute (median) | engine lost no more than the other |",
                  "| --- | --- | ---: | --- | --- | --- | --- | --- | --- | --- |"]
        by_pos: dict = {}
        for c in cs:
            by_pos.setdefault((c["position"], c["interval"], c["kill_step"]), []).append(c)
        for (pos, ipos, at), pc in by_pos.items():
            figs = [figures(c, free[f"{engine}-{kind}-{c['seed']}"]["step_s"]) for c in pc]
            rh = [f["rehab"] for f in figs if f["rehab"]]
            ok = [x for x in (agrees(r.get("predicted_heal_steps"), r.get("lag"), r.get("informative", True))
                              for r in rh) if x is not None]
            flat = sum(bool(r.get("plateau")) for r in rh)
            told = [r for r in rh if r.get("informative", True) and r.get("lag") is not None]
            cell_ok = agrees(statistics.median(r["predicted_heal_steps"] for r in told),
                             statistics.median(r["lag"] for r in told)) if told else None
            if cell_ok is not None:
                t["cell_pred"] += 1
                t["cell_pred_ok"] += cell_ok
            elif rh and flat * 2 > len(rh):
                t["cell_flat"] += 1
            inside = [_inside(c["auto"]["test_loss"], lo, hi) for c in pc]
            for c, f in zip(pc, figs):
                a = c["auto"]
                t["cells"] += 1
                t["engine_ok"] += f["engine_ok"]
                if END_RULE in ((a["candidates"].get("rehabilitate") or {}).get("reason") or ""):
                    t["end_rule"].append(f["recompute"]["lost_s"] - f["rehab"]["lost_s"] if f["rehab"] else None)
                    t["end_rule_worse"] += not f["engine_ok"]
                t["fallback"] += a["fallback"]
                if a["chosen"] == "rehabilitate" and not a["fallback"]:
                    t["rehab"] += 1
                    t["rehab_in"] += _inside(a["test_loss"], lo, hi)
                    t["rehab_no_worse"] += a["test_loss"] <= hi * (1 + 1e-4)
                    t["rel"].append(a["test_loss"] / c["ref_test_loss"] - 1.0)
                    if a["test_loss"] > hi * (1 + 1e-4):  # above the worst seed: whose, and by how much
                        t["above"].setdefault((engine, kind), []).append(
                            (hi / c["ref_test_loss"] - 1.0, a["test_loss"] / c["ref_test_loss"] - 1.0,
                             (a.get("test_acc") or 0.0) - (free[f"{engine}-{kind}-{c['seed']}"].get("test_acc") or 0.0)))
                elif a["chosen"] == "recompute" and not a["fallback"]:
                    t["rec"] += 1
                    t["rec_exact"] += abs(a["test_loss"] - c["ref_test_loss"]) <= 1e-4 * abs(c["ref_test_loss"])
                    forced = c.get("forced")
                    t["wrong"] += bool(forced) and (forced["lost_s"] > a["lost_s"] or not _inside(forced["test_loss"], lo, hi))
                if ipos == "late" and f["ratio"] is not None:
                    t["late"].append(f["ratio"])
            t["pred"] += len(ok)
            t["pred_ok"] += sum(ok)
            chose = _counts(c["auto"]["chosen"] + (" then recompute" if c["auto"]["fallback"] else "") for c in pc)
            lines.append(
                f"| {pos} | {ipos} | {at} | {chose} | {sum(inside)}/{len(pc)} | "
                f"{_med(r.get('predicted_heal_steps') for r in rh)} / {_med(r.get('lag') for r in rh)} | "
                f"{sum(ok)}/{len(ok)}" + (f" ({flat} on a plateau)" if flat else "")
                + f" {'yes' if cell_ok else 'no' if cell_ok is not None else '-'} | {_med(r['lost_steps'] for r in rh)} / "
                f"{_med(f['recompute']['lost_steps'] for f in figs if f['recompute'])} | "
                f"{_med((r['lost_s'] for r in rh), 2)} / {_med((f['recompute']['lost_s'] for f in figs if f['recompute']), 2)} | "
                f"{sum(f['engine_ok'] for f in figs)}/{len(pc)} |")
        lines.append("")
    late = t["late"]
    errs = res.get("errors") or []
    lines += ["### Against the goals", "",
              f"* Runs that did not end cleanly (left out of every figure): {len(errs)}"
              + (": " + ", ".join(e["run"] for e in errs) if errs else "") + ".",
              f"* The engine rehabilitated {t['rehab']} of {t['cells']} killed runs: final test loss inside "
              f"the failure-free seed spread in {t['rehab_in']}, no worse than the worst seed in "
              f"{t['rehab_no_worse']}.  It recomputed {t['rec']} (the reason in each Decision), ending on "
              f"the seed's failure-free test loss (relative 1e-4) in {t['rec_exact']}; a heal check fell "
              f"back to recompute in {t['fallback']}.",
              *_above_lines(t["above"], free),
              f"* Rehabilitated runs' final test loss against the same seed's failure-free one: median "
              f"{_pct(t['rel'], 50)}, 90th percentile {_pct(t['rel'], 90)}, worst {_pct(t['rel'], 100)}.",
              f"* Heal steps predicted vs measured (the engine's and the forced rehabilitations): within +-50 % "
              f"in {t['cell_pred_ok']} of {t['cell_pred']} cells (median over the cell's runs whose lag "
              f"could be measured; {t['cell_flat']} more cells on a plateau, where steps of progress are "
              f"not defined), in {t['pred_ok']} of {t['pred']} runs with an informative lag "
              f"({100 * t['pred_ok'] / max(1, t['pred']):.0f} %).",
              f"* Late in the interval, rehabilitation's lost time / recompute's: median {_med(late, 2)}, "
              f"at most {max(late) if late else float('nan'):.2f}, over {len(late)} runs.",
              f"* Where the engine recomputed, rehabilitating (forced) would have lost more time or ended "
              f"outside the spread in {t['wrong']} of {t['rec']} runs.  The engine's choice lost no more "
              f"time than the other path (+ one step) in {t['engine_ok']} of {t['cells']}"
              + (f"; it recomputed {len(t['end_rule'])} because rehabilitating would have left the run over half "
                 f"a step behind at its end (quality before time: `shard_recovery.HEALED_LAG`), {t['end_rule_worse']} "
                 f"of them losing more time than the forced rehabilitation (+ one step), by a median "
                 f"{_med(t['end_rule'], 2)} s" if t["end_rule"] else "") + ".", ""]
    return lines


def _above_lines(above: dict, free: dict) -> list[str]:
    """Per model: the rehabilitated runs that ended above the worst failure-free seed -- how far
    their own seed's failure-free run was below the worst (a seed near the top leaves the spread
    with any change upwards), their change against it beside the spread's width, and the test
    accuracy's."""
    if not above:
        return []
    parts = []
    for (engine, kind), xs in sorted(above.items()):
        lo, hi = spread(free, engine, kind)
        gap, rel, acc = ([x[i] for x in xs] for i in range(3))
        parts.append(f"{kind} ({engine}): {len(xs)} runs, their seeds' failure-free test loss "
                     f"{100 * min(gap):.2f}..{100 * max(gap):.2f} % below the worst seed's; theirs "
                     f"{100 * min(rel):+.2f}..{100 * max(rel):+.2f} % against their own seed's (the seed spread "
                     f"is {100 * (hi / lo - 1):.1f} % wide), test accuracy {100 * min(acc):+.1f}..{100 * max(acc):+.1f} points")
    return [f"* Rehabilitated runs above the worst failure-free seed, per model: {'; '.join(parts)}."]


def _counts(xs) -> str:
    out: dict = {}
    for x in xs:
        out[x] = out.get(x, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in out.items())


def quantile(xs, q: float) -> float:
    """The ``q``-th percentile of ``xs`` (non-empty): the nearest rank."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def _pct(xs, q: float) -> str:
    xs = list(xs)
    return "-" if not xs else f"{100 * quantile(xs, q):+.2f} %"


def _med(xs, nd: int = 1) -> str:
    xs = [x for x in xs if x is not None]
    return "-" if not xs else f"{statistics.median(xs):.{nd}f}"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="mlp,lm,conv")
    p.add_argument("--lightning", default="mlp", help="model kinds also run through Lightning ('' for none)")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--first-seed", type=int, default=0,
                   help="seeds first..first+seeds-1 (new seeds test a model fitted on earlier ones)")
    p.add_argument("--ks", default="default,4", help="snapshot intervals: 'default' and/or numbers")
    p.add_argument("--jobs", type=int, default=2, help="jobs at once")
    p.add_argument("--workdir", default=None)
    p.add_argument("--reuse", action="store_true",
                   help="reuse the work dir's finished runs made by the same code and settings")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    a = p.parse_args(argv)
    global REUSE
    REUSE = a.reuse
    work = Path(a.workdir or tempfile.mkdtemp(prefix="cft_matrix_"))
    ks = [None if x == "default" else int(x) for x in a.ks.split(",") if x]
    engines = {"ours": [m for m in a.models.split(",") if m]}
    if a.lightning:
        engines["lightning"] = [m for m in a.lightning.split(",") if m]
    t0 = time.time()
    res = matrix(work, engines, a.seeds, ks, a.jobs, a.first_seed)
    res.update(command=("python benchmarks/sharded_matrix.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip(),
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), minutes=(time.time() - t0) / 60, workdir=str(work))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    text = "\n".join(markdown(res)) + "\n"
    if a.markdown:
        Path(a.markdown).write_text(text)
    print(text)
    return res


if __name__ == "__main__":
    main()
