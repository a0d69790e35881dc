"""The simulator on the trace the benchmark ran: the same failures, on the coefficients the live
job calibrated, side by side with what the real systems measured (8 workers), and the same
trace on a 32-device job (``chameleon_ft.sim.trace.scale_trace``/``trace_setting``).

``setup_from_run`` turns a ``pipeline_trace.py`` result into a ``TraceSetup``:

* workload, cluster (device speeds, links) and coefficients: the adaptive run's last
  ``calibration`` record before the first fault (its ``setup``, the engine's own inputs);
* the trace: each fault at its wall time from the run's first post-warm-up commit -- kills as
  ``fail``, the replacement as ``join`` when the engine decided on it, the straggler as
  ``slow``; horizon = that run's measured span;
* costs: rebuild = the calibrated group rebuild + state agreement, restart = the torchrun
  system's measured median MTTR, checkpoint interval = its checkpoint period in seconds
  (restart is the torchrun system's only: the chameleon-ft jobs write no checkpoint, their
  engine found restart infeasible at every decision, and the simulated engine does too),
  ``D`` = the engine's at the first decision, the replacement ETA = the measured kill -> join.

``compare`` replays it and returns rows of simulated vs measured average throughput per system.
The live "reroute" and "replan" systems are replayed as the simulator's ``engine-reroute`` /
``engine-replan``: the engine over the same restricted sets (reroute may wait for a
replacement).  Limits: the simulator prices every phase with the model and takes no straggler
decisions; the measured runs are one each on a shared machine.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Optional

from chameleon_ft.engine.perf import estimate
from chameleon_ft.engine.planner import SearchSpace
from chameleon_ft.sim.trace import (Trace, TraceEvent, TraceSetup, cluster_from_json, coefficients_from_json,
                                trace_setting, workload_from_json)

# The live systems' policies in the simulator: its "reroute" and "replan" systems are the engine
# over a restricted set (benchmarks/pipeline_trace.py FT_ALLOWED), not "always reroute / re-plan".
SIM_POLICY = {"adaptive": "adaptive", "reroute": "engine-reroute", "replan": "engine-replan",
              "restart": "restart", "redundant": "redundant"}


def _start(stamps: list, warmup: int) -> float:
    st = sorted(stamps, key=lambda s: s[1])
    return next((t for s, t in st if s >= warmup), st[0][1])


def relaunch_seconds(restart: dict, ckpt_every: int, step_s: float) -> list[float]:
    """The torchrun system's relaunch per kill: its MTTR (fault -> first commit of a new step)
    less the steps it redid since its last checkpoint (the simulator adds those itself)."""
    out = []
    for f in (restart.get("metrics") or {}).get("faults", []):
        if f.get("mttr_s") is None:
            continue
        done = max((s for s, t in restart.get("stamps") or [] if t <= f["t"]), default=0) if "t" in f else 0
        out.append(max(0.0, f["mttr_s"] - (done % ckpt_every) * step_s))
    return out


def _joins(run: dict) -> list[tuple[float, tuple[int, ...]]]:
    """(time, devices) of the replacements a chameleon-ft run's engine decided on."""
    return [(e["ts"], tuple(e["decision"]["event"]["devices"])) for e in run.get("events") or []
            if e.get("event") == "decision" and e["decision"]["event"]["kind"] == "join"]


def _replacement_etas(run: dict) -> list[float]:
    """Measured kill -> join seconds of each replacement in ``run``."""
    kills = [f for f in run.get("faults") or [] if f["kind"] == "kill"]
    out = []
    for ts, devs in _joins(run):
        killed = [f["t"] for f in kills if (int(f["worker"]),) == devs and f["t"] < ts]
        if killed:
            out.append(ts - max(killed))
    return out


