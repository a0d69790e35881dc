"""Failure-trace runner for pipeline (DP x PP) jobs: one sequence of faults, every system on it.

    python benchmarks/pipeline_trace.py [--trace realistic|burst|quick|tiny] [--systems adaptive,reroute,replan,restart]
        [--json benchmarks/results/pipeline-trace.json] [--markdown docs/benchmarks-pipeline-trace.md]
        [--plot docs/img/pipeline-trace.png]

Every run is ``benchmarks/_pipe_bench.py`` (8 CPU workers, 2 pipelines x 4 stages of an 8-block
MLP) in **accelerator-emulation mode**: each block's forward padded by ``--block-sleep`` s, its
backward by twice that, so that a step's time follows the schedule and the worker count; the
chameleon-ft systems' engine is told an emulated device memory (``--device-memory``, default
``pipeline_bench.DEVICE_MEMORY``: a device holds two blocks with their state), so that the model
needs its stages and a re-plan recovers from a loss instead of improving on the user's layout.

A *trace* (``TRACES``) is a list of faults by global step.  ``realistic`` (170 steps): SIGKILL
worker 1 (pipeline 0, stage 1) at step 30, and a replacement arrives for it (the launcher's
``--max-replacements 1`` starts one at once); worker 6 becomes a 2x straggler from step 80
(``_pipe_bench.py --slow``: its emulated compute, forward and backward, twice as long); SIGKILL
worker 5 at step 120 (no replacement left).  ``burst``: two kills 10 steps apart in the same
pipeline, no replacement.  A kill is sent from this process by PID with a real signal once
worker 0 committed the step (``LocalJob.wait_step`` + ``LocalJob.kill``, as
``pipeline_bench.run_ft``); its wall time is recorded.  A straggler's time is worker 0's commit
of the step before it starts.

Systems (each at its best on this job):

* ``adaptive``: chameleon-ft ``ElasticTrainer(stages=4)`` under ``python -m chameleon_ft.cli.launch``,
  the engine choosing among all its policies (``--allowed`` unset).
* ``reroute``: the same runtime restricted to ``reroute,heal,wait,restart,keep`` -- ReCycle-like
  rerouting, plus what rerouting alone would still do well: heal the arriving replacement in
  place (``heal``/``wait``), keep going through a straggler (``keep``), restart only as the
  last resort.
* ``replan``: restricted to ``replan,grow,restart,keep`` -- Oobleck-like dynamic parallelism: a
  new layout over the survivors at every failure, and growing into a replacement (``grow``).
* ``restart``: the ``torch.distributed.pipelining`` baseline (``_pipe_bench.py --mode torch``:
  ``PipelineStage`` + ``Schedule1F1B``, gradient all-reduce between same-stage ranks) with
  per-rank stage checkpoints every ``--ckpt-every`` steps (10, as the DDP matrix), under
  ``python -m torch.distributed.run --max-restarts N --monitor-interval 0.1`` with a c10d
  rendezvous on loopback and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (the matrix's fast-recovery
  ``torchrun-restart+fix`` configuration: without it the restarted round hangs on torch 2.13).
  Its "replacement" is implicit: a restart relaunches all 8 workers.  At its best because the
  checkpoint is tiny (saving every 10 steps costs almost nothing here, and the trace's kills fall
  on checkpoint steps, so little work is redone) and the monitor polls every 0.1 s; what it
  cannot avoid is killing and re-importing/re-forming all 8 workers per failure.

Workers 1 and 5 hold the same stage (stage 1 of pipelines 0 and 1): the second kill of
``realistic`` leaves the stage one replica only if the replacement healed into worker 1's slot.
Otherwise no surviving replica of those layers exists, only checkpoint-restart is feasible, and a
chameleon-ft run ends there with exit 75 -- pipeline checkpoints are not written yet
(``ElasticTrainer(stages>1, checkpoint=...)`` raises), so the run is reported as not completed,
with its figures up to that point.  The launcher evicts a worker left out of the job for
``--hang-timeout`` + 2 s; the runner's default of 30 s (not 10) gives a replacement importing
torch on a loaded machine the time to join (a SIGKILL is detected by the launcher, not by it).

A Bamboo-like redundant-computation system is **not** built on this runtime (another helper
adds a simulated stand-in); it does not appear here.

Metrics, per system, from worker 0's commit stamps (pure functions, tested on synthetic logs):
average throughput = global batch x (last step - step at ``--warmup``) / wall time between those
stamps (redone steps after a restart count once: net progress); a timeline of samples/s over a
sliding window of ``--window`` steps; per kill the MTTR (kill -> the first commit of a step
beyond the last one committed before it); the steady rate after each recovery (skipping
``--settle`` steps, up to the next fault) against the same system's failure-free rate (a
failure-free run of ``--ff-steps``; the three chameleon-ft systems are one program until the
first fault, so one failure-free chameleon-ft run serves all three); the decision, recovery
and migration events of the chameleon-ft runs' ``events.jsonl`` (and any ``calibration`` /
``prediction`` events, copied as they are; the restart system's "decisions" are its relaunches,
timed by the first relaunched worker's PID record); ratios adaptive / each system.

Limits, honestly: wall-clock timings on a shared 2-core machine (8 workers time-share it, other
jobs may run): read ratios, not digits; one run per system.  A full default run takes ~12 min.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trace_sim  # noqa: E402  (benchmarks/, next to this file)
from chameleon_ft.cli.localjob import LocalJob, kill_processes  # noqa: E402
from chameleon_ft.runtime.eventlog import read_jsonl  # noqa: E402
from pipeline_bench import DEVICE_MEMORY, SCRIPT, descendants, machine  # noqa: E402
from harness.systems import free_port  # noqa: E402
# The report (markdown, plot) renders the results JSON: benchmarks/pipeline_trace_report.py.
from pipeline_trace_report import FT_ALLOWED, MODE, _fmt, choice_rows, markdown, plot, summary, why_lines  # noqa: E402,F401

SYSTEMS = ("adaptive", "reroute", "replan", "restart")
COPIED_EVENTS = ("calibration", "prediction")


# ---------------------------------------------------------------- traces
@dataclass(frozen=True)
class Fault:
    step: int              # kill: once worker 0 committed this step; slow: from this step on
    kind: str              # "kill" | "slow"
    worker: int
    factor: float = 1.0    # slow only
    replaced: bool = False  # kill only: a replacement arrives for it


@dataclass(frozen=True)
class Trace:
    name: str
    steps: int
    faults: tuple = field(default_factory=tuple)

    def kills(self) -> list[Fault]:
        return [f for f in self.faults if f.kind == "kill"]

    def replacements(self) -> int:
        """The launcher replaces the first deaths: the replaced kills must come first."""
        flags = [f.replaced for f in sorted(self.kills(), key=lambda f: f.step)]
        if flags != sorted(flags, reverse=True):
            raise ValueError(f"trace {self.name}: replaced kills must precede unreplaced ones")
        return sum(flags)

    def slow_arg(self) -> Optional[str]:
        slow = [f for f in self.faults if f.kind == "slow"]
        if len(slow) > 1:
            raise ValueError(f"trace {self.name}: at most one straggler")
        return f"{slow[0].worker}:{slow[0].factor:g}:{slow[0].step}" if slow else None

    def to_json(self) -> dict:
        return {"name": self.name, "steps": self.steps, "faults": [asdict(f) for f in self.faults]}

    @staticmethod
    def from_json(d: dict) -> "Trace":
        return Trace(d["name"], d["steps"], tuple(Fault(**f) for f in d["faults"]))


TRACES = {
    "realistic": Trace("realistic", 170, (Fault(30, "kill", 1, replaced=True), Fault(80, "slow", 6, factor=2.0),
                                          Fault(120, "kill", 5))),
    "burst": Trace("burst", 100, (Fault(30, "kill", 1), Fault(40, "kill", 2))),
    # The second kill hits another stage (0, whose replica is worker 0): 25 steps are too few for a
    # replacement to start and heal on loaded cores, and stage 1 would be left with no replica.
    "quick": Trace("quick", 60, (Fault(15, "kill", 1, replaced=True), Fault(30, "slow", 6, factor=2.0),
                                  Fault(40, "kill", 4))),
    "tiny": Trace("tiny", 20, (Fault(8, "kill", 1),)),
    # A large model on a slow link: a worker lost for a moment (its replacement comes at once),
    # then one lost for good early on -- waiting suits the first, re-planning the second.
    "slowlink": Trace("slowlink", 150, (Fault(20, "kill", 1, replaced=True), Fault(50, "kill", 5))),
    # Fail-slow, then fail-stop: a device turns 4x slow (a throttled accelerator, a degraded
    # link) and stays so; later another worker dies for good.  Routing micro-batches away from
    # the slow one suits the first, re-planning the second (issue 27: the choice per event).
    "failslow": Trace("failslow", 120, (Fault(20, "slow", 6, factor=4.0), Fault(60, "kill", 1))),
    # The same two events the other way round: a worker lost for good, then another turns 4x slow.
    # After a reroute the routes stay as they are until the next failure (no rebalance of a
    # rerouted plan); after a re-plan a rebalance can route work away from the slow worker.
    "killslow": Trace("killslow", 110, (Fault(15, "kill", 1), Fault(35, "slow", 6, factor=4.0))),
}


# ---------------------------------------------------------------- pure metrics
def avg_throughput(stamps: list, batch: int, warmup: int = 0) -> Optional[float]:
    """Samples/s from the first commit of step >= ``warmup`` to the last commit: net progress
    (steps redone after a restart count once) x ``batch`` / wall time.  None without progress."""
    st = sorted(stamps, key=lambda s: s[1])
    first = next((s for s in st if s[0] >= warmup), None)
    if first is None or st[-1][1] <= first[1] or st[-1][0] <= first[0]:
        return None
    return (st[-1][0] - first[0]) * batch / (st[-1][1] - first[1])


def timeline(stamps: list, batch: int, window: int = 4) -> list:
    """[time, samples/s] at each commit: net progress over the last ``window`` commits (>= 0)."""
    st = sorted(stamps, key=lambda s: s[1])
    out = []
    for i in range(window, len(st)):
        (s0, t0), (s1, t1) = st[i - window], st[i]
        if t1 > t0:
            out.append([t1, max(0, s1 - s0) * batch / (t1 - t0)])
    return out


def mttr(stamps: list, t_fault: float) -> Optional[float]:
    """Fault -> first commit of a step beyond the last one committed before the fault."""
    done = max((s for s, t in stamps if t <= t_fault), default=0)
    after = [t for s, t in stamps if t > t_fault and s > done]
    return min(after) - t_fault if after else None


def steady_rate(stamps: list, lo: float, hi: Optional[float] = None, settle: int = 0) -> Optional[float]:
    """Steps/s over the commits in (lo, hi), less the first ``settle``; net progress."""
    st = sorted([s for s in stamps if s[1] > lo and (hi is None or s[1] < hi)], key=lambda s: s[1])[settle:]
    if len(st) < 2 or st[-1][1] <= st[0][1]:
        return None
    return max(0, st[-1][0] - st[0][0]) / (st[-1][1] - st[0][1])


def fault_metrics(stamps: list, faults: list[dict], ff_rate: Optional[float], settle: int = 3,
                  recoveries: Sequence[float] = ()) -> list[dict]:
    """Per fault (``{"step", "kind", "worker", "t"}``, in time order): MTTR (kills), the steady
    steps/s after it (after recovery + ``settle`` commits, up to the next fault) and its gap to
    the failure-free steps/s: 1 - rate / ff_rate.

    A step whose collectives were done before the kill may still commit just after it; where
    the run logged ``recoveries`` (chameleon-ft's ``recovery`` events, written at the first step
    after recovery), the first one between this fault and the next bounds the MTTR from below."""
    out = []
    ts = [f["t"] for f in faults]
    for i, f in enumerate(faults):
        m = mttr(stamps, f["t"]) if f["kind"] == "kill" else None
        nxt = ts[i + 1] if i + 1 < len(ts) else float("inf")
        rec = min((r for r in recoveries if f["t"] < r < nxt), default=None)
        if m is not None and rec is not None:
            m = max(m, rec - f["t"])
        lo = f["t"] + (m or 0.0)
        r = steady_rate(stamps, lo, ts[i + 1] if i + 1 < len(ts) else None, settle)
        out.append({**f, "mttr_s": m, "rate_after": r,
                    "gap": (1 - r / ff_rate) if (r is not None and ff_rate) else None})
    return out


def markers(events: list[dict]) -> dict:
    """Decision, recovery and migration markers from a chameleon-ft event log, and every
    ``calibration`` / ``prediction`` event as it is."""
    decisions = []
    for e in events:
        if e.get("event") == "decision":
            d = e.get("decision") or {}
            ev = d.get("event") if isinstance(d.get("event"), dict) else {}
            decisions.append({"ts": e["ts"], "chosen": d.get("chosen"), "kind": ev.get("kind"),
                              "candidates": [{k: c.get(k) for k in ("policy", "feasible", "step_time_s", "score",
                                                                     "reason")}
                                             for c in d.get("candidates", []) if isinstance(c, dict)]})
    # Every member logs the same decision: one marker per (chosen, about the same time).
    unique = []
    for d in sorted(decisions, key=lambda d: d["ts"]):
        if not unique or d["chosen"] != unique[-1]["chosen"] or d["ts"] - unique[-1]["ts"] > 1.0:
            unique.append(d)
    recoveries = [{"ts": e["ts"], "mttr": e.get("mttr")} for e in events if e.get("event") == "recovery"]
    migrations = [{"ts": e["ts"], "bytes": e.get("bytes", 0), "step": e.get("step")} for e in events
                  if e.get("event") == "migration" and e.get("phase") == "end" and e.get("step", 0) > 0]
    return {"decisions": unique, "recoveries": recoveries, "migrations": migrations,
            "copied": [e for e in events if e.get("event") in COPIED_EVENTS]}


def decision_counts(decisions: list[dict]) -> dict:
    out: dict = {}
    for d in decisions:
        out[d["chosen"]] = out.get(d["chosen"], 0) + 1
    return out


def system_metrics(run: dict, ff_stamps: list, batch: int, warmup: int, settle: int, window: int) -> dict:
    """Every figure of one system's trace run (``run``: stamps, faults, events) and its
    failure-free run's stamps."""
    ff = steady_rate(ff_stamps, float("-inf"), settle=warmup)
    mk = markers(run.get("events", []))
    faults = fault_metrics(run["stamps"], run["faults"], ff, settle, [r["ts"] for r in mk["recoveries"]])
    if run.get("restarts"):
        mk["decisions"] = [{"ts": t, "chosen": "restart", "kind": "fail_stop", "candidates": []} for t in run["restarts"]]
    return {"throughput": avg_throughput(run["stamps"], batch, warmup),
            "ff_throughput": None if ff is None else ff * batch, "ff_steps_per_s": ff,
            "timeline": timeline(run["stamps"], batch, window), "faults": faults,
            "decisions": mk["decisions"], "decision_counts": decision_counts(mk["decisions"]),
            "recoveries": mk["recoveries"], "migrations": mk["migrations"], "copied_events": mk["copied"]}


