"""The reroute/replan crossover measured on live runs, and the engine's predictions checked
against what the runs measured.  Pure functions over the pipeline benchmark's results (commit
stamps, event logs) plus the plots; ``pipeline_bench.py`` runs the jobs.

* **Goodput after a failure** (``goodput_curve``): for an expected time to the next failure
  ``D``, the samples a run committed in ``(t_decision, t_decision + D]`` divided by ``D``: what
  the engine's score ``(B / t_step) · (D − t_transition) / D`` stands for, measured.  Both fixed
  runs (always reroute, always re-plan) see the same kill at the same step, so their curves
  over a grid of ``D`` cross where re-planning starts to pay: the **measured D\\***
  (``crossover_point``).  The **predicted D\\*** is the engine's, from the candidates it priced at
  the decision (``selector.crossover_mttf``), and the predicted curves come from the same
  figures (``predicted_curve``).
* **Estimator accuracy** (``accuracy``): every ``prediction`` event a run logged (the chosen
  candidate's predicted step and transition seconds beside the measured ones, see
  ``chameleon_ft/runtime/predictions.py``) -> relative errors, their median and maximum.

Limits: a run is one sample of a noisy shared machine; the measured curves use commit stamps of
worker 0 (its clock), the decision time of the event log (the deciding member's wall clock,
the same machine).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Optional, Sequence

from chameleon_ft.engine.decision import crossover_mttf


def decision_of(events: list[dict]) -> Optional[dict]:
    """The first failure Decision of a run's event log (with its wall time as ``ts``)."""
    for e in events:
        if e["event"] == "decision" and e["decision"]["event"]["kind"] != "straggler":
            return {**e["decision"], "ts": e["ts"]}
    return None


def goodput_curve(stamps: Sequence, t0: float, batch: int, ds: Sequence[float]) -> list[Optional[float]]:
    """Samples per second committed in ``(t0, t0 + D]`` for each ``D`` (None past the run's end)."""
    times = sorted(t for _, t in stamps)
    end = times[-1] if times else t0
    out = []
    for d in ds:
        if t0 + d > end:
            out.append(None)
            continue
        out.append(batch * sum(1 for t in times if t0 < t <= t0 + d) / d)
    return out


def predicted_curve(step_s: float, transition_s: float, batch: int, ds: Sequence[float]) -> list[float]:
    """The engine's score of a candidate over ``ds``: ``(B / t_step) · max(0, D − t_trans) / D``."""
    return [batch / step_s * max(0.0, d - transition_s) / d for d in ds]


def crossover_point(ds: Sequence[float], reroute: Sequence[Optional[float]],
                    replan: Sequence[Optional[float]]) -> Optional[float]:
    """The ``D`` from which re-planning's goodput stays at or above rerouting's (linear
    interpolation between grid points); None when it never does, or does from the first."""
    pts = [(d, b - a) for d, a, b in zip(ds, reroute, replan) if a is not None and b is not None]
    if not pts or pts[-1][1] < 0:
        return None
    last_neg = max((i for i, (_, diff) in enumerate(pts) if diff < 0), default=None)
    if last_neg is None:
        return None
    (d0, y0), (d1, y1) = pts[last_neg], pts[last_neg + 1]
    return d0 + (d1 - d0) * (-y0) / (y1 - y0) if y1 != y0 else d1


def predicted_crossover(decision: dict) -> Optional[float]:
    cand = {c["policy"]: c for c in decision.get("candidates", [])}
    rr, rp = cand.get("reroute"), cand.get("replan")
    if not (rr and rp and rr["feasible"] and rp["feasible"]):
        return None
    return crossover_mttf(rr["step_time_s"], rp["step_time_s"], rr["transition_s"], rp["transition_s"])


