"""Runtime benchmarks: MTTR of an outside SIGKILL, and failure-free overhead against plain DDP.

    python benchmarks/runtime_bench.py [--kills 9] [--repeats 3] [--steps 40] [--json F]

Both use ``benchmarks/_train_bench.py`` on 4 CPU workers in accelerator-emulation mode (every
micro-batch padded to ``--mb-sleep`` seconds; 2 micro-batches per worker per step, so a 50 ms
compute step by default).

* **MTTR**: one SIGKILL of a random worker at a random moment per run, sent from this process.
  MTTR = kill -> the first step committed after it; the breakdown (detect, membership, rebuild,
  state transfer, first step) comes from the recovering member's event log.  A kill is "inside"
  a collective when the recovering member had waited in the failed all-reduce for more than
  2 ms, else "between" steps.
* **Overhead**: steady-state seconds per step (after a warm-up) of the same script under plain
  ``torch.distributed`` DDP (``python -m torch.distributed.run``) and under ``chameleon-ft run``,
  alternating, median of ``--repeats`` runs each; overhead = ft / ddp - 1.

Wall-clock timings on a shared 2-core machine: read the medians and ratios, not single runs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from chameleon_ft.cli.localjob import LocalJob

SCRIPT = Path(__file__).with_name("_train_bench.py")
PHASES = ["detect", "membership", "rebuild", "state_transfer", "first_step"]


def one_kill(root: Path, rng: random.Random, mb_sleep: float, join_ms: int) -> dict:
    job = LocalJob(root, SCRIPT, ["--mode", "ft", "--out", str(root / "stamps.json"), "--steps", "60",
                                  "--mb-sleep", str(mb_sleep)], nproc=4, hang_timeout=5,
                   launch_args=["--join-timeout-ms", str(join_ms)])
    try:
        job.start()
        victim, step = rng.randrange(4), rng.randrange(5, 30)
        job.wait_step(step)
        time.sleep(rng.uniform(0, 2 * mb_sleep + 0.01))
        t_kill = job.kill(victim)
        codes = job.wait(120)
        if codes != [0]:
            raise RuntimeError(f"job failed ({codes}):\n{job.output()[-3000:]}")
        rec = next(e for e in job.events() if e["event"] == "recovery")
        return {"where": "inside" if rec["mttr"]["detect"] > 0.002 else "between",
                "mttr": rec["ts"] - t_kill, **{k: rec["mttr"].get(k, 0.0) for k in PHASES}}
    finally:
        job.cleanup()


def seconds_per_step(stamps: list[float], warmup: int) -> float:
    s = stamps[warmup:]
    return (s[-1] - s[0]) / (len(s) - 1)


def one_run(mode: str, root: Path, steps: int, mb_sleep: float) -> float:
    root.mkdir(parents=True, exist_ok=True)
    out = root / f"{mode}.json"
    args = ["--mode", mode, "--out", str(out), "--steps", str(steps), "--mb-sleep", str(mb_sleep)]
    if mode == "ddp":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               str(SCRIPT), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode:
            raise RuntimeError(f"plain DDP run failed:\n{proc.stderr[-3000:]}")
    else:
        job = LocalJob(root / "ft", SCRIPT, args, nproc=4, hang_timeout=5)
        try:
            job.start()
            if job.wait(300) != [0]:
                raise RuntimeError(f"chameleon-ft run failed:\n{job.output()[-3000:]}")
        finally:
            job.cleanup()
    return seconds_per_step(json.loads(out.read_text())["stamps"], warmup=5)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=9)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--mb-sleep", type=float, default=0.025)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--join-timeout-ms", type=int, default=50, help="passed to chameleon-ft run")
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args(argv)
    rng = random.Random(a.seed)
    result: dict = {"mb_sleep": a.mb_sleep, "mode": "accelerator emulation", "join_timeout_ms": a.join_timeout_ms,
                    "kills": [], "overhead": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.kills):
            row = one_kill(Path(tmp) / f"kill{i}", rng, a.mb_sleep, a.join_timeout_ms)
            result["kills"].append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        times: dict[str, list[float]] = {"ddp": [], "ft": []}
        for r in range(a.repeats):
            for mode in (("ddp", "ft") if r % 2 == 0 else ("ft", "ddp")):
                times[mode].append(one_run(mode, Path(tmp) / f"{mode}{r}", a.steps, a.mb_sleep))
                print(f"{mode} run {r}: {times[mode][-1] * 1e3:.1f} ms/step", flush=True)
    print(f"\nMTTR, 4 workers, {2 * a.mb_sleep * 1e3:.0f} ms emulated compute step, "
          f"join timeout {a.join_timeout_ms} ms, medians:")
    print("| kill | n | MTTR | " + " | ".join(PHASES) + " |")
    print("| --- | ---: | ---: |" + " ---: |" * len(PHASES))
    for where in ("inside", "between", "all"):
        sel = [r for r in result["kills"] if where == "all" or r["where"] == where]
        if sel:
            med = {k: statistics.median(r[k] for r in sel) for k in ["mttr"] + PHASES}
            result.setdefault("mttr_median", {})[where] = med
            print(f"| {where} | {len(sel)} | " + " | ".join(f"{med[k] * 1e3:.0f} ms" for k in ["mttr"] + PHASES) + " |")
    if a.repeats:
        ddp, ft = statistics.median(times["ddp"]), statistics.median(times["ft"])
        result["overhead"] = {"ddp_s_per_step": ddp, "ft_s_per_step": ft, "overhead": ft / ddp - 1,
                              "runs": times}
        print(f"\nfailure-free: plain DDP {ddp * 1e3:.1f} ms/step, chameleon-ft {ft * 1e3:.1f} ms/step, "
              f"overhead {100 * (ft / ddp - 1):+.1f} % (median of {a.repeats} runs each)")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
