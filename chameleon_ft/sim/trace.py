"""Trace replay: every policy against one stored failure trace, side by side.

A :class:`Trace` is what a benchmark recorded or scripted: at ``t_s`` seconds from the start,
devices ``fail``, ``join`` (a failed device comes back, like a repair) or turn ``slow`` (their
compute becomes ``slowdown`` times slower than the cluster's description says, from then on;
``slowdown`` 1 gives them their own speed back).  :func:`replay` runs the simulator's job model
(:class:`chameleon_ft.sim.simulator._Job`: the real selector, planner and migration planning) for each policy over
the same events in time order, on the *exact* model (what the decisions predict is what
happens; there is no true/believed split here: a replay is compared with a measured run, which
is the truth).

* ``D`` (expected time to the next failure) is ``mttf_s`` when given, else the trace's horizon
  divided by its number of ``fail`` events: the average gap, known only in hindsight; a
  benchmark that wants the decisions blind to the trace passes ``mttf_s``.
* ``slow`` re-prices the running plan with the new speed; a policy in ``rebalance`` (the live
  pipeline jobs' adaptive engine, and their always-reroute) then asks the selector to keep or
  rebalance (micro-batches between the running pipelines, nothing moves; not a rerouted plan),
  the others keep it.  Later decisions see the speed.
* ``restart`` is torchrun-style checkpoint-restart: every membership change (fail or join) pays
  ``restart_s`` plus the steps since the last checkpoint (every ``checkpoint_every_s``), redone,
  then runs the best plan over the devices alive (the deployed layout once all of its devices
  are back: torchrun knows no speeds) -- except a device back while a relaunch is
  still under way, which that relaunch takes in (torchrun's rendezvous admits a restarted
  node's workers: a kill with a quick replacement is one restart, not two).
* ``engine-reroute`` / ``engine-replan`` are what a live benchmark's "fixed" systems are: the
  engine deciding over a restricted set ({reroute, heal, restart, keep}, plus ``wait`` when a
  replacement is expected; {replan, grow, restart, keep}) -- where ``reroute`` / ``replan``
  always take their own response.  ``benchmarks/trace_sim.py`` replays the live systems with them.
* ``redundant`` is a **Bamboo-like stand-in, simulation only** (Thorpe et al., NSDI'23; not
  Bamboo's code or its schedule): each stage keeps a copy of a neighbour's layers and runs their
  forward pass redundantly; stage ``s > 0`` is shadowed by its predecessor ``s − 1`` and stage 0,
  which has none, by its successor, stage 1 (Bamboo closes the ring through the last stage; we
  keep the layer chain contiguous so that the performance model prices a takeover exactly, and
  with balanced stages the cost is the same).  The failure-free step is multiplied by
  ``overhead``: by default ``1 +`` the redundant forward work the pipeline's idle time cannot
  absorb, as a share of the step (:func:`redundant_overhead`; often exactly 1 when the bubble is
  large; Bamboo reports larger measured overheads: pass one).  When a device dies its shadow
  takes its layers over (the step is the plan with the two stages merged on the shadow, times
  ``overhead``; transition = the rebuild only, nothing migrates); a device that joins is healed
  back into its slot (its layers copied from a peer).  When a stage and its shadow are both
  lost (two adjacent stages), or the merged stage does not fit in memory, it falls back to
  checkpoint-restart over the survivors and returns to the shadowed layout at the next join
  that makes it possible (paying a restart).  The memory the shadow copies take is not
  modelled, nor does the stand-in re-create a lost shadow in the background.

:func:`scale_trace` maps a trace of a small cluster onto one ``k`` times larger (the small
cluster tiled ``k`` times, every copy seeing the same events) and :func:`trace_setting` builds
the matching job: ``k`` times the devices and the global batch, pipelines of ``stages``
consecutive devices, as the runtime deploys them.  :class:`TraceSetup` is the stored form (a
trace plus the workload, cluster and costs it was measured on) that ``chameleon-ft simulate
--trace`` reads.

Limits: one event at a time (events at the same instant are handled in the trace's order); a
failure during a transition adds its own transition after it; the per-policy figures are the
performance model's, so a replay is only as close to a measured run as the calibration is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

# The engine types' JSON codecs live beside their types; re-exported here for TraceSetup's users.
from chameleon_ft.engine.cluster import Cluster, Device, cluster_from_json, cluster_to_json
from chameleon_ft.engine.perf import Coefficients, coefficients_from_json, coefficients_to_json, estimate
from chameleon_ft.engine.plan import Pipeline, Plan, even_split, validate
from chameleon_ft.engine.planner import SearchSpace, balance_layers
from chameleon_ft.engine.selector import heal_seconds
from chameleon_ft.sim.simulator import ENGINE_RESTRICTED, POLICY_NAMES, JobSetting, TrueModel, _Job, _progress
from chameleon_ft.engine.workload import Workload, transformer, workload_from_json, workload_to_json

KINDS = ("fail", "join", "slow")
REPLAY_POLICIES = tuple(p for p in POLICY_NAMES if p != "oracle") + ("redundant",) + ENGINE_RESTRICTED
FIXED_POLICIES = ("reroute", "replan", "shrink", "restart", "redundant")
DEFAULT_POLICIES = ("adaptive", "reroute", "replan", "restart", "redundant")


@dataclass(frozen=True)
class TraceEvent:
    t_s: float
    kind: str
    devices: tuple[int, ...]
    slowdown: float = 1.0  # "slow": compute this many times slower than the cluster's speed
    # "fail": the steps since the last checkpoint when it happens, where the trace knows them (a
    # run that checkpoints every N steps, killed after step k: k mod N); None: the time grid
    # (``checkpoint_every_s``) says.  A kill right after a checkpoint step sits on the grid's
    # edge, where a few percent of timing decide between nothing and a whole interval redone.
    redo_steps: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(sorted(int(d) for d in self.devices)))
        if self.kind not in KINDS:
            raise ValueError(f"event kind {self.kind!r}; choose from {', '.join(KINDS)}")
        if not self.devices:
            raise ValueError("an event names at least one device")
        if self.t_s < 0:
            raise ValueError("events happen at t_s >= 0")
        if self.slowdown < 1.0:
            raise ValueError("slowdown is a factor >= 1")
        if self.kind != "slow" and self.slowdown != 1.0:
            raise ValueError("only a 'slow' event has a slowdown")
        if self.redo_steps is not None and (self.kind != "fail" or self.redo_steps < 0):
            raise ValueError("only a 'fail' event has redo_steps (>= 0)")

    def to_json(self) -> dict:
        out = {"t_s": self.t_s, "kind": self.kind, "devices": list(self.devices)}
        if self.kind == "slow":
            out["slowdown"] = self.slowdown
        if self.redo_steps is not None:
            out["redo_steps"] = self.redo_steps
        return out

    @staticmethod
    def from_json(data: dict) -> "TraceEvent":
        return TraceEvent(float(data["t_s"]), data["kind"], tuple(data["devices"]),
                          float(data.get("slowdown", 1.0)), data.get("redo_steps"))


@dataclass(frozen=True)
class Trace:
    events: tuple[TraceEvent, ...]
    horizon_s: float
    name: str = "trace"
    description: str = ""

    def __post_init__(self) -> None:
        if self.horizon_s <= 0:
            raise ValueError("horizon_s must be positive")
        # Stable: events at the same instant keep the trace's order.
        object.__setattr__(self, "events", tuple(sorted(self.events, key=lambda e: e.t_s)))
        late = [e for e in self.events if e.t_s >= self.horizon_s]
        if late:
            raise ValueError(f"event at {late[0].t_s} s is not before the horizon ({self.horizon_s} s)")

    @property
    def failures(self) -> int:
        return sum(e.kind == "fail" for e in self.events)

    @property
    def devices(self) -> set[int]:
        return {d for e in self.events for d in e.devices}

    def to_json(self) -> dict:
        return {"name": self.name, "description": self.description, "horizon_s": self.horizon_s,
                "events": [e.to_json() for e in self.events]}

    @staticmethod
    def from_json(data: dict) -> "Trace":
        return Trace(tuple(TraceEvent.from_json(e) for e in data["events"]), float(data["horizon_s"]),
                     data.get("name", "trace"), data.get("description", ""))


@dataclass
class TraceResult:
    policy: str
    samples: float
    horizon_s: float
    failure_free_throughput: float  # the deployed plan without failures (and without redundancy)
    timeline: list[tuple[float, float]] = field(repr=False)  # (t s, samples/s), piecewise constant
    # Per event: (t s, event kind, chosen response, predicted step s, transition s).
    decisions: list[tuple[float, str, str, float, float]] = field(repr=False)
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        """Average samples/s over the horizon."""
        return self.samples / self.horizon_s

    @property
    def goodput(self) -> float:
        return self.throughput / self.failure_free_throughput if self.failure_free_throughput else 0.0

    def to_json(self) -> dict:
        finite = lambda x: None if math.isinf(x) else x  # noqa: E731
        return {"policy": self.policy, "samples": self.samples, "horizon_s": self.horizon_s,
                "throughput": self.throughput, "failure_free_throughput": self.failure_free_throughput,
                "goodput": self.goodput, "counts": self.counts,
                "timeline": [[t, x] for t, x in self.timeline],
                "decisions": [{"t_s": t, "event": k, "chosen": c, "step_s": finite(s), "transition_s": finite(x)}
                              for t, k, c, s, x in self.decisions]}


def replay(trace: Trace, workload: Workload, cluster: Cluster, plan: Plan, policies=DEFAULT_POLICIES,
           coeffs: Coefficients = Coefficients(), *, rebuild_s: float, restart_s: float,
           checkpoint_every_s: float, search_space: SearchSpace, replacement_eta_s: float | None = None,
           mttf_s: float | None = None, redundant_overhead: float | None = None,
           checkpoint_phase_s: float = 0.0, limited_replacements: bool = False,
           engine_restart: bool = True, rebalance=()) -> dict[str, TraceResult]:
    """Every policy in ``policies`` against the same events, from the same deployed ``plan``
    (``checkpoint_phase_s``: seconds since the last checkpoint when the trace starts;
    ``limited_replacements``: the trace's joins are all the replacements the job gets, as a
    launcher's ``--max-replacements`` -- once they came, the engine expects none;
    ``engine_restart`` False: the engine's policies cannot restart, the job writes no checkpoint;
    ``rebalance``: the policies that rebalance a straggler, ``JobSetting.rebalance``)."""
    unknown = set(policies) - set(REPLAY_POLICIES)
    if unknown:
        raise ValueError(f"unknown policies {sorted(unknown)}; choose from {', '.join(REPLAY_POLICIES)}")
    missing = trace.devices - set(cluster.ids)
    if missing:
        raise ValueError(f"the trace names devices the cluster does not have: {sorted(missing)}")
    validate(plan, workload, cluster.ids)
    if checkpoint_every_s <= 0:
        raise ValueError("checkpoint_every_s must be positive")
    if mttf_s is not None and mttf_s <= 0:
        raise ValueError("mttf_s must be positive")
    D = mttf_s if mttf_s is not None else trace.horizon_s / max(1, trace.failures)
    setting = JobSetting(workload, cluster, restart_s, checkpoint_every_s, search_space,
                         lambda alive, down: D, rebuild_s, replacement_eta_s, checkpoint_phase_s,
                         sum(len(e.devices) for e in trace.events if e.kind == "join") if limited_replacements else None,
                         engine_restart, frozenset(rebalance))
    ideal = workload.global_batch / estimate(plan, workload, cluster, coeffs).step_time
    results = {}
    for policy in policies:
        if policy == "redundant":
            overhead = redundant_overhead if redundant_overhead is not None else \
                default_redundant_overhead(plan, workload, cluster, coeffs)
            job: _Job = _RedundantJob(setting, plan, coeffs, overhead)
        else:
            job = _Job(setting, policy, plan, coeffs, TrueModel())
        now, samples = 0.0, 0.0
        segments = [(0.0, job.busy_until, job.batch / job.step_time)]
        for ev in trace.events:
            samples += _progress(job.busy_until, job.batch, job.step_time, now, ev.t_s)
            now = ev.t_s
            if ev.kind == "fail":
                job.fail(now, ev.devices, ev.redo_steps)
            elif ev.kind == "join":
                job.repair(now, ev.devices, kind="join")
            else:
                job.slow(now, ev.devices, ev.slowdown, cluster)
            segments.append((now, job.busy_until, job.batch / job.step_time))
        samples += _progress(job.busy_until, job.batch, job.step_time, now, trace.horizon_s)
        results[policy] = TraceResult(policy, samples, trace.horizon_s, ideal,
                                      _timeline(segments, trace.horizon_s), list(job.log), dict(job.decisions))
    return results


def best_fixed(results: dict[str, TraceResult]) -> str | None:
    """The fixed policy with the highest average throughput."""
    fixed = [p for p in results if p in FIXED_POLICIES]
    return max(fixed, key=lambda p: results[p].throughput, default=None)


def _timeline(segments, horizon_s: float) -> list[tuple[float, float]]:
    """(t, samples/s) points, piecewise constant: a transition is a zero-throughput gap."""
    points: list[tuple[float, float]] = []
    for i, (t, busy, rate) in enumerate(segments):
        nxt = segments[i + 1][0] if i + 1 < len(segments) else horizon_s
        if busy > t:
            points.append((t, 0.0))
            if busy < nxt:
                points.append((busy, rate))
        else:
            points.append((t, rate))
    out: list[tuple[float, float]] = []
    for t, x in points:
        if out and out[-1][0] == t:
            out[-1] = (t, x)  # events at the same instant: the last state holds
        elif not out or out[-1][1] != x:
            out.append((t, x))
    return out


# -- the Bamboo-like stand-in --------------------------------------------------------------
def _shadow(stage: int) -> int:
    """The stage that holds a copy of ``stage``'s layers."""
    return stage - 1 if stage > 0 else 1