def ratios(per_system: dict, ref: str = "adaptive") -> dict:
    """``ref``'s average throughput / each system's."""
    r = (per_system.get(ref) or {}).get("throughput")
    return {k: (r / v["throughput"]) if (r and v.get("throughput")) else None for k, v in per_system.items()}


# ---------------------------------------------------------------- runs
def worker_args(a, out: Path, steps: int, trace: Optional[Trace]) -> list[str]:
    args = ["--out", str(out), "--steps", str(steps), "--block-sleep", str(a.block_sleep),
            "--global-batch", str(a.global_batch), "--micro-batch", str(a.micro_batch),
            "--dim", str(getattr(a, "dim", 64))]
    slow = trace.slow_arg() if trace else None
    return args + (["--slow", slow] if slow else [])


def _slow_faults(trace: Optional[Trace], stamps: list) -> list[dict]:
    """A straggler starts when worker 0 committed the step before it."""
    out = []
    for f in (trace.faults if trace else ()):
        if f.kind == "slow":
            t = min((t for s, t in stamps if s >= f.step - 1), default=None)
            if t is not None:
                out.append({"step": f.step, "kind": "slow", "worker": f.worker, "factor": f.factor, "t": t})
    return out


def run_ft(a, root: Path, allowed: Optional[str], trace: Optional[Trace], steps: int) -> dict:
    out = root / "stamps.json"
    args = ["--mode", "ft", *worker_args(a, out, steps, trace)] + (["--allowed", allowed] if allowed else [])
    if a.emulate_link:
        args += ["--emulate-link", a.emulate_link]
    if getattr(a, "overlap", False):
        args += ["--overlap"]
    if a.device_memory:
        args += ["--device-memory", str(a.device_memory)]
    job = LocalJob(root / "run", SCRIPT, args, nproc=8, hang_timeout=a.hang_timeout,
                   max_replacements=trace.replacements() if trace else 0,
                   launch_args=["--mttf", str(a.mttf)] if a.mttf else ())
    faults, ok, err = [], False, None
    try:
        job.start()
        for f in sorted(trace.kills() if trace else [], key=lambda f: f.step):
            job.wait_step(f.step + 1, a.timeout)  # worker 0 logs step k's record once it committed k - 1
            faults.append({"step": f.step, "kind": "kill", "worker": f.worker, "t": job.kill(f.worker)})
        codes = job.wait(a.timeout)
        ok = codes == [0]
        err = None if ok else f"launcher exit {codes}: {job.output()[-1500:]}"
    except Exception as e:  # a system that fails the trace is a result, not a crash of the runner
        err = f"{type(e).__name__}: {e}"[-1500:]
    finally:
        job.cleanup()
    stamps = json.loads(out.read_text())["stamps"] if out.exists() else []
    faults = sorted(faults + _slow_faults(trace, stamps), key=lambda f: f["t"])
    return {"completed": ok, "error": err, "stamps": stamps, "faults": faults, "events": job.events()}


