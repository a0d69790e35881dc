"""Rehabilitating over recomputing: the cost model and the repair recipe.

When a failure loses state that no survivor holds (an FSDP/ZeRO shard, a pipeline stage with no
replica), two ways back exist:

* **recompute** — every worker rolls back to the last snapshot (step ``t_c``) and redoes the
  ``t_f - t_c`` lost steps.  Exact; costs ``(t_f - t_c) · t_step`` plus loading.
* **rehabilitate** — survivors keep their step-``t_f`` state; only the lost part is restored from
  the snapshot (optionally extrapolated along its recent trend), its optimizer moments are
  repaired (first moment reset, second kept, bias correction restarted) and its learning rate
  warmed up again; training then heals the gap.  Cost = the extra steps needed to close the loss
  gap, ``gap / |slope|``, with a safety factor for the uncertainty of that estimate.

The gap is measured when the runtime can afford one forward pass after restoring (``loss after
restore - loss before failure``); otherwise it is estimated as ``lost_fraction · (loss at
snapshot - loss now)``: reverting a fraction ``f`` of the parameters to ``t_c`` costs about that
fraction of the progress made since.  Rehabilitation is ruled out when the loss is not going down
(no slope to heal along), when the gap exceeds ``max_gap_fraction`` of the progress since the
snapshot, or when the lost fraction is above ``max_lost_fraction``: then recompute is the safe
choice.  This is our reading of the published method; its text is not public here.

Limits: the heal estimate is linear in the loss curve's recent slope; no guarantee that the
rehabilitated run reaches the same final loss — tests check it closes the gap on small models.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LossTrend:
    slope: float  # loss change per step, recent (negative when training improves)
    loss_now: float | None = None
    loss_at_snapshot: float | None = None
    measured_gap: float | None = None  # loss after restoring the stale part minus loss_now


@dataclass(frozen=True)
class RehabOutcome:
    recompute_steps: float
    rehab_steps: float | None  # None when rehabilitation is ruled out (with the safety factor)
    reason: str  # why rehab is ruled out, or how its cost was estimated
    heal_steps: float | None = None  # the point estimate: steps of progress the repair costs


def repair_steps(lost_fraction: float, momentum: float, warmup_steps: int = 0,
                 restart_bias_correction: bool = False) -> float:
    """Progress the optimizer repair of the restored part costs, in whole-model steps.

    The restored part's update in its ``k``-th step after the repair is ``warmup(k) x
    ramp(k)`` of a full one: ``warmup(k) = min(1, k / warmup_steps)`` (the learning-rate
    warm-up; 1 without), ``ramp(k) = 1 - momentum**k`` when the first moment was reset and its
    bias correction keeps counting from the run's start (1 when it restarts, or without
    momentum).  The shortfall, summed over the steps, times the lost fraction: e.g. a reset
    first moment alone costs ``momentum / (1 - momentum)`` of its steps, a restarted bias
    correction with a ``W``-step linear warm-up ``(W - 1) / 2``."""
    if not 0 <= lost_fraction <= 1:
        raise ValueError("lost fraction must be in [0, 1]")
    ramp = 0 < momentum < 1 and not restart_bias_correction
    w = max(0, int(warmup_steps))
    short, k = 0.0, 1
    while k <= 100_000:
        eff = min(1.0, k / w) if w else 1.0
        if ramp:
            eff *= 1.0 - momentum ** k
        if eff >= 1.0 - 1e-9 and k >= w:
            break
        short += 1.0 - eff
        k += 1
    return lost_fraction * short


@dataclass(frozen=True)
class RehabRecipe:
    """What the runtime does to a restored shard."""

    extrapolate_snapshots: int = 0  # use the last K snapshots' trend (0 = plain restore)
    damping: float = 0.5  # fraction of the extrapolated trend applied
    reset_first_moment: bool = True
    keep_second_moment: bool = True
    # Adam's first-moment bias correction counts from the repair for the restored part (its
    # updates are full-size at once), and a linear learning-rate warm-up of ``warmup_steps``
    # steps ramps them instead (0: none).  The runtime applies both to the restored elements'
    # update only (``ShardedExecutor``).
    restart_bias_correction: bool = True
    warmup_steps: int = 10


def rehab_cost(
    steps_since_snapshot: int,
    lost_fraction: float,
    trend: LossTrend | None,
    safety: float = 1.5,
    max_gap_fraction: float = 0.9,
    max_lost_fraction: float = 0.5,
    repair: float = 0.0,
    heal_scale: float = 1.0,
) -> RehabOutcome:
    """Steps that recompute and rehabilitate cost (multiply by the step time for seconds).

    ``repair``: steps the optimizer repair itself costs (``repair_steps``), added to both the
    point estimate (``heal_steps``) and the cost with the safety factor (``rehab_steps``).
    ``heal_scale``: measured / predicted heal steps of this job's earlier rehabilitations
    (``HealCheck``; 1 before any), which multiplies the gap model's estimate."""
    if steps_since_snapshot < 0 or not 0 <= lost_fraction <= 1:
        raise ValueError("steps since snapshot must be >= 0 and lost fraction in [0, 1]")
    recompute = float(steps_since_snapshot)
    if steps_since_snapshot == 0 or lost_fraction == 0:
        return RehabOutcome(recompute, 0.0, "the snapshot is current: nothing to heal", 0.0)
    if lost_fraction > max_lost_fraction:
        return RehabOutcome(recompute, None, f"{lost_fraction:.0%} of the model lost (limit {max_lost_fraction:.0%})")
    if trend is None or not np.isfinite(trend.slope) or trend.slope >= 0:
        return RehabOutcome(recompute, None, "the loss is not decreasing: no trend to heal along")
    progress = None
    if trend.loss_at_snapshot is not None and trend.loss_now is not None:
        progress = trend.loss_at_snapshot - trend.loss_now
    if trend.measured_gap is not None:
        gap, how = trend.measured_gap, "measured gap"
    elif progress is not None:
        gap, how = lost_fraction * max(progress, 0.0), "gap estimated from the lost fraction"
    else:
        gap, how = lost_fraction * steps_since_snapshot * -trend.slope, "gap estimated from the slope"
    if not np.isfinite(gap):
        return RehabOutcome(recompute, None, "the loss gap is not a finite number")
    if progress is not None and progress > 0 and gap > max_gap_fraction * progress:
        return RehabOutcome(recompute, None, f"gap {gap:.3g} is over {max_gap_fraction:.0%} of the progress since the snapshot")
    point = heal_scale * max(gap, 0.0) / -trend.slope
    extra = (f" x calibrated {heal_scale:.3g}" if heal_scale != 1.0 else "") + (f" + repair {repair:.3g}" if repair else "")
    return RehabOutcome(recompute, safety * point + repair,
                        f"{how}: {gap:.3g} / slope {trend.slope:.3g} x {safety}{extra}", point + repair)


