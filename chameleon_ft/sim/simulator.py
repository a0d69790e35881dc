"""Discrete-event simulation of a long training run under failures.

Devices fail at a per-GPU rate (a share of failures take out a whole node), come back after a
repair time, and after each event a *policy* decides what the job does.  The adaptive policy is
the real selector (:func:`chameleon_ft.engine.selector.select`) with the real planner and migration planning;
the fixed policies model the systems people use today:

==============  ==============================================================================
``adaptive``    the selector, global batch kept (the default a user gets)
``oracle``      the same selector deciding with the *true* cost model (only with model error)
``adaptive+shrink``  the selector with shrinking allowed (the user lets the global batch change)
``reroute``     always reroute (ReCycle's idea, priced as this runtime schedules it -- no bubble
                filling), heal repaired devices back in; restart when a stage lost every replica
``replan``      always re-plan over the survivors (Oobleck)
``shrink``      drop broken replicas, smaller global batch (TorchFT); replicas heal back in
``restart``     checkpoint-restart on every membership change (torchrun elastic)
==============  ==============================================================================

Goodput = useful samples / (failure-free throughput · wall time).  Samples processed with a
shrunk global batch count as useful.

Model error: the simulated cluster runs on a *true* cost model (:class:`TrueModel`) whose
compute and communication scales, per-step overhead, and restart, rebuild and data-movement
costs are the selector's believed ones times seeded log-normal factors (``exp(spread · Z)``,
default spread 0.2), while every policy decides with the believed model.  Each result reports
goodput under the true model (what happened) and under the believed one (what the decisions
expected); ``oracle`` decides with the true model, so ``oracle − adaptive`` is what model error
cost the adaptive policy.  ``model_error=0`` is the perfect model (true = believed).  A "device" is a tensor-parallel group (``tp`` GPUs); a
GPU failure takes its group out.

The job model (``_Job``: the selector's decision per event, carried out on the true model) is
shared with trace replay (:mod:`chameleon_ft.sim.trace`) through a :class:`JobSetting`.

Limits: failures are independent (exponential); repair times are exponential around a stated
mean; a failure during a transition restarts the transition; no failure can hit the spare pool.
The presets' repair times, restart costs and node-failure shares are stated assumptions.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from chameleon_ft.engine.cluster import Cluster, Device, Link
from chameleon_ft.engine.failures import LLAMA3_RATE_PER_DEVICE_S, Event, EventKind
from chameleon_ft.engine.perf import Coefficients, estimate
from chameleon_ft.engine.plan import Plan
from chameleon_ft.engine.planner import SearchSpace, plan_search
from chameleon_ft.engine.selector import JobState, SelectorConfig, select
from chameleon_ft.engine.workload import Workload, transformer

FIXED = ("reroute", "replan", "shrink", "restart")
POLICY_NAMES = ("adaptive", "adaptive+shrink") + FIXED + ("oracle",)
ADAPTIVE = ("adaptive", "adaptive+shrink", "oracle")
# Trace replay of a live benchmark's "fixed" systems, which are the engine deciding over a
# restricted set (``benchmarks/pipeline_trace.py``: reroute may also wait for a replacement).
ENGINE_RESTRICTED = ("engine-reroute", "engine-replan")
BATCH_CHANGING = ("adaptive+shrink", "shrink")
_REBUILD_S = 1.0  # believed: re-forming the process groups in place


@dataclass(frozen=True)
class Preset:
    name: str
    gpus: int
    gpus_per_node: int
    tp: int
    workload: Workload
    days: float
    rate_per_gpu_s: float
    node_fraction: float  # share of failures that take out a whole node
    repair_mean_s: float
    restart_s: float
    checkpoint_every_s: float
    space: SearchSpace
    source: str

    @property
    def devices(self) -> int:
        return self.gpus // self.tp

    def setting(self) -> "JobSetting":
        rate, tp, repair = self.rate_per_gpu_s, self.tp, self.repair_mean_s

        def mttf(alive: int, down: int) -> float:
            """Expected time to the next membership change: a failure among the live GPUs, or
            one of the ``down`` devices coming back from repair."""
            return 1.0 / (rate * max(1, alive) * tp + down / repair)

        return JobSetting(self.workload, self.cluster(), self.restart_s, self.checkpoint_every_s,
                          self.space, mttf)

    def cluster(self) -> Cluster:
        per_node = max(1, self.gpus_per_node // self.tp)
        mem = 80e9 * self.tp
        return Cluster(
            tuple(Device(i, i // per_node, 1.0, mem) for i in range(self.devices)),
            intra=Link(5e-6, 150e9 * self.tp),
            inter=Link(10e-6, 50e9 * max(1, self.tp // 2)),
        )


def _llama(layers: int, hidden: int, batch: int, tp: int) -> Workload:
    # 400 TFLOP/s peak per H100 at ~40 % MFU, times tp GPUs per device; selective activation
    # recomputation (act_factor 8 instead of 34).
    return transformer(num_layers=layers, hidden=hidden, seq_len=8192, micro_batch=1,
                       global_batch=batch, flops_per_s=160e12 * tp, act_factor=8,
                       name=f"{layers}L-h{hidden}")


PRESETS: dict[str, Preset] = {
    "llama3-16k": Preset(
        "llama3-16k", 16384, 8, 8, _llama(126, 16384, 2048, 8), 54, LLAMA3_RATE_PER_DEVICE_S,
        0.2, 2 * 3600, 600, 1800, SearchSpace(pp_min=8, pp_max=16, global_limit=0),
        "Llama 3 405B pre-training: 16,384 H100, TP8 x PP16 x DP128, 419 unexpected interruptions "
        "in 54 days (Dubey et al., 2024). Repair 2 h, restart 10 min, checkpoint every 30 min: assumed.",
    ),
    "gpt-1k": Preset(
        "gpt-1k", 1024, 8, 8, _llama(48, 8192, 512, 8), 14, LLAMA3_RATE_PER_DEVICE_S,
        0.2, 2 * 3600, 300, 1800, SearchSpace(pp_min=2, pp_max=16),
        "A 40B-class model on 1,024 GPUs (TP8) with the Llama 3 per-GPU failure rate.",
    ),
    "scale-128k": Preset(
        "scale-128k", 131072, 8, 8, _llama(126, 16384, 16384, 8), 7, LLAMA3_RATE_PER_DEVICE_S,
        0.2, 2 * 3600, 900, 1800, SearchSpace(pp_min=8, pp_max=16, global_limit=0),
        "The Llama 3 recipe scaled to 131,072 GPUs (16,384 TP8 devices), same per-GPU rate.",
    ),
    "small": Preset(
        "small", 64, 8, 1, transformer(num_layers=16, hidden=2048, seq_len=2048, global_batch=64,
                                       flops_per_s=160e12, name="small"),
        2, LLAMA3_RATE_PER_DEVICE_S * 200, 0.2, 3600, 120, 1800, SearchSpace(pp_max=8),
        "A 64-GPU toy job with a 200x failure rate, for quick runs and tests.",
    ),
}


@dataclass(frozen=True)
class TrueModel:
    """The cost model the simulated cluster really follows: the believed one with each
    coefficient multiplied by its own factor.  ``link`` multiplies every transfer time (link
    bandwidth divided by it: migration, heal and, with ``comm``, the all-reduce), ``overhead_s``
    is a per-step overhead the believed model does not have."""

    compute: float = 1.0
    comm: float = 1.0
    overhead_s: float = 0.0
    link: float = 1.0
    rebuild: float = 1.0
    restart: float = 1.0

    @classmethod
    def perturbed(cls, spread: float, seed: int, step_s: float) -> "TrueModel":
        """Log-normal factors ``exp(spread · Z)`` (median 1), seeded; the missing overhead is
        ``max(0, f − 1)`` of the failure-free step ``step_s``."""
        if spread < 0:
            raise ValueError("model error (spread) must be >= 0")
        if spread == 0:
            return cls()
        rng = random.Random(f"true-model-{seed}")
        f = [math.exp(spread * rng.gauss(0.0, 1.0)) for _ in range(6)]
        return cls(f[0], f[1], max(0.0, f[2] - 1) * step_s, f[3], f[4], f[5])

    @property
    def exact(self) -> bool:
        return self == TrueModel()

    def coefficients(self, believed: Coefficients) -> Coefficients:
        """The believed coefficients with the true factors applied; the per-task, per-hop and
        optimizer costs a pipeline job calibrated are kept as they are (until 2026-12-03 they
        were dropped, so a replayed pipeline trace ran faster than its own calibration)."""
        return replace(believed, compute_scale=believed.compute_scale * self.compute,
                       comm_scale=believed.comm_scale * self.comm,
                       step_overhead_s=believed.step_overhead_s + self.overhead_s)

    def cluster(self, believed: Cluster) -> Cluster:
        slow = lambda link: Link(link.latency_s, link.bandwidth_Bps / self.link)  # noqa: E731
        return replace(believed, intra=slow(believed.intra), inter=slow(believed.inter))

    def to_json(self) -> dict:
        return dict(vars(self))


@dataclass
class PolicyResult:
    policy: str
    samples: float
    ideal: float
    failures: int
    decisions: dict[str, int]
    downtime_s: float
    timeline: list[tuple[float, float]] = field(repr=False)  # (time_s, throughput)
    decide_s: list[float] = field(repr=False, default_factory=list)
    believed_samples: float = 0.0  # the same decisions as the believed model predicted them
    believed_ideal: float = 0.0

    @property
    def goodput(self) -> float:
        """Under the true model: what happened."""
        return self.samples / self.ideal if self.ideal else 0.0

    @property
    def believed_goodput(self) -> float:
        """Under the believed model: what the decisions expected."""
        return self.believed_samples / self.believed_ideal if self.believed_ideal else 0.0

    def to_json(self) -> dict:
        return {"policy": self.policy, "goodput": self.goodput, "believed_goodput": self.believed_goodput,
                "samples": self.samples,
                "failures": self.failures, "decisions": self.decisions, "downtime_s": self.downtime_s,
                "median_decide_s": sorted(self.decide_s)[len(self.decide_s) // 2] if self.decide_s else None}


def draw_events(preset: Preset, seed: int) -> list[tuple[float, tuple[int, ...], float]]:
    """Failure times, the devices each takes out, and the repair time: one schedule shared by
    every policy so that they face the same failures."""
    rng = random.Random(seed)
    horizon = preset.days * 86400
    rate = preset.rate_per_gpu_s * preset.gpus
    per_node = max(1, preset.gpus_per_node // preset.tp)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= horizon:
            return out
        dev = rng.randrange(preset.devices)
        if rng.random() < preset.node_fraction:
            node = dev // per_node
            devs = tuple(range(node * per_node, min((node + 1) * per_node, preset.devices)))
        else:
            devs = (dev,)
        out.append((t, devs, rng.expovariate(1 / preset.repair_mean_s)))


@dataclass(frozen=True)
class JobSetting:
    """What a simulated job runs on and what its recoveries cost; shared by the preset-driven
    :func:`simulate` and trace replay (:mod:`chameleon_ft.sim.trace`).  ``mttf(alive, down)`` is the
    ``D`` the decisions use, given the live devices and those down."""

    workload: Workload
    cluster: Cluster
    restart_s: float
    checkpoint_every_s: float
    space: SearchSpace
    mttf: Callable[[int, int], float]
    rebuild_s: float = _REBUILD_S
    replacement_eta_s: float | None = None  # lets the adaptive policies consider ``wait``
    checkpoint_phase_s: float = 0.0  # seconds since the last checkpoint at time 0
    # Replacements the job will get (a launcher's ``--max-replacements``): once that many devices
    # came back, no replacement is expected and ``wait`` is not an option.  None: no limit.
    max_replacements: int | None = None
    # Whether the engine's policies may choose checkpoint-restart: False for a job that writes no
    # checkpoint (the live pipeline benchmarks' chameleon-ft systems), where restart is infeasible.
    engine_restart: bool = True
    # The policies that answer a straggler with a micro-batch rebalance (the live pipeline jobs'
    # adaptive engine, and their always-reroute since 2026-12-05); the others keep it.
    rebalance: frozenset = frozenset()

    def since_checkpoint(self, now: float) -> float:
        """Seconds of work since the last checkpoint at ``now`` (what a restart redoes)."""
        return (now + self.checkpoint_phase_s) % self.checkpoint_every_s


class _Job:
    """One policy's view of the job during the simulation.  It decides with the believed model
    (``oracle``: the true one) and runs on the true one; ``step_time``/``busy_until`` are what
    really happens, ``b_step_time``/``b_busy_until`` what the decision model predicted."""

    def __init__(self, setting: JobSetting, policy: str, base: Plan, coeffs: Coefficients, truth: TrueModel):
        self.setting, self.policy, self.truth = setting, policy, truth
        self._kind = "fail"  # the event being handled, for the log
        self.cluster = setting.cluster
        self.true_cluster = truth.cluster(self.cluster)
        self.true_coeffs = truth.coefficients(coeffs)
        oracle = policy == "oracle"
        self.coeffs = self.true_coeffs if oracle else coeffs  # what the decisions use
        self.decide_cluster = self.true_cluster if oracle else self.cluster
        self.workload = setting.workload
        self.full_plan = base
        self.plan = base
        self.alive = set(self.cluster.ids)
        self.batch = setting.workload.global_batch
        # What the running plan leaves out (dead devices rerouted around) and the extra load
        # that puts on peers: a slowdown re-prices the plan with them.
        self.run_dead: frozenset[int] = frozenset()
        self.run_extra: dict[int, float] = {}
        # One row per event: (time s, kind, chosen response, predicted step s, transition s).
        self.log: list[tuple[float, str, str, float, float]] = []
        self.b_step_time = estimate(base, self.workload, self.decide_cluster, self.coeffs).step_time
        self.step_time = self._true_step(base)
        self.busy_until = self.b_busy_until = 0.0
        self.restart_until = -math.inf  # a relaunch in progress ends then (devices back by then join it)
        self.decisions: dict[str, int] = {}
        self.decide_s: list[float] = []
        self.replaced = 0  # devices that joined (replacements used)
        self._undo: tuple | None = None  # the running re-plan's predecessor (``_apply``)
        allowed = {"adaptive": frozenset({"reroute", "replan", "restart", "keep", "heal", "grow"}),
                   "oracle": frozenset({"reroute", "replan", "restart", "keep", "heal", "grow"}),
                   "adaptive+shrink": frozenset({"reroute", "replan", "shrink", "restart", "keep", "heal", "grow"}),
                   "reroute": frozenset({"reroute", "restart", "keep", "heal"}),
                   "replan": frozenset({"replan", "restart", "keep", "grow"}),
                   "shrink": frozenset({"shrink", "restart", "keep", "heal"}),
                   "restart": frozenset({"restart"}),
                   "engine-reroute": frozenset({"reroute", "heal", "restart", "keep"}),
                   "engine-replan": frozenset({"replan", "grow", "restart", "keep"})}[policy]
        if setting.replacement_eta_s is not None and policy in ADAPTIVE + ("engine-reroute",):
            allowed = allowed | {"wait"}
        if not setting.engine_restart and policy in ADAPTIVE + ENGINE_RESTRICTED:
            allowed = allowed - {"restart"}
        if policy in setting.rebalance:
            allowed = allowed | {"rebalance"}
        self.rebuild_d = setting.rebuild_s * (truth.rebuild if oracle else 1.0)
        self.restart_d = setting.restart_s * (truth.restart if oracle else 1.0)
        self.link_d = truth.link if oracle else 1.0
        self.cfg = SelectorConfig(allowed=allowed, allow_batch_change="shrink" in allowed,
                                  restart_s=self.restart_d, space=setting.space, rebuild_s=self.rebuild_d,
                                  replacement_eta_s=setting.replacement_eta_s)

    def _true_step(self, plan: Plan, dead=frozenset(), extra=None, predicted: float | None = None) -> float:
        """The plan's step time under the true model (the prediction itself when it is exact)."""
        if predicted is not None and self.truth.exact:
            return predicted
        return estimate(plan, self.workload, self.true_cluster, self.true_coeffs, dead, extra).step_time

    def throughput(self, now: float) -> float:
        return 0.0 if now < self.busy_until else self.batch / self.step_time

    def _state(self) -> JobState:
        return JobState(self.workload, self.decide_cluster, self.plan, frozenset(self.alive), self.coeffs)

    def _mttf(self, down: int = 0) -> float:
        return self.setting.mttf(len(self.alive), down)

    def _record(self, now: float, kind: str, chosen: str, transition_s: float) -> None:
        self.log.append((now, kind, chosen, self.b_step_time, transition_s))

    def _apply(self, now: float, option) -> None:
        """Carry ``option`` out: the decision model's figures for the prediction, the true
        model's for what happens (the transition's rebuild, data movement, restart and redone
        steps re-priced)."""
        self.decisions[option.policy] = self.decisions.get(option.policy, 0) + 1
        # A re-plan's migration can be interrupted (``repair``): what to go back to.
        self._undo = (self.plan, self.run_dead, self.run_extra, self.batch, self.b_step_time, self.step_time) \
            if option.policy == "replan" else None
        if option.plan is not None:
            self.plan = option.plan
        self.run_dead, self.run_extra = option.dead, option.extra
        self.batch = option.global_batch or self.batch
        true_step = self._true_step(self.plan, option.dead, option.extra, option.step_time)
        t = self.truth
        if option.policy == "restart":
            extra_s = (self.setting.restart_s * t.restart - self.restart_d) + self._redo * (true_step - option.step_time)
        else:  # rebuild + data movement (migration, heal)
            move = max(0.0, option.transition_s - self.rebuild_d - self.cfg.search_s)
            extra_s = (self.setting.rebuild_s * t.rebuild - self.rebuild_d) + move * (t.link / self.link_d - 1)
        self.b_step_time = option.step_time
        self.b_busy_until = max(self.b_busy_until, now) + option.transition_s
        self.step_time = true_step
        self.busy_until = max(self.busy_until, now) + option.transition_s + extra_s
        if option.policy == "restart":
            self.restart_until = self.busy_until
        self._record(now, self._kind, option.policy, option.transition_s)

    def fail(self, now: float, devices: tuple[int, ...], redo_steps: int | None = None) -> None:
        self._kind = "fail"
        devs = tuple(d for d in devices if d in self.alive)
        if not devs:
            self._record(now, "fail", "ignored", 0.0)
            return
        # Steps a restart redoes: the trace's own count where it knows it, else the time grid's.
        self._redo = (int(redo_steps) if redo_steps is not None
                      else int(self.setting.since_checkpoint(now) / self.step_time))
        cfg = replace(self.cfg, steps_since_checkpoint=self._redo)
        limit = self.setting.max_replacements
        if limit is not None and self.replaced >= limit:  # as the live engine: none left, no wait
            cfg = replace(cfg, replacement_eta_s=None)
        t0 = time.perf_counter()
        down = len(self.cluster.ids) - len(self.alive) + len(devs)
        decision = select(Event(EventKind.FAIL_STOP, devs, now), self._state(), cfg, self._mttf(down))
        self.decide_s.append(time.perf_counter() - t0)
        self.alive -= set(devs)
        option = self._pick(decision, (self.policy, "restart"))
        if option is None:
            self.busy_until = self.b_busy_until = math.inf  # nothing can run: wait for a repair
            self._record(now, "fail", "stopped", math.inf)
            return
        self._apply(now, option)

    def repair(self, now: float, devices: tuple[int, ...], kind: str = "repair") -> None:
        self._kind = kind
        back = tuple(d for d in devices if d not in self.alive)
        if not back:
            self._record(now, kind, "ignored", 0.0)
            return
        self.alive |= set(back)
        self.replaced += len(back) if kind == "join" else 0
        if self._undo is not None and now < self.busy_until and set(back) <= set(self._undo[0].devices):
            self._interrupted(now, back)
            return
        if self.busy_until == math.inf:
            self._restart_over_alive(now)
            return
        if self.policy == "restart" and now < self.restart_until:
            # Back while a relaunch is under way: the relaunch takes it in (torchrun's rendezvous
            # admits the restarted node's workers), no second restart.
            self._plan_over_alive()
            self._record(now, kind, "restart", 0.0)
        elif self.policy == "restart":
            self._restart_over_alive(now)
        else:
            t0 = time.perf_counter()
            down = len(self.cluster.ids) - len(self.alive)
            self._redo = 0
            decision = select(Event(EventKind.JOIN, back, now), self._state(), self.cfg, self._mttf(down))
            self.decide_s.append(time.perf_counter() - t0)
            option = self._pick(decision, {"reroute": ("heal",), "shrink": ("heal",), "replan": ("grow",)}.get(self.policy, ()))
            if option is not None and option.policy != "keep":
                self._apply(now, option)
            else:
                self._record(now, kind, "keep", 0.0)

    def _interrupted(self, now: float, back: tuple[int, ...]) -> None:
        """A replacement joined while a re-plan's state was still moving: as the runtime does, the
        membership change ends the migration, the re-plan is undone (nobody dropped a block), and
        the plan before it -- which names the joined device's slot -- gets that device's blocks
        back: a heal, from now (the migration's time so far is lost)."""
        self.plan, self.run_dead, self.run_extra, self.batch, self.b_step_time, self.step_time = self._undo
        self._undo = None
        self.busy_until = self.b_busy_until = now
        down = len(self.cluster.ids) - len(self.alive)
        decision = select(Event(EventKind.JOIN, back, now), self._state(),
                          replace(self.cfg, allowed=frozenset({"heal", "keep"})), self._mttf(down))
        option = next((o for o in decision.options if o.policy == "heal" and o.feasible), None)
        if option is None:
            self._record(now, "join", "keep", 0.0)
            return
        self._apply(now, option)

    def slow(self, now: float, devices: tuple[int, ...], slowdown: float, base: Cluster) -> None:
        """``devices`` now run ``slowdown`` times slower than in ``base`` (1: their own speed
        back); the running plan is re-priced, and a policy that rebalances stragglers
        (``JobSetting.rebalance``) asks the selector, keep or rebalance (micro-batches between
        the running pipelines, as the live pipeline runtime does).  Later decisions see the speeds."""
        speeds = {d: base[d].speed / slowdown for d in devices}
        oracle = self.decide_cluster is self.true_cluster
        self.cluster = self.cluster.with_speeds(speeds)
        self.true_cluster = self.true_cluster.with_speeds(speeds)
        self.decide_cluster = self.true_cluster if oracle else self.cluster
        if self.busy_until != math.inf:
            self.b_step_time, self.step_time = self._running_steps()
            if "rebalance" in self.cfg.allowed and slowdown > 1:
                self._kind = "slow"
                d = select(Event(EventKind.STRAGGLER, devices, now), self._state(),
                           replace(self.cfg, straggler_relayout=False), self._mttf())
                if d.chosen == "rebalance":
                    self._apply(now, d.choice)
                    return
        self._record(now, "slow", "keep", 0.0)

    def _running_steps(self) -> tuple[float, float]:
        """(believed, true) step time of the running plan."""
        dead, extra = self.run_dead, self.run_extra
        b = estimate(self.plan, self.workload, self.decide_cluster, self.coeffs, dead, extra).step_time
        return b, self._true_step(self.plan, dead, extra, b)

    def _pick(self, decision, preferred: tuple[str, ...]):
        """The adaptive policies take the selector's choice; a fixed one takes the first of its
        preferred responses that is feasible."""
        if self.policy in ADAPTIVE + ENGINE_RESTRICTED:
            return decision.choice
        for name in preferred:
            option = next((o for o in decision.options if o.policy == name), None)
            if option is not None and option.feasible:
                return option
        return None

    def _plan_over_alive(self) -> None:
        """Run the best plan over the devices alive, from a checkpoint (a restart's layout) --
        torchrun's (``restart``) relaunches the deployed layout when all of its devices are back:
        it knows no device speeds (a straggler stays in its slot, as in the live baseline)."""
        if self.policy == "restart" and set(self.full_plan.devices) <= self.alive:
            plan = self.full_plan
            b = estimate(plan, self.workload, self.decide_cluster, self.coeffs).step_time
        else:
            survivors = self.decide_cluster.without(set(self.cluster.ids) - self.alive)
            best = plan_search(self.workload, survivors, self.coeffs, self.setting.space, base=self.full_plan).best
            plan, b = best.plan, best.estimate.step_time
        self.plan, self.b_step_time = plan, b
        self.run_dead, self.run_extra = frozenset(), {}
        self.step_time = self._true_step(plan, predicted=b)
        self.batch = self.workload.global_batch

    def _restart_over_alive(self, now: float) -> None:
        self._plan_over_alive()
        lost = self.setting.since_checkpoint(now)
        for attr, cost in (("busy_until", self.setting.restart_s * self.truth.restart), ("b_busy_until", self.restart_d)):
            busy = getattr(self, attr)
            setattr(self, attr, max(busy if busy != math.inf else now, now) + cost + lost)
        self.restart_until = self.busy_until
        self.decisions["restart"] = self.decisions.get("restart", 0) + 1
        self._record(now, self._kind, "restart", self.restart_d + lost)


