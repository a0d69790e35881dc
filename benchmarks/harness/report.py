"""Results JSON -> ``docs/benchmarks.md`` (tables per mode, worker count and scenario) and plots.
Generated; the document is never edited by hand: change this file or the harness and rerun it.

For each scenario every system's figures sit side by side; for each figure where another
system that did not crash beats chameleon-ft (adaptive), a sentence says so, with a reason
computed from the runs' data (``reasons.py``: noise only within the measured run-to-run spread)
or "not explained"; every efficiency above 1 gets the same treatment.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from .reasons import Spread, efficiency_reason, hang_note, reason, representative
from .reasons import median as _median, value

# (figure key, label, better: "low" | "high", format)
FIGURES = [
    ("mttr_s", "MTTR (s)", "low", "{:.3f}"),
    ("mttr2_s", "MTTR 2nd fault (s)", "low", "{:.3f}"),
    ("full_strength_s", "back to N workers (s)", "low", "{:.2f}"),
    ("throughput", "samples/s (run)", "high", "{:.0f}"),
    ("throughput_before", "samples/s before", "high", "{:.0f}"),
    ("throughput_after", "samples/s after", "high", "{:.0f}"),
    ("efficiency", "post-recovery efficiency", "high", "{:.2f}"),
    ("step_time_s", "step (ms)", "low", "{:.0f}"),
    ("step_time_after_s", "step after (ms)", "low", "{:.0f}"),
    ("predicted_step_s", "engine predicted step (ms)", None, "{:.0f}"),
    ("samples_lost", "samples lost", "low", "{:.0f}"),
    ("samples_duplicated", "samples duplicated", "low", "{:.0f}"),
    ("peak_rss_mb", "peak RSS / worker (MB)", "low", "{:.0f}"),
    ("final_loss", "final loss", "low", "{:.4f}"),
    ("wall_s", "wall (s)", "low", "{:.1f}"),
]
MS = {"step_time_s", "step_time_after_s", "predicted_step_s"}


def _fmt(v, f, key=""):
    if v is None:
        return "-"
    return f.format(v * 1e3 if key in MS else v)


def _spread(rows, key, f):
    vals = sorted(v for r in rows if (v := value(r, key)) is not None)
    med = _fmt(statistics.median(vals), f, key) if vals else "-"
    if len(vals) > 1:
        return f"{med} ({_fmt(vals[0], f, key)}-{_fmt(vals[-1], f, key)})"
    return med


def _groups(res):
    """(mb_sleep, nproc) -> scenario -> system -> rows, in run order."""
    out: dict = {}
    for r in res["runs"]:
        out.setdefault((r["mb_sleep"], r["nproc"]), {}).setdefault(r["scenario"], {}).setdefault(
            r["system"], []).append(r)
    # emulation before plain CPU, fewer workers first
    return dict(sorted(out.items(), key=lambda kv: (kv[0][0] == 0, kv[0][1])))


def _plot_setup():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _color(system):
    return {"chameleon-ft": "tab:green", "torchrun-restart+fix": "tab:blue", "torchrun-restart": "tab:cyan",
            "torchft+fix": "tab:orange", "torchft": "tab:brown", "lightning-ddp": "tab:purple"}.get(system, "tab:gray")


def plot_mttr(scen: dict, title: str, path: Path) -> Path | None:
    """MTTR bars per system, one panel per scenario with faults."""
    panels = [(sc, systems) for sc, systems in scen.items()
              if any(_median(rows, "mttr_s") is not None or rows[0].get("t_fault") for rows in systems.values())]
    if not panels:
        return None
    plt = _plot_setup()
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.6), squeeze=False)
    for ax, (sc, systems) in zip(axes[0], panels):
        names = list(systems)
        vals = [_median(systems[n], "mttr_s") for n in names]
        bars = ax.bar(range(len(names)), [v or 0 for v in vals],
                      color=[_color(n) if v is not None else "lightgray" for n, v in zip(names, vals)])
        for b, v, n in zip(bars, vals, names):
            if v is None:
                crashed = any(r["crashed"] for r in systems[n])
                ax.annotate("crashed" if crashed else "no recovery", (b.get_x() + b.get_width() / 2, 0.01),
                            rotation=90, ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=7)
        ax.set_yscale("symlog", linthresh=0.1)
        ax.set_title(sc, fontsize=9)
    axes[0][0].set_ylabel("MTTR (s): fault -> first step after")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _rate(timeline, bin_s=0.5):
    if not timeline:
        return [], []
    end = timeline[-1][0]
    n = int(end / bin_s) + 1
    acc = [0.0] * n
    for t, _step, samples, _world in timeline[1:]:
        acc[min(n - 1, int(t / bin_s))] += samples
    last = max(end - (n - 1) * bin_s, 1e-3)  # the last bin is only partly covered
    return ([(i + 0.5) * bin_s for i in range(n)],
            [a / (bin_s if i < n - 1 else max(last, bin_s / 2)) for i, a in enumerate(acc)])


def plot_timelines(scen: dict, title: str, path: Path) -> Path | None:
    """Throughput over time per system (first repeat), faults as red lines, chameleon-ft's
    decisions as green triangles labelled with the policy."""
    panels = [(sc, systems) for sc, systems in scen.items() if sc != "failure-free"]
    if not panels:
        return None
    plt = _plot_setup()
    cols = min(3, len(panels))
    rows_n = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows_n, cols, figsize=(4.6 * cols, 3.0 * rows_n), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (sc, systems) in zip(axes.flat, panels):
        for name, rows in systems.items():
            if "[" in name:  # fixed-policy variants: the adaptive line is enough here
                continue
            r = rows[0]
            x, y = _rate(r.get("timeline"))
            if x:
                ax.step(x, y, where="mid", color=_color(name), label=name, lw=1.2)
            for t in r.get("fault_times") or []:
                ax.axvline(t, color=_color(name), ls=":", lw=1.0)
            if name == "chameleon-ft":
                for d in (r.get("chameleon") or {}).get("decisions", []):
                    ax.plot([d["t"]], [0], marker="^", color="green", ms=7, clip_on=False)
                    ax.annotate(d["chosen"], (d["t"], 0), xytext=(2, 8), textcoords="offset points", fontsize=7,
                                color="green")
        ax.set_title(sc, fontsize=9)
        ax.set_xlabel("s since the first step", fontsize=8)
        ax.set_ylabel("samples/s (0.5 s bins)", fontsize=8)
        ax.tick_params(labelsize=7)
    axes.flat[0].legend(fontsize=7, loc="lower left")
    fig.suptitle(title + " — dotted: each run's faults (its colour); triangles: chameleon-ft's decisions",
                 fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _scenario_table(L, res, sc, systems, spread):
    figs = [f for f in FIGURES if any(_median(rows, f[0]) is not None for rows in systems.values())
            and (f[0] != "step_time_s" or sc == "failure-free")]   # with faults: "step after"
    L += [f"### {sc}: {res['scenarios'].get(sc, '')}", ""]
    if sc == "node-loss" and (note := _node_loss_note(res, systems)):
        L += [note, ""]
    if sc == "hang" and (note := hang_note(systems)):
        L += [note, ""]
    L += [
          "| system | crashed | " + " | ".join(f[1] for f in figs) + " | note |",
          "| --- | --- | " + " | ".join("---:" for _ in figs) + " | --- |"]
    for s, rows in systems.items():
        crashed = sum(r["crashed"] for r in rows)
        notes = "; ".join(sorted({r["note"] for r in rows if r["note"]}))
        reps = f" ({crashed}/{len(rows)})" if len(rows) > 1 else ""
        L.append(f"| {s} | {'yes' if crashed else 'no'}{reps} | "
                 + " | ".join(_spread(rows, f[0], f[3]) for f in figs) + f" | {notes} |")
    if any(len(rows) > 1 for rows in systems.values()):
        L += ["", "Repeated cells: median (min-max) over the repeats; the kill's moment inside the step is "
              "randomised per repeat."]
    bd = [(b, r.get("fault_offset_s")) for r in systems.get("chameleon-ft", []) for b in
          (r.get("chameleon") or {}).get("breakdowns", [])[:1]]
    if bd:
        L += ["", "chameleon-ft MTTR breakdown (recovering member; first fault): " + "; ".join(
            f"fault {b['where']} a collective: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in b.items()
                                                             if k != "where") for b, _ in bd)]
    dec = [d for r in systems.get("chameleon-ft", [])[:1] for d in (r.get("chameleon") or {}).get("decisions", [])]
    if dec:
        L += ["", "chameleon-ft decisions (first run): " + ", ".join(
            f"{d['kind']} -> **{d['chosen']}**" + (f" (predicted step {d['predicted_step_s'] * 1e3:.0f} ms)"
                                                   if d.get("predicted_step_s") else "") for d in dec)]
    tuned, ours_rows = systems.get("torchft-tuned", []), systems.get("chameleon-ft", [])
    if (t := _median(tuned, "mttr_s")) and (o := _median(ours_rows, "mttr_s")):
        L += ["", "MTTR against TorchFT tuned for fast recovery: chameleon-ft "
              f"{_spread(ours_rows, 'mttr_s', '{:.3f}')} s "
              f"over {len(ours_rows)} run(s), TorchFT tuned {_spread(tuned, 'mttr_s', '{:.3f}')} s over {len(tuned)} "
              f"run(s): chameleon-ft's median is {o / t:.2f}x TorchFT tuned's"
              + (f" (TorchFT tuned lost {_median(tuned, 'samples_lost'):.0f} samples, chameleon-ft "
                 f"{_median(ours_rows, 'samples_lost'):.0f})" if _median(tuned, "samples_lost") is not None
                 and _median(ours_rows, "samples_lost") is not None else "") + "."]
    if sc == "failure-free" and (mine := _median(systems.get("chameleon-ft", []), "step_time_s")):
        ov = [f"{s} {(mine / o - 1) * 100:+.1f} %" for s, rows in systems.items()
              if s != "chameleon-ft" and not any(r["crashed"] for r in rows) and (o := _median(rows, "step_time_s"))]
        if ov:
            L += ["", "Failure-free overhead of chameleon-ft (its median step time against each system's; "
                  "negative: faster): " + ", ".join(ov) + ".  The issue's target is at most +1 % against plain "
                  "DDP (torchrun-restart's script is plain DDP); `benchmarks/runtime_bench.py` measures it with "
                  "alternating repeats."]
    L += ["", "Where chameleon-ft is not the best:", ""]
    ours, found = systems.get("chameleon-ft"), False
    for key, label, better, f in figs:
        if better is None or ours is None or (mine := _median(ours, key)) is None:
            continue
        for s, rows in systems.items():
            if s == "chameleon-ft" or any(r["crashed"] for r in rows):
                continue
            other = _median(rows, key)
            if (other is None or _fmt(other, f, key) == _fmt(mine, f, key)
                    or (other < mine) != (better == "low")):
                continue
            why = reason(res, key, rows, ours, sc, spread)
            L.append(f"* {label}: {s} {_fmt(other, f, key)} vs chameleon-ft {_fmt(mine, f, key)} — {why}.")
            found = True
    if not found:
        L.append("* nowhere among the systems that did not crash.")
    above = [(s, r) for s, rows in systems.items() for r in [representative(rows, "efficiency")]
             if round(r.get("efficiency") or 0, 2) > 1]
    if above:
        L += ["", "Post-recovery efficiency above 1 (more samples/s per surviving worker than failure-free):", ""]
        L += [f"* {s} {r['efficiency']:.2f}: {efficiency_reason(res, r, spread)}." for s, r in above]
    L.append("")


def _node_loss_note(res, systems) -> str:
    """chameleon-ft's node-loss MTTR against its single kill's, with the phase it went to."""
    ours = systems.get("chameleon-ft", [])
    bd = [b for r in ours for b in (r.get("chameleon") or {}).get("breakdowns", [])[:1]]
    mttr = _median(ours, "mttr_s")
    kill = [r for r in res["runs"] if r["system"] == "chameleon-ft" and r["scenario"] == "kill"
            and ours and r["nproc"] == ours[0]["nproc"] and r["mb_sleep"] == ours[0]["mb_sleep"]]
    if not bd or mttr is None:
        return ""
    k = _median(kill, "mttr_s")
    phase = max((p for p in bd[0] if p not in ("where", "total")), key=lambda p: bd[0][p])
    return (f"chameleon-ft's MTTR here is {mttr:.2f} s" + (f", against {k:.2f} s for one kill" if k else "")
            + f"; its largest phase is {phase} ({bd[0][phase] * 1e3:.0f} ms of {bd[0].get('total', 0) * 1e3:.0f} ms)"
            + (": with exactly half of the workers gone at once, the Lighthouse's split-brain guard (a quorum "
               "needs more than half of the heartbeating workers) waits until the dead workers' heartbeats expire "
               "(`heartbeat_timeout_ms` = 1000; `chameleon_ft/runtime/membership.py`)." if phase == "membership"
               else "."))


def write_report(res: dict, doc: Path) -> Path:
    doc = Path(doc)
    stem = "benchmarks-short" if "--short" in res.get("command", "") else "benchmarks"
    L = ["# Benchmarks: chameleon-ft against the baselines", "",
         "<!-- generated by benchmarks/matrix.py from its results JSON; do not edit by hand -->", "",
         f"* command: `{res['command']}`", f"* date: {res['date']}", f"* machine: {res['machine']}",
         "* modes: " + "; ".join(f"**{m}**" for m in res["modes"].values()),
         f"* {res['steps']} steps (at least; the replacement scenario runs longer), global batch "
         f"{res['global_batch']}", f"* matrix wall time: {res['duration_s']:.0f} s", "",
         "Mostly single runs on a shared 2-core machine: read ratios, crashes and lost/duplicated samples, "
         "not digits.", "",
         *(["The reduced plan (`--reduced`, `REDUCED_PLAN` in `benchmarks/matrix.py`): the full plan's other "
            "cells (two kills, straggler, replacement, 8 workers, most fixed policies, CPU baselines) were not "
            "run for this report; `python benchmarks/matrix.py` runs them all.", ""]
           if "--reduced" in res.get("command", "") else []),
         "## Systems", "", "| system | variant | note |", "| --- | --- | --- |"]
    L += [f"| {s} | {d['variant']} | {d['note']} |" for s, d in res["systems"].items()]
    L += ["", "Metrics: see `benchmarks/harness/metrics.py`.  MTTR = fault -> first step committed without "
          "the victim (or after a torchrun / checkpoint restart); efficiency = throughput after the last "
          "recovery / (failure-free throughput x W / N), W = the world at the end; samples lost and "
          "duplicated are counted from the sample ids every worker logged for the steps it trained (lost: ids "
          "of the epochs' committed steps no update trained; duplicated: ids trained more than once in an "
          "epoch).  Reasons are computed from each run's data; a difference is called noise only within the "
          "run-to-run spread measured on the repeated cells of the same mode, else it is \"not explained\".", ""]
    plots = []
    spread = Spread(res, [f[0] for f in FIGURES])
    for (mb, nproc), scen in _groups(res).items():
        mode = res["modes"].get(str(mb)) or f"mb_sleep {mb}"
        title = f"{nproc} workers, {mode}"
        L += [f"## {title}", ""]
        for sc, systems in scen.items():
            _scenario_table(L, res, sc, systems, spread)
        tag = f"{stem}-{nproc}w-{'emu' if mb > 0 else 'cpu'}"
        for kind, fn in (("mttr", plot_mttr), ("timeline", plot_timelines)):
            p = fn(scen, title, doc.parent / "benchmarks" / f"{tag}-{kind}.png")
            if p:
                L += [f"![{kind}: {title}]({p.relative_to(doc.parent)})", ""]
                plots.append(p)
    _fixed_policies(L, res, spread)
    if stem == "benchmarks":
        L += _linked_pages(doc.parent)
    doc.write_text("\n".join(L) + "\n")
    return doc


# The other harnesses' own pages: linked, never copied (a copy goes stale when they rerun).
LINKED_PAGES = (
    ("Pipeline (DP x PP) benchmarks", [
        ("benchmarks-pipeline.md", "benchmarks/pipeline_bench.py",
         "failure-free overhead against torch.distributed.pipelining, one SIGKILL of a middle-stage "
         "worker per policy, the reroute/replan crossover, the estimator's predicted vs measured step "
         "and transition"),
        ("benchmarks-pipeline-memory.md", "benchmarks/pipeline_bench.py --device-memory",
         "the kill, crossover and estimator runs with an emulated device memory (the re-plan is PP3 + PP4)"),
        ("benchmarks-pipeline-trace.md", "benchmarks/pipeline_trace.py",
         "the failure trace `realistic` on adaptive, always-reroute, always-replan and torchrun "
         "checkpoint-restart, and the same trace in the simulator"),
        ("benchmarks-pipeline-trace-10ms.md", "benchmarks/pipeline_trace.py --block-sleep 0.01",
         "the same trace at 10 ms per block forward"),
        ("benchmarks-pipeline-diagnostics.md", "benchmarks/pipeline_bench.py --diag no-start-check,blocking-p2p",
         "where the failure-free overhead goes (patched runtimes, diagnostics only)"),
    ]),
    ("Sharded training (FSDP2) benchmarks", [
        ("benchmarks-sharded.md", "benchmarks/sharded_bench.py",
         "rehabilitate vs recompute lost time after a kill early and late in the snapshot interval, "
         "the engine's pick, peak RSS with buddy snapshots, overhead vs plain FSDP2"),
    ]),
)


def _linked_pages(docs: Path) -> list[str]:
    """A section per family of the other benchmark pages that exist, each a link with the
    script that writes it (those pages hold the current figures)."""
    L: list[str] = []
    for title, pages in LINKED_PAGES:
        present = [(name, cmd, what) for name, cmd, what in pages if (docs / name).exists()]
        if not present:
            continue
        L += ["", f"## {title}", "",
              "Not copied here: these benchmarks write their own pages, which hold the current figures:", ""]
        L += [f"* [{name}]({name}) (`python {cmd}`): {what}" for name, cmd, what in present]
    return L


def _fixed_policies(L, res, spread):
    """Adaptive against each fixed policy, per scenario (4-worker emulation cells)."""
    rows: dict = {}
    for r in res["runs"]:
        if r["family"] == "chameleon-ft" and r["scenario"] != "failure-free":
            rows.setdefault((r["scenario"], r["nproc"], r["mb_sleep"]), {}).setdefault(r["system"], []).append(r)
    tables = {k: v for k, v in rows.items() if len(v) > 1}
    if not tables:
        return
    L += ["## chameleon-ft: adaptive against each fixed policy", "",
          "Score the engine maximises: samples/s x remaining useful time; here measured as the run's "
          "samples/s and wall time (same steps).  Batch after: the global batch of the last committed step.", ""]
    for (sc, nproc, mb), systems in tables.items():
        L += [f"### {sc}, {nproc} workers, {'emulation' if mb > 0 else 'CPU'}", "",
              "| system | crashed | chosen | MTTR (s) | samples/s after | samples/s (run) | batch after | wall (s) |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
        for s, rs in systems.items():
            chosen = ", ".join(d["chosen"] or "nothing feasible" for d in (rs[0].get("chameleon") or {}).get("decisions", []))
            batch = rs[0].get("batch_last")
            L.append(f"| {s} | {'yes' if any(r['crashed'] for r in rs) else 'no'} | {chosen or '-'} | "
                     f"{_spread(rs, 'mttr_s', '{:.3f}')} | {_spread(rs, 'throughput_after', '{:.0f}')} | "
                     f"{_spread(rs, 'throughput', '{:.0f}')} | {batch if batch is not None else '-'} | "
                     f"{_spread(rs, 'wall_s', '{:.1f}')} |")
        ad = _median(systems.get("chameleon-ft", []), "throughput")
        better = [(s, v) for s, rs in systems.items() if s != "chameleon-ft" and not any(r["crashed"] for r in rs)
                  and (v := _median(rs, "throughput")) and ad and v > ad]
        L.append("")
        for s, v in better:
            why = reason(res, "throughput", systems[s], systems["chameleon-ft"], sc, spread)
            L.append(f"* {s} trained faster over the run ({v:.0f} vs {ad:.0f} samples/s, "
                     f"{(v / ad - 1) * 100:+.1f} %): {why}.")
        L.append("")