def analyse(runs: dict[str, dict], batch: int, ds: Sequence[float]) -> dict:
    """``runs``: 'reroute' and 'replan' -> {"stamps", "events"} of the two fixed-policy kill
    runs.  The measured and predicted goodput curves and crossovers."""
    out: dict = {"D": list(ds)}
    for name in ("reroute", "replan"):
        r = runs[name]
        d = decision_of(r["events"])
        if d is None:
            raise ValueError(f"the {name} run logged no failure decision")
        c = next(c for c in d["candidates"] if c["policy"] == name)
        out[name] = {"measured": goodput_curve(r["stamps"], d["ts"], batch, ds),
                     "predicted": predicted_curve(c["step_time_s"], c["transition_s"], batch, ds),
                     "predicted_step_s": c["step_time_s"], "predicted_transition_s": c["transition_s"],
                     "d_star_predicted": predicted_crossover(d)}
    out["d_star_measured"] = crossover_point(ds, out["reroute"]["measured"], out["replan"]["measured"])
    # The engine's D* from what each fixed run's decision priced for the policy it carried out
    # (the other one is not allowed there); a decision that priced both gives its own.
    rr, rp = out["reroute"], out["replan"]
    both = [out[n]["d_star_predicted"] for n in ("reroute", "replan") if out[n]["d_star_predicted"]]
    out["d_star_predicted"] = (statistics.median(both) if both else
                               crossover_mttf(rr["predicted_step_s"], rp["predicted_step_s"],
                                              rr["predicted_transition_s"], rp["predicted_transition_s"]))
    return out


def accuracy(records: Sequence[dict]) -> dict:
    """Relative errors of the predicted step and transition seconds (|predicted / measured - 1|)."""
    steps = [abs(r["step_error"]) for r in records if r.get("step_error") is not None]
    trans = [abs(r["transition_error"]) for r in records if r.get("transition_error") is not None]

    def summary(xs):
        return {"n": len(xs), "median": statistics.median(xs) if xs else None, "max": max(xs) if xs else None}
    return {"step": summary(steps), "transition": summary(trans)}


def ordering_agrees(curves: dict, mttf: float) -> Optional[bool]:
    """At ``D = mttf``: whether the measured goodput puts the policy the engine predicts best
    first (None when a run did not last ``mttf`` after its decision, or the two tie)."""
    rr_c = curves["reroute"]
    rp_c = curves["replan"]
    m_rr = goodput_curve_at(curves, "reroute", mttf)
    m_rp = goodput_curve_at(curves, "replan", mttf)
    if m_rr is None or m_rp is None:
        return None
    p_rr = predicted_curve(rr_c["predicted_step_s"], rr_c["predicted_transition_s"], 1, [mttf])[0]
    p_rp = predicted_curve(rp_c["predicted_step_s"], rp_c["predicted_transition_s"], 1, [mttf])[0]
    if m_rr == m_rp:
        return None  # a tie (e.g. neither committed a step within D): no ordering to agree with
    return (m_rp > m_rr) == (p_rp > p_rr)


def goodput_curve_at(curves: dict, name: str, d: float) -> Optional[float]:
    """The measured goodput at ``d`` from the stored grid (linear interpolation)."""
    ds, ys = curves["D"], curves[name]["measured"]
    pts = [(x, y) for x, y in zip(ds, ys) if y is not None]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= d <= x1:
            return y0 + (y1 - y0) * (d - x0) / (x1 - x0)
    return None


def goodput_over(stamps: Sequence, events: list[dict], batch: int, d: float) -> Optional[float]:
    """A run's goodput over ``d`` seconds after its first failure Decision (None: no decision,
    or the run ended sooner)."""
    dec = decision_of(events)
    return None if dec is None else goodput_curve(stamps, dec["ts"], batch, [d])[0]


