"""Rehabilitating over recomputing: the cost model and the repair recipe.

When a failure loses state that no survivor holds (an FSDP/ZeRO shard, a pipeline stage with no
replica), two ways back exist:

* **recompute** — every worker rolls back to the last snapshot (step ``t_c``) and redoes the
  ``t_f - t_c`` lost steps.  Exact; costs ``(t_f - t_c) · t_step`` plus loading.
* **rehabilitate** — survivors keep their step-``t_f`` state; only the lost part is restored from
  the snapshot (optionally extrapolated along its recent trend), its optimizer moments are
  repaired (first moment reset, second kept, bias correction restarted) and its learning rate
  warmed up again; training then heals the gap.  Cost = the run's lag: the steps of progress it
  is behind once the restored part is back (``lost fraction x steps since the snapshot``, or a
  measured gap over the loss curve's slope), with a safety factor for its uncertainty.

Reverting a fraction ``f`` of the state to step ``t_c`` reverts about that fraction of the
progress made since, so the run lags ``f x (t_f - t_c)`` steps; a gap measured after restoring
(``loss after restore - loss before failure``, when a runtime can afford the forward pass) gives
``gap / |slope|`` instead.  Rehabilitation is ruled out when the lost fraction is above
``max_lost_fraction``, when the loss is not a finite number, and for a measured gap with no
decreasing loss or above ``max_gap_fraction`` of the progress since the snapshot: then
recompute is the safe choice.  The repair then adds what the restored part's smaller updates
lose, step by step, while training heals the lag at a rate (``lag_path``): measured, the gap
rises through the warm-up and then decays, so the estimate is the mean lag over a horizon of
steps after the repair, which is what is measured.  After a rehabilitation ``HealCheck``
measures the lag on the job's own loss and calibrates the next estimate (``heal_scale``).  This is our reading of the
published method; its text is not public here.

Limits: the lag estimate assumes the restored part's progress was like the rest's; no
guarantee that the rehabilitated run reaches the same final loss -- the sharded matrix
(``benchmarks/sharded_matrix.py``) measures it on three model kinds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class LossTrend:
    slope: float  # loss change per step, recent (negative when training improves)
    loss_now: float | None = None
    loss_at_snapshot: float | None = None
    measured_gap: float | None = None  # loss after restoring the stale part minus loss_now
    # The recent slope of log(loss) per step (``shard_recovery.progress_rate``): -0.05 is a loss
    # falling by ~5 % a step.  None when a loss is not positive or too few are known.
    log_slope: float | None = None


@dataclass(frozen=True)
class RehabOutcome:
    recompute_steps: float
    rehab_steps: float | None  # None when rehabilitation is ruled out (with the safety factor)
    reason: str  # why rehab is ruled out, or how its cost was estimated
    heal_steps: float | None = None  # the point estimate: steps of progress the repair costs
    path: tuple = ()  # with a horizon: the predicted lag after each step of it (``lag_path``)


# The lag's prior healing rate: the fraction of what remains of it that training closes per step
# (``lag_path``).  Measured on the issue-23 matrix of 2026-12-03, as the decay of the mean gap
# after the warm-up: the small LM and the CNN ~0.09 per step (17 -> 8.5 and 245 -> 120 x 1e-3
# log loss over 8 steps), the MLP faster.  ``HealCheck`` calibrates the job's next prediction.
HEAL_RATE = 0.1
# Steps after the repair over which the lag is predicted and then measured (its mean over them).
HEAL_HORIZON = 16
# Fast progress: where the loss falls by more than this fraction a step (the slope of its log),
# the lag is priced as not healing.  Measured on the same matrix: the CNN's early lag (its log
# loss falling 7-18 % a step) stayed level over the 16 steps -- the restored part follows the
# rest as a shift in time -- where the LM's and the MLP's (2-4 % a step) healed at 0.06-0.3 a
# step.  Read off seeds 0-4 (any threshold from 4 to 6 % a step puts every cell's prediction
# within +-50 %); checked on seeds 5-9 and on new seeds (``docs/benchmarks-sharded.md``).
FAST_PROGRESS = 0.05


def heal_rate_at(rate: float, log_slope: float | None) -> tuple[float, str]:
    """The healing rate to price a lag with, and why: ``rate`` unless the loss falls faster than
    ``FAST_PROGRESS`` a step (``log_slope`` below ``-FAST_PROGRESS``), where a lag does not heal
    (0)."""
    if log_slope is not None and math.isfinite(log_slope) and log_slope < -FAST_PROGRESS:
        return 0.0, (f"no healing priced: the loss falls {1 - math.exp(log_slope):.0%} a step "
                     f"-- over {FAST_PROGRESS:.0%}, where a lag stays behind as a shift in time")
    return rate, ""


def repair_shortfall(lost_fraction: float, momentum: float, warmup_steps: int = 0,
                     restart_bias_correction: bool = False) -> list[float]:
    """The progress each step after the repair loses to it, in whole-model steps:
    ``lost_fraction x (1 - warmup(k) x ramp(k))`` for the ``k``-th step, as long as it is not 0.
    ``warmup(k) = min(1, k / warmup_steps)`` (the learning-rate warm-up; 1 without),
    ``ramp(k) = 1 - momentum**k`` when the first moment was reset and its bias correction keeps
    counting from the run's start (1 when it restarts, or without momentum)."""
    if not 0 <= lost_fraction <= 1:
        raise ValueError("lost fraction must be in [0, 1]")
    ramp = 0 < momentum < 1 and not restart_bias_correction
    w = max(0, int(warmup_steps))
    out, k = [], 1
    while k <= 100_000:
        eff = min(1.0, k / w) if w else 1.0
        if ramp:
            eff *= 1.0 - momentum ** k
        if eff >= 1.0 - 1e-9 and k >= w:
            break
        out.append(lost_fraction * (1.0 - eff))
        k += 1
    return out


