"""The GPU check (issue 25): every executor on the accelerator, killed from outside, checked.

    python benchmarks/gpu_check.py [--cpu] [--quick] [--kinds dp,pipeline,sharded] [--json F]

One script a person with one GPU (or many) runs, in a few minutes, and that CI runs on the CPU
(``--cpu``), so that the GPU minutes go to running it, not to writing it.  For each kind --
data parallel (``ElasticTrainer``), pipeline (``stages=2``), sharded (``sharding="full"``) --
it runs 4 workers under ``chameleon-ft run`` on one device (``cuda:0``, or the CPU with
``--cpu``), once failure-free and once with worker 2 SIGKILLed from outside at step 6, and
checks:

* **exactly once**: every step committed once, every sample of every epoch once (event log);
* **replicas agree**: the survivors' parameters are bitwise equal (data parallel; the sharded
  job's gathered model);
* **trajectory**: the killed run's final parameters within 1e-5 (relative) of the failure-free
  run's (reroute and recompute keep the trajectory; only summation order differs);
* **MTTR**: the kill to the survivors' first step, and the runtime's own breakdown;
* **memory**: each worker's peak accelerator memory before the kill and after the recovery
  (``torch.cuda.max_memory_allocated``; host RSS with ``--cpu``);
* **overhead**: data parallel only -- the failure-free step time against plain DDP
  (``torch.nn.parallel.DistributedDataParallel`` over ``torchrun``) on the same device.
  Not yet: FSDP2 and ``torch.distributed.pipelining`` baselines here (they are in
  ``benchmarks/sharded_bench.py`` and ``benchmarks/pipeline_bench.py`` for the CPU);
* **NCCL** (a CUDA device only): one NCCL process group created, used, aborted and made again
  inside one process.

Several workers share one GPU, and NCCL refuses two ranks on one device, so the tensor
collectives there go over gloo on CUDA tensors (gloo stages them through host memory).  With two
GPUs or more, the runtime's NCCL path (one rank per GPU) is not written yet: the script says so.
Results: a table on stdout, ``--json`` for the record (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("dp", "pipeline", "sharded")
KILL_AT, VICTIM, STEPS_PER_EPOCH, DIM = 6, 2, 8, 32


# ------------------------------------------------------------------ the worker
def worker(a) -> None:
    import torch

    from chameleon_ft import ElasticTrainer, elastic_main
    from chameleon_ft.runtime.recovery import ElasticConfig

    def main():
        torch.set_num_threads(1)
        device = torch.device("cpu") if a.cpu else torch.device("cuda", 0)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        g = torch.Generator().manual_seed(1234)
        n = STEPS_PER_EPOCH * a.global_batch
        x = torch.randn(n, DIM, generator=g)
        y = torch.tanh(x @ torch.randn(DIM, 4, generator=g))
        data = torch.utils.data.TensorDataset(x, y)
        torch.manual_seed(7)
        blocks = [torch.nn.Sequential(torch.nn.Linear(DIM, a.hidden), torch.nn.Tanh())]
        blocks += [torch.nn.Sequential(torch.nn.Linear(a.hidden, a.hidden), torch.nn.Tanh()) for _ in range(2)]
        blocks.append(torch.nn.Linear(a.hidden, 4))
        model = torch.nn.Sequential(*blocks).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        mem, steps = {}, []

        def peak() -> float:
            if device.type == "cuda":
                return torch.cuda.max_memory_allocated(device) / 2**20
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

        def on_step(ctx):
            steps.append([ctx.step, time.time()])
            if ctx.step == KILL_AT - 1:
                mem["before"] = peak()
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
        if a.kind == "pipeline":
            loss_fn = lambda out, batch: torch.nn.functional.mse_loss(out, batch[1].to(device))  # noqa: E731
            tr = ElasticTrainer(model, opt, data, loss_fn, a.global_batch, 4, stages=2, on_step=on_step,
                                input_fn=lambda b: b[0].to(device), config=ElasticConfig(stragglers=False))
        else:
            def loss_fn(m, batch):
                xb, yb = batch
                return torch.nn.functional.mse_loss(m(xb.to(device)), yb.to(device))
            tr = ElasticTrainer(model, opt, data, loss_fn, a.global_batch, 4, on_step=on_step,
                                config=ElasticConfig(stragglers=False),
                                sharding="full" if a.kind == "sharded" else None, snapshot_every=2)
        tr.fit(epochs=a.epochs)
        ctx = tr.ctx
        mem["after"] = peak()
        if a.kind == "pipeline":
            params = {f"{b}.{k}": v.detach().cpu().tolist() for b in sorted(ctx.held)
                      for k, v in ctx.blocks[b].state_dict().items()}
        else:
            params = {k: v.detach().cpu().tolist() for k, v in model.state_dict().items()}
        Path(a.out, f"final_{ctx.worker_id}.json").write_text(json.dumps(
            {"params": params, "mem_mb": mem, "steps": steps, "device": str(device)}))

    elastic_main(main)


def plain_ddp(a) -> None:
    """Plain DDP (torchrun) on the same device: the data-parallel baseline's step time."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    r, n = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if a.cpu else torch.device("cuda", 0)
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, a.hidden), torch.nn.Tanh(), torch.nn.Linear(a.hidden, a.hidden),
                                torch.nn.Tanh(), torch.nn.Linear(a.hidden, a.hidden), torch.nn.Tanh(),
                                torch.nn.Linear(a.hidden, 4)).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(STEPS_PER_EPOCH * a.global_batch, DIM, generator=g)
    y = torch.tanh(x @ torch.randn(DIM, 4, generator=g))
    share = a.global_batch // n
    ts = []
    for step in range(STEPS_PER_EPOCH * a.epochs):
        i = (step % STEPS_PER_EPOCH) * a.global_batch + r * share
        loss = torch.nn.functional.mse_loss(ddp(x[i:i + share].to(device)), y[i:i + share].to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        ts.append(time.time())
    if r == 0:
        Path(a.out, "plain.json").write_text(json.dumps({"steps": ts}))
    dist.destroy_process_group()


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
        before = torch.cuda.memory_allocated()
        pg.abort()
        out[f"{attempt}_aborted"] = True
        out[f"{attempt}_mem_mb"] = before / 2**20
    return out


# ------------------------------------------------------------------ the harness
def _job(out: Path, a, kind: str, kill: bool):
    sys.path.insert(0, str(ROOT))
    from chameleon_ft.cli.localjob import LocalJob

    args = ["--worker", "--kind", kind, "--out", str(out), "--epochs", str(a.epochs), "--hidden", str(a.hidden),
            "--global-batch", str(a.global_batch)] + (["--cpu"] if a.cpu else [])
    job = LocalJob(out, __file__, args, nproc=4, hang_timeout=10, env={"PYTHONPATH": str(ROOT)})
    t_kill = None
    try:
        job.start()
        if kill:
            job.wait_step(KILL_AT, 300)
            t_kill = job.kill(VICTIM)
        codes = job.wait(600)
        if codes != [0]:
            raise RuntimeError(f"{kind} ({'killed' if kill else 'failure-free'}): {codes}\n{job.output()[-3000:]}")
        finals = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in out.glob("final_*.json")}
        return finals, job.events(), t_kill
    finally:
        job.cleanup()


