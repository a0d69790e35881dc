"""Cost of the collective header (``GroupManager.checked``) on the step's gradient all-reduce.

    python benchmarks/collective_header.py [--sizes 692,1000000,10000000] [--iters 10] [--repeats 15]

Four local processes form one gloo group (``GroupManager``, as the runtime does) and time
``--iters`` SUM all-reduces of a float32 buffer of each size, with the header (``header="step"``:
one extra all-gather of 16 int64 per call) and without, alternating within each repeat so both
see the same machine load.  Reported per size: the median over repeats of the mean time per
all-reduce, and with/without as a ratio of the medians.  Wall-clock figures on a shared CPU
machine: read the medians and ratios, not single runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(rank: int, world: int, port: int, sizes: list[int], iters: int, repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from chameleon_ft.runtime.groups import GroupManager
    from chameleon_ft.runtime.membership import MembershipView

    torch.set_num_threads(1)

    def client():
        return dist.TCPStore("127.0.0.1", port, world, False, timedelta(seconds=30))

    gm = GroupManager(client(), rank, client, op_timeout_s=60.0, connect_timeout_s=30.0)
    gm.rebuild(MembershipView(1, tuple(range(world)), rank, world, "header-bench"))
    result: dict = {}
    for size in sizes:
        buf = torch.ones(size)
        for header in (None, "step"):  # warm-up
            for _ in range(3):
                gm.allreduce(buf, header=header, copy=False)
        times: dict = {"plain": [], "header": []}
        for rep in range(repeats):
            order = [(None, "plain"), ("step", "header")]
            for header, name in order if rep % 2 == 0 else order[::-1]:
                gm.allreduce(torch.zeros(1), copy=False)  # line the members up
                t0 = time.perf_counter()
                for _ in range(iters):
                    gm.allreduce(buf, header=header, copy=False)
                times[name].append((time.perf_counter() - t0) / iters)
        result[str(size)] = times
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="692,1000000,10000000",
                   help="float32 elements per all-reduce (692: the tests' MLP)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.worker is not None:
        worker(a.worker, a.world, a.port, sizes, a.iters, a.repeats, a.out)
        return
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, a.world + 1, True, timedelta(seconds=60), wait_for_workers=False)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), "--world", str(a.world),
                                   "--port", str(server.port), "--sizes", a.sizes, "--iters", str(a.iters),
                                   "--repeats", str(a.repeats), "--out", out], env=env)
                 for r in range(a.world)]
        codes = [q.wait() for q in procs]
        if any(codes):
            raise SystemExit(f"a worker failed: exit codes {codes}")
        with open(out) as f:
            result = json.load(f)
    print(f"{a.world} gloo processes, {a.iters} all-reduces x {a.repeats} repeats per size "
          "(median of repeats, ms per all-reduce)")
    print(f"{'float32 elements':>17} {'no header':>10} {'header':>10} {'ratio':>7} {'extra':>8}")
    for size in sizes:
        t = result[str(size)]
        plain, hdr = statistics.median(t["plain"]) * 1e3, statistics.median(t["header"]) * 1e3
        print(f"{size:>17,} {plain:>10.3f} {hdr:>10.3f} {hdr / plain:>7.3f} {hdr - plain:>+8.3f}")


if __name__ == "__main__":
    main()
