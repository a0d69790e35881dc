"""Measure MTTR of the elastic runtime: 4 workers under ``chameleon-ft run``, one SIGKILL from
outside per run at a random moment, timings from the run's event log.

    python tests/runtime/_workers/measure_mttr.py --kills 7 [--mb-sleep 0.025]

Per kill: *MTTR* = kill -> the first step committed after it (the recovery event is written
right after that commit), and the source member's breakdown (detect = its wait in the failed
collective, membership, rebuild, state transfer, first step).  A kill is classed "inside" when
the source member waited in the failed collective for more than 2 ms (the victim died while
the others were in, or entering, the all-reduce), otherwise "between" (the victim died while
computing, the launcher had already ended the generation, and the survivors learned it as
they entered their next all-reduce).
Wall-clock timings on a shared machine: medians, not guarantees.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from elastic_job import Job


def one_kill(root: Path, mb_sleep: float, rng: random.Random) -> dict:
    job = Job(root, mb_sleep=mb_sleep, epochs=2, worker_args=["--no-stragglers"])
    try:
        job.start()
        victim, step = rng.randrange(4), rng.randrange(2, 12)
        job.wait_step(step)
        time.sleep(rng.uniform(0, 2 * mb_sleep + 0.01))
        t_kill = job.kill(victim)
        assert job.wait(60) == [0], job.output()
        evs = job.events()
        rec = next(e for e in evs if e["event"] == "recovery")
        return {"where": "inside" if rec["mttr"]["detect"] > 0.002 else "between",
                "mttr": rec["ts"] - t_kill,
                **{k: v for k, v in rec["mttr"].items()}}
    finally:
        job.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=7)
    p.add_argument("--mb-sleep", type=float, default=0.025, help="emulated compute per micro-batch")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng = random.Random(a.seed)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.kills):
            rows.append(one_kill(Path(tmp) / f"k{i}", a.mb_sleep, rng))
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()})
    keys = ["mttr", "detect", "membership", "rebuild", "state_transfer", "first_step"]
    print(f"\nmedians (mb_sleep {a.mb_sleep} s, 2 micro-batches per worker per step):")
    print("| kill | n | " + " | ".join(keys) + " |")
    for where in ("inside", "between", "all"):
        sel = [r for r in rows if where == "all" or r["where"] == where]
        if sel:
            med = [f"{statistics.median(r[k] for r in sel) * 1000:.0f} ms" for k in keys]
            print(f"| {where} | {len(sel)} | " + " | ".join(med) + " |")


if __name__ == "__main__":
    main()
