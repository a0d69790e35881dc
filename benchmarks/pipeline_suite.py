"""``chameleon-ft bench --pipeline [--quick]``: the pipeline (DP x PP) benchmarks in one command.

    chameleon-ft bench --pipeline            # pipeline_bench (overhead + one kill per policy), then the
                                             # `realistic` failure trace on every system (~12 min)
    chameleon-ft bench --pipeline --quick    # a smoke test: short runs, the 60-step `quick` trace,
                                             # adaptive and restart only (~6 min on 2 loaded cores)

1. ``benchmarks/pipeline_bench.py``'s ``main()`` with its own flags (``--bench-args`` replaces
   them; ``--no-bench`` skips it): failure-free overhead against ``torch.distributed.pipelining``
   and one SIGKILL per policy -> ``benchmarks/results/pipeline.json``, ``docs/benchmarks-pipeline.md``.
2. ``benchmarks/pipeline_trace.py`` (``--trace-args`` are added to its flags; ``--no-trace``
   skips it): one failure trace, every system -> ``benchmarks/results/pipeline-trace.json``,
   ``docs/img/pipeline-trace.png`` and ``docs/benchmarks-pipeline-trace.md``.

``--quick`` writes ``*-quick`` files, so that a smoke test never replaces the full reports.
Everything runs in accelerator-emulation mode (see the two scripts).  CLI hook:
``bench_main(argv)``, loaded from the source checkout by ``chameleon_ft.cli``.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(ROOT))


def bench_argv(quick: bool) -> list[str]:
    if quick:
        return ["--repeats", "1", "--policies", "adaptive", "--steps", "20", "--kill-steps", "24",
                "--json", str(ROOT / "benchmarks/results/pipeline-quick.json"),
                "--markdown", str(ROOT / "docs/benchmarks-pipeline-quick.md")]
    return ["--repeats", "3", "--json", str(ROOT / "benchmarks/results/pipeline.json"),
            "--markdown", str(ROOT / "docs/benchmarks-pipeline.md")]


def trace_argv(quick: bool) -> list[str]:
    sfx = "-quick" if quick else ""
    out = ["--json", str(ROOT / f"benchmarks/results/pipeline-trace{sfx}.json"),
           "--plot", str(ROOT / f"docs/img/pipeline-trace{sfx}.png"),
           "--markdown", str(ROOT / f"docs/benchmarks-pipeline-trace{sfx}.md")]
    if quick:
        return ["--trace", "quick", "--systems", "adaptive,restart", "--ff-steps", "25", *out]
    return ["--trace", "realistic", *out]


def bench_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="chameleon-ft bench --pipeline", description=__doc__.splitlines()[0])
    ap.add_argument("--pipeline", action="store_true", help="(selects this suite)")
    ap.add_argument("--quick", action="store_true", help="a short smoke test; writes *-quick files")
    ap.add_argument("--no-bench", action="store_true", help="skip pipeline_bench (overhead + one kill)")
    ap.add_argument("--no-trace", action="store_true", help="skip the failure trace")
    ap.add_argument("--bench-args", help="pipeline_bench's flags instead of the suite's (one shell-quoted string)")
    ap.add_argument("--trace-args", default="", help="extra flags for pipeline_trace (one shell-quoted string)")
    a = ap.parse_args(argv)
    # SIGTERM -> SystemExit, so that the running job's ``finally`` kills its processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    code = 0
    if not a.no_bench:
        import pipeline_bench

        code |= int(pipeline_bench.main(shlex.split(a.bench_args) if a.bench_args else bench_argv(a.quick)) or 0)
    if not a.no_trace:
        import pipeline_trace

        code |= pipeline_trace.main(trace_argv(a.quick) + shlex.split(a.trace_args))
    return code


if __name__ == "__main__":
    sys.exit(bench_main())
