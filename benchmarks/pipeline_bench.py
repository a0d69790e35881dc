"""Pipeline (DP x PP) benchmark: failure-free overhead against plain ``torch.distributed.pipelining``
and recovery from one SIGKILL under each pipeline policy.

    python benchmarks/pipeline_bench.py [--repeats 1] [--kills 1] [--steps 30] [--adaptive-mttf 0.3,3]
        [--json benchmarks/results/pipeline.json] [--markdown docs/benchmarks-pipeline.md]
        (plots go to docs/img/ next to the markdown)

Both sides run ``benchmarks/_pipe_bench.py``: 8 CPU workers, 2 pipelines x 4 stages of an
8-block MLP, in **accelerator-emulation mode** (each block's forward padded by ``--block-sleep``
seconds, its backward by twice that; see the worker's doc).

* **Overhead**: steady-state steps/s (after ``--warmup`` steps) of the chameleon-ft runtime
  (``python -m chameleon_ft.cli.launch``) and of the baseline (``python -m torch.distributed.run``:
  ``PipelineStage`` + ``Schedule1F1B`` per pipeline, gradient all-reduce between same-stage
  ranks), alternating, median of ``--repeats`` runs each; ratio = ours / baseline.
* **One kill**: per policy set ({reroute}, {replan}, adaptive {reroute, replan}) a run whose
  middle-stage worker (``--victim``, default 1: pipeline 0, stage 1) is SIGKILLed from this
  process once worker 0 committed step ``--kill-step``.  MTTR = kill -> first step committed
  after it (worker 0's clock) and the recovering member's breakdown; time to the re-planned
  layout = kill -> last member's migration end; efficiency = steps/s after recovery (skipping
  ``--settle`` steps) / (failure-free steps/s x 7/8); the engine's predicted step time of the
  chosen candidate against the measured one.

* **The crossover** (``pipeline_crossover.py``): from the {reroute} and {replan} kill runs, the
  goodput over ``D`` seconds after the decision for a grid of ``D``, measured and as the engine
  predicted it; the measured and predicted ``D*``; then adaptive kill runs with ``D`` fixed on
  either side of the predicted ``D*`` (``--adaptive-mttf`` factors) -- the engine's choice, and
  whether the measured goodput orders the policies as predicted.
* **Estimator accuracy**: every run's predicted-vs-measured records after each decision (step
  and transition seconds), their error distribution, and a scatter plot.

Limits, honestly: wall-clock timings on a shared 2-core machine (other jobs may run): read
medians and ratios, not digits; a run takes ~1.5 min of which most is 8 workers importing torch.
The metric functions (``rate``, ``kill_metrics``) are pure and tested on synthetic logs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from chameleon_ft.cli.localjob import LocalJob, kill_processes

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipeline_crossover as xo  # noqa: E402

SCRIPT = Path(__file__).with_name("_pipe_bench.py")
POLICIES = {"reroute": "reroute", "replan": "replan", "adaptive": "reroute,replan"}
PHASES = ["detect", "membership", "rebuild", "state_transfer", "first_step"]
MODE = "accelerator emulation"
# Emulated device memory (bytes): a stage holds at most two 4160-parameter blocks with their
# weights and Adam state (12 bytes per parameter), or three with the small first block.  Without
# it the engine's best plan for 8 workers is 8 x PP1, twice as fast as the job's 2 x PP4, and
# every re-plan would improve on the user's layout instead of recovering from a loss.
DEVICE_MEMORY = 120e3


# ---------------------------------------------------------------- pure metrics
def rate(stamps: list, after: Optional[float] = None, skip: int = 0) -> Optional[float]:
    """Committed steps per second over ``stamps`` ([step, time] pairs, in order): those
    after time ``after`` (all by default), less the first ``skip``.  None with < 2 left."""
    ts = [t for _, t in stamps if after is None or t > after][skip:]
    if len(ts) < 2 or ts[-1] <= ts[0]:
        return None
    return (len(ts) - 1) / (ts[-1] - ts[0])


def median_interval(stamps: list, lo: Optional[float] = None, hi: Optional[float] = None) -> Optional[float]:
    ts = [t for _, t in stamps if (lo is None or t > lo) and (hi is None or t < hi)]
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    return statistics.median(gaps) if gaps else None


def noticed_after_kill(mttr_log_s: Optional[float], breakdown: dict) -> Optional[float]:
    """Kill -> the recovering member noticed the failure: the recovery record's time less every
    phase after detection.  (The breakdown's ``detect`` starts at the member's *step* start, so
    in a pipeline step of ~0.8 s it holds the compute before the kill: it is not a latency.)"""
    after = [breakdown.get(k) for k in PHASES[1:]]
    if mttr_log_s is None or any(x is None for x in after):
        return None
    return mttr_log_s - sum(after)


def resumed_after_kill(mttr_log_s: Optional[float], breakdown: dict) -> Optional[float]:
    """Kill -> training resumed on the new layout: the recovery record's time less its first
    step (noticed + membership + rebuild + state transfer).  MTTR adds that first step, which in
    a pipeline job is a whole step of the new plan (a rerouted step: ~1.4 s here)."""
    first = breakdown.get("first_step")
    return None if mttr_log_s is None or first is None else mttr_log_s - first


def kill_metrics(events: list[dict], stamps: list, t_kill: float, ff_rate: Optional[float],
                 world: int = 8, settle: int = 2, warmup: int = 3, predicted: list = ()) -> dict:
    """Recovery figures of one kill run from its event log, worker 0's commit stamps and its
    per-step predictions ([step, engine's step time of the running plan, plan])."""
    after = [(s, t) for s, t in stamps if t > t_kill]
    first = after[0][1] if after else None
    out: dict = {"mttr_s": None if first is None else first - t_kill}
    recs = [e for e in events if e["event"] == "recovery"]
    if recs:
        rec = min(recs, key=lambda e: e["ts"])
        out["breakdown"] = {k: rec.get("mttr", {}).get(k) for k in PHASES}
        out["mttr_log_s"] = rec["ts"] - t_kill
        out["noticed_s"] = noticed_after_kill(out["mttr_log_s"], out["breakdown"])
        out["resumed_s"] = resumed_after_kill(out["mttr_log_s"], out["breakdown"])
    ends = [e for e in events if e["event"] == "migration" and e.get("phase") == "end" and e.get("step", 0) > 0
            and e["ts"] > t_kill]
    moved = [e for e in ends if e.get("transfers")]
    out["migration"] = {"bytes": sum(e.get("bytes", 0) for e in ends),
                        "transfers": sum(e.get("transfers", 0) for e in ends),
                        "rounds": max((e.get("rounds", 0) for e in ends), default=0),
                        "predicted_bytes": next((e.get("predicted_bytes") for e in ends), None),
                        "predicted_s": next((e.get("predicted_s") for e in ends), None),
                        "seconds_max": max((e.get("seconds", 0.0) for e in ends), default=0.0),
                        # overlapped (--overlap): trained on while the state moved, for this many steps
                        "overlapped": any(e.get("overlapped") for e in ends),
                        "steps_overlapped": max((e.get("steps_overlapped", 0) for e in ends), default=0)}
    out["to_new_layout_s"] = (max(e["ts"] for e in moved) - t_kill) if moved else None
    ds = [e["decision"] for e in events if e["event"] == "decision" and e["ts"] > t_kill - 1]
    if ds:
        d = ds[0]
        chosen = next((c for c in d["candidates"] if c["policy"] == d["chosen"]), {})
        out["decision"] = {"chosen": d["chosen"], "predicted_step_s": chosen.get("step_time_s"),
                           "extra_microbatches": chosen.get("extra_microbatches"),
                           "plan": chosen.get("plan") if isinstance(chosen.get("plan"), str) else None,
                           "candidates": {c["policy"]: {"feasible": c["feasible"], "step_time_s": c.get("step_time_s"),
                                                        "score": c.get("score"), "reason": c.get("reason")}
                                          for c in d["candidates"]}}
    at = dict((s, t) for s, t in stamps)
    pre = [p for p in predicted if p[0] in at and at[p[0]] < t_kill]
    out["predicted_ff_step_s"] = pre[-1][1] if pre else None
    out["ff_plan"] = pre[-1][2] if pre and len(pre[-1]) > 2 else None
    post = [p for p in predicted if p[0] in at and at[p[0]] > t_kill]
    out["plan_after"] = post[-1][2] if post and len(post[-1]) > 2 else None
    before = [(s, t) for s, t in stamps if t < t_kill][warmup:]
    out["measured_step_before_s"] = median_interval(before)
    out["measured_step_after_s"] = median_interval(after[settle:])
    r_after = rate(after, skip=settle)
    out["rate_before"] = rate(before)
    out["rate_after"] = r_after
    out["efficiency"] = (r_after / (ff_rate * (world - 1) / world)) if (r_after and ff_rate) else None
    # Against the same run's own pre-kill rate (same machine load as the rate after).
    rb = out["rate_before"]
    out["efficiency_in_run"] = (r_after / (rb * (world - 1) / world)) if (r_after and rb) else None
    return out


# ---------------------------------------------------------------- runs
def machine() -> str:
    """The machine line of the pipeline pages (this one, the trace's, the profile's)."""
    import os

    import torch

    return (f"{platform.node()}: {os.cpu_count()} CPU cores, {platform.machine()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")


def worker_args(a, out: Path, steps: int) -> list[str]:
    return ["--out", str(out), "--steps", str(steps), "--block-sleep", str(a.block_sleep),
            "--global-batch", str(a.global_batch), "--micro-batch", str(a.micro_batch), "--dim", str(a.dim),
            *getattr(a, "extra_args", ())]


def read_memory(out: Path) -> dict:
    """Each worker's peak RSS and parameters held (``_pipe_bench.write_memory``), by worker."""
    d = Path(str(out) + ".mem")
    got = [json.loads(f.read_text()) for f in sorted(d.glob("*.json"))] if d.is_dir() else []
    return {str(m["worker"]): {"peak_rss": m["peak_rss"], "params": m["params"]} for m in got}


def memory_summary(runs: list[dict]) -> dict:
    """Per-worker peak RSS over a system's runs: median and max (bytes), params held (max)."""
    rss = [m["peak_rss"] for run in runs for m in run.values()]
    params = [m["params"] for run in runs for m in run.values()]
    if not rss:
        return {}
    return {"median": statistics.median(rss), "max": max(rss), "params_max": max(params), "workers": len(rss)}


def descendants(pid: int) -> list[int]:
    """PIDs of ``pid``'s descendants (torchrun starts its workers in sessions of their own, so
    killing its process group would orphan them)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def run_baseline(a, root: Path) -> list:
    root.mkdir(parents=True, exist_ok=True)
    out = root / "stamps.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
           str(SCRIPT), "--mode", "torch", *worker_args(a, out, a.steps)]
    with open(root / "log.txt", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        code = None
        try:
            code = proc.wait(timeout=400)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if proc.poll() is None:  # timed out or interrupted: the workers first, by PID
                kill_processes(descendants(proc.pid) + [proc.pid], [proc])
    if code != 0:
        raise RuntimeError(f"baseline run failed ({code}):\n{(root / 'log.txt').read_text()[-3000:]}")
    return json.loads(out.read_text())["stamps"]


def run_ft(a, root: Path, allowed: Optional[str] = None, steps: Optional[int] = None,
           kill_step: Optional[int] = None, diag: Optional[str] = None,
           mttf: Optional[float] = None) -> tuple[dict, list, Optional[float]]:
    out = root / "stamps.json"
    args = ["--mode", "ft", *worker_args(a, out, steps or a.steps), "--build", a.build] + (
        ["--allowed", allowed] if allowed else [])
    if diag:
        args += ["--diag", diag]
    if kill_step is not None and a.emulate_link:
        args += ["--emulate-link", a.emulate_link]
    if kill_step is not None and a.device_memory:
        args += ["--device-memory", str(a.device_memory)]
    if kill_step is not None and getattr(a, "overlap", False):
        args.append("--overlap")
    if kill_step is not None:
        args.append("--predict")
    job = LocalJob(root / "run", SCRIPT, args, nproc=8, hang_timeout=a.hang_timeout,
                   launch_args=["--mttf", str(mttf)] if mttf else ())
    t_kill = None
    try:
        job.start()
        if kill_step is not None:
            # Worker 0 logs step k's record once it committed step k - 1.
            job.wait_step(kill_step + 1, 400)
            t_kill = job.kill(a.victim)
        codes = job.wait(400)
        if codes != [0]:
            raise RuntimeError(f"chameleon-ft run failed ({codes}):\n{job.output()[-3000:]}")
        return json.loads(out.read_text()), job.events(), t_kill
    finally:
        job.cleanup()


# ---------------------------------------------------------------- report
def fmt(x, unit="", scale=1.0, nd=0) -> str:
    return "-" if x is None else f"{x * scale:.{nd}f}{unit}"


def memory_phrase(config: dict) -> str:
    """How a results page names its runs' emulated device memory (``--device-memory``)."""
    return (f"emulated device memory of {config['device_memory'] / 1e3:g} kB (the model needs its stages: a "
            "device holds two blocks with their optimizer state)")


def markdown(res: dict) -> str:
    c = res["config"]
    emu = (f"{MODE}: {c['block_sleep'] * 1e3:g} ms forward + {2 * c['block_sleep'] * 1e3:g} ms backward per block, "
           f"8 blocks (width {c.get('dim', 64)}), 2 pipelines x 4 stages, global batch {c['global_batch']}, micro-batch {c['micro_batch']}"
           + (f"; kill runs with an {memory_phrase(c)}" if c.get("device_memory") else ""))
    lines = ["# Pipeline (DP x PP) benchmark", "",
             "<!-- generated by benchmarks/pipeline_bench.py from its results JSON; do not edit by hand -->", "",
             f"* command: `{res['command']}`", f"* date: {res['date']}", f"* machine: {res['machine']}",
             f"* mode: **{emu}**", f"* wall time: {res['wall_s']:.0f} s", "",
             "Wall-clock figures on a shared 2-core machine (8 workers; other jobs ran concurrently): "
             "read medians and ratios, not digits.", ""]
    o = res.get("overhead")
    if o:
        lines += [f"## Failure-free: chameleon-ft vs torch.distributed.pipelining ({MODE})", "",
                  "| system | runs | steps/s (median) | step (ms, median) | runs' steps/s |",
                  "| --- | ---: | ---: | ---: | --- |"]
        named = [("torch.distributed.pipelining (Schedule1F1B) + DP all-reduce", "baseline"),
                 ("chameleon-ft ElasticTrainer(stages=4)", "ft")]
        named += [(f"diagnostic only: chameleon-ft with `{k.split(':', 1)[1]}` patched in", k)
                  for k in o["rates"] if k.startswith("ft-diag:")]
        for name, key in named:
            rs = o["rates"][key]
            lines.append(f"| {name} | {len(rs)} | {o[key]:.3f} | {1e3 / o[key]:.0f} | "
                         + ", ".join(f"{r:.3f}" for r in rs) + " |")
        lines += ["", f"Ratio ours / baseline (steps/s): **{o['ratio']:.3f}** (overhead "
                  f"{100 * (1 / o['ratio'] - 1):+.1f} % in step time; target <= +1 %).", ""]
        for k in o["rates"]:
            if k.startswith("ft-diag:"):
                lines += [f"Diagnostic ratio `{k.split(':', 1)[1]}` / baseline: {o[k] / o['baseline']:.3f} "
                          "(a patched runtime, to locate the overhead; see `benchmarks/_pipe_bench.py`).", ""]
    mem = res.get("memory") or {}
    if mem.get("baseline") and mem.get("ft"):
        lines += ["## Peak memory per worker (the same failure-free runs)", "",
                  f"Peak resident memory (`ru_maxrss`) of each of the 8 workers at the end of its run, "
                  f"over every run; the MLP's hidden width is {c.get('dim', 64)}.  Our blocks are given as "
                  f"{'per-block factories (a worker builds only the blocks it holds)' if c.get('build', 'factories') == 'factories' else 'a built model (every worker builds the whole model first)'}; "
                  "the baseline builds only its stage's blocks.", "",
                  "| system | workers | peak RSS median | peak RSS max | parameters held (max) |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for name, key in (("torch.distributed.pipelining + DP all-reduce", "baseline"),
                          ("chameleon-ft ElasticTrainer(stages=4)", "ft")):
            m = mem[key]
            lines.append(f"| {name} | {m['workers']} | {m['median'] / 2**20:.1f} MiB | {m['max'] / 2**20:.1f} MiB "
                         f"| {m['params_max']:,} |")
        lines += ["", f"Ratio ours / baseline, peak RSS per worker: median **{mem['ft']['median'] / mem['baseline']['median']:.3f}**, "
                  f"max **{mem['ft']['max'] / mem['baseline']['max']:.3f}** (goal <= 1.1).", ""]
    kills = res.get("kills") or []
    if kills:
        lines += [f"## One SIGKILL of a middle-stage worker ({MODE})", "",
                  f"Worker {c['victim']} killed from outside once worker 0 committed step {c['kill_step']}; "
                  f"{c['kill_steps']} steps per run; efficiency = steps/s after recovery (first {c['settle']} "
                  "steps after it skipped) / (failure-free steps/s x 7/8), failure-free = the median "
                  "chameleon-ft rate above.", "",
                  "Detection: *kill -> noticed* is the recovering member's failure notice after the kill "
                  "(the recovery record's time less every later phase); the breakdown's *detect* starts at "
                  "that member's step start, so it also holds the step's work before the kill.  *MTTR* is "
                  "kill -> first step committed on the new layout (as in the data-parallel reports), so it "
                  "holds that whole step; *kill -> resumed* stops where the first step starts (noticed + "
                  "membership + rebuild + state transfer).", "",
                  "| allowed | chosen | MTTR | kill -> resumed | kill -> noticed | detect | membership | rebuild | state transfer | first step "
                  "| kill -> new layout | moved | steps/s before / after | efficiency (vs median / vs own pre-kill) | predicted step before / after (chosen) "
                  "| measured step before / after |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for k in kills:
            m, b = k["metrics"], k["metrics"].get("breakdown") or {}
            d = m.get("decision") or {}
            lines.append(
                f"| {{{k['allowed']}}} | {d.get('chosen', '-')} | {fmt(m['mttr_s'], ' ms', 1e3)} | "
                f"{fmt(m.get('resumed_s', resumed_after_kill(m.get('mttr_log_s'), b)), ' ms', 1e3)} | "
                f"{fmt(m.get('noticed_s', noticed_after_kill(m.get('mttr_log_s'), b)), ' ms', 1e3)} | "
                + " | ".join(fmt(b.get(p), " ms", 1e3) for p in PHASES)
                + f" | {fmt(m['to_new_layout_s'], ' ms', 1e3)} | {m['migration']['bytes'] / 1e3:.0f} kB "
                f"| {fmt(m['rate_before'], '', 1, 3)} / {fmt(m['rate_after'], '', 1, 3)} "
                f"| {fmt(m['efficiency'], '', 1, 2)} / {fmt(m['efficiency_in_run'], '', 1, 2)} "
                f"| {fmt(m.get('predicted_ff_step_s'), ' ms', 1e3)} / {fmt(d.get('predicted_step_s'), ' ms', 1e3)} "
                f"| {fmt(m['measured_step_before_s'], ' ms', 1e3)} / {fmt(m['measured_step_after_s'], ' ms', 1e3)} |")
        lines += ["", "Candidates the engine priced at the decision (predicted step time, score):", ""]
        for k in kills:
            d = k["metrics"].get("decision") or {}
            cs = "; ".join(f"{p}: {fmt(v['step_time_s'], ' ms', 1e3)}, score {fmt(v['score'], '', 1, 1)}"
                           + ("" if v["feasible"] else f" (infeasible: {v['reason']})")
                           for p, v in (d.get("candidates") or {}).items())
            lines.append(f"* {{{k['allowed']}}} -> {d.get('chosen')}: {cs}; plan before `{k['metrics'].get('ff_plan')}`, "
                         f"after `{k['metrics'].get('plan_after')}`")
        lines.append("")
    lines += xo.markdown(res.get("crossover"), res.get("adaptive_d") or [], prediction_records(res), MODE,
                         img_name(res.get("markdown")))
    if res.get("notes"):
        lines += ["## Notes", ""] + [f"* {n}" for n in res["notes"]] + [""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1, help="failure-free runs per system (alternating)")
    ap.add_argument("--kills", type=int, default=1, help="kill runs per policy set")
    ap.add_argument("--policies", default="reroute,replan,adaptive")
    ap.add_argument("--steps", type=int, default=30, help="steps of a failure-free run")
    ap.add_argument("--kill-steps", type=int, default=36, help="steps of a kill run")
    ap.add_argument("--kill-step", type=int, default=10)
    ap.add_argument("--victim", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--settle", type=int, default=3)
    ap.add_argument("--block-sleep", type=float, default=0.01)
    ap.add_argument("--dim", type=int, default=64, help="the MLP's hidden width (memory runs: e.g. 2048)")
    ap.add_argument("--build", choices=["factories", "modules"], default="factories",
                    help="how our side gives the blocks (_pipe_bench.py --build)")
    ap.add_argument("--emulate-link", default="0.003:2e5",
                    help="kill runs: the emulated network between workers (LATENCY_S:BANDWIDTH_BPS) for "
                         "messages between stages and migrations, so that a migration costs several steps as on "
                         "a real cluster ('' for none; the overhead runs never emulate it)")
    ap.add_argument("--device-memory", type=float, default=0.0,
                    help="kill runs: each emulated device's memory for the engine (bytes; default 0: none, the "
                         f"engine re-plans to fewer, fuller stages); {DEVICE_MEMORY:g} holds at most two of the "
                         "model's blocks with their optimizer state, so that it needs its stages as on real accelerators")
    ap.add_argument("--overlap", action="store_true",
                    help="kill runs: migrations run while the job trains rerouted (ElasticConfig.overlap_migration)")
    ap.add_argument("--adaptive-mttf", default="0.3,3",
                    help="adaptive kill runs with D = these factors x the predicted crossover D* ('' for none)")
    ap.add_argument("--no-fixed-at-d", dest="fixed_at_d", action="store_false",
                    help="skip the fixed-policy runs with the adaptive runs' D")
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--hang-timeout", type=float, default=10.0)
    ap.add_argument("--diag", default=None,
                    help="comma-separated diagnostic variants of the runtime to time too in the overhead "
                         "runs: no-start-check, blocking-p2p (see _pipe_bench.py)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--markdown", help="write the markdown report here")
    ap.add_argument("--note", action="append", default=[], help="a line for the report's notes")
    ap.add_argument("--workdir", help="keep every run's directory (event logs, outputs) here")
    ap.add_argument("--from-json", help="no runs: re-render --markdown from these results (adding --note lines)")
    a = ap.parse_args(argv)
    if a.from_json:
        res = json.loads(Path(a.from_json).read_text())
        res["notes"] = list(res.get("notes") or []) + a.note
        return _write(res, a)
    t0 = time.time()
    res: dict = {"command": "python benchmarks/pipeline_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "machine": machine(),
                 "mode": MODE, "config": {k: v for k, v in vars(a).items() if k not in ("json", "markdown", "note", "from_json")},
                 "notes": a.note}
    rates: dict[str, list[float]] = {"baseline": [], "ft": []}
    memory: dict[str, list[dict]] = {"baseline": [], "ft": []}
    systems = ["baseline", "ft"]
    diags = [d for d in (a.diag or "").split(",") if d]
    for d in diags:
        rates[f"ft-diag:{d}"] = []
        systems.append(f"ft-diag:{d}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = a.workdir or tmp  # --workdir: keep the runs' event logs
        for r in range(a.repeats):
            for mode in systems[r % len(systems):] + systems[:r % len(systems)]:  # rotate the order
                root = Path(tmp) / f"{mode.replace(':', '-')}{r}"
                if mode == "baseline":
                    stamps = run_baseline(a, root)
                else:
                    diag = mode.split(":", 1)[1] if mode.startswith("ft-diag:") else None
                    for attempt in range(3):
                        got, events, _ = run_ft(a, root / str(attempt), diag=diag)
                        # A worker that started late joined after the first plan: the job grew
                        # into another layout, not the compared one.  Such a run is not kept.
                        if not any(e["event"] == "decision" for e in events):
                            break
                        print(f"{mode} run {r}: a decision in a failure-free run (a late worker joined); "
                              "run again", flush=True)
                    stamps = got["stamps"]
                rates[mode].append(rate(stamps, skip=a.warmup))
                if mode in memory:
                    memory[mode].append(read_memory((root if mode == "baseline" else root / str(attempt))
                                                    / "stamps.json"))
                print(f"{mode} run {r}: {rates[mode][-1]:.3f} steps/s", flush=True)
        if a.repeats:
            b, f = statistics.median(rates["baseline"]), statistics.median(rates["ft"])
            res["overhead"] = {"baseline": b, "ft": f, "ratio": f / b, "rates": rates}
            res["memory"] = {k: memory_summary(v) for k, v in memory.items()}
            for d in diags:
                res["overhead"][f"ft-diag:{d}"] = statistics.median(rates[f"ft-diag:{d}"])
        ff = res["overhead"]["ft"] if a.repeats else None
        res["kills"] = []
        for name in [p for p in a.policies.split(",") if p]:
            for i in range(a.kills):
                root = Path(tmp) / f"kill-{name}{i}"
                got, events, t_kill = run_ft(a, root, POLICIES[name], a.kill_steps, a.kill_step)
                stamps = got["stamps"]
                m = kill_metrics(events, stamps, t_kill, ff, settle=a.settle, warmup=a.warmup,
                                 predicted=got.get("predicted", []))
                res["kills"].append({"allowed": POLICIES[name], "run": i, "metrics": m,
                                     "stamps": stamps, "t_kill": t_kill, "events": _kept(events)})
                print(name, json.dumps({k: v for k, v in m.items() if k != "decision"}, default=str), flush=True)
        _crossover(a, res, Path(tmp))
    res["wall_s"] = time.time() - t0
    return _write(res, a)


def _kept(events: list[dict]) -> list[dict]:
    """The events a report needs from a run (not the per-step records)."""
    return [e for e in events if e["event"] in ("decision", "recovery", "migration", "prediction", "calibration",
                                                "failure")]


def _crossover(a, res: dict, tmp: Path) -> None:
    """From the always-reroute and always-re-plan kill runs: the goodput-over-D curves and the
    crossover; then adaptive runs of the same kill with D on either side of the predicted D*."""
    runs = {}
    for k in res["kills"]:
        name = {"reroute": "reroute", "replan": "replan"}.get(k["allowed"])
        if name and name not in runs:
            runs[name] = {"stamps": k["stamps"], "events": k["events"]}
    if len(runs) < 2:
        return
    span = min(r["stamps"][-1][1] - (xo.decision_of(r["events"]) or {"ts": r["stamps"][-1][1]})["ts"]
               for r in runs.values())
    if span <= 1.0:
        return
    curves = xo.analyse(runs, a.global_batch, xo.log_grid(0.1, span, 40))
    res["crossover"] = curves
    d_star = curves["d_star_predicted"]
    res["adaptive_d"] = []
    if d_star and a.adaptive_mttf:
        for f in [float(x) for x in a.adaptive_mttf.split(",") if x]:
            d = d_star * f
            got, events, _ = run_ft(a, tmp / f"adaptive-D{f:g}", POLICIES["adaptive"], a.kill_steps, a.kill_step,
                                    mttf=d)
            dec = xo.decision_of(events) or {}
            # Each fixed policy again with the same D: its plan search prices a re-plan's
            # migration over D too (always-replan with the job's own D picks the fastest plan).
            at_d = {"adaptive": xo.goodput_over(got["stamps"], events, a.global_batch, d)}
            for name in ("reroute", "replan") if a.fixed_at_d else ():
                g2, ev2, _ = run_ft(a, tmp / f"{name}-D{f:g}", POLICIES[name], a.kill_steps, a.kill_step, mttf=d)
                at_d[name] = xo.goodput_over(g2["stamps"], ev2, a.global_batch, d)
                at_d[f"{name}_decision"] = xo.plan_summary(xo.decision_of(ev2))
            at_d["adaptive_decision"] = xo.plan_summary(dec)
            res["adaptive_d"].append({
                "mttf": d, "factor": f, "chosen": dec.get("chosen"), "d_star": xo.predicted_crossover(dec) if dec else None,
                "goodput": {n: xo.goodput_curve_at(curves, n, d) for n in ("reroute", "replan")}, "at_d": at_d,
                "agrees": xo.ordering_agrees(curves, d), "events": _kept(events), "stamps": got["stamps"]})
            print(f"adaptive D={d:.2f}s: {dec.get('chosen')} {at_d}", flush=True)


def prediction_records(res: dict) -> list[dict]:
    """Every predicted-vs-measured record of the results' kill runs, labelled by run."""
    out = []
    for k in res.get("kills") or []:
        out += [{**e, "run": f"{{{k['allowed']}}} #{k['run']}"} for e in k.get("events", []) if e["event"] == "prediction"]
    for r in res.get("adaptive_d") or []:
        out += [{**e, "run": f"adaptive D={r['mttf']:.3g} s"} for e in r.get("events", []) if e["event"] == "prediction"]
    return out


def img_name(markdown: Optional[str]) -> str:
    """The plots' name stem for a page: ``docs/benchmarks-pipeline-memory.md`` -> ``pipeline-memory``."""
    stem = Path(markdown).stem if markdown else "pipeline"
    return stem[len("benchmarks-"):] if stem.startswith("benchmarks-") else stem


def _write(res: dict, a) -> int:
    """The results JSON, the plots and the markdown page, where asked; the page is printed too."""
    if a.markdown:
        res["markdown"] = a.markdown
        img, name = Path(a.markdown).parent / "img", img_name(a.markdown)
        if res.get("crossover"):
            xo.plot_crossover(res["crossover"], img / f"{name}-crossover.png",
                              f"goodput over D after one kill, 8 workers 2 x PP4 ({MODE})")
        recs = prediction_records(res)
        if recs:
            xo.plot_accuracy(recs, img / f"{name}-accuracy.png",
                             f"engine's predictions vs measured, per decision ({MODE})")
    return write_results(res, a.json, a.markdown, markdown)


def write_results(res: dict, json_path: Optional[str], markdown_path: Optional[str], render) -> int:
    """Store a page's results JSON and its markdown (``render(res)``), print the markdown."""
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(res, indent=1))
    md = render(res)
    if markdown_path:
        Path(markdown_path).write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