def plan_summary(decision: Optional[dict]) -> Optional[dict]:
    """The chosen candidate of a Decision: policy, plan (devices per pipeline), predicted step
    and transition seconds."""
    if not decision:
        return None
    c = next((c for c in decision.get("candidates", []) if c["policy"] == decision.get("chosen")), None)
    if c is None:
        return {"policy": decision.get("chosen")}
    plan = c.get("plan") or {}
    return {"policy": c["policy"], "pipelines": [p["devices"] for p in plan.get("pipelines", [])],
            "step_s": c.get("step_time_s"),
            "transition_s": c.get("transition_s"), "score": c.get("score")}


def log_grid(lo: float, hi: float, n: int) -> list[float]:
    return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]


# ---------------------------------------------------------------- plots
def plot_crossover(curves: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ds = curves["D"]
    for name, colour in (("reroute", "tab:blue"), ("replan", "tab:orange")):
        ys = curves[name]["measured"]
        pts = [(d, y) for d, y in zip(ds, ys) if y is not None]
        ax.plot([d for d, _ in pts], [y for _, y in pts], "o-", color=colour, ms=3, label=f"{name}: measured")
        ax.plot(ds, curves[name]["predicted"], "--", color=colour, label=f"{name}: predicted")
    for key, style, label in (("d_star_measured", "-", "measured D*"), ("d_star_predicted", ":", "predicted D*")):
        v = curves.get(key)
        if v and math.isfinite(v):
            ax.axvline(v, color="k", ls=style, lw=1, label=f"{label} = {v:.2f} s")
    ax.set_xscale("log")
    ax.set_xlabel("D: expected time to the next failure (s), from the decision")
    ax.set_ylabel("goodput over D (samples/s)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_accuracy(records: Sequence[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for ax, (p, m, label) in zip(axes, (("predicted_step_s", "measured_step_s", "step (s)"),
                                        ("predicted_transition_s", "measured_transition_s", "transition (s)"))):
        pts = [(r[m], r[p], r["chosen"]) for r in records if r.get(p) and r.get(m)]
        for pol, marker in (("reroute", "o"), ("replan", "s")):
            sel = [(x, y) for x, y, c in pts if c == pol]
            ax.scatter([x for x, _ in sel], [y for _, y in sel], marker=marker, label=pol)
        other = [(x, y) for x, y, c in pts if c not in ("reroute", "replan")]
        if other:
            ax.scatter([x for x, _ in other], [y for _, y in other], marker="^", label="other")
        if pts:
            hi = max(max(x, y) for x, y, _ in pts) * 1.1
            ax.plot([0, hi], [0, hi], "k-", lw=0.8)
            ax.fill_between([0, hi], [0, hi * 0.95], [0, hi * 1.05], color="0.85", label="±5 %")
        ax.set_xlabel(f"measured {label}")
        ax.set_ylabel(f"predicted {label}")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- report
