"""Sharded (FSDP2) benchmark: issue 23's matrix of rehabilitation against recompute, buddy
snapshots' memory, and failure-free overhead against plain FSDP2, into one page.

    python benchmarks/sharded_bench.py [--parts matrix,memory,overhead] [--seeds 5] [--steps 60]
        [--k 10] [--repeats 2] [--matrix-json F] [--update]
        [--json benchmarks/results/sharded.json] [--markdown docs/benchmarks-sharded.md]

* **Matrix** (``benchmarks/sharded_matrix.py``, its method there): three model kinds, kills
  early/mid/late in the run and in the snapshot interval, default and tuned snapshot
  intervals, seeds; the engine's choice and the other path; lost training time, heal steps
  predicted and measured, final test loss against the failure-free seed spread.
  ``--matrix-json`` renders a result that ``sharded_matrix.py --json`` wrote.
* **Memory**: peak RSS per worker with buddy snapshots every ``k`` steps and without snapshots,
  on a larger model (``--mem-hidden``).
* **Overhead**: steady steps/s of ours (snapshots every ``k``, and at Young/Daly's interval) and
  of plain FSDP2 under torchrun (torch's collectives on a gloo default group), alternating,
  median of ``--repeats``.

Memory and overhead runs are ``benchmarks/_shard_bench.py``: 4 CPU workers, an MLP regression
with Adam, FSDP2 over all 4, accelerator emulation (``--sample-sleep`` seconds per sample).
``--update`` reruns only ``--parts`` and keeps the other parts' results in ``--json``.

Limits, honestly: a shared 2-core machine; read medians and ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "_shard_bench.py"
sys.path.insert(0, str(ROOT))

from chameleon_ft.cli.localjob import LocalJob  # noqa: E402
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness.systems import free_port  # noqa: E402
import sharded_controls  # noqa: E402
import sharded_matrix  # noqa: E402


def steady_step_s(rows, warmup: int) -> float:
    rs = sorted(rows, key=lambda r: r[1])[warmup:]
    return (rs[-1][1] - rs[0][1]) / max(1, len(rs) - 1)


# ------------------------------------------------------------------ runs
def _ours(out: Path, args: Sequence[str], kill: Optional[tuple[int, int]] = None, nproc: int = 4) -> dict:
    job = LocalJob(out, WORKER, ["--out", str(out), *args], nproc=nproc, hang_timeout=10,
                   env={"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    try:
        job.start()
        if kill is not None:
            job.wait_step(kill[1])
            job.kill(kill[0])
        rc = job.wait(600)
        if rc != [0]:
            raise RuntimeError(f"run {out} failed ({rc}):\n{job.output()[-3000:]}")
    finally:
        job.cleanup()
    return _finals(out)


def _plain(out: Path, args: Sequence[str], nproc: int = 4) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                             "--master-port", str(free_port()),
                             str(WORKER), "--mode", "plain", "--out", str(out), *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0:
        raise RuntimeError(f"plain FSDP2 run failed:\n{text[-3000:]}")
    return _finals(out)


def _finals(out: Path) -> dict:
    return {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in out.glob("final_*.json")}


def memory(work: Path, k: int, hidden: int, steps: int, common: list[str]) -> dict:
    out = {}
    for name, snap in (("no snapshots", "0"), (f"snapshots every {k}", str(k))):
        f = _ours(work / f"mem{snap}", [*common, "--hidden", str(hidden), "--steps", str(steps),
                                        "--snapshot-every", snap])
        out[name] = statistics.median(v["rss_mb"] for v in f.values())
    # The survivors of a kill re-shard 4 -> 3 (rows streamed one at a time, no full copy).
    f = _ours(work / "memkill", [*common, "--hidden", str(hidden), "--steps", str(steps),
                                 "--snapshot-every", str(k)], kill=(2, k + 3))
    out[f"snapshots every {k}, kill at step {k + 3} (re-shard 4 -> 3)"] = statistics.median(
        v["rss_mb"] for v in f.values())
    f = _plain(work / "memplain", [*common, "--hidden", str(hidden), "--steps", str(steps)])
    out["plain FSDP2"] = statistics.median(v["rss_mb"] for v in f.values())
    return out


def overhead(work: Path, k: int, steps: int, repeats: int, common: list[str]) -> dict:
    res: dict[str, list[float]] = {"plain FSDP2": [], f"ours, K={k}": [], "ours, K=Young/Daly": []}
    for i in range(repeats):
        res["plain FSDP2"].append(steady_step_s(_plain(work / f"ovp{i}", [*common, "--steps", str(steps)])[0]["rows"], 10))
        f = _ours(work / f"ovk{i}", [*common, "--steps", str(steps), "--snapshot-every", str(k)])
        res[f"ours, K={k}"].append(steady_step_s(f[0]["rows"], 10))
        f = _ours(work / f"ovy{i}", [*common, "--steps", str(steps)])
        res["ours, K=Young/Daly"].append(steady_step_s(f[0]["rows"], 10))
        res.setdefault("young_daly_k", []).append(f[0]["k"])
    med = {name: statistics.median(v) for name, v in res.items()}
    base = med["plain FSDP2"]
    return {"step_s": med, "runs": res,
            "ratio": {name: base / v for name, v in med.items() if name not in ("plain FSDP2", "young_daly_k")}}


def markdown(res: dict, cmd: str) -> str:
    cmds = res.get("commands") or {}
    made = (f"Produced by `{cmd}` ({res['date']})" if len(set(cmds.values())) <= 1 else
            "Produced by " + "; ".join(f"{part}: `{c}`" for part, c in cmds.items()))
    lines = ["# Sharded training (FSDP2): rehabilitate vs recompute", "",
             f"{made}; 4 CPU workers, FSDP2 over all 4, accelerator "
             "emulation; see `benchmarks/sharded_bench.py` for the method.", ""]
    if res.get("matrix"):
        lines += sharded_matrix.markdown(res["matrix"]) + sharded_controls.markdown(res["matrix"])
    mem = res.get("memory")
    if mem:
        lines += ["", "## Peak RSS per worker (median, MB)", "", "| setting | MB |", "|---|---|"]
        lines += [f"| {k} | {v:.0f} |" for k, v in mem.items()]
    ov = res.get("overhead")
    if ov:
        lines += ["", "## Failure-free overhead against plain FSDP2", "",
                  "| system | s/step (median) | plain / ours |", "|---|---|---|"]
        for name, v in ov["step_s"].items():
            if name == "young_daly_k":
                continue
            ratio = ov["ratio"].get(name)
            lines.append(f"| {name} | {v:.4f} | {'' if ratio is None else f'{ratio:.3f}'} |")
        lines.append(f"\nYoung/Daly's K in those runs: {ov['runs'].get('young_daly_k')}.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5, help="matrix: seeds per cell")
    p.add_argument("--steps", type=int, default=60, help="overhead: steps per run")
    p.add_argument("--k", type=int, default=10, help="memory, overhead: a fixed snapshot interval")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--matrix-json", default=None,
                   help="matrix: render this benchmarks/sharded_matrix.py --json result (or several, comma-separated, "
                        "merged) instead of running it")
    p.add_argument("--mem-hidden", type=int, default=1024)
    p.add_argument("--sample-sleep", type=float, default=0.002)
    p.add_argument("--parts", default="matrix,memory,overhead")
    p.add_argument("--update", action="store_true",
                   help="rerun only --parts and keep the other parts' results in --json")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "sharded.json"))
    p.add_argument("--markdown", default=str(ROOT / "docs" / "benchmarks-sharded.md"))
    a = p.parse_args(argv)
    parts = set(a.parts.split(","))
    common = ["--sample-sleep", str(a.sample_sleep), "--lr", "3e-4"]
    work = Path(tempfile.mkdtemp(prefix="cft_sharded_"))
    cmd = ("python benchmarks/sharded_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    res: dict = {}
    if a.update and Path(a.json).exists():  # keep the parts not rerun, with their own commands
        res = json.loads(Path(a.json).read_text())
        res.setdefault("commands", {p_: res.get("command", "python benchmarks/sharded_bench.py")
                                    for p_ in ("matrix", "memory", "overhead") if p_ in res})
        res.pop("recovery", None)  # superseded by the matrix (issue 23)
        res["commands"].pop("recovery", None)
    res.setdefault("commands", {})
    res.update({"date": time.strftime("%Y-%m-%d"), "args": vars(a)})
    res["commands"].update({p_: f"{cmd} ({res['date']})" for p_ in parts})
    try:
        if "matrix" in parts:
            res["matrix"] = (sharded_matrix.merge([json.loads(Path(f).read_text()) for f in a.matrix_json.split(",")])
                             if a.matrix_json else
                             sharded_matrix.main(["--seeds", str(a.seeds), "--workdir", str(work / "matrix")]))
        if "memory" in parts:
            res["memory"] = memory(work, a.k, a.mem_hidden, 30, common)
            print(json.dumps(res["memory"]), flush=True)
        if "overhead" in parts:
            res["overhead"] = overhead(work, a.k, a.steps, a.repeats, common)
            print(json.dumps(res["overhead"]["step_s"]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(res, indent=1))
    Path(a.markdown).write_text(markdown(res, cmd))
    print(f"wrote {a.json} and {a.markdown}")
    return 0


def bench_main(argv) -> int:
    """``chameleon-ft bench --sharded [flags]``."""
    return main([a for a in argv if a != "--sharded"])


if __name__ == "__main__":
    sys.exit(main())
