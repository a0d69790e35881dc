"""Discrete-event simulation of a long training run under failures.

Devices fail at a per-GPU rate (a share of failures take out a whole node), come back after a
repair time, and after each event a *policy* decides what the job does.  The adaptive policy is
the real selector (:func:`chameleon_ft.selector.select`) with the real planner and restorer;
the fixed policies model the systems people use today:

==============  ==============================================================================
``adaptive``    the selector, global batch kept (the default a user gets)
``adaptive+shrink``  the selector with shrinking allowed (the user lets the global batch change)
``reroute``     always reroute (ReCycle), heal repaired devices back in; restart when a stage
                lost every replica
``replan``      always re-plan over the survivors (Oobleck)
``shrink``      drop broken replicas, smaller global batch (TorchFT); replicas heal back in
``restart``     checkpoint-restart on every membership change (torchrun elastic)
==============  ==============================================================================

Goodput = useful samples / (failure-free throughput · wall time).  Samples processed with a
shrunk global batch count as useful.  A "device" is a tensor-parallel group (``tp`` GPUs); a
GPU failure takes its group out.

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

from .cluster import Cluster, Device, Link
from .failures import LLAMA3_RATE_PER_DEVICE_S, Event, EventKind
from .perf import Coefficients, estimate
from .plan import Plan
from .planner import SearchSpace, plan_search
from .selector import JobState, SelectorConfig, select
from .workload import Workload, transformer

FIXED = ("reroute", "replan", "shrink", "restart")
POLICY_NAMES = ("adaptive", "adaptive+shrink") + FIXED
BATCH_CHANGING = ("adaptive+shrink", "shrink")


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

    @property
    def goodput(self) -> float:
        return self.samples / self.ideal if self.ideal else 0.0

    def to_json(self) -> dict:
        return {"policy": self.policy, "goodput": self.goodput, "samples": self.samples,
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


class _Job:
    """One policy's view of the job during the simulation."""

    def __init__(self, preset: Preset, policy: str, base: Plan, coeffs: Coefficients):
        self.p, self.policy, self.coeffs = preset, policy, coeffs
        self.cluster = preset.cluster()
        self.workload = preset.workload
        self.full_plan = base
        self.plan = base
        self.alive = set(self.cluster.ids)
        self.batch = preset.workload.global_batch
        self.step_time = estimate(base, self.workload, self.cluster, coeffs).step_time
        self.busy_until = 0.0
        self.decisions: dict[str, int] = {}
        self.decide_s: list[float] = []
        allowed = {"adaptive": frozenset({"reroute", "replan", "restart", "keep", "heal", "grow"}),
                   "adaptive+shrink": frozenset({"reroute", "replan", "shrink", "restart", "keep", "heal", "grow"}),
                   "reroute": frozenset({"reroute", "restart", "keep", "heal"}),
                   "replan": frozenset({"replan", "restart", "keep", "grow"}),
                   "shrink": frozenset({"shrink", "restart", "keep", "heal"}),
                   "restart": frozenset({"restart"})}[policy]
        self.cfg = SelectorConfig(allowed=allowed, allow_batch_change="shrink" in allowed,
                                  restart_s=preset.restart_s, space=preset.space, rebuild_s=1.0)

    def throughput(self, now: float) -> float:
        return 0.0 if now < self.busy_until else self.batch / self.step_time

    def _state(self) -> JobState:
        return JobState(self.workload, self.cluster, self.plan, frozenset(self.alive), self.coeffs)

    def _mttf(self, down: int = 0) -> float:
        """Expected time to the next membership change: a failure among the live GPUs, or one of
        the ``down`` devices coming back from repair."""
        fail = self.p.rate_per_gpu_s * max(1, len(self.alive)) * self.p.tp
        return 1.0 / (fail + down / self.p.repair_mean_s)

    def _apply(self, now: float, option) -> None:
        self.decisions[option.policy] = self.decisions.get(option.policy, 0) + 1
        if option.plan is not None:
            self.plan = option.plan
        self.batch = option.global_batch or self.batch
        self.step_time = option.step_time
        self.busy_until = max(self.busy_until, now) + option.transition_s

    def fail(self, now: float, devices: tuple[int, ...]) -> None:
        devs = tuple(d for d in devices if d in self.alive)
        if not devs:
            return
        cfg = replace(self.cfg, steps_since_checkpoint=int((now % self.p.checkpoint_every_s) / self.step_time))
        t0 = time.perf_counter()
        down = self.p.devices - len(self.alive) + len(devs)
        decision = select(Event(EventKind.FAIL_STOP, devs, now), self._state(), cfg, self._mttf(down))
        self.decide_s.append(time.perf_counter() - t0)
        self.alive -= set(devs)
        option = self._pick(decision, (self.policy, "restart"))
        if option is None:
            self.busy_until = math.inf  # nothing can run: wait for a repair
            return
        self._apply(now, option)

    def repair(self, now: float, devices: tuple[int, ...]) -> None:
        back = tuple(d for d in devices if d not in self.alive)
        if not back:
            return
        self.alive |= set(back)
        if self.busy_until == math.inf:
            self._restart_over_alive(now)
            return
        if self.policy == "restart":
            self._restart_over_alive(now)
        else:
            t0 = time.perf_counter()
            down = self.p.devices - len(self.alive)
            decision = select(Event(EventKind.JOIN, back, now), self._state(), self.cfg, self._mttf(down))
            self.decide_s.append(time.perf_counter() - t0)
            option = self._pick(decision, {"reroute": ("heal",), "shrink": ("heal",), "replan": ("grow",)}.get(self.policy, ()))
            if option is not None and option.policy != "keep":
                self._apply(now, option)

    def _pick(self, decision, preferred: tuple[str, ...]):
        """The adaptive policies take the selector's choice; a fixed one takes the first of its
        preferred responses that is feasible."""
        if self.policy.startswith("adaptive"):
            return decision.choice
        for name in preferred:
            option = next((o for o in decision.options if o.policy == name), None)
            if option is not None and option.feasible:
                return option
        return None

    def _restart_over_alive(self, now: float) -> None:
        survivors = self.cluster.without(set(self.cluster.ids) - self.alive)
        best = plan_search(self.workload, survivors, self.coeffs, self.p.space, base=self.full_plan).best
        self.plan, self.step_time = best.plan, best.estimate.step_time
        self.batch = self.workload.global_batch
        lost = (now % self.p.checkpoint_every_s)
        self.busy_until = max(self.busy_until if self.busy_until != math.inf else now, now) + self.p.restart_s + lost
        self.decisions["restart"] = self.decisions.get("restart", 0) + 1