def markdown(curves: Optional[dict], adaptive: Sequence[dict], records: Sequence[dict], mode: str,
             img: str = "pipeline") -> list[str]:
    lines: list[str] = []
    if curves:
        fmt = lambda x: "-" if x is None else f"{x:.2f} s"  # noqa: E731
        lines += [f"## The reroute/replan crossover on live runs ({mode})", "",
                  "Goodput over `D` seconds after the decision (samples committed / `D`) of the always-reroute "
                  "and always-re-plan runs above (same job, same kill), against the engine's predicted curves "
                  "`(B / t_step) · (D − t_transition) / D` from the candidates it priced at the decision.", "",
                  f"* measured D\\* = **{fmt(curves.get('d_star_measured'))}**, predicted D\\* = "
                  f"**{fmt(curves.get('d_star_predicted'))}**",
                  f"* predicted step / transition: reroute {curves['reroute']['predicted_step_s'] * 1e3:.0f} ms / "
                  f"{curves['reroute']['predicted_transition_s'] * 1e3:.0f} ms, replan "
                  f"{curves['replan']['predicted_step_s'] * 1e3:.0f} ms / {curves['replan']['predicted_transition_s'] * 1e3:.0f} ms",
                  "", f"![crossover](img/{img}-crossover.png)", ""]
    if adaptive:
        lines += ["Adaptive runs of the same job and kill with `D` fixed (`chameleon-ft run --mttf D`): the engine's "
                  "choice, and whether the measured goodput over `D` of the fixed runs orders the two policies "
                  "as the engine predicted.", "",
                  "| D | chosen | predicted D* at the decision | measured goodput over D: reroute / replan | ordering agrees |",
                  "| ---: | --- | ---: | ---: | --- |"]
        for a in adaptive:
            g = a.get("goodput") or {}
            gr, gp = g.get("reroute"), g.get("replan")
            lines.append(f"| {a['mttf']:.3g} s | {a['chosen']} | {a['d_star'] if a['d_star'] is None else round(a['d_star'], 2)} s | "
                         f"{'-' if gr is None else f'{gr:.1f}'} / {'-' if gp is None else f'{gp:.1f}'} | "
                         f"{a.get('agrees')} |")
        lines.append("")
        fixed = [a for a in adaptive if "reroute" in (a.get("at_d") or {})]
        if fixed:
            fmt = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
            lines += ["The same kill with every system given the same `D` (each fixed policy's own plan search "
                      "then prices a re-plan's migration over that `D` too): goodput over `D` after the decision "
                      "(samples/s), and the plan each chose.", "",
                      "| D | adaptive | always-reroute | always-replan | adaptive / better fixed | adaptive's choice | always-replan's choice |",
                      "| ---: | ---: | ---: | ---: | ---: | --- | --- |"]
            for a in fixed:
                g = a["at_d"]
                best = max((g[n] for n in ("reroute", "replan") if g.get(n) is not None), default=None)
                ratio = "-" if best in (None, 0) or g.get("adaptive") is None else f"{g['adaptive'] / best:.2f}"
                desc = lambda p: "-" if not p else (f"{p['policy']} {p.get('pipelines')}, transition "  # noqa: E731
                                                   f"{(p.get('transition_s') or 0):.2f} s")
                lines.append(f"| {a['mttf']:.3g} s ({a['factor']:g} x predicted D*) | {fmt(g.get('adaptive'))} | "
                             f"{fmt(g.get('reroute'))} | {fmt(g.get('replan'))} | {ratio} | "
                             f"{desc(g.get('adaptive_decision'))} | {desc(g.get('replan_decision'))} |")
            lines.append("")
    if records:
        acc = accuracy(records)

        def pct(x):
            return "-" if x is None else f"{100 * x:.1f} %"
        lines += [f"## Estimator accuracy: predicted vs measured after each decision ({mode})", "",
                  "Every failure Decision of the pipeline runs logs the chosen candidate's predicted step and "
                  "transition seconds; the job then measures them (median commit interval over 5 steps after the "
                  "first; transition = group rebuild + state agreement and transfer).", "",
                  "| quantity | decisions | median error | max error | goal |", "| --- | ---: | ---: | ---: | --- |",
                  f"| step time | {acc['step']['n']} | {pct(acc['step']['median'])} | {pct(acc['step']['max'])} | median <= 5 %, max <= 15 % |",
                  f"| transition | {acc['transition']['n']} | {pct(acc['transition']['median'])} | {pct(acc['transition']['max'])} | median <= 5 %, max <= 15 % |",
                  "", "| run | chosen | predicted step | measured step | error | predicted transition | measured transition | error |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in records:
            te = r.get("transition_error")
            lines.append(f"| {r.get('run', '-')} | {r['chosen']} | {r['predicted_step_s'] * 1e3:.0f} ms | "
                         f"{r['measured_step_s'] * 1e3:.0f} ms | {100 * r['step_error']:+.1f} % | "
                         f"{(r.get('predicted_transition_s') or 0) * 1e3:.0f} ms | {r['measured_transition_s'] * 1e3:.0f} ms | "
                         f"{'-' if te is None else f'{100 * te:+.1f} %'} |")
        lines += ["", f"![accuracy](img/{img}-accuracy.png)", ""]
    return lines