def repair_steps(lost_fraction: float, momentum: float, warmup_steps: int = 0,
                 restart_bias_correction: bool = False) -> float:
    """Progress the optimizer repair of the restored part costs in all, in whole-model steps
    (the sum of ``repair_shortfall``): e.g. a reset first moment alone costs ``momentum / (1 -
    momentum)`` of its steps, a restarted bias correction with a ``W``-step linear warm-up
    ``(W - 1) / 2``."""
    return float(sum(repair_shortfall(lost_fraction, momentum, warmup_steps, restart_bias_correction)))


def lag_path(initial: float, shortfall: Sequence[float], heal_rate: float, horizon: int) -> list[float]:
    """The lag (steps of progress behind the failure-free run) after each of the ``horizon``
    steps after a repair: it starts at ``initial`` (what the restore leaves), grows by each
    step's repair ``shortfall`` and shrinks by ``heal_rate`` of itself per step -- training
    moves the restored part, furthest from where it would be, fastest back (measured: the gap
    rises through the warm-up, then decays; ``HEAL_RATE``)."""
    if not 0 <= heal_rate < 1:
        raise ValueError("heal rate must be in [0, 1)")
    lag, out = float(initial), []
    for t in range(max(1, int(horizon))):
        lag = lag * (1.0 - heal_rate) + (shortfall[t] if t < len(shortfall) else 0.0)
        out.append(lag)
    return out


def lag_at(path: Sequence[float], steps: int, heal_rate: float, shortfall: Sequence[float] = (),
           scale: float = 1.0) -> float | None:
    """The lag ``steps`` steps after the repair: the predicted ``path``'s, or past its end the
    path continued as ``lag_path`` does (healed at ``heal_rate``, plus ``scale x`` each later
    step's ``shortfall``).  With ``steps`` = the steps left in the run: how far behind the
    failure-free run the run ends -- quality lost, not time (None without a path)."""
    if not path:
        return None
    n = max(1, int(steps))
    if n <= len(path):
        return float(path[n - 1])
    lag = float(path[-1])
    for t in range(len(path), n):
        lag = lag * (1.0 - heal_rate) + (scale * shortfall[t] if t < len(shortfall) else 0.0)
    return lag


