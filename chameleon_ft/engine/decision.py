"""The selector's output and its scoring: a candidate response (:class:`Option`), the choice
among them (:class:`Decision`, serialised to JSON) and the score that ranks them.

Score = ``(B / t_step) · (D − t_transition) / D``: samples per second over the expected time to
the next failure ``D``, discounted by the time spent getting there (:func:`score`); an option
that goes through phases scores the samples of every phase within ``D``, divided by ``D``
(:func:`phased_score`).  :func:`crossover_mttf` is the ``D`` at which reroute and replan tie.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from chameleon_ft.engine.failures import Event
from chameleon_ft.engine.migration import MigrationPlan
from chameleon_ft.engine.plan import Plan


@dataclass
class Option:
    policy: str
    feasible: bool
    reason: str = ""
    step_time: float | None = None
    transition_s: float | None = None
    peak_memory: float | None = None
    global_batch: int | None = None
    lr_scale: float = 1.0
    score: float = 0.0
    plan: Plan | None = None
    dead: frozenset[int] = frozenset()
    extra: dict[int, float] = field(default_factory=dict)
    migration: MigrationPlan | None = None
    breakdown: dict[str, float] = field(default_factory=dict)
    # Piecewise throughput over the horizon: (from s, until s, step time, global batch) per
    # phase, nothing processed between phases.  None: one phase, from transition_s on.
    phases: tuple[tuple[float, float, float, int], ...] | None = None

    @property
    def throughput(self) -> float | None:
        if not self.feasible or not self.step_time or not self.global_batch:
            return None
        return self.global_batch / self.step_time

    def to_json(self, with_plan: bool) -> dict:
        out = {
            "policy": self.policy,
            "feasible": self.feasible,
            "reason": self.reason,
            "step_time_s": self.step_time,
            "transition_s": self.transition_s,
            "throughput": self.throughput,
            "peak_memory_bytes": self.peak_memory,
            "global_batch": self.global_batch,
            "lr_scale": self.lr_scale,
            "score": self.score,
        }
        if self.breakdown:
            out["breakdown"] = self.breakdown
        if self.phases:
            out["phases"] = [{"from_s": a, "until_s": None if math.isinf(b) else b, "step_time_s": t,
                              "global_batch": n} for a, b, t, n in self.phases]
        if self.plan is not None:
            out["plan"] = self.plan.to_json() if with_plan else self.plan.describe()
        if self.extra and with_plan:
            out["extra_microbatches"] = {str(k): v for k, v in sorted(self.extra.items())}
        if self.migration is not None:
            out["migration"] = self.migration.summary()
        return out


@dataclass
class Decision:
    event: Event
    mttf_s: float
    options: list[Option]
    chosen: str | None
    decide_s: float = 0.0
    search_s: float = 0.0  # measured: plan search and migration pricing within decide_s

    @property
    def choice(self) -> Option | None:
        return next((o for o in self.options if o.policy == self.chosen), None)

    def option(self, policy: str) -> Option:
        return next(o for o in self.options if o.policy == policy)

    def to_json(self, max_plan_devices: int = 64) -> dict:
        small = all(o.plan is None or len(o.plan.devices) <= max_plan_devices for o in self.options)
        return {
            "event": self.event.to_json(),
            "mttf_s": self.mttf_s,
            "chosen": self.chosen,
            "decide_s": self.decide_s,
            "search_s": self.search_s,
            "candidates": [o.to_json(with_plan=small) for o in self.options],
        }


def score(global_batch: int, step_time: float, transition_s: float, mttf_s: float) -> float:
    """Samples per second, discounted by the share of ``D`` spent in transition."""
    return phased_score(((transition_s, math.inf, step_time, global_batch),), mttf_s)


def phased_score(phases, mttf_s: float) -> float:
    """Samples processed within ``D`` divided by ``D``, for a run that goes through
    ``phases`` = (from s, until s, step time, global batch); with one phase from
    ``t_transition`` on this is ``(B / t_step) · (D − t_transition) / D``."""
    if mttf_s <= 0:
        return 0.0
    samples = 0.0
    for start, stop, step_time, batch in phases:
        if step_time <= 0:
            return 0.0
        samples += batch / step_time * max(0.0, min(stop, mttf_s) - start)
    return samples / mttf_s


def crossover_mttf(t_reroute: float, t_replan: float, trans_reroute: float, trans_replan: float) -> float:
    """``D`` at which reroute and replan score the same; with ``trans_reroute = 0`` this is
    ``trans_replan / (1 - t_replan / t_reroute)``."""
    inv = 1 / t_replan - 1 / t_reroute
    if inv <= 0:
        return float("inf")
    return (trans_replan / t_replan - trans_reroute / t_reroute) / inv