def _replayed(res: dict, system: str) -> Optional[Trace]:
    """``system``'s own run as a trace: its faults at their wall times from its first post-warm-up
    commit, its replacements' joins (chameleon-ft: when the engine decided on one; torchrun: it
    relaunches every worker, the killed one too, so that one is back at once -- its relaunch
    takes it in), horizon = its measured span.  A kill carries the steps since the torchrun
    system's last checkpoint (its step mod ``--ckpt-every``): the trace's kills fall right after
    checkpoint steps, where the simulator's time grid would decide by a few percent of timing
    between nothing and a whole interval redone."""
    run = res["systems"].get(system) or {}
    if not run.get("stamps"):
        return None
    t0 = _start(run["stamps"], int(res.get("config", {}).get("warmup", 5)))
    every = int(res.get("config", {}).get("ckpt_every", 10))
    horizon = max(t for _, t in run["stamps"]) - t0
    evs = [TraceEvent(max(0.0, ts - t0), "join", devs) for ts, devs in _joins(run)]
    for f in run.get("faults") or []:
        at = max(0.0, f["t"] - t0)
        if f["kind"] == "kill":  # after worker 0 committed step f["step"]; checkpoints every N steps from 0
            evs.append(TraceEvent(at, "fail", (int(f["worker"]),), redo_steps=int(f["step"]) % every
                                  if f.get("step") is not None else None))
            if system == "restart":  # torchrun relaunches every worker, the killed one too
                evs.append(TraceEvent(at + 1e-3, "join", (int(f["worker"]),)))
        elif f["kind"] == "slow":
            evs.append(TraceEvent(at, "slow", (int(f["worker"]),), float(f["factor"])))
    return Trace(tuple(sorted(evs, key=lambda e: e.t_s)), horizon, res["trace"]["name"],
                 f"replayed from benchmarks/pipeline_trace.py ({system} run)")


def engine_could_restart(res: dict) -> bool:
    """Whether checkpoint-restart was ever a feasible candidate of a chameleon-ft run's decisions
    (the benchmark's jobs write no checkpoint, so their engine cannot restart; the simulator
    must not either).  No decision at all: True (not known)."""
    seen = [c.get("feasible") for name, run in res["systems"].items() if name != "restart"
            for e in run.get("events") or [] if e.get("event") == "decision"
            for c in e["decision"].get("candidates") or [] if c.get("policy") == "restart"]
    return any(seen) or not seen


def setup_from_run(res: dict, system: str = "adaptive", replay: Optional[str] = None) -> Optional[TraceSetup]:
    """The simulator's setup from ``system``'s calibration, replaying ``replay``'s own run
    (default: the same system's)."""
    run = res["systems"].get(system) or {}
    events = run.get("events") or []
    faults = run.get("faults") or []
    cals = [e for e in events if e.get("event") == "calibration" and e.get("setup")]
    trace = _replayed(res, replay or system)
    if not cals or trace is None:
        return None
    t_fault = min((f["t"] for f in faults), default=float("inf"))
    before = [c for c in cals if c["ts"] < t_fault] or cals[:1]
    setup = before[-1]["setup"]
    etas = _replacement_etas(run)
    restart = res["systems"].get("restart") or {}
    cfg = res.get("config", {})
    ff_rate = (restart.get("metrics") or {}).get("ff_steps_per_s")
    ff = 1.0 / ff_rate if ff_rate else 0.5
    mttrs = relaunch_seconds(restart, int(cfg.get("ckpt_every", 10)), ff)
    first = next((e["decision"] for e in events if e.get("event") == "decision"), {})
    cal = before[-1]
    warmup = int(cfg.get("warmup", 5))
    return TraceSetup(
        trace, workload_from_json(setup["workload"]), cluster_from_json(setup["cluster"]),
        coefficients_from_json(setup["coefficients"]), stages=int(cfg.get("stages", 4)),
        rebuild_s=float(cal.get("rebuild_s") or 0.1) + float(cal.get("agree_s") or 0.0),
        restart_s=statistics.median(mttrs) if mttrs else 60.0,
        checkpoint_every_s=float(cfg.get("ckpt_every", 10)) * ff,
        mttf_s=first.get("mttf_s") or setup.get("mttf_s"),
        space=SearchSpace(dp_min=2, min_microbatches=1),
        replacement_eta_s=statistics.median(etas) if etas else None,
        # The launcher replaced the trace's replaced kills and no more (``--max-replacements``).
        limited_replacements=True,
        # The trace starts at the first commit after warm-up; checkpoints are every ckpt_every
        # steps from step 0.
        checkpoint_phase_s=(warmup % int(cfg.get("ckpt_every", 10))) * ff,
        engine_restart=engine_could_restart(res), rebalance=rebalancing(res))


def rebalancing(res: dict) -> tuple[str, ...]:
    """The simulator's names of the live systems whose engine could rebalance a straggler: the
    adaptive one, and always-reroute when its allowed set (stored with the run) names it."""
    out = []
    for name, run in res["systems"].items():
        cfg = str(run.get("config") or "")
        if name in SIM_POLICY and name != "restart" and ("allowed all" in cfg or "rebalance" in cfg):
            out.append(SIM_POLICY[name])
    return tuple(out)


