"""Sharded state after a failure: heal from a replica, recompute, rehabilitate, or restart.

When a worker of a sharded job (FSDP / HSDP) dies, the rows of the flat parameter and optimizer
state it held may have no current copy among the survivors.  Four ways back, each priced as the
*training time it loses* (seconds) so the cheapest is chosen:

* **heal** -- every lost row still has a current copy in another replica group (HSDP): copy it.
  Exact; loses only the copy (``transfer_s``).
* **recompute** -- everyone rolls back to the latest step ``t_c`` at which every row has a
  surviving snapshot (their own for the survivors' rows, the buddy's copy for the lost ones) and
  redoes the ``t_f - t_c`` steps.  Exact; loses ``transfer_s + (t_f - t_c) * step_s``.
* **rehabilitate** -- the survivors keep their step-``t_f`` rows; only the lost rows come back
  from their last (stale) snapshot, repaired (``rehab.RehabRecipe``); training heals the gap.
  Loses ``transfer_s + rehab_steps * step_s`` with ``rehab_steps`` from ``rehab.rehab_cost``
  (the live loss trend, plus what the optimizer repair costs step by step:
  ``rehab.repair_shortfall``, healed at ``heal_rate`` per step); ruled out where that function
  rules it out.  ``predicted_heal_steps`` is the point estimate (no safety factor): the steps
  of progress the rehabilitated run is expected to lag behind, on average over the
  ``heal_horizon`` steps after the repair (``heal_path``: after each of them).
* **restart** -- the launcher restarts the job from the last disk checkpoint (the fallback):
  ``restart_s + (t_f - t_ckpt) * step_s``.

``snapshot_interval`` is Young/Daly's optimum for how often to take the snapshots that make
recompute and rehabilitation possible, from their measured cost and the failure rate, bounded
by the run (at least ``SNAPSHOTS_PER_RUN`` snapshots over it): with a realistic failure rate
Young/Daly's interval for a short job is longer than the job, which left rehabilitation only
the initial state to restore from (issue 23).

Rehabilitation is ruled out, and the Decision says why, when the lost rows' snapshot is the
initial state (step 0: restoring it restarts a part of the model from scratch, which the gap
model does not describe) and when its own estimate of the steps to heal (with the safety
factor) exceeds the steps left in the run (``remaining_steps``), or, where recompute is
possible, when the lag it predicts for the run's last step is over ``HEALED_LAG`` (half a
step): a gap that cannot close before the end is lost quality, not lost time (issue 23's
matrix: the LM's late kills ended +0.2 % on their final test loss, as that lag predicts).

Pure logic: the runtime (``runtime/executors/sharded/``) gathers the facts and carries the choice out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from chameleon_ft.engine.rehab import (HEAL_HORIZON, HEAL_RATE, HealCheck, LossTrend, heal_rate_at, lag_at,
                                       rehab_cost, repair_shortfall)

__all__ = ["PATHS", "SNAPSHOTS_PER_RUN", "HEALED_LAG", "ShardFacts", "ShardDecision", "choose_recovery", "describe", "common_snapshot", "stale_snapshot",
           "snapshot_interval", "loss_trend", "progress_rate", "heal_check"]

PATHS = ("heal", "recompute", "rehabilitate", "restart")
SNAPSHOTS_PER_RUN = 8  # the interval is at most a run's steps / this
# A lag the run still has at its end is never made up: where recompute can redo the steps
# instead, rehabilitation is ruled out if its predicted lag at the run's last step exceeds half
# a step (below a step's resolution).  Without recompute (Lightning's adapter: it would roll the
# loop back) the lag is said, and priced against restart as time.
HEALED_LAG = 0.5
NOT_HEALED_BY_THE_END = "does not heal by the run's end"  # in the reason when that rules it out


@dataclass(frozen=True)
class ShardFacts:
    """What the survivors know at a failure (every figure in seconds or steps).

    ``rows``: shard rows of the old layout; ``current``: rows some survivor holds at step
    ``step`` (its own, or a replica's); ``snapshots``: row -> the steps at which a survivor holds
    a snapshot of it (own for the survivors' rows, the buddy's copy for the others)."""

    step: int
    rows: int
    current: frozenset
    snapshots: dict
    step_s: float
    transfer_s: float = 0.0
    lost_fraction: float = 0.0
    trend: Optional[LossTrend] = None
    checkpoint_step: Optional[int] = None
    restart_s: float = 60.0
    allowed: frozenset = frozenset(PATHS)
    momentum: float = 0.0  # the optimizer's first-moment decay (Adam's beta1, SGD momentum) when reset
    warmup_steps: int = 0  # the restored part's learning-rate warm-up (rehab.RehabRecipe)
    restart_bias_correction: bool = False  # the restored part's first-moment bias correction restarts
    remaining_steps: Optional[int] = None  # steps left in the run (None: unknown, no bound)
    heal_scale: float = 1.0  # measured / predicted heal steps of this job's earlier rehabilitations
    # The fraction of the progress since the snapshot the restore recovers by extrapolating the
    # lost rows along their last two snapshots (``rehab.rehab_cost(recovered=...)``; 0: plain).
    recovered: float = 0.0
    heal_rate: float = HEAL_RATE  # the lag's healing rate per step (``rehab.lag_path``)
    heal_horizon: int = HEAL_HORIZON  # steps the lag is predicted over, then measured (at most the run's)

    @property
    def lost(self) -> tuple[int, ...]:
        return tuple(k for k in range(self.rows) if k not in self.current)


@dataclass
class ShardDecision:
    chosen: str
    candidates: dict = field(default_factory=dict)  # path -> {feasible, lost_s, steps, reason}
    rollback_to: Optional[int] = None  # recompute: the step everyone returns to
    snapshot_step: Optional[int] = None  # rehabilitate: the lost rows' snapshot step
    predicted_heal_steps: Optional[float] = None  # rehabilitate: the mean lag over the horizon, in steps
    lost_rows: tuple = ()
    heal_path: tuple = ()  # rehabilitate: the predicted lag after each step of the horizon
    end_lag: Optional[float] = None  # rehabilitate: the predicted lag when the run ends (steps behind)

    def to_json(self) -> dict:
        return {"chosen": self.chosen, "candidates": self.candidates, "rollback_to": self.rollback_to,
                "snapshot_step": self.snapshot_step, "predicted_heal_steps": self.predicted_heal_steps,
                "heal_horizon": len(self.heal_path) or None, "heal_path": list(self.heal_path),
                "end_lag": self.end_lag, "lost_rows": list(self.lost_rows)}


def common_snapshot(rows: int, snapshots: dict, not_after: int) -> Optional[int]:
    """The latest step (at most ``not_after``) at which every row has a snapshot, or None."""
    common = None
    for k in range(rows):
        steps = {s for s in snapshots.get(k, ()) if s <= not_after}
        common = steps if common is None else common & steps
        if not common:
            return None
    return max(common) if common else None


def stale_snapshot(lost: Sequence[int], snapshots: dict, not_after: int) -> Optional[int]:
    """The step rehabilitation restores the ``lost`` rows from: the oldest of their latest
    snapshots (at most ``not_after``); None when a lost row has none (or nothing is lost)."""
    have = [max((s for s in snapshots.get(k, ()) if s <= not_after), default=None) for k in lost]
    return None if not have or any(s is None for s in have) else min(have)


def choose_recovery(f: ShardFacts) -> ShardDecision:
    """Price every path on ``f`` and choose the one that loses the least training time
    (heal, then recompute, win ties: they are exact)."""
    lost = f.lost
    cands: dict[str, dict] = {}

    def put(path: str, lost_s: Optional[float], reason: str, steps: Optional[float] = None) -> None:
        ok = lost_s is not None and path in f.allowed
        if lost_s is not None and path not in f.allowed:
            reason = f"not allowed by the configuration ({reason})"
        cands[path] = {"feasible": ok, "lost_s": lost_s, "steps": steps, "reason": reason}

    if not lost:
        put("heal", f.transfer_s, "every lost row has a current replica", 0.0)
        if not cands["heal"]["feasible"]:
            # Nothing was lost (a failed collective, a commit one member missed): every row goes
            # on from its live holder -- nothing to carry out that a configuration could refuse.
            cands["heal"] = {"feasible": True, "lost_s": f.transfer_s, "steps": 0.0,
                             "reason": "nothing was lost: every row goes on from its live holder"}
    else:
        put("heal", None, f"rows {list(lost)} have no surviving current copy")
    t_c = common_snapshot(f.rows, f.snapshots, f.step)
    if t_c is None:
        put("recompute", None, "no step at which every row has a surviving snapshot")
    else:
        redo = f.step - t_c
        put("recompute", f.transfer_s + redo * f.step_s, f"roll back to step {t_c}, redo {redo} steps", redo)
    snap = stale_snapshot(lost, f.snapshots, f.step)
    heal_steps, heal_path, end_lag = None, (), None
    if not lost:
        put("rehabilitate", None, "nothing was lost")
    elif snap is None:
        put("rehabilitate", None, "a lost row has no snapshot")
    elif snap == 0:
        put("rehabilitate", None, "the lost rows' snapshot is the initial state (step 0): restoring "
            "it restarts them from scratch")
    else:
        horizon = f.heal_horizon if f.remaining_steps is None else min(f.heal_horizon, max(1, f.remaining_steps))
        rate, why_rate = heal_rate_at(f.heal_rate, f.trend.log_slope if f.trend is not None else None)
        shortfall = repair_shortfall(f.lost_fraction, f.momentum, f.warmup_steps, f.restart_bias_correction)
        out = rehab_cost(f.step - snap, f.lost_fraction, f.trend, shortfall=shortfall, heal_scale=f.heal_scale,
                         recovered=f.recovered, heal_rate=rate, horizon=horizon)
        if why_rate and out.rehab_steps is not None:
            out = replace(out, reason=f"{out.reason}; {why_rate}")
        if f.remaining_steps is not None and out.rehab_steps is not None and out.path:
            # The quality it costs: how far behind the run ends (a lag that has not healed by
            # then is never made up: issue 23's matrix, the LM's late kills).
            end_lag = lag_at(out.path, f.remaining_steps, rate, shortfall, f.heal_scale)
            out = replace(out, reason=f"{out.reason}; the run ends {end_lag:.2g} steps of progress behind "
                          f"({f.remaining_steps} steps after the repair)")
        if (out.rehab_steps is not None and end_lag is not None and end_lag > HEALED_LAG
                and cands["recompute"]["feasible"]):  # an exact way back exists: take it
            put("rehabilitate", None, f"restoring rows {list(lost)} from step {snap} leaves a lag that "
                f"{NOT_HEALED_BY_THE_END}: over {HEALED_LAG} steps, quality lost rather than time ({out.reason})")
            end_lag = None
        elif out.rehab_steps is None:
            put("rehabilitate", None, out.reason)
        elif f.remaining_steps is not None and out.rehab_steps > f.remaining_steps:
            put("rehabilitate", None, f"restoring rows {list(lost)} from step {snap} heals in "
                f"{out.rehab_steps:.3g} steps (with the safety factor), more than the "
                f"{f.remaining_steps} left in the run ({out.reason})")
        else:
            heal_steps, heal_path = out.heal_steps, out.path
            put("rehabilitate", f.transfer_s + out.rehab_steps * f.step_s,
                f"restore rows {list(lost)} from step {snap}; {out.reason}", out.rehab_steps)
    if f.checkpoint_step is None:
        put("restart", None, "no disk checkpoint")
    else:
        redo = f.step - f.checkpoint_step
        put("restart", f.restart_s + redo * f.step_s, f"restart from the checkpoint of step "
            f"{f.checkpoint_step}, redo {redo} steps", redo)
    order = {p: i for i, p in enumerate(PATHS)}
    feasible = sorted((c["lost_s"], order[p], p) for p, c in cands.items() if c["feasible"])
    chosen = feasible[0][2] if feasible else "restart"
    return ShardDecision(chosen, cands, rollback_to=t_c if chosen == "recompute" else None,
                         snapshot_step=snap if chosen == "rehabilitate" else None,
                         predicted_heal_steps=heal_steps if chosen == "rehabilitate" else None,
                         lost_rows=lost, heal_path=heal_path if chosen == "rehabilitate" else (),
                         end_lag=end_lag if chosen == "rehabilitate" else None)


def describe(d: dict) -> str:
    """One console line for a ``ShardDecision.to_json()``: what was lost, what was chosen and
    why, and why each other path was not taken (a user must see that part of the model was
    restored from an older step)."""
    c, ch, lost = d["candidates"], d["chosen"], list(d.get("lost_rows") or [])
    out = f"{'shard rows ' + str(lost) + ' lost' if lost else 'no shard row lost'}: {ch}"
    if ch in c:
        out += f" ({c[ch]['reason']})"
    if ch == "rehabilitate":
        heal = d.get("predicted_heal_steps")
        out += f"; those rows restart from step {d.get('snapshot_step')}"
        if heal is not None and d.get("heal_horizon"):
            out += f", predicted to lag {heal:.1f} steps behind on average over the next {d['heal_horizon']}"
        elif heal is not None:
            out += f", predicted to catch up in {heal:.1f} steps"
    off = [f"{p}: {x['reason']}" for p, x in c.items() if p != ch and not x["feasible"]]
    return out + (f"; not taken: {'; '.join(off)}" if off else "")


def snapshot_interval(cost_s: float, mttf_s: float, step_s: float, lo: int = 1, hi: int = 200,
                      run_steps: Optional[int] = None) -> int:
    """Steps between snapshots: Daly's higher-order refinement of Young's optimum
    ``sqrt(2 C M)`` for a snapshot costing ``cost_s`` and a mean time to failure ``mttf_s``,
    in steps of ``step_s``; clamped to [lo, hi], and to ``run_steps // SNAPSHOTS_PER_RUN``
    when the run's length is known."""
    if run_steps:
        hi = max(lo, min(hi, run_steps // SNAPSHOTS_PER_RUN))
    if step_s <= 0 or not math.isfinite(step_s):
        return lo
    c, m = max(cost_s, 0.0), max(mttf_s, 1e-9)
    if c <= 0:
        return lo
    if c < 2 * m:
        tau = math.sqrt(2 * c * m) * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c
    else:
        tau = m
    return int(min(hi, max(lo, round(tau / step_s))))


HEAL_WINDOW = 16  # losses before a rehabilitation that its heal check fits the trend to


def heal_points(history: Sequence[tuple[int, float]], start: int, window: int = HEAL_WINDOW) -> list[tuple[int, float]]:
    """The losses ``heal_check`` fits its trend to: the last ``window`` finite ones up to ``start``
    (what a recovery ships to every member, so that all watch the heal on the same trend)."""
    return [(s, v) for s, v in history if s <= start and math.isfinite(v)][-window:]


def heal_check(history: Sequence[tuple[int, float]], start: int, predicted: float,
               window: int = HEAL_WINDOW, fallback_step: Optional[int] = None, path: Sequence[float] = ()) -> Optional[HealCheck]:
    """The ``HealCheck`` of a rehabilitation at ``start``: the failure-free trend is the line
    fitted to the last ``window`` losses before it (to their logarithm when all are positive);
    ``fallback_step``: the snapshot step a recompute could still roll back to; ``path``: the
    decision's predicted lag per step (``ShardDecision.heal_path``).  None without a decreasing
    trend: on a plateau (the slope not below zero by two standard errors) steps of progress are
    not defined -- a residual over a slope of ~0 would read as a lag of tens of steps (a heal on
    the MLP's plateau "19 steps behind", and a needless fall back to recompute)."""
    pts = heal_points(history, start, window)
    log = bool(pts) and all(v > 0 for _, v in pts)
    fit = [(s, math.log(v) if log else v) for s, v in pts]
    slope = _slope(fit) if len(fit) >= 3 else None
    if slope is None or slope >= 0:
        return None
    mean_s, mean_v = sum(s for s, _ in fit) / len(fit), sum(v for _, v in fit) / len(fit)
    resid = [v - (mean_v + slope * (s - mean_s)) for s, v in fit]
    noise = math.sqrt(sum(r * r for r in resid) / max(1, len(resid) - 2))
    se = noise / math.sqrt(sum((s - mean_s) ** 2 for s, _ in fit))  # the slope's standard error
    if slope + 2 * se >= 0:
        return None
    return HealCheck(start=start, slope=slope, base=mean_v + slope * (start - mean_s),
                     noise=noise, predicted=float(predicted), log=log, fallback_step=fallback_step,
                     path=tuple(float(x) for x in path), slope_se=se, fit_n=len(fit), fit_center=mean_s - start)


def loss_trend(history: Sequence[tuple[int, float]], window: int = 20, at_snapshot: Optional[int] = None) -> Optional[LossTrend]:
    """The recent slope of the loss (least squares over the last ``window`` committed steps),
    the loss now, and the loss at step ``at_snapshot`` (when recorded)."""
    pts = [(s, v) for s, v in history if math.isfinite(v)][-window:]
    if len(pts) < 3:
        return None
    slope = _slope(pts)
    if slope is None:
        return None
    ms, mv = sum(s for s, _ in pts) / len(pts), sum(v for _, v in pts) / len(pts)
    # The fitted value at the last step: one step's loss is noisy.
    now = mv + slope * (pts[-1][0] - ms)
    snap = None
    if at_snapshot is not None:
        near = [v for s, v in history if abs(s - at_snapshot) <= 1]
        snap = sum(near) / len(near) if near else None
    return LossTrend(slope=slope, loss_now=now, loss_at_snapshot=snap, log_slope=progress_rate(history))


def progress_rate(history: Sequence[tuple[int, float]], window: int = 8) -> Optional[float]:
    """The least-squares slope of log(loss) per step over the last ``window`` committed steps
    (-0.05: the loss falls ~5 % a step); None unless at least 3 are known and every one is a
    positive finite number."""
    pts = [(s, v) for s, v in history if math.isfinite(v)][-window:]
    if len(pts) < 3 or any(v <= 0 for _, v in pts):
        return None
    return _slope([(s, math.log(v)) for s, v in pts])


def _slope(pts: Sequence[tuple[int, float]]) -> Optional[float]:
    """The least-squares slope of ``(step, value)`` points; None when their steps do not vary."""
    ms = sum(s for s, _ in pts) / len(pts)
    mv = sum(v for _, v in pts) / len(pts)
    var = sum((s - ms) ** 2 for s, _ in pts)
    return sum((s - ms) * (v - mv) for s, v in pts) / var if var else None