def torchrun_command(a, root: Path, trace: Optional[Trace], steps: int) -> list[str]:
    restarts = len(trace.kills()) if trace else 0
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "8",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
            "--max-restarts", str(restarts), "--monitor-interval", "0.1",
            str(SCRIPT), "--mode", "torch", *worker_args(a, root / "stamps.json", steps, trace),
            "--ckpt-dir", str(root / "ckpt"), "--ckpt-every", str(a.ckpt_every)]


def run_restart(a, root: Path, trace: Optional[Trace], steps: int) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    ck = root / "ckpt"
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    faults, ok, err = [], False, None
    with open(root / "log.txt", "wb") as log:
        proc = subprocess.Popen(torchrun_command(a, root, trace, steps), stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + a.timeout
            for f in sorted(trace.kills() if trace else [], key=lambda f: f.step):
                while max((r["step"] for r in read_jsonl(ck / "stamps.jsonl")), default=0) < f.step:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise RuntimeError(f"no step {f.step} (torchrun exit {proc.poll()})")
                    time.sleep(0.005)
                pid = max((r["restart"], r["pid"]) for r in read_jsonl(ck / "pids.jsonl") if r["rank"] == f.worker)[1]
                t = time.time()
                os.kill(pid, signal.SIGKILL)
                faults.append({"step": f.step, "kind": "kill", "worker": f.worker, "t": t})
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            ok = code == 0
            err = None if ok else f"torchrun exit {code}"
        except Exception as e:
            err = f"{type(e).__name__}: {e}"[-1500:]
        finally:
            if proc.poll() is None:  # the workers first, by PID (torchrun starts them in sessions of their own)
                kill_processes(descendants(proc.pid) + [proc.pid], [proc])
    if not ok:
        err = (err or "") + "\n" + (root / "log.txt").read_text(errors="replace")[-1500:]
    recs = read_jsonl(ck / "stamps.jsonl")
    stamps = [[r["step"], r["ts"]] for r in recs]
    starts: dict = {}
    for r in read_jsonl(ck / "pids.jsonl"):
        if r["restart"] > 0:
            starts[r["restart"]] = min(starts.get(r["restart"], r["ts"]), r["ts"])
    faults = sorted(faults + _slow_faults(trace, stamps), key=lambda f: f["t"])
    return {"completed": ok, "error": err, "stamps": stamps, "faults": faults, "events": [],
            "restarts": [starts[k] for k in sorted(starts)]}


def run_system(a, system: str, root: Path, trace: Optional[Trace], steps: int) -> dict:
    if system == "restart":
        return run_restart(a, root, trace, steps)
    return run_ft(a, root, FT_ALLOWED[system], trace, steps)


# ---------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default="realistic", choices=sorted(TRACES))
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--ff-steps", type=int, default=30, help="steps of each failure-free run")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--emulate-link", default=None,
                    help="chameleon-ft systems: LATENCY_S:BANDWIDTH_BPS of an emulated network for messages "
                         "between stages and migrations (ElasticConfig.emulate_link); the torchrun baseline's "
                         "restart is not network-bound and runs without it")
    ap.add_argument("--overlap", action="store_true",
                    help="chameleon-ft systems: migrations run while the job trains rerouted "
                         "(ElasticConfig.overlap_migration)")
    ap.add_argument("--device-memory", type=float, default=DEVICE_MEMORY,
                    help="chameleon-ft systems: each emulated device's memory for the engine (bytes; 0 for none; "
                         "see pipeline_bench.DEVICE_MEMORY): the model needs its pipeline stages")
    ap.add_argument("--mttf", type=float, default=None,
                    help="chameleon-ft systems: D, the expected time to the next failure the engine decides with "
                         "(chameleon-ft run --mttf); default: its estimate from the fleet prior and this run")
    ap.add_argument("--settle", type=int, default=3)
    ap.add_argument("--window", type=int, default=4, help="commits the timeline's rate is smoothed over")
    ap.add_argument("--ckpt-every", type=int, default=10, help="restart: steps between checkpoints")
    ap.add_argument("--block-sleep", type=float, default=0.004)
    ap.add_argument("--dim", type=int, default=64, help="the MLP's hidden width (a larger model: more to migrate)")
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--hang-timeout", type=float, default=30.0,
                    help="chameleon-ft's collective watchdog; the launcher also evicts a worker left out of the "
                         "job for this + 2 s, and a replacement importing torch on 2 loaded cores needs > 12 s "
                         "to join (kills are detected by the launcher, not by this timeout)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--json", default="benchmarks/results/pipeline-trace.json")
    ap.add_argument("--markdown", default=None, help="also write the markdown section here")
    ap.add_argument("--plot", default="docs/img/pipeline-trace.png")
    ap.add_argument("--workdir", help="keep every run's directory here")
    ap.add_argument("--from-json", help="no runs: recompute the metrics of these results (written back) and "
                                        "re-render the plot and markdown; several files (comma-separated): one "
                                        "page, a summary over the traces first, a plot per trace")
    return ap