def simulate(preset: Preset, policies=POLICY_NAMES, seed: int = 0, days: float | None = None) -> dict[str, PolicyResult]:
    """Run every policy against the same failure schedule."""
    if days is not None:
        preset = replace(preset, days=days)
    coeffs = Coefficients()
    base = plan_search(preset.workload, preset.cluster(), coeffs, replace(preset.space, global_limit=1 << 30)).best.plan
    events = draw_events(preset, seed)
    horizon = preset.days * 86400
    results = {}
    for policy in policies:
        if policy not in POLICY_NAMES:
            raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICY_NAMES)}")
        job = _Job(preset, policy, base, coeffs)
        ideal_tp = job.batch / job.step_time
        queue: list[tuple[float, int, str, tuple[int, ...]]] = []
        for i, (t, devs, repair) in enumerate(events):
            heapq.heappush(queue, (t, 2 * i, "fail", devs))
            heapq.heappush(queue, (t + repair, 2 * i + 1, "repair", devs))
        now, samples, downtime = 0.0, 0.0, 0.0
        timeline = [(0.0, ideal_tp)]
        while queue and queue[0][0] < horizon:
            t, _, kind, devs = heapq.heappop(queue)
            samples += _progress(job, now, t)
            downtime += _downtime(job, now, t)
            now = t
            (job.fail if kind == "fail" else job.repair)(now, devs)
            timeline.append((now, job.batch / job.step_time if job.busy_until != math.inf else 0.0))
        samples += _progress(job, now, horizon)
        downtime += _downtime(job, now, horizon)
        results[policy] = PolicyResult(policy, samples, ideal_tp * horizon, len(events), job.decisions,
                                       downtime, timeline, job.decide_s)
    return results


def _progress(job: _Job, start: float, stop: float) -> float:
    productive = max(0.0, stop - max(start, min(job.busy_until, stop)))
    return productive * job.batch / job.step_time


def _downtime(job: _Job, start: float, stop: float) -> float:
    return max(0.0, min(job.busy_until, stop) - start)
