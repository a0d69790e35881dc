"""``chameleon-ft`` command line: run | demo | simulate | report.

* ``run``      launch a fault-tolerant job (torchrun-style flags), see ``chameleon_ft.cli.launch``
* ``demo``     the live demo: local CPU workers, a worker killed mid-run, the decision and recovery
* ``simulate`` discrete-event simulation of a long run under failures, every policy side by side
               (``--preset``), or the replay of a stored failure trace (``--trace``)
* ``report``   render a run directory's event log (summary, decisions, throughput plot)
* ``bench``    the benchmark matrix against torchrun, TorchFT and plain Lightning (source checkout);
               ``bench --pipeline [--quick]``: the pipeline benchmarks and the failure-trace runner;
               ``bench --sharded [sharded_bench.py flags]``: FSDP2 rehabilitate vs recompute
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _simulate(argv: list[str]) -> int:
    from chameleon_ft.sim.simulator import ADAPTIVE, BATCH_CHANGING, POLICY_NAMES, PRESETS, deployed, model_error_cost, simulate

    ap = argparse.ArgumentParser(prog="chameleon-ft simulate", description="Simulate a long training run under failures.")
    ap.add_argument("--preset", default="llama3-16k", choices=sorted(PRESETS))
    ap.add_argument("--days", type=float, help="simulated days (default: the preset's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", nargs="+", default=None, choices=POLICY_NAMES + ("redundant",),
                    help="default: all (oracle only with --model-error > 0)")
    ap.add_argument("--model-error", type=float, default=0.2, metavar="SPREAD",
                    help="the simulated cluster follows a true cost model whose coefficients are the "
                         "believed ones times exp(SPREAD * N(0,1)) factors, seeded (default 0.2; 0: the "
                         "selector's model is exact)"),
    ap.add_argument("--out", default="runs/simulate", help="folder for the plot and the JSON results")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--trace", metavar="FILE.json",
                    help="replay a stored failure trace (chameleon_ft.sim.trace.TraceSetup JSON) instead of a preset")
    ap.add_argument("--devices", type=int, help="with --trace: replay on this many devices (the trace scaled)")
    ap.add_argument("--mttf-s", type=float, help="with --trace: D for the decisions (default: the file's, "
                                                   "else the horizon over the number of failures)")
    ap.add_argument("--json", metavar="OUT", help="with --trace: write the results here")
    args = ap.parse_args(argv)
    if args.trace:
        return _simulate_trace(args, ap)
    if args.policies and "redundant" in args.policies:
        ap.error("redundant (the Bamboo-like stand-in) runs in a trace replay only (--trace)")
    if args.days is not None and args.days <= 0:
        ap.error("--days must be positive")
    if args.model_error < 0:
        ap.error("--model-error must be >= 0")

    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 120)
    preset = PRESETS[args.preset]
    console.print(f"[bold]{preset.name}[/]: {preset.source}")
    console.print(f"{preset.gpus:,} GPUs = {preset.devices:,} devices of TP{preset.tp}; "
                  f"{args.days or preset.days:g} days; seed {args.seed}")
    with console.status("simulating every policy against the same failure schedule..."):
        results = simulate(preset, args.policies, seed=args.seed, days=args.days, model_error=args.model_error)
    table = Table(title=f"goodput = useful samples / failure-free samples ({preset.name}), "
                        f"true model (model error {args.model_error:g})")
    for col in ("policy", "goodput", "believed", "downtime (h)", "failures", "decisions", "median decision"):
        table.add_column(col, justify="left" if col in ("policy", "decisions") else "right")
    best_fixed = max(r.goodput for p, r in results.items() if p not in ADAPTIVE) if any(
        p not in ADAPTIVE for p in results) else None
    for name, r in results.items():
        label = name + (" *" if name in BATCH_CHANGING else "")
        med = r.to_json()["median_decide_s"]
        style = "bold green" if name in ADAPTIVE and best_fixed is not None and r.goodput >= best_fixed else None
        table.add_row(label, f"{r.goodput:.4%}", f"{r.believed_goodput:.4%}", f"{r.downtime_s / 3600:.2f}",
                      str(r.failures), ", ".join(f"{k} {v}" for k, v in sorted(r.decisions.items())),
                      f"{med * 1e3:.1f} ms" if med is not None else "-", style=style)
    console.print(table)
    console.print("* changes the global batch (shrink); the others keep it.  goodput: under the true model "
                  "(what happened); believed: what the deciding model predicted for the same decisions.")
    cost = model_error_cost(results)
    if cost is not None:
        console.print(f"cost of model error: oracle (decides with the true model) {results['oracle'].goodput:.4%} "
                      f"- adaptive {results['adaptive'].goodput:.4%} = {cost:+.4%} goodput")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"preset": preset.name, "seed": args.seed, "days": args.days or preset.days,
            "model_error": args.model_error, "cost_of_model_error": cost,
            "true_model": deployed(preset, args.seed, args.model_error)[1].to_json(),
            "results": {k: v.to_json() for k, v in results.items()}}
    (out / f"{preset.name}.json").write_text(json.dumps(data, indent=2))
    if not args.no_plot:
        path = out / f"{preset.name}.png"
        _plot_sim(results, preset, path)
        console.print(f"plot: {path}")
    console.print(f"results: {out / (preset.name + '.json')}")
    return 0


def _simulate_trace(args, ap) -> int:
    from dataclasses import replace

    from rich.console import Console
    from rich.table import Table

    from chameleon_ft.sim.trace import DEFAULT_POLICIES, REPLAY_POLICIES, TraceSetup, best_fixed

    policies = tuple(args.policies or DEFAULT_POLICIES)
    bad = [p for p in policies if p not in REPLAY_POLICIES]
    if bad:
        ap.error(f"a replay runs {', '.join(REPLAY_POLICIES)}; not {', '.join(bad)}")
    if args.mttf_s is not None and args.mttf_s <= 0:
        ap.error("--mttf-s must be positive")
    setup = TraceSetup.from_json(json.loads(Path(args.trace).read_text()))
    if args.mttf_s is not None:
        setup = replace(setup, mttf_s=args.mttf_s)
    n = args.devices or len(setup.cluster.devices)
    try:
        results = setup.run(n, policies)
    except ValueError as e:
        ap.error(str(e))
    console = Console(width=None if sys.stdout.isatty() else 120)
    tr = setup.trace
    console.print(f"[bold]{tr.name}[/]: {tr.description or 'no description'}")
    d = setup.mttf_s if setup.mttf_s is not None else tr.horizon_s / max(1, tr.failures)
    console.print(f"{len(tr.events)} events over {tr.horizon_s:g} s, replayed on {n} devices "
                  f"({setup.stages} stages per pipeline); D = {d:g} s; exact model.  "
                  "redundant = a Bamboo-like stand-in, simulation only")
    best = best_fixed(results)
    table = Table(title=f"average throughput over the trace ({n} devices)")
    for col in ("policy", "samples/s", "vs best fixed", "goodput", "decisions"):
        table.add_column(col, justify="left" if col in ("policy", "decisions") else "right")
    for name, r in results.items():
        ratio = f"{r.throughput / results[best].throughput:.3f}x" if best and results[best].throughput else "-"
        table.add_row(name + (" (best fixed)" if name == best else ""), f"{r.throughput:.4g}", ratio,
                      f"{r.goodput:.2%}", ", ".join(f"{k} {v}" for k, v in sorted(r.counts.items())))
    console.print(table)
    events = Table(title="chosen response per event (predicted step s / transition s)")
    events.add_column("t (s)", justify="right")
    events.add_column("event (recorded devices)")
    for name in results:
        events.add_column(name)
    rows = zip(*(r.decisions for r in results.values()))
    for ev, row in zip(tr.events, rows):
        what = f"{ev.kind} {list(ev.devices)}" + (f" x{ev.slowdown:g}" if ev.kind == "slow" else "")
        events.add_row(f"{ev.t_s:g}", what, *(f"{c} {s:.3g}/{x:.3g}" for _, _, c, s, x in row))
    console.print(events)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"trace": tr.name, "devices": n, "mttf_s": d, "best_fixed": best,
                                   "results": {k: v.to_json() for k, v in results.items()}}, indent=2))
        console.print(f"results: {out}")
    return 0


def _plot_sim(results, preset, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [1, 2]})
    names = list(results)
    ax1.barh(names, [results[n].goodput * 100 for n in names], color=["tab:green" if n.startswith("adaptive") else "tab:gray" for n in names])
    lo = min(r.goodput for r in results.values()) * 100
    ax1.set_xlim(max(0, lo - 2), 100.5)
    ax1.set_xlabel("goodput (%)")
    ax1.invert_yaxis()
    for n in names:
        ts, tp = zip(*results[n].timeline)
        ideal = tp[0]
        ax2.step([t / 86400 for t in ts], [x / ideal for x in tp], where="post", label=n, lw=1)
    ax2.set_xlabel("day")
    ax2.set_ylabel("throughput / failure-free (between transitions)")
    ax2.legend(fontsize=8, loc="lower left")
    fig.suptitle(f"chameleon-ft simulate --preset {preset.name}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _run(argv: list[str]) -> int:
    from chameleon_ft.cli import launch

    return launch.main(argv)


def _demo(argv: list[str]) -> int:
    from chameleon_ft.cli import demo

    return demo.main(argv)


def _report(argv: list[str]) -> int:
    from chameleon_ft.cli import report

    return report.main(argv)


def _bench(argv: list[str]) -> int:
    """The benchmarks live in the source tree (``benchmarks/matrix.py``; with ``--pipeline``,
    ``benchmarks/pipeline_suite.py``; with ``--sharded``, ``benchmarks/sharded_bench.py``), not in the installed package: load them from the
    checkout this package was installed from."""
    import importlib.util

    name = ("pipeline_suite.py" if "--pipeline" in argv
            else "sharded_bench.py" if "--sharded" in argv else "matrix.py")
    path = Path(__file__).resolve().parent.parent / "benchmarks" / name
    if not path.is_file():
        print(f"chameleon-ft bench: needs a source checkout (benchmarks/{name} not found next to "
              f"{Path(__file__).resolve().parent}); install with `pip install -e .`", file=sys.stderr)
        return 2
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"chameleon_ft_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return int(module.bench_main(argv) or 0)


COMMANDS = {"run": _run, "demo": _demo, "simulate": _simulate, "report": _report, "bench": _bench}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from chameleon_ft import __version__

        print(f"chameleon-ft {__version__}")
        return 0
    cmd = COMMANDS.get(argv[0])
    if cmd is None:
        print(f"chameleon-ft: unknown command {argv[0]!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return int(cmd(argv[1:]) or 0)
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("chameleon_ft."):
            print(f"chameleon-ft {argv[0]}: not available in this build ({e.name} missing)", file=sys.stderr)
            return 2
        raise
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
