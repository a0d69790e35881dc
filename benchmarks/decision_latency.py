"""Median wall time of one full decision (plan search + migration plan + selection) for one failure.

    python benchmarks/decision_latency.py [--repeats 7] [--sizes 1024 16384 131072]

Workload: a Llama-3-405B-like 126-layer transformer; devices are 8-GPU tensor-parallel groups
(80 GB each GPU); the job runs the planner's best plan (pipeline depth 8 to 16) when device 5
fails.  Targets (issue 2): at most 10 ms at 1,024 devices and at most 1 s at 131,072.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import replace

from chameleon_ft.engine.cluster import Link, homogeneous
from chameleon_ft.engine.failures import Event, EventKind
from chameleon_ft.engine.planner import SearchSpace, plan_search
from chameleon_ft.engine.selector import JobState, SelectorConfig, select
from chameleon_ft.engine.workload import transformer

TARGETS_S = {1024: 0.010, 131072: 1.0}


def setup(n: int):
    workload = transformer(num_layers=126, hidden=16384, seq_len=8192, micro_batch=1,
                           global_batch=max(2048, n), flops_per_s=160e12 * 8, act_factor=8)
    cluster = homogeneous(n, per_node=1, memory_bytes=640e9,
                          intra=Link(5e-6, 1.2e12), inter=Link(10e-6, 200e9))
    space = SearchSpace(pp_min=8, pp_max=16)
    base = plan_search(workload, cluster, space=replace(space, global_limit=1 << 30)).best.plan
    return workload, cluster, space, base


def measure(n: int, repeats: int) -> dict:
    workload, cluster, space, base = setup(n)
    state = JobState(workload, cluster, base, frozenset(cluster.ids))
    config = SelectorConfig(space=space, restart_s=600)
    times, decision = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        decision = select(Event(EventKind.FAIL_STOP, (5,)), state, config, mttf_s=3 * 3600)
        times.append(time.perf_counter() - t0)
    return {"devices": n, "plan": base.describe(), "median_s": statistics.median(times),
            "min_s": min(times), "chosen": decision.chosen, "target_s": TARGETS_S.get(n)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 16384, 131072])
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    rows = [measure(n, args.repeats) for n in args.sizes]
    print(f"decision latency, median of {args.repeats} ({platform.processor() or platform.machine()}, "
          f"python {platform.python_version()})")
    print(f"{'devices':>8}  {'plan':<28} {'median':>9} {'min':>9} {'target':>8}  chosen")
    for r in rows:
        tgt = f"{r['target_s'] * 1e3:.0f} ms" if r["target_s"] else "-"
        print(f"{r['devices']:>8}  {r['plan']:<28} {r['median_s'] * 1e3:8.1f}ms {r['min_s'] * 1e3:8.1f}ms "
              f"{tgt:>8}  {r['chosen']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