def takeover_plan(plan: Plan, alive) -> Plan | None:
    """``plan`` with every dead stage merged into its shadow; None when a dead stage's shadow is
    dead too (two adjacent stages lost) or a one-stage pipeline lost its device."""
    if plan.shard_degree != 1:
        raise ValueError("the redundant stand-in models unsharded pipelines only")
    alive = set(alive)
    pipes = []
    for pipe in plan.pipelines:
        dead = [s for s, d in enumerate(pipe.devices) if d not in alive]
        if not dead:
            pipes.append(pipe)
            continue
        if pipe.depth == 1 or any(pipe.devices[_shadow(s)] not in alive for s in dead):
            return None
        cut = {s if s > 0 else 1 for s in dead}  # the boundary that disappears in the merge
        pipes.append(Pipeline(tuple(d for d in pipe.devices if d in alive),
                              tuple(b for i, b in enumerate(pipe.bounds) if i not in cut), pipe.microbatches))
    return Plan(tuple(pipes))


def default_redundant_overhead(plan: Plan, workload: Workload, cluster: Cluster,
                               coeffs: Coefficients = Coefficients()) -> float:
    """``1 +`` the redundant forward work that no stage's idle time absorbs, as a share of the
    step.  Stage ``h`` runs the forward of every stage it shadows for each of its pipeline's
    ``m`` micro-batches; under 1F1B it idles its pipeline's time (``perf.estimate``) − ``m·c_h``
    per step."""
    est = estimate(plan, workload, cluster, coeffs)
    step = est.step_time
    worst = 0.0
    for j, pipe in enumerate(plan.pipelines):
        p, m = pipe.depth, pipe.microbatches
        if p == 1 or m == 0:
            continue
        speed = [cluster[d].speed / coeffs.compute_scale for d in pipe.devices]
        spans = [pipe.layers_of_stage(s) for s in range(p)]
        c = [workload.compute_s(lo, hi) / speed[s] for s, (lo, hi) in enumerate(spans)]
        fwd = [sum(layer.fwd_s for layer in workload.layers[lo:hi]) for lo, hi in spans]
        for h in range(p):
            redundant = m * sum(fwd[s] for s in range(p) if _shadow(s) == h) / speed[h]
            idle = est.pipeline_times[j] - m * c[h]
            worst = max(worst, redundant - idle)
    return 1.0 + worst / step if step > 0 else 1.0