def _flat(params: dict):
    import torch

    return {k: torch.tensor(v) for k, v in params.items()}


def _rel(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).norm() / max(float(b[k].norm()), 1e-12)) for k in b if k in a)


def check(kind: str, a, work: Path) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from _helpers.recovery import committed_ids

    (work / f"{kind}-free").mkdir(parents=True)
    (work / f"{kind}-kill").mkdir(parents=True)
    free, free_ev, _ = _job(work / f"{kind}-free", a, kind, kill=False)
    killed, ev, t_kill = _job(work / f"{kind}-kill", a, kind, kill=True)
    res = {"kind": kind, "device": next(iter(killed.values()))["device"], "survivors": sorted(killed)}
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
    from chameleon_ft.runtime.eventlog import resumed_after

    res["mttr_s"] = resumed_after(ev, t_kill)
    rec = [e for e in ev if e["event"] == "recovery" and e["ts"] > t_kill]
    res["mttr_breakdown"] = rec[0]["mttr"] if rec else None
    res["chosen"] = [e["decision"]["chosen"] for e in ev if e["event"] == "decision"][:1]
    res["mem_mb"] = {w: f["mem_mb"] for w, f in killed.items()}
    free_steps = sorted(s[1] for s in next(iter(free.values()))["steps"])
    gaps = sorted(b - a_ for a_, b in zip(free_steps, free_steps[1:]))
    res["step_s"] = gaps[len(gaps) // 2]
    if kind == "dp":
        res["plain_ddp_step_s"] = _plain_step(a, work)
        res["overhead"] = res["step_s"] / res["plain_ddp_step_s"] - 1
    res["passed"] = bool(res["exactly_once"] and res["trajectory_ok"] and res["replicas_equal"] is not False)
    return res


def _plain_step(a, work: Path) -> float:
    import socket

    out = work / "plain"
    out.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(port),
           __file__, "--plain", "--out", str(out), "--epochs", str(a.epochs), "--hidden", str(a.hidden),
           "--global-batch", str(a.global_batch)] + (["--cpu"] if a.cpu else [])
    subprocess.run(cmd, check=True, capture_output=True, timeout=600,
                   env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT)))
    ts = json.loads((out / "plain.json").read_text())["steps"]
    gaps = sorted(b - a_ for a_, b in zip(ts, ts[1:]))
    return gaps[len(gaps) // 2]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="run on the CPU (CI; no GPU needed)")
    p.add_argument("--quick", action="store_true", help="fewer epochs (CI)")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kind", default="dp", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--epochs", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--global-batch", type=int, default=32, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.epochs = a.epochs or (2 if a.quick else 4)
    if a.worker:
        return worker(a)
    if a.plain:
        return plain_ddp(a)
    import torch

    if not a.cpu and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here; --cpu runs the same checks on the CPU")
    gpus = 0 if a.cpu else torch.cuda.device_count()
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "device": "cpu" if a.cpu else torch.cuda.get_device_name(0), "gpus": gpus, "kinds": {}}
    res["multi_gpu_nccl"] = ("not run: the runtime's NCCL path (one rank per GPU) is not written yet"
                             if gpus >= 2 else "not run: fewer than 2 GPUs")
    res["nccl_abort"] = nccl_abort_check() if not a.cpu else {"ran": False, "why": "--cpu"}
    with tempfile.TemporaryDirectory(prefix="cft-gpu-check-") as tmp:
        for kind in a.kinds.split(","):
            t0 = time.time()
            res["kinds"][kind] = check(kind, a, Path(tmp))
            res["kinds"][kind]["seconds"] = time.time() - t0
            print(json.dumps({k: v for k, v in res["kinds"][kind].items() if k != "mem_mb"}), flush=True)
    res["passed"] = all(r["passed"] for r in res["kinds"].values())
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    print(table(res))
    return res


def table(res: dict) -> str:
    lines = [f"gpu_check on {res['device']} ({res['gpus']} GPU(s)), torch {res['torch']}, {res['date']}",
             "| kind | chosen | exactly once | replicas equal | trajectory (rel) | MTTR s | step s | vs plain DDP | peak MB before / after (worker 0) | passed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for kind, r in res["kinds"].items():
        m = r["mem_mb"].get("0") or r["mem_mb"].get(0) or {}
        ov = f"{100 * r['overhead']:+.1f} %" if "overhead" in r else "-"
        lines.append(f"| {kind} | {','.join(r['chosen'])} | {r['exactly_once']} | {r['replicas_equal']} | "
                     f"{r['trajectory_rel']:.2e} | {r['mttr_s']:.3f} | {r['step_s']:.4f} | {ov} | "
                     f"{m.get('before', 0):.0f} / {m.get('after', 0):.0f} | {r['passed']} |")
    lines.append(f"NCCL abort and re-create: {res['nccl_abort']}")
    lines.append(f"multi-GPU NCCL path: {res['multi_gpu_nccl']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