def run(argv=None) -> dict:
    a = build_parser().parse_args(argv)
    paths = [p for p in (a.from_json or "").split(",") if p]
    results = [recompute(json.loads(Path(p).read_text())) for p in paths] or [collect(a, argv)]
    for i, res in enumerate(results):
        if a.plot:
            path = Path(a.plot)
            tag = res["trace"]["name"] + ("-overlap" if res["config"].get("overlap") else "")
            path = path if i == 0 else path.with_name(f"{path.stem}-{tag}{path.suffix}")
            plot(res, path)
            res["plot"] = str(path)
            res["plot_rel"] = os.path.relpath(path, Path(a.markdown).parent if a.markdown else "docs")
        out = paths[i] if paths else a.json  # re-rendering updates the recomputed metrics in place
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(res, indent=1))
    if a.markdown:
        Path(a.markdown).parent.mkdir(parents=True, exist_ok=True)
        body = "\n".join(markdown(r) for r in results)
        if len(results) > 1:
            body = "\n".join(summary(results)) + "\n\n" + body
        Path(a.markdown).write_text("# Pipeline (DP x PP) failure trace\n\n" + body)
    return results[0]


def recompute(res: dict) -> dict:
    """Every system's metrics again from the results' own stamps, faults and events."""
    c = res["config"]
    for s in res["systems"].values():
        if "events" in s:
            s["metrics"] = system_metrics(s, s["ff_stamps"], c["global_batch"], c["warmup"], c["settle"], c["window"])
    res["ratios"] = ratios({k: v["metrics"] for k, v in res["systems"].items()})
    _simulate(res)
    return res