class _RedundantJob(_Job):
    """The ``redundant`` policy: shadow takeover while it can, checkpoint-restart otherwise."""

    def __init__(self, setting: JobSetting, base: Plan, coeffs: Coefficients, overhead: float):
        if overhead < 1.0:
            raise ValueError("the redundant overhead is a factor >= 1")
        takeover_plan(base, base.devices)  # rejects sharded plans up front
        super().__init__(setting, "restart", base, coeffs, TrueModel())  # restart: its fallback
        self.policy, self.overhead = "redundant", overhead
        self.shadowed = True  # running the deployed layout (with takeovers); False after a fallback
        self.step_time = self.b_step_time = self.step_time * overhead

    def _scaled(self) -> None:
        self.step_time *= self.overhead
        self.b_step_time *= self.overhead
        t, kind, chosen, _, x = self.log[-1]
        self.log[-1] = (t, kind, chosen, self.b_step_time, x)

    def _apply(self, now, option) -> None:
        super()._apply(now, option)
        self._scaled()

    def _restart_over_alive(self, now: float) -> None:
        super()._restart_over_alive(now)
        self._scaled()

    def _running_steps(self) -> tuple[float, float]:
        b, t = super()._running_steps()
        return b * self.overhead, t * self.overhead

    def _fits(self, plan: Plan | None) -> float | None:
        if plan is None:
            return None
        est = estimate(plan, self.workload, self.decide_cluster, self.coeffs)
        return est.step_time if est.fits else None

    def _run(self, now: float, plan: Plan, step: float, transition_s: float, chosen: str) -> None:
        self.plan, self.run_dead, self.run_extra = plan, frozenset(), {}
        self.batch = self.workload.global_batch
        self.step_time = self.b_step_time = step * self.overhead
        start = now if self.busy_until == math.inf else max(self.busy_until, now)
        self.busy_until = self.b_busy_until = start + transition_s
        self.decisions[chosen] = self.decisions.get(chosen, 0) + 1
        self._record(now, self._kind, chosen, transition_s)

    def fail(self, now: float, devices: tuple[int, ...], redo_steps: int | None = None) -> None:
        devs = tuple(d for d in devices if d in self.alive)
        plan = takeover_plan(self.full_plan, self.alive - set(devs)) if self.shadowed and devs else None
        step = self._fits(plan)
        if step is None:
            self.shadowed = self.shadowed and not devs
            super().fail(now, devices, redo_steps)  # nothing to do, or checkpoint-restart over the survivors
            return
        self._kind = "fail"
        self.alive -= set(devs)
        self._run(now, plan, step, self.setting.rebuild_s, "takeover")

    def repair(self, now: float, devices: tuple[int, ...], kind: str = "repair") -> None:
        self._kind = kind
        back = {d for d in devices if d not in self.alive}
        if not back:
            self._record(now, kind, "ignored", 0.0)
            return
        self.alive |= back
        plan = takeover_plan(self.full_plan, self.alive)
        step = self._fits(plan)
        if step is not None and self.shadowed:
            heal = heal_seconds(self.full_plan, back & set(self.full_plan.devices), self.workload, self.cluster)
            self._run(now, plan, step, heal + self.setting.rebuild_s, "heal")
        elif step is not None:  # back to the shadowed layout, through a restart
            self.shadowed = True
            self._run(now, plan, step, self.setting.restart_s + self.setting.since_checkpoint(now), "restart")
        else:
            self._restart_over_alive(now)