def at_step_time(setup: TraceSetup, step_s: float) -> TraceSetup:
    """``setup`` with every time coefficient scaled so that its deployed plan's step takes
    ``step_s`` (the estimate is homogeneous in them): the torchrun system replayed at its own
    measured failure-free step rather than ours."""
    w, c, plan = trace_setting(setup.workload, setup.cluster, len(setup.cluster.devices), setup.stages)
    now = estimate(plan, w, c, setup.coefficients).step_time
    r = step_s / now if now > 0 else 1.0
    k = setup.coefficients
    coeffs = replace(k, compute_scale=k.compute_scale * r, comm_scale=k.comm_scale * r,
                     step_overhead_s=k.step_overhead_s * r, task_overhead_s=k.task_overhead_s * r,
                     optimizer_s_per_param=k.optimizer_s_per_param * r, hop_overhead_s=k.hop_overhead_s * r)
    return replace(setup, coefficients=coeffs)


def compare(res: dict, devices: tuple[int, ...] = (8, 32)) -> Optional[dict]:
    """Simulated average throughput per policy on the recorded and the scaled job, beside the
    measured one per system (8 workers).  On the recorded job each policy with a measured run
    replays that run's own trace (its fault times and span: a restart's relaunches stretch its
    run); the others and the scaled job replay the adaptive run's."""
    setup = setup_from_run(res)
    if setup is None:
        return None
    out: dict = {"setup": setup.to_json(), "rows": []}
    measured = {s: (r.get("metrics") or {}).get("throughput") for s, r in res["systems"].items()}
    policies = ("adaptive", "reroute", "replan", "restart", "redundant")
    ff_rate = ((res["systems"].get("restart") or {}).get("metrics") or {}).get("ff_steps_per_s")
    for n in devices:
        sim = setup.run(devices=n, policies=tuple(SIM_POLICY[p] for p in policies))
        for p in policies:
            own = setup_from_run(res, replay=p) if (n == len(setup.cluster.devices) and measured.get(p)) else None
            if own is not None and p == "restart" and ff_rate:
                own = at_step_time(own, 1.0 / ff_rate)
            r = own.run(devices=n, policies=(SIM_POLICY[p],))[SIM_POLICY[p]] if own is not None else sim[SIM_POLICY[p]]
            row = {"devices": n, "policy": p, "simulated": r.throughput, "decisions": dict(r.counts)}
            if n == len(setup.cluster.devices):
                row["measured"] = measured.get(p)
            out["rows"].append(row)
    return out


def markdown(cmp: Optional[dict], mode: str) -> list[str]:
    if not cmp:
        return []
    lines = [f"## The same trace in the simulator ({mode} coefficients)", "",
             "`benchmarks/trace_sim.py`: the adaptive run's calibrated workload, device speeds, links and "
             "overheads, the trace's faults at their measured times, restart = the torchrun system's measured "
             "MTTR; `redundant` is the simulator's Bamboo-like stand-in (simulation only).  On the 8-device job "
             "each measured system's row replays that system's own run (its fault times and span: a restart's "
             "relaunches stretch its run; torchrun relaunches every worker, the killed one too, so that one "
             "joins the relaunch; its steps at torchrun's own measured failure-free step, its checkpoints every "
             "`--ckpt-every` steps from step 0); the others and the 32-device job replay the adaptive run's.  "
             "The reroute and replan rows are what the live systems are: the engine over their restricted "
             "sets (`engine-reroute` may wait for a replacement, `engine-replan`).", "",
             "| devices | policy | simulated samples/s | measured samples/s | simulated / measured | simulated decisions |",
             "| ---: | --- | ---: | ---: | ---: | --- |"]
    for r in cmp["rows"]:
        m, s = r.get("measured"), r["simulated"]
        ratio = f"{s / m:.2f}" if m and s else "-"
        dec = ", ".join(f"{k} {v}" for k, v in sorted(r["decisions"].items()))
        lines.append(f"| {r['devices']} | {r['policy']} | {s:.1f} | {'-' if m is None else f'{m:.1f}'} | {ratio} | {dec} |")
    by = {(r["devices"], r["policy"]): r["simulated"] for r in cmp["rows"]}
    for n in sorted({r["devices"] for r in cmp["rows"]}):
        fixed = [by.get((n, p)) for p in ("reroute", "replan") if by.get((n, p))]
        if fixed and by.get((n, "adaptive")):
            lines.append("")
            lines.append(f"Simulated, {n} devices: adaptive / better fixed (reroute, replan) = "
                         f"**{by[(n, 'adaptive')] / max(fixed):.3f}**.")
    return lines + [""]
