"""The GPU check (issue 25): every executor and both adapters on the accelerator, killed from
outside, checked against a failure-free run and against torch as shipped on the same device.

    python benchmarks/gpu_check.py [--cpu] [--quick] [--kinds dp,pipeline,sharded,accelerate,lightning]
                                   [--recoveries 3] [--nccl-kinds dp,accelerate,lightning] [--json F]

One script a person with one GPU (or many) runs, in a few minutes, and that CI runs on the CPU
(``--cpu``), so that the GPU minutes go to running it, not to writing it.  For each kind --
data parallel (``ElasticTrainer``), pipeline (``stages=2``), sharded (``sharding="full"``),
Accelerate (``FaultTolerantAccelerator``), Lightning (``FaultToleranceCallback``); the workers
are in ``_gpu_workers.py`` -- it runs 4 workers under ``chameleon-ft run`` sharing one device
(``cuda:0``, or the CPU with ``--cpu``), once failure-free and once with worker 2 SIGKILLed from
outside at step 6 (data parallel: ``--recoveries`` workers, 2, 3 and 1, three steps apart), and
checks:

* **exactly once**: every step committed once, every sample of every epoch once (event log);
* **replicas agree**: the survivors' parameters are bitwise equal (all but the pipeline, whose
  workers hold different blocks);
* **trajectory**: the killed run's final parameters within 1e-5 (relative) of the failure-free
  run's (reroute and recompute keep the trajectory; only summation order differs);
* **MTTR**: each kill to the survivors' first step after it, and the runtime's own breakdown;
* **memory**: worker 0's allocated and peak device memory (``torch.cuda.memory_allocated`` /
  ``max_memory_allocated``; the process's RSS with ``--cpu``) before the first kill and after
  each recovery, and its growth from the first recovery to the last;
* **overhead**: the failure-free step time against torch as shipped on the same device and
  backend under ``torchrun`` -- plain DDP (data parallel and the adapters), plain FSDP2
  (``fully_shard``), ``torch.distributed.pipelining`` (``Schedule1F1B``, 2 x 2, the stages'
  gradients all-reduced).  A baseline that cannot run there is reported with its error: with
  several ranks on one GPU gloo is torch's only choice, and gloo has no CUDA all-gather,
  reduce-scatter or send/recv;
* **the step at size** (``perf``, failure-free, ``--perf-repeats`` runs each, alternating): a
  GPT-2-small-shaped causal LM in bf16 (124 M parameters; ``--perf-size tiny`` on the CPU)
  under ``ElasticTrainer`` against plain DDP running the same loop (the same micro-batches,
  ``no_sync`` on all but the last, each collated from ``dataset[i]``): step time, peak memory
  (``max_memory_allocated``; RSS growth on the CPU) and host syncs per step
  (``torch.cuda.set_sync_debug_mode("warn")``, counted after a warm-up).  One worker on a
  single GPU (several workers sharing it would time gloo's host staging, not the step), one per
  GPU over NCCL with two or more, two on the CPU;
* **NCCL** (a CUDA device only): one NCCL process group created, used, aborted and made again
  inside one process; with 2 GPUs or more the ``--nccl-kinds`` run again with one worker per GPU
  (``CHAMELEON_FT_BACKEND=nccl``, the baselines over NCCL too), a kill included.

Several workers share one GPU, and NCCL refuses two ranks on one device, so the tensor
collectives there go over gloo on CUDA tensors (``CHAMELEON_FT_BACKEND=gloo``).
Results: a table on stdout, ``--json`` for the record (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _gpu_workers as W  # noqa: E402

KINDS = ("dp", "pipeline", "sharded", "accelerate", "lightning")
KILL_AT, STEPS_PER_EPOCH = 6, W.STEPS_PER_EPOCH
RECOVERY_GAP = 3  # steps between the kills of the data-parallel run (--recoveries)


def nccl_abort_check() -> dict:
    """One NCCL group, used, aborted and made again inside this process (world size 1)."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available() or not dist.is_nccl_available():
        return {"ran": False, "why": "no CUDA device" if not torch.cuda.is_available() else "no NCCL in this torch"}
    out = {"ran": True}
    store = dist.HashStore()
    for attempt in ("first", "again"):
        pg = dist.ProcessGroupNCCL(dist.PrefixStore(attempt, store), 0, 1)
        t = torch.ones(4, device="cuda")
        pg.allreduce([t]).wait()
        torch.cuda.synchronize()
        out[attempt] = float(t.sum())
        out[f"{attempt}_mem_mb"] = torch.cuda.memory_allocated() / 2**20
        pg.abort()
        out[f"{attempt}_aborted"] = True
    return out