# -- the larger setting --------------------------------------------------------------------
def scale_trace(trace: Trace, from_devices: int = 8, to_devices: int = 32) -> Trace:
    """The trace on a cluster ``k = to_devices / from_devices`` times larger: device ``d`` maps
    to ``d, d + from_devices, …, d + (k − 1)·from_devices`` (the small cluster tiled ``k``
    times, every copy seeing the same events at the same times).  With pipelines of consecutive
    devices and a stage count dividing ``from_devices``, the same fraction of devices and of
    pipelines is hit, at the same stages."""
    if from_devices <= 0 or to_devices % from_devices:
        raise ValueError(f"to_devices ({to_devices}) must be a multiple of from_devices ({from_devices})")
    if any(d >= from_devices or d < 0 for d in trace.devices):
        raise ValueError(f"the trace names devices outside 0..{from_devices - 1}")
    k = to_devices // from_devices
    events = tuple(replace(e, devices=tuple(d + from_devices * r for r in range(k) for d in e.devices))
                   for e in trace.events)
    return Trace(events, trace.horizon_s, f"{trace.name}-x{k}",
                 (trace.description + " " if trace.description else "")
                 + f"[scaled {from_devices} -> {to_devices} devices: the small cluster tiled {k} times]")


def trace_setting(workload: Workload, cluster: Cluster, devices: int, stages: int) -> tuple[Workload, Cluster, Plan]:
    """The job on ``devices`` devices: the global batch scaled with the device count, the
    cluster's devices repeated in order (same speed, memory and devices per node), and the
    deployed plan the runtime starts from: pipelines of ``stages`` consecutive devices, layers
    balanced for equal speeds, micro-batches split evenly."""
    n = len(cluster.devices)
    if devices <= 0 or (devices % n and n % devices):
        raise ValueError(f"{devices} devices: need a multiple or a divisor of the cluster's {n}")
    batch = workload.global_batch * devices // n
    if batch <= 0 or batch % workload.micro_batch:
        raise ValueError(f"the scaled global batch {batch} is not a multiple of micro_batch {workload.micro_batch}")
    w = replace(workload, global_batch=batch)
    per_node = len(cluster.devices_on_node(cluster.devices[0].node))
    src = cluster.devices
    grown = Cluster(tuple(Device(i, i // per_node, src[i % n].speed, src[i % n].memory_bytes) for i in range(devices)),
                    intra=cluster.intra, inter=cluster.inter, collective=cluster.collective,
                    migration=cluster.migration)
    if devices < stages or w.num_layers < stages:
        raise ValueError(f"{stages} stages need at least {stages} devices and {stages} layers")
    chunks = [tuple(range(i, i + stages)) for i in range(0, devices - devices % stages, stages)]
    bounds = balance_layers(w, [1.0] * stages)
    plan = Plan(tuple(Pipeline(c, bounds, m) for c, m in zip(chunks, even_split(w.num_microbatches, len(chunks)))))
    validate(plan, w, grown.ids)
    return w, grown, plan


# -- the stored form -----------------------------------------------------------------------
def default_workload() -> Workload:
    """A placeholder job for a trace stored without one: 8 transformer blocks, 16 samples in
    micro-batches of 2 (not a measured workload)."""
    return transformer(num_layers=8, hidden=1024, seq_len=512, micro_batch=2, global_batch=16,
                       flops_per_s=1e12, name="trace-default")


@dataclass(frozen=True)
class TraceSetup:
    """A trace and the job it was recorded on: the JSON a benchmark stores and ``chameleon-ft
    simulate --trace`` reads (see :meth:`to_json` for the schema)."""

    trace: Trace
    workload: Workload
    cluster: Cluster
    coefficients: Coefficients = Coefficients()
    stages: int = 4
    rebuild_s: float = 1.0
    restart_s: float = 60.0
    checkpoint_every_s: float = 600.0
    mttf_s: float | None = None
    redundant_overhead: float | None = None
    space: SearchSpace = SearchSpace()
    replacement_eta_s: float | None = None
    checkpoint_phase_s: float = 0.0  # seconds since the last checkpoint when the trace starts
    limited_replacements: bool = False  # the trace's joins are all the replacements (``replay``)
    engine_restart: bool = True  # the engine's policies may restart (the job writes checkpoints)
    rebalance: tuple = ()  # the policies that rebalance a straggler (``JobSetting.rebalance``)

    def to_json(self) -> dict:
        """``{"trace": {name, description, horizon_s, events: [{t_s, kind, devices, slowdown?}]},
        "workload": {layers: [[params, fwd_s, bwd_s, act_bytes, out_bytes], …], global_batch,
        micro_batch, weight_bytes, grad_bytes, optim_bytes}, "cluster": {devices, per_node, intra:
        [latency_s, bandwidth_Bps], inter: […], memory_bytes}, "coefficients": {compute_scale,
        comm_scale, step_overhead_s}, "stages": P, "settings": {rebuild_s, restart_s,
        checkpoint_every_s, mttf_s, redundant_overhead, pp_min, pp_max, engine_restart, …}}``."""
        return {"trace": self.trace.to_json(), "workload": workload_to_json(self.workload),
                "cluster": cluster_to_json(self.cluster), "coefficients": coefficients_to_json(self.coefficients),
                "stages": self.stages,
                "settings": {"rebuild_s": self.rebuild_s, "restart_s": self.restart_s,
                             "checkpoint_every_s": self.checkpoint_every_s, "mttf_s": self.mttf_s,
                             "checkpoint_phase_s": self.checkpoint_phase_s,
                             "redundant_overhead": self.redundant_overhead,
                             "pp_min": self.space.pp_min, "pp_max": self.space.pp_max,
                             "dp_min": self.space.dp_min, "min_microbatches": self.space.min_microbatches,
                             "replacement_eta_s": self.replacement_eta_s,
                             "limited_replacements": self.limited_replacements,
                             "engine_restart": self.engine_restart, "rebalance": list(self.rebalance)}}

    @staticmethod
    def from_json(data: dict) -> "TraceSetup":
        """Only ``trace`` is required: a missing workload is :func:`default_workload`, a missing
        cluster one node of as many devices as the trace's highest id needs (at least 8)."""
        trace = Trace.from_json(data["trace"])
        cluster = (cluster_from_json(data["cluster"]) if "cluster" in data
                   else cluster_from_json({"devices": max(8, max(trace.devices, default=0) + 1)}))
        s = data.get("settings", {})
        space = SearchSpace(pp_min=int(s.get("pp_min", 1)), pp_max=s.get("pp_max"), dp_min=int(s.get("dp_min", 1)),
                            min_microbatches=int(s.get("min_microbatches", 0)))
        return TraceSetup(trace, workload_from_json(data["workload"]) if "workload" in data else default_workload(),
                          cluster, coefficients_from_json(data.get("coefficients")), int(data.get("stages", 4)),
                          float(s.get("rebuild_s", 1.0)), float(s.get("restart_s", 60.0)),
                          float(s.get("checkpoint_every_s", 600.0)), s.get("mttf_s"), s.get("redundant_overhead"),
                          space, s.get("replacement_eta_s"), float(s.get("checkpoint_phase_s", 0.0)),
                          bool(s.get("limited_replacements", False)), bool(s.get("engine_restart", True)),
                          tuple(s.get("rebalance", ())))

    def run(self, devices: int | None = None, policies=DEFAULT_POLICIES) -> dict[str, TraceResult]:
        """Replay the trace on the recorded setting, or (``devices``) on the scaled one."""
        n = len(self.cluster.devices)
        trace = self.trace if devices in (None, n) else scale_trace(self.trace, n, devices)
        w, c, plan = trace_setting(self.workload, self.cluster, devices or n, self.stages)
        return replay(trace, w, c, plan, policies, self.coefficients, rebuild_s=self.rebuild_s,
                      restart_s=self.restart_s, checkpoint_every_s=self.checkpoint_every_s,
                      search_space=self.space, mttf_s=self.mttf_s, redundant_overhead=self.redundant_overhead,
                      replacement_eta_s=self.replacement_eta_s, checkpoint_phase_s=self.checkpoint_phase_s,
                      limited_replacements=self.limited_replacements, engine_restart=self.engine_restart,
                      rebalance=self.rebalance)