def deployed(preset: Preset, seed: int = 0, model_error: float = 0.2) -> tuple[Plan, TrueModel]:
    """The plan every policy starts from (the believed model's best) and the true model."""
    coeffs = Coefficients()
    base = plan_search(preset.workload, preset.cluster(), coeffs, replace(preset.space, global_limit=1 << 30)).best.plan
    step = estimate(base, preset.workload, preset.cluster(), coeffs).step_time
    return base, TrueModel.perturbed(model_error, seed, step)


def simulate(preset: Preset, policies=None, seed: int = 0, days: float | None = None,
             model_error: float = 0.2) -> dict[str, PolicyResult]:
    """Run every policy against the same failure schedule, on a true cost model perturbed by
    ``model_error`` from the believed one (0: the believed model is exact).  ``policies``
    defaults to every policy (``oracle`` only when there is a model error)."""
    if days is not None:
        preset = replace(preset, days=days)
    coeffs = Coefficients()
    base, truth = deployed(preset, seed, model_error)
    if policies is None:
        policies = [p for p in POLICY_NAMES if p != "oracle" or not truth.exact]
    events = draw_events(preset, seed)
    horizon = preset.days * 86400
    results = {}
    for policy in policies:
        if policy not in POLICY_NAMES:
            raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICY_NAMES)}")
        job = _Job(preset.setting(), policy, base, coeffs, truth)
        ideal_tp = job.batch / job._true_step(base)
        b_ideal_tp = job.batch / estimate(base, preset.workload, job.decide_cluster, job.coeffs).step_time
        queue: list[tuple[float, int, str, tuple[int, ...]]] = []
        for i, (t, devs, repair) in enumerate(events):
            heapq.heappush(queue, (t, 2 * i, "fail", devs))
            heapq.heappush(queue, (t + repair, 2 * i + 1, "repair", devs))
        now, samples, b_samples, downtime = 0.0, 0.0, 0.0, 0.0
        timeline = [(0.0, ideal_tp)]
        while queue and queue[0][0] < horizon:
            t, _, kind, devs = heapq.heappop(queue)
            samples += _progress(job.busy_until, job.batch, job.step_time, now, t)
            b_samples += _progress(job.b_busy_until, job.batch, job.b_step_time, now, t)
            downtime += _downtime(job, now, t)
            now = t
            (job.fail if kind == "fail" else job.repair)(now, devs)
            timeline.append((now, job.batch / job.step_time if job.busy_until != math.inf else 0.0))
        samples += _progress(job.busy_until, job.batch, job.step_time, now, horizon)
        b_samples += _progress(job.b_busy_until, job.batch, job.b_step_time, now, horizon)
        downtime += _downtime(job, now, horizon)
        results[policy] = PolicyResult(policy, samples, ideal_tp * horizon, len(events), job.decisions,
                                       downtime, timeline, job.decide_s, b_samples, b_ideal_tp * horizon)
    return results


def model_error_cost(results: dict[str, PolicyResult]) -> float | None:
    """Goodput the adaptive policy lost to model error: the oracle's minus its own (true model)."""
    if "oracle" not in results or "adaptive" not in results:
        return None
    return results["oracle"].goodput - results["adaptive"].goodput


def _progress(busy_until: float, batch: int, step_time: float, start: float, stop: float) -> float:
    productive = max(0.0, stop - max(start, min(busy_until, stop)))
    return productive * batch / step_time


def _downtime(job: _Job, start: float, stop: float) -> float:
    return max(0.0, min(job.busy_until, stop) - start)