# ------------------------------------------------------------------ the harness
def _worker_args(a, kind: str, out: Path, nproc: int, per_gpu: bool) -> list[str]:
    return (["--worker", "--kind", kind, "--out", str(out), "--epochs", str(a.epochs), "--hidden", str(a.hidden),
             "--global-batch", str(a.global_batch), "--world", str(nproc), "--perf-size", a.perf_size,
             "--perf-steps", str(a.perf_steps), "--perf-warmup", str(a.perf_warmup), "--perf-micro", str(a.perf_micro)]
            + (["--cpu"] if a.cpu else []) + (["--per-gpu"] if per_gpu else []))


def _env(per_gpu: bool) -> dict:
    # CHAMELEON_FT_LOG_SAMPLES: the sample ids per step the exactly-once check reads
    return {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CHAMELEON_FT_BACKEND": "nccl" if per_gpu else "gloo",
            "CHAMELEON_FT_LOG_SAMPLES": "1"}


def _job(out: Path, a, kind: str, kills: list[tuple[int, int]], nproc: int, per_gpu: bool):
    """Run ``kind`` under ``chameleon-ft run``; ``kills``: (step, worker) SIGKILLed from
    outside in turn, each once that step is reached.  Returns (finals, events, kill times)."""
    from chameleon_ft.cli.localjob import LocalJob

    job = LocalJob(out, __file__, _worker_args(a, kind, out, nproc, per_gpu), nproc=nproc, hang_timeout=10,
                   env=_env(per_gpu))
    t_kills = []
    try:
        job.start()
        for step, victim in kills:
            job.wait_step(step, 300)
            t_kills.append(job.kill(victim))
        codes = job.wait(600)
        if codes != [0]:
            raise RuntimeError(f"{kind} ({'killed' if kills else 'failure-free'}): {codes}\n{job.output()[-3000:]}")
        finals = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in out.glob("final_*.json")}
        return finals, job.events(), t_kills
    finally:
        job.cleanup()


def _flat(params: dict):
    import torch

    return {k: torch.tensor(v) for k, v in params.items()}


def _rel(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).norm() / max(float(b[k].norm()), 1e-12)) for k in b if k in a)


def _median_gap(rows) -> float:
    ts = sorted(r[1] for r in rows)
    gaps = sorted(b - a_ for a_, b in zip(ts, ts[1:]))
    return gaps[len(gaps) // 2]


def _memory(rows, t_kills: list[float], after_steps: int = 2) -> dict:
    """Worker 0's device memory (allocated and peak MB) before the first kill and once each
    recovery has run ``after_steps`` steps (the last record before the next kill)."""
    out = {"before": None, "after": []}
    pre = [r for r in rows if r[1] < t_kills[0]] if t_kills else rows
    if pre:
        out["before"] = {"allocated": pre[-1][2], "peak": max(r[3] for r in pre)}
    for i, t in enumerate(t_kills):
        nxt = t_kills[i + 1] if i + 1 < len(t_kills) else float("inf")
        win = [r for r in rows if t < r[1] < nxt]
        if len(win) >= after_steps:
            out["after"].append({"allocated": win[-1][2], "peak": max(r[3] for r in win)})
    if out["after"] and len(t_kills) > 1:
        out["growth_mb"] = out["after"][-1]["allocated"] - out["after"][0]["allocated"]
    return out


def _baseline(a, kind: str, work: Path, nproc: int, per_gpu: bool, mbs: int = 1) -> dict:
    """Torch as shipped on the same device and layout (torchrun), ``mbs`` micro-batches per
    worker and step as the system compared; a baseline that cannot run there (gloo has no CUDA
    all-gather / reduce-scatter / send-recv, NCCL no two ranks on one GPU) is reported with its
    error, not left out silently."""
    out = work / f"plain-{kind}-{mbs}-{'nccl' if per_gpu else 'shared'}"
    out.mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port),
           __file__, "--plain", "--plain-mbs", str(mbs), *_worker_args(a, kind, out, nproc, per_gpu)[1:]]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, **_env(per_gpu)))
    except subprocess.TimeoutExpired:
        return {"ran": False, "error": "timed out after 300 s"}
    if p.returncode != 0:
        return {"ran": False, "error": _worker_error(p.stderr or p.stdout)}
    return {"ran": True, "step_s": _median_gap(json.loads((out / "final_0.json").read_text())["steps"])}