@dataclass(frozen=True)
class RehabRecipe:
    """What the runtime does to a restored shard."""

    # The restored part is moved along the trend of its last two snapshots (damped; 0: a plain
    # restore).  The issue-23 sweep (2026-12-03, 5 seeds, kill 4 steps after a snapshot, 32
    # steps in): the small LM's lag 1.22 -> 0.86 steps, the CNN's final test loss over its
    # failure-free run's: median 1.076 -> 1.046, worst 1.166 -> 1.102 (``docs/runtime-sharded.md``).
    extrapolate_snapshots: int = 2
    damping: float = 0.5  # fraction of the extrapolated trend applied
    reset_first_moment: bool = True
    keep_second_moment: bool = True
    # Adam's first-moment bias correction counts from the repair for the restored part (its
    # updates are full-size at once), and a linear learning-rate warm-up of ``warmup_steps``
    # steps ramps them instead (0: none; on the same sweep none halved the LM's lag again but
    # left the CNN 1.5-2.2x its failure-free test loss in 2 of 5 seeds).  The runtime applies
    # both to the restored elements' update only (``ShardedExecutor``).
    restart_bias_correction: bool = True
    warmup_steps: int = 10


def rehab_cost(
    steps_since_snapshot: int,
    lost_fraction: float,
    trend: LossTrend | None,
    safety: float = 1.5,
    max_gap_fraction: float = 0.9,
    max_lost_fraction: float = 0.5,
    shortfall: Sequence[float] = (),
    heal_scale: float = 1.0,
    recovered: float = 0.0,
    heal_rate: float = 0.0,
    horizon: int | None = None,
) -> RehabOutcome:
    """Steps that recompute and rehabilitate cost (multiply by the step time for seconds).

    Rehabilitation's cost is its **lag**: the steps of progress the run is behind once the
    restored part is back, ``lost_fraction x steps_since_snapshot`` (reverting a fraction of
    the state by ``n`` steps reverts that fraction of their progress; the loss gap this opens is
    that many steps of the loss curve's slope), or, with a measured loss gap, ``gap / |slope|``.
    The lag does not depend on the slope, so a flat or noisy loss curve (a plateau: the gap is
    as small as the progress) prices it as well as a steep one.  ``shortfall``: the progress
    each step after the repair loses to it (``repair_shortfall``).  ``heal_scale``: measured /
    predicted lag of this job's earlier rehabilitations (``HealCheck``; 1 before any).
    ``recovered``: the fraction of the progress since the snapshot that the restore brings back
    by extrapolating the restored part along its last two snapshots (``RehabRecipe``'s damped
    trend: ``damping x min(1, gap between them / steps since the snapshot)``; 0 for a plain
    restore): the lag without a measured gap is ``(1 - recovered) x lost_fraction x steps``.

    With a ``horizon`` (steps) the point estimate is the **mean lag over the horizon's steps**
    after the repair, the quantity ``HealCheck`` and the sharded matrix measure: ``lag_path``
    from the lag above, grown by each step's ``shortfall`` and healed at ``heal_rate`` per step;
    the cost with the safety factor is ``safety x`` that mean.  Without one, the lag never heals:
    point = lag + the whole shortfall, which the safety factor does not multiply.

    Ruled out: more than ``max_lost_fraction`` of the model lost; a loss that is not a finite
    number; a measured gap with no decreasing loss to heal along, or over ``max_gap_fraction``
    of the progress since the snapshot."""
    if steps_since_snapshot < 0 or not 0 <= lost_fraction <= 1:
        raise ValueError("steps since snapshot must be >= 0 and lost fraction in [0, 1]")
    recompute = float(steps_since_snapshot)
    if steps_since_snapshot == 0 or lost_fraction == 0:
        return RehabOutcome(recompute, 0.0, "the snapshot is current: nothing to heal", 0.0)
    if lost_fraction > max_lost_fraction:
        return RehabOutcome(recompute, None, f"{lost_fraction:.0%} of the model lost (limit {max_lost_fraction:.0%})")
    if trend is not None and not all(np.isfinite(x) for x in (trend.slope, trend.loss_now or 0.0)):
        return RehabOutcome(recompute, None, "the loss is not a finite number")
    if trend is not None and trend.measured_gap is not None:
        progress = (None if trend.loss_at_snapshot is None or trend.loss_now is None
                    else trend.loss_at_snapshot - trend.loss_now)
        if trend.slope >= 0:
            return RehabOutcome(recompute, None, "a measured gap and the loss is not decreasing: no trend to heal along")
        if progress is not None and progress > 0 and trend.measured_gap > max_gap_fraction * progress:
            return RehabOutcome(recompute, None, f"gap {trend.measured_gap:.3g} is over {max_gap_fraction:.0%} of "
                                "the progress since the snapshot")
        lag, how = max(trend.measured_gap, 0.0) / -trend.slope, f"measured gap {trend.measured_gap:.3g} / slope {trend.slope:.3g}"
    else:
        kept = 1.0 - min(max(recovered, 0.0), 1.0)  # the share of the progress not brought back
        lag = kept * lost_fraction * steps_since_snapshot
        how = f"lost fraction {lost_fraction:.3g} x {steps_since_snapshot} steps since the snapshot"
        if kept < 1.0:
            how += f" x {kept:.3g} not recovered by the extrapolated restore"
        if trend is not None and trend.slope < 0:
            how += f" (a loss gap of ~{lag * -trend.slope:.3g})"
    cal = f" x calibrated {heal_scale:.3g}" if heal_scale != 1.0 else ""
    repair = float(sum(shortfall))
    if horizon is not None:
        path = [heal_scale * x for x in lag_path(lag, shortfall, heal_rate, horizon)]
        point = sum(path) / len(path)
        how += (f" + repair {repair:.3g}, healing {heal_rate:.3g} per step: mean {point:.3g} "
                f"over {len(path)} steps")
        return RehabOutcome(recompute, safety * point, f"lag {how}{cal}, x safety {safety}", point,
                            tuple(round(x, 4) for x in path))
    point = heal_scale * lag
    extra = cal + (f" + repair {repair:.3g}" if repair else "")
    return RehabOutcome(recompute, safety * point + repair, f"lag {how}{extra}, x safety {safety}", point + repair)