def collect(a, argv) -> dict:
    trace = TRACES[a.trace]
    systems = [s for s in a.systems.split(",") if s]
    bad = set(systems) - set(SYSTEMS)
    if bad:
        raise SystemExit(f"unknown systems {sorted(bad)}; choose from {SYSTEMS}")
    t0 = time.time()
    res: dict = {"command": "python benchmarks/pipeline_trace.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "machine": machine(),
                 "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
                 "mode": MODE, "config": {k: v for k, v in vars(a).items() if k not in ("from_json",)},
                 "trace": trace.to_json(), "systems": {}}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(a.workdir or tmp)
        ff: dict = {}
        for kind in sorted({"restart" if s == "restart" else "ft" for s in systems}):
            got = run_system(a, "restart" if kind == "restart" else "adaptive", base / f"ff-{kind}", None, a.ff_steps)
            ff[kind] = got["stamps"]
            print(f"failure-free {kind}: {len(got['stamps'])} steps, completed {got['completed']}", flush=True)
        for s in systems:
            got = run_system(a, s, base / s, trace, trace.steps)
            m = system_metrics(got, ff["restart" if s == "restart" else "ft"], a.global_batch, a.warmup, a.settle, a.window)
            cfg = "torchrun --max-restarts, checkpoint every %d steps" % a.ckpt_every if s == "restart" else (
                "chameleon-ft, allowed " + (FT_ALLOWED[s] or "all"))
            res["systems"][s] = {"config": cfg, "completed": got["completed"], "error": got["error"],
                                 "stamps": got["stamps"], "faults": got["faults"], "ff_stamps": ff["restart" if s == "restart" else "ft"],
                                 "events": [e for e in got["events"] if e.get("event") != "step"],
                                 "restarts": got.get("restarts", []), "metrics": m}
            print(f"{s}: completed {got['completed']}, throughput {_fmt(m['throughput'], 1)} samples/s, "
                  f"MTTR {[_fmt(f['mttr_s'], 1) for f in m['faults'] if f['kind'] == 'kill']}, "
                  f"decisions {m['decision_counts']}", flush=True)
    res["ratios"] = ratios({k: v["metrics"] for k, v in res["systems"].items()})
    res["wall_s"] = time.time() - t0
    _simulate(res)
    return res


def _simulate(res: dict) -> None:
    """The same trace in the simulator, on the adaptive run's calibrated coefficients."""
    try:
        res["simulated"] = trace_sim.compare(res)
    except Exception as exc:  # the measured figures stand without it; say why it is missing
        res["simulated"] = None
        res["simulation_error"] = f"{type(exc).__name__}: {exc}"
        print(f"trace simulation failed: {res['simulation_error']}", flush=True)


def main(argv=None) -> int:
    # SIGTERM -> SystemExit, so that the running job's ``finally`` kills its processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    res = run(argv)
    print(markdown(res))
    return 0 if all(s["completed"] for s in res["systems"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