@dataclass
class HealCheck:
    """Whether a rehabilitated run heals as predicted, measured on the job's own loss.

    The failure-free trend is the loss line fitted before the failure (``slope``, ``base`` =
    its value at ``start``, ``noise`` = the residuals' standard deviation); the gap at step
    ``s`` is the measured loss minus that line's value there.  ``observe`` every committed step:
    at ``start + ceil(predicted)`` (at least 1) it reports whether the gap is within the noise
    band (``2 x noise``, or 5 % of the gap at the repair, whichever is larger) -- *on track* --
    and it keeps watching until the gap closes (the measured heal steps) or ``4 x`` that long
    has passed (not healed).  ``ratio`` (measured / predicted steps; a lower bound when it did
    not heal) calibrates the next prediction (``rehab_cost(heal_scale=...)``).

    Limits: the failure-free trend is a straight line, which runs below a flattening loss curve
    over long horizons (the gap then looks larger than it is); one global loss per step."""

    start: int
    slope: float
    base: float
    noise: float
    predicted: float
    gap0: float | None = None
    check: dict | None = None
    closed_at: int | None = None
    done: bool = False

    @property
    def check_at(self) -> int:
        return self.start + max(1, int(np.ceil(self.predicted)))

    def tolerance(self) -> float:
        return max(2.0 * self.noise, 0.05 * abs(self.gap0 or 0.0), 1e-12)

    def observe(self, step: int, loss: float) -> list[dict]:
        """The records this step produces: ``{"kind": "check", ...}`` at the check step,
        ``{"kind": "end", ...}`` when the gap closed or the watch ran out."""
        if self.done or not np.isfinite(loss):
            return []
        gap = loss - (self.base + self.slope * (step - self.start))
        if self.gap0 is None:
            self.gap0 = gap
        out = []
        healed = gap <= self.tolerance()
        if healed and self.closed_at is None:
            self.closed_at = step
        if self.check is None and step >= self.check_at:
            self.check = {"kind": "check", "step": step, "predicted_heal_steps": self.predicted,
                          "gap_at_repair": self.gap0, "gap": gap, "tolerance": self.tolerance(),
                          "on_track": self.closed_at is not None}
            out.append(self.check)
        limit = self.start + 4 * max(1, int(np.ceil(self.predicted)))
        if self.check is not None and (self.closed_at is not None or step >= limit):
            self.done = True
            measured = None if self.closed_at is None else self.closed_at - self.start
            out.append({"kind": "end", "step": step, "predicted_heal_steps": self.predicted,
                        "measured_heal_steps": measured, "healed": measured is not None,
                        "gap": gap, "ratio": self.ratio()})
        return out

    def ratio(self) -> float:
        """Measured / predicted heal steps (a lower bound while not healed)."""
        steps = (self.closed_at if self.closed_at is not None else self.check_at) - self.start
        return max(steps, 1) / max(self.predicted, 1.0)