@dataclass
class HealCheck:
    """How far a rehabilitated run lags behind its failure-free trend, measured on the job's
    own loss, against what the engine predicted.

    The failure-free trend is the line fitted to the losses before the failure -- to their
    logarithm when every loss is positive (a loss curve that flattens is close to a straight
    line there), else to the losses -- with ``slope`` per step, ``base`` its value at the repair
    step ``start`` and ``noise`` the standard deviation of its residuals.  After the repair each
    committed step's residual (fitted value minus trend) is kept; the **lag** is their mean over
    the slope: the steps of progress the run is behind, the same quantity as the engine's
    ``predicted`` heal steps (the training time rehabilitation loses).  Its 95 % interval is
    ``lag +- 2 x sd / |slope|``, ``sd`` counting the watched losses' noise (``noise / sqrt(n)``),
    the fitted line's error where it is extrapolated to and, through the division, the slope's
    (``slope_se``, ``fit_n``, ``fit_center``; without them the noise alone): one step's loss is
    noisy and a slope near a plateau uncertain, so a small lag is told apart from zero only on a
    steep, quiet curve (``informative``).

    ``observe`` every committed step: after ``window`` steps a ``check`` record says whether
    the heal is **on track** (the lag's lower bound within ``1.5 x predicted + 1`` steps: the
    engine's safety factor and one step's resolution); ``window`` more steps later an ``end``
    record says the same over every step since the repair and gives ``ratio`` = measured /
    predicted (when informative), which calibrates the next prediction
    (``rehab_cost(heal_scale=...)``).  With the engine's predicted ``path`` (the lag after each
    step of its horizon) the window is half the horizon (3 to 6 steps), and the lag so far is
    held against the path's mean over the same steps; without one, the window is the predicted
    lag (3 to 6 steps).  Either record says
    ``fallback`` when the heal is not on track and rolling back to ``fallback_step`` (a
    snapshot the runtime still holds) now loses fewer steps than the lag already measured.

    Limits: a straight trend over at most 12 steps (longer, a flattening curve makes any lag
    look larger); one global loss per step; a lag smaller than the noise allows is reported as
    not informative, never as measured."""

    start: int
    slope: float
    base: float
    noise: float
    predicted: float
    log: bool = False
    fallback_step: int | None = None
    path: tuple = ()  # the predicted lag after each step of the horizon (``rehab_cost``)
    # The trend's fit: the slope's standard error, how many losses it was fitted to and their
    # mean step's offset from ``start`` (<= 0); with them the lag's interval counts the line's
    # own uncertainty, extrapolated over the steps watched (0: the noise alone, as before).
    slope_se: float = 0.0
    fit_n: int = 0
    fit_center: float = 0.0
    residuals: list = field(default_factory=list)
    check: dict | None = None
    done: bool = False

    @property
    def window(self) -> int:
        if self.path:  # at most 12 steps watched, as without: the trend is a straight line
            return int(min(6, max(3, len(self.path) // 2)))
        return int(min(6, max(3, np.ceil(self.predicted))))

    @property
    def check_at(self) -> int:
        return self.start + self.window

    def expected(self) -> float:
        """The predicted lag over the steps watched so far (the path's mean over them)."""
        n = len(self.residuals)
        if not self.path or not n:
            return self.predicted
        part = self.path[:n]
        return float(sum(part) / len(part))

    def bound(self) -> float:
        return 1.5 * self.expected() + 1.0

    def lag(self) -> tuple[float, float]:
        """(lag, half-width of its 95 % interval) in steps, over the residuals so far."""
        n = len(self.residuals)
        if not n or self.slope >= 0:
            return float("nan"), float("inf")
        mean = sum(self.residuals) / n
        lag = mean / -self.slope
        var = self.noise ** 2 / n  # the watched losses' own noise
        if self.fit_n:
            # plus the fitted line's error where it is extrapolated to (the watched steps' mean
            # offset), and the slope's error in the division: a slope barely below zero (near
            # a plateau) reads a small residual as many steps -- seen, "13.7 steps behind" on
            # the MLP's flattening curve, and a needless fall back to recompute.
            k = (n + 1) / 2.0
            var += self.noise ** 2 / self.fit_n + (self.slope_se * (k - self.fit_center)) ** 2
            var += (lag * self.slope_se) ** 2
        return float(lag), float(2.0 * math.sqrt(var) / -self.slope)

    def observe(self, step: int, loss: float) -> list[dict]:
        """The records this step produces: ``{"kind": "check", ...}`` at ``check_at``,
        ``{"kind": "end", ...}`` ``window`` steps later."""
        if self.done or step <= self.start or not np.isfinite(loss) or (self.log and loss <= 0):
            return []
        value = math.log(loss) if self.log else float(loss)
        self.residuals.append(value - (self.base + self.slope * (step - self.start)))
        out = []
        if self.check is None and step >= self.check_at:
            self.check = self._record("check", step)
            out.append(self.check)
        elif self.check is not None and step >= self.check_at + self.window:
            self.done = True
            out.append(self._record("end", step))
        return out

    def _record(self, kind: str, step: int) -> dict:
        lag, half = self.lag()
        expected = self.expected()
        on_track = bool(lag - half <= self.bound())
        informative = bool(half <= max(1.0, 0.5 * max(expected, abs(lag))))
        redo = None if self.fallback_step is None else step - self.fallback_step
        rec = {"kind": kind, "step": int(step), "steps_watched": len(self.residuals),
               "predicted_heal_steps": self.predicted, "expected_lag": expected, "lag": lag, "lag_interval": [lag - half, lag + half],
               "bound": self.bound(), "informative": informative, "on_track": on_track,
               "fallback": bool(not on_track and redo is not None and lag - half > redo),
               "fallback_step": self.fallback_step}
        if kind == "end":
            rec["healed"] = on_track
            rec["measured_heal_steps"] = lag if informative else None
            rec["ratio"] = self.ratio() if informative else None
        return rec

    def ratio(self) -> float:
        """Measured / predicted lag over the steps watched (both at least one step: below that
        the two agree)."""
        lag, _ = self.lag()
        return max(lag, 1.0) / max(self.expected(), 1.0)