def perf_check(a, work: Path, nproc: int, per_gpu: bool) -> dict:
    """The step at size (module doc): ours and plain DDP, ``--perf-repeats`` runs each,
    alternating; medians and ours/DDP ratios."""
    from chameleon_ft.cli.localjob import LocalJob

    runs: dict = {"ours": [], "ddp": []}
    for r in range(a.perf_repeats):
        for side in (("ours", "ddp") if r % 2 == 0 else ("ddp", "ours")):
            out = work / f"perf-{side}-{r}"
            out.mkdir(parents=True)
            if side == "ddp":
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", 0))
                    port = sock.getsockname()[1]
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                       "--master-port", str(port), __file__, "--plain",
                       *_worker_args(a, "perf", out, nproc, per_gpu)[1:]]
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                                   env=dict(os.environ, **_env(per_gpu)))
                if p.returncode != 0:
                    return {"ran": False, "error": "plain DDP: " + _worker_error(p.stderr or p.stdout)}
            else:
                job = LocalJob(out, __file__, _worker_args(a, "perf", out, nproc, per_gpu), nproc=nproc,
                               hang_timeout=60, env=_env(per_gpu))
                try:
                    job.start()
                    codes = job.wait(900)
                    if codes != [0]:
                        return {"ran": False, "error": f"chameleon-ft: {codes}: {job.output()[-300:]}"}
                finally:
                    job.cleanup()
            runs[side].append(json.loads((out / "perf_0.json").read_text()))
    med = lambda side, k: _median([x[k] for x in runs[side]])  # noqa: E731
    res = {"ran": True, "size": a.perf_size, "workers": nproc, "layout": "NCCL, one GPU per worker" if per_gpu
           else "one device", "runs": runs}
    for k in ("step_s", "peak_mb"):
        res[k] = {"ours": med("ours", k), "ddp": med("ddp", k)}
        res[f"{k}_ratio"] = res[k]["ours"] / res[k]["ddp"] if res[k]["ddp"] else None
    syncs = [x["syncs_per_step"] for x in runs["ours"] + runs["ddp"]]
    res["syncs_per_step"] = ({"ours": med("ours", "syncs_per_step"), "ddp": med("ddp", "syncs_per_step")}
                             if None not in syncs else None)
    return res


def _median(xs: list) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def _worker_error(text: str) -> str:
    """The worker's own exception line (``SomethingError: ...``), not torchrun's summary after it
    (its last line with "error" is ``error_file: <N/A>``: seen on the H200, 2026-12-04)."""
    lines = text.splitlines()
    exc = [ln for ln in lines if re.match(r"\s*(\[rank\d+\]:\s*)?[\w.]*(Error|Exception): ", ln)]
    # A peer's "Connection closed by peer" follows the rank that failed first: that one's, if any.
    exc = [ln for ln in exc if "closed by peer" not in ln and "Connection reset" not in ln] or exc
    err = exc or [ln for ln in lines if "Error" in ln or "error" in ln]
    return (err[0] if exc else err[-1] if err else text[-300:]).strip()[:300]


def check(kind: str, a, work: Path, nproc: int = 4, per_gpu: bool = False) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from _helpers.recovery import committed_ids

    from chameleon_ft.runtime.eventlog import resumed_after

    tag = f"{kind}-{'nccl' if per_gpu else 'shared'}"
    (work / f"{tag}-free").mkdir(parents=True)
    (work / f"{tag}-kill").mkdir(parents=True)
    victims = [w for w in (2, 3, 1) if w < nproc][:a.recoveries if kind == "dp" else 1]
    kills = [(KILL_AT + RECOVERY_GAP * i, v) for i, v in enumerate(victims)]
    free, _, _ = _job(work / f"{tag}-free", a, kind, [], nproc, per_gpu)
    killed, ev, t_kills = _job(work / f"{tag}-kill", a, kind, kills, nproc, per_gpu)
    res = {"kind": kind, "layout": "one GPU per worker, NCCL" if per_gpu else "one device shared, gloo",
           "device": next(iter(killed.values()))["device"], "workers": nproc, "killed": victims,
           "survivors": sorted(killed)}
    ids = committed_ids(ev)
    steps_ok = sorted(ids) == list(range(STEPS_PER_EPOCH * a.epochs))
    seen = [sorted(i for s in range(e * STEPS_PER_EPOCH, (e + 1) * STEPS_PER_EPOCH) for i in ids.get(s, []))
            for e in range(a.epochs)]
    res["exactly_once"] = steps_ok and all(s == list(range(STEPS_PER_EPOCH * a.global_batch)) for s in seen)
    if kind == "pipeline":  # each worker holds its blocks: the union against the failure-free union
        merge = lambda fs: {k: v for f in fs.values() for k, v in _flat(f["params"]).items()}  # noqa: E731
        got, ref = merge(killed), merge(free)
        res["replicas_equal"] = None
    else:
        ws = sorted(killed)
        got, ref = _flat(killed[ws[0]]["params"]), _flat(free[min(free)]["params"])
        res["replicas_equal"] = all(_flat(killed[w]["params"])[k].equal(got[k]) for w in ws[1:] for k in got)
    res["trajectory_rel"] = _rel(got, ref)
    res["trajectory_ok"] = res["trajectory_rel"] < 1e-5
    res["mttr_s"] = [resumed_after(ev, t) for t in t_kills]
    rec = [e for e in ev if e["event"] == "recovery" and e["ts"] > t_kills[0]]
    res["mttr_breakdown"] = rec[0]["mttr"] if rec else None
    res["chosen"] = [e["decision"]["chosen"] for e in ev if e["event"] == "decision"]
    res["memory_mb"] = _memory(killed[0]["steps"], t_kills)
    res["step_s"] = _median_gap(free[min(free)]["steps"])
    base_kind = kind if kind in W.BASELINES else "dp"  # the adapters' baseline is plain DDP
    res["baseline"] = {"dp": "plain DDP", "sharded": "plain FSDP2 (fully_shard)",
                       "pipeline": "torch.distributed.pipelining Schedule1F1B + DP all-reduce"}[base_kind]
    # The micro-batches per worker and step of what is compared: ElasticTrainer's of 4 samples,
    # the adapters' one DataLoader batch (the pipeline baseline runs its own schedule).
    mbs = 1 if kind in W.ADAPTERS else max(1, a.global_batch // (nproc * W.MICRO))
    key = (base_kind, per_gpu, mbs)  # each baseline runs once per layout and shape
    if key not in a.baselines:
        a.baselines[key] = _baseline(a, base_kind, work, nproc, per_gpu, mbs)
    res["baseline_run"] = base = a.baselines[key]
    if base.get("ran"):
        res["overhead"] = res["step_s"] / base["step_s"] - 1
    res["passed"] = bool(res["exactly_once"] and res["trajectory_ok"] and res["replicas_equal"] is not False
                         and all(m is not None for m in res["mttr_s"]))
    return res


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="run on the CPU (CI; no GPU needed)")
    p.add_argument("--quick", action="store_true", help="fewer epochs (CI)")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--nccl-kinds", default="dp,accelerate,lightning",
                   help="with 2 GPUs or more: the kinds also run with one worker per GPU over NCCL")
    p.add_argument("--recoveries", type=int, default=3, help="data parallel: workers killed in turn")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--perf-size", choices=sorted(W.PERF_SIZES), default=None,
                   help="the step at size: gpt2 (GPT-2 small, the GPU's default) or tiny (--cpu's)")
    p.add_argument("--perf-steps", type=int, default=None, help="steps per run (30 on a GPU, 12 on the CPU)")
    p.add_argument("--perf-warmup", type=int, default=5)
    p.add_argument("--perf-micro", type=int, default=4, help="the micro-batch (two per worker and step)")
    p.add_argument("--perf-repeats", type=int, default=2)
    p.add_argument("--no-perf", action="store_true", help="skip the step at size")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--plain-mbs", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--per-gpu", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kind", default="dp", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--epochs", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--global-batch", type=int, default=32, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.epochs = a.epochs or (2 if a.quick else 4)
    a.perf_size = a.perf_size or ("tiny" if a.cpu else "gpt2")
    a.perf_steps = a.perf_steps or (12 if a.cpu else 30)
    if a.worker:
        return W.ADAPTERS.get(a.kind, W.elastic)(a)
    if a.plain:
        return W.BASELINES[a.kind](a)
    import torch

    if not a.cpu and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here; --cpu runs the same checks on the CPU")
    if KILL_AT + RECOVERY_GAP * (a.recoveries - 1) >= STEPS_PER_EPOCH * a.epochs - 2:
        raise SystemExit(f"gpu_check: {a.recoveries} recoveries do not fit in {a.epochs} epochs")
    gpus = 0 if a.cpu else torch.cuda.device_count()
    a.baselines = {}
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "device": "cpu" if a.cpu else torch.cuda.get_device_name(0), "gpus": gpus, "kinds": {}}
    res["nccl_abort"] = nccl_abort_check() if not a.cpu else {"ran": False, "why": "--cpu"}
    runs = [(k, 4, False) for k in a.kinds.split(",") if k]
    if gpus >= 2:
        runs += [(k, min(4, gpus), True) for k in a.nccl_kinds.split(",") if k]
    else:
        res["multi_gpu_nccl"] = "not run: fewer than 2 GPUs"
    with tempfile.TemporaryDirectory(prefix="cft-gpu-check-") as tmp:
        for kind, nproc, per_gpu in runs:
            t0 = time.time()
            key = f"{kind}+nccl" if per_gpu else kind
            res["kinds"][key] = r = check(kind, a, Path(tmp), nproc, per_gpu)
            r["seconds"] = time.time() - t0
            print(json.dumps({k: v for k, v in r.items() if k != "memory_mb"}), flush=True)
        if not a.no_perf:
            t0 = time.time()
            nproc = 2 if a.cpu else (min(4, gpus) if gpus >= 2 else 1)
            res["perf"] = perf_check(a, Path(tmp), nproc, per_gpu=gpus >= 2)
            res["perf"]["seconds"] = time.time() - t0
            print(json.dumps({k: v for k, v in res["perf"].items() if k != "runs"}), flush=True)
    res["passed"] = all(r["passed"] for r in res["kinds"].values())
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    print(table(res))
    return res


def table(res: dict) -> str:
    lines = [f"gpu_check on {res['device']} ({res['gpus']} GPU(s)), torch {res['torch']}, {res['date']}",
             "| run | workers | chosen | exactly once | replicas equal | trajectory (rel) | MTTR s | step s "
             "| vs baseline | memory MB (worker 0): before / after each recovery | passed |",
             "| --- | ---: | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, r in res["kinds"].items():
        m = r["memory_mb"]
        mem = (f"{m['before']['allocated']:.0f} / " if m.get("before") else "- / ") + \
            ", ".join(f"{x['allocated']:.0f}" for x in m["after"])
        if "overhead" in r:
            ov = f"{100 * r['overhead']:+.1f} % ({r['baseline']})"
        else:
            ov = f"{r['baseline']} did not run: {r['baseline_run'].get('error', '')[:80]}"
        lines.append(f"| {key} | {r['workers']} | {','.join(r['chosen'])} | {r['exactly_once']} | {r['replicas_equal']} | "
                     f"{r['trajectory_rel']:.2e} | {', '.join(f'{x:.3f}' for x in r['mttr_s'] if x is not None)} | "
                     f"{r['step_s']:.4f} | {ov} | {mem} | {r['passed']} |")
    pf = res.get("perf")
    if pf and pf.get("ran"):
        sy = pf["syncs_per_step"]
        lines.append(f"the step at size ({pf['size']}, bf16, {pf['workers']} worker(s), {pf['layout']}): "
                     f"ours {pf['step_s']['ours'] * 1e3:.2f} ms vs plain DDP {pf['step_s']['ddp'] * 1e3:.2f} ms "
                     f"({100 * (pf['step_s_ratio'] - 1):+.1f} %); peak memory {pf['peak_mb']['ours']:.0f} vs "
                     f"{pf['peak_mb']['ddp']:.0f} MB ({pf['peak_mb_ratio']:.3f}x); host syncs per step: "
                     + (f"ours {sy['ours']:.2f}, DDP {sy['ddp']:.2f}" if sy else "not counted (no CUDA)"))
    elif pf:
        lines.append(f"the step at size did not run: {pf.get('error')}")
    lines.append(f"NCCL abort and re-create: {res['nccl_abort']}")
    if "multi_gpu_nccl" in res:
        lines.append(f"one worker per GPU over NCCL: {res['multi_gpu_nccl']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
