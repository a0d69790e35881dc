"""What one data-parallel step costs against plain DDP, where the difference shows on a CPU.

    python benchmarks/step_cost.py [--cases link,tiny] [--repeats 3] [--json F] [--markdown docs/benchmarks-step.md]

Cases (every figure against plain DDP in the same run, runs alternating; ``benchmarks/_step_bench.py``
is the script every side runs: the same model, samples, micro-batches and collation):

* ``link``: two network-namespace nodes (``tests/_helpers/netns.py``), one worker each, every
  node's egress rate-limited to 1 Gbit/s by ``tc tbf``; 6 x ``Linear(1024, 1024)`` (6.3 M
  parameters, a 25 MB gradient: ~0.2 s over the link) whose every layer's backward also waits
  30 ms of emulated device time (the CPU free meanwhile, as while a GPU computes): reducing
  during backward hides the transfer there.  Plain DDP as shipped (``bucket_cap_mb`` 25) and
  tuned (``bucket_cap_mb=4``: a bucket per layer, as its docs advise for overlap), chameleon-ft
  given the same ``bucket_cap_mb`` (``ElasticConfig.bucket_cap_mb``).  ``--compress bf16``: both
  sides reduce with DDP's compression hook (DDP ``register_comm_hook``, ours
  ``ElasticConfig.grad_compression``).  Needs root and iproute2.
* ``tiny``: two workers on this machine, a 2-layer MLP whose step is 1-2 ms: only the fixed cost
  per step shows (Python, synchronisation, the commit).
* ``solo``: the ``tiny`` step with one worker (a group of one: every collective still goes through
  gloo's queue and worker thread, but no peer is waited for): each system's fixed cost per step
  without the peer's scheduling on a shared 2-core machine, which moves the two-worker step by
  tens of per cent from run to run; the difference in microseconds is what ours adds to a step.
* ``memory``: the ``link`` case's model (6.3 M parameters, no emulated device time), two workers
  on this machine: worker 0's peak resident memory from the start of training (before the model
  is built) to its end, less the resident set then -- the model, its gradients, the optimizer's
  momentum, the gradient buckets and the step's transients.  Plain DDP as shipped and with
  ``gradient_as_bucket_view=True`` (DDP's docs: saves one gradient's size), chameleon-ft without
  and with ``ElasticConfig.gradient_as_bucket_view``.
* ``accelerate``: the ``tiny`` step written as an Accelerate loop (``prepare``, ``backward``,
  ``optimizer.step``): plain ``Accelerator`` under torchrun (DDP, gloo) against
  ``FaultTolerantAccelerator`` under ``chameleon-ft run`` -- the adapter against its plain self;
* ``lightning``: the ``tiny`` step as a ``LightningModule``, ``Trainer(strategy="ddp")`` under
  torchrun against the same plus ``FaultToleranceCallback()`` under ``chameleon-ft run``;
* ``trainer``: the ``tiny`` step under ``transformers.Trainer`` (torchrun) against
  ``FaultTolerantTrainer`` (``chameleon-ft run``), the same ``TrainingArguments``; the plain
  ``Trainer`` tuned as its docs advise (``ddp_find_unused_parameters=False``: it defaults to True
  for a model that is not a ``PreTrainedModel``, a graph walk a step for DDP); ``trainer-shipped``:
  the same against the plain ``Trainer`` as shipped.

* ``calls``: the ``tiny`` step once more for each pair above (``ElasticTrainer`` and each adapter
  against its plain self), worker 0 under cProfile: Python calls (functions and builtins) per
  step over ``--tiny-steps`` steps, start-up included -- a figure that does not move with the
  machine's speed, unlike every timing here.

Step time = median of the gaps between consecutive steps on the lowest-ranked worker, after
``--warmup`` steps; ratio = DDP's steps/s over ours... reported as ours/DDP steps per second.
The 1-2 ms cases also give the median of each repeat's ours/plain ratio (the runs alternate, so
a machine that drifts over the run shows less in it) and the main thread's CPU per step.
Wall-clock timings on a shared 2-core machine: read the medians of the repeats.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from chameleon_ft.cli.localjob import LocalJob  # noqa: E402
from _helpers.recovery import LIGHTNING_PRELOAD, TRAINER_PRELOAD  # noqa: E402

SCRIPT = Path(__file__).with_name("_step_bench.py")
PORT = 29561


def step_seconds(out: Path, warmup: int) -> float:
    stamps = json.loads(out.read_text())["stamps"][warmup:]
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


def step_cpu_seconds(out: Path, warmup: int) -> float:
    """The main thread's CPU seconds per step (mean after ``warmup``): the host's own work."""
    cpu = json.loads(out.read_text())["cpu"][warmup:]
    return (cpu[-1] - cpu[0]) / (len(cpu) - 1)


def _ddp_cmd(nnodes: int, node: int, nproc: int, master: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank", str(node),
            "--nproc-per-node", str(nproc), "--master-addr", master, "--master-port", str(PORT), str(SCRIPT), *args]


def run_link(system: str, bucket_mb, steps: int, work: Path, net, compress=None) -> Path:
    out = work / f"{system}-{bucket_mb}.json"
    args = ["--system", system, "--model", "mlp6", "--out", str(out), "--steps", str(steps), "--micro-batch", "8"]
    if bucket_mb:
        args += ["--bucket-mb", str(bucket_mb)]
    if compress:
        args += ["--compress", compress]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
    if system == "ddp":
        procs = [net.run(i, _ddp_cmd(2, i, 1, net.addr(0), args), env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT) for i in range(2)]
        outs = [p.communicate(timeout=600)[0].decode(errors="replace") for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError(f"plain DDP failed:\n{outs[0][-2000:]}\n{outs[1][-2000:]}")
        return out
    job = LocalJob(work / f"ft-{bucket_mb}", SCRIPT, args, nproc=1, hang_timeout=60, env=env)
    try:
        for i in range(2):
            job.start(extra=["--nnodes", "2", "--node-rank", str(i), "--rdzv-endpoint", f"{net.addr(0)}:{PORT}"],
                      wrap=net.wrap(i))
        if job.wait(600) != [0, 0]:
            raise RuntimeError(f"chameleon-ft failed:\n{job.output()[-3000:]}")
    finally:
        job.cleanup()
    return out


def run_tiny(system: str, steps: int, work: Path, model: str = "tiny", extra: tuple = (), nproc: int = 2) -> Path:
    """``nproc`` workers of ``system`` on this machine (plain ones under torchrun, ours under
    ``chameleon-ft run``); the lowest-ranked worker's output file."""
    tag = "-".join([model, system, *(x.strip("-") for x in extra)] + ([f"n{nproc}"] if nproc != 2 else []))
    out = work / f"{tag}.json"
    args = ["--system", system, "--model", model, "--out", str(out), "--steps", str(steps), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if system in ("ddp", "acc", "pl", "hf", "hf-tuned"):  # under torchrun
        for attempt in range(2):  # (plain Lightning now and then aborts in teardown, after its steps)
            p = subprocess.run(_ddp_cmd(1, 0, nproc, "127.0.0.1", args), capture_output=True, text=True, env=env,
                               timeout=600)
            if not p.returncode:
                return out
            print(f"{system}: the plain run failed (exit {p.returncode}){'; once more' if not attempt else ''}:\n"
                  f"{p.stderr[-1500:]}", flush=True)
        raise RuntimeError(f"plain DDP failed:\n{p.stderr[-3000:]}")
    job = LocalJob(work / f"ft-{tag}", SCRIPT, args, nproc=nproc, hang_timeout=30, env=env)
    try:
        job.start(extra=PRELOAD.get(system, ()))
        if job.wait(600) != [0]:
            raise RuntimeError(f"chameleon-ft failed:\n{job.output()[-3000:]}")
    finally:
        job.cleanup()
    return out


# What the adapters' users preload at launch (docs/lightning.md, docs/transformers.md).
PRELOAD = {"pl-ft": LIGHTNING_PRELOAD, "hf-ft": TRAINER_PRELOAD}


def peak_mb(out: Path) -> tuple[float, float]:
    """Worker 0's peak resident memory over the run and over the steps after the first five
    (start-up's one-off transients left out), each less its resident set when training
    began (MB)."""
    m = json.loads(out.read_text())["memory"]
    return (m["peak_kb"] - m["start_kb"]) / 1024, (m["steady_peak_kb"] - m["start_kb"]) / 1024


LINK_SYSTEMS = [("ddp", None), ("ft", None), ("ddp", 4.0), ("ft", 4.0)]
MEMORY_SYSTEMS = [("ddp", False), ("ft", False), ("ddp", True), ("ft", True)]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="link,tiny")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--link-steps", type=int, default=30)
    ap.add_argument("--tiny-steps", type=int, default=400)
    ap.add_argument("--memory-steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--compress", choices=["fp16", "bf16"], default=None,
                    help="link: both sides reduce with DDP's fp16/bf16 compression hook (ours: "
                         "ElasticConfig.grad_compression)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    a = ap.parse_args(argv)
    res: dict = {"command": "python benchmarks/step_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cases": {}}
    cases = a.cases.split(",")
    with tempfile.TemporaryDirectory(prefix="cft-step-") as tmp:
        work = Path(tmp)
        if "link" in cases:
            from _helpers import netns
            why = netns.available()
            if why:
                raise SystemExit(f"step_cost: the link case {why}")
            runs: dict = {f"{s}/{b or 25}": [] for s, b in LINK_SYSTEMS}
            with netns.Net(2) as net:
                res["link"] = net.limit(a.rate)
                for r in range(a.repeats):
                    order = LINK_SYSTEMS if r % 2 == 0 else LINK_SYSTEMS[::-1]
                    for system, bucket in order:
                        d = work / f"link{r}"
                        d.mkdir(exist_ok=True)
                        s = step_seconds(run_link(system, bucket, a.link_steps, d, net, a.compress), a.warmup)
                        runs[f"{system}/{bucket or 25}"].append(s)
                        print(f"link {system} bucket_cap_mb={bucket or 25}: {s * 1e3:.1f} ms/step", flush=True)
            res["cases"]["link"] = runs
            res["compress"] = a.compress
        if "memory" in cases:
            runs = {f"{s}{'/gav' if g else ''}": [] for s, g in MEMORY_SYSTEMS}
            for r in range(a.repeats):
                for system, gav in (MEMORY_SYSTEMS if r % 2 == 0 else MEMORY_SYSTEMS[::-1]):
                    d = work / f"memory{r}"
                    d.mkdir(exist_ok=True)
                    extra = ("--device-ms", "0", "--micro-batch", "8", *(("--gav",) if gav else ()))
                    run, steady = peak_mb(run_tiny(system, a.memory_steps, d, "mlp6", extra))
                    runs[f"{system}{'/gav' if gav else ''}"].append(steady)
                    runs.setdefault(f"{system}{'/gav' if gav else ''}/run", []).append(run)
                    print(f"memory {system} gradient_as_bucket_view={gav}: peak +{steady:.1f} MB in steps, "
                          f"+{run:.1f} MB over the run", flush=True)
            res["cases"]["memory"] = runs
        for case, pair, _, _ in TINY_CASES:
            if case not in cases:
                continue
            runs = {"ddp": [], "ft": [], "ddp_cpu": [], "ft_cpu": []}
            for r in range(a.repeats):
                for side in ((0, 1) if r % 2 == 0 else (1, 0)):
                    d = work / f"{case}{r}"
                    d.mkdir(exist_ok=True)
                    out = run_tiny(pair[side], a.tiny_steps, d, nproc=NPROC.get(case, 2))
                    s, c = step_seconds(out, a.warmup), step_cpu_seconds(out, a.warmup)
                    runs[("ddp", "ft")[side]].append(s)
                    runs[("ddp_cpu", "ft_cpu")[side]].append(c)
                    print(f"{case} {pair[side]}: {s * 1e3:.3f} ms/step, main thread CPU {c * 1e3:.3f} ms/step", flush=True)
            res["cases"][case] = runs
        if "calls" in cases:
            res["cases"]["calls"] = {case: {side: python_calls(system, a.tiny_steps, work / f"calls-{case}")
                                            for side, system in zip(("plain", "ours"), pair)}
                                     for case, pair, _, _ in TINY_CASES if case not in ("trainer-shipped", "solo")}
            for case, got in res["cases"]["calls"].items():
                print(f"calls {case}: plain {got['plain']:.0f}, ours {got['ours']:.0f} a step", flush=True)
    text = markdown(res)
    print(text)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    if a.markdown:
        Path(a.markdown).write_text(text)
    return res


# The 1-2 ms cases: (case, (plain system, ours) for ``_step_bench.py``, the table's title, their names).
TINY_CASES = (
    ("tiny", ("ddp", "ft"), "A 1-2 ms step, two workers on one machine (the fixed cost per step)",
     ("plain DDP", "chameleon-ft")),
    ("solo", ("ddp", "ft"), "The same step with one worker: each system's fixed cost per step without a peer",
     ("plain DDP", "chameleon-ft")),
    ("accelerate", ("acc", "acc-ft"), "The same step as an Accelerate loop: plain `Accelerator` (DDP under "
     "torchrun) against `FaultTolerantAccelerator`", ("plain Accelerate", "FaultTolerantAccelerator")),
    ("lightning", ("pl", "pl-ft"), "The same step under Lightning: `Trainer(strategy=\"ddp\")` against the same "
     "plus `FaultToleranceCallback()`", ("plain Lightning", "with FaultToleranceCallback")),
    ("trainer", ("hf-tuned", "hf-ft"), "The same step under the HF `Trainer`: `transformers.Trainer` (DDP under "
     "torchrun, `ddp_find_unused_parameters=False` as its docs advise) against `FaultTolerantTrainer`",
     ("plain Trainer, tuned", "FaultTolerantTrainer")),
    ("trainer-shipped", ("hf", "hf-ft"), "The same with the plain `Trainer` as shipped "
     "(`ddp_find_unused_parameters` left to its default, True for this model)",
     ("plain Trainer", "FaultTolerantTrainer")))

NPROC = {"solo": 1}  # workers of a 1-2 ms case (2 unless named)


def python_calls(system: str, steps: int, work: Path) -> float:
    """Python calls a step on worker 0 of ``system`` (cProfile over the whole loop)."""
    import pstats

    work.mkdir(parents=True, exist_ok=True)
    out = run_tiny(system, steps, work, extra=("--profile",))
    return pstats.Stats(str(out) + ".prof").total_calls / steps


def _med(xs) -> float:
    return statistics.median(xs)


def markdown(res: dict) -> str:
    lines = ["# The data-parallel step against plain DDP", "",
             f"`{res['command']}` ({res['date']}; generated by `benchmarks/step_cost.py`, whose docstring "
             "gives the method).  Median ms per step over the repeats (each run's median step); "
             "ratio = chameleon-ft's steps/s over plain DDP's in the same configuration.", ""]
    link = res["cases"].get("link")
    if link:
        squeeze = (f", both sides with DDP's {res['compress']} compression hook (ours: `grad_compression`)"
                   if res.get("compress") else "")
        lines += [f"## Two namespace nodes, 1 Gbit/s link, 6.3 M parameters, 30 ms emulated device time per "
                  f"layer backward ({res.get('link', '')}){squeeze}", "",
                  "| bucket_cap_mb | plain DDP | chameleon-ft | ours / DDP (steps/s) | runs (DDP; ours) |",
                  "| --- | ---: | ---: | ---: | --- |"]
        for b in ("25", "4.0"):
            d, f = link.get(f"ddp/{b}"), link.get(f"ft/{b}")
            if d and f:
                lines.append(f"| {b.replace('.0', '')}{' (as shipped)' if b == '25' else ' (tuned)'} | "
                             f"{_med(d) * 1e3:.1f} ms | {_med(f) * 1e3:.1f} ms | {_med(d) / _med(f):.3f} | "
                             f"{', '.join(f'{x * 1e3:.0f}' for x in d)}; {', '.join(f'{x * 1e3:.0f}' for x in f)} |")
        if link.get("ddp/25") and link.get("ft/4.0"):
            lines += ["", f"Ours at `bucket_cap_mb=4` against DDP as shipped: "
                          f"{_med(link['ddp/25']) / _med(link['ft/4.0']):.3f}."]
        lines.append("")
    mem = res["cases"].get("memory")
    if mem:
        lines += ["## Peak memory: the link case's model (6.3 M parameters: a 24 MiB gradient), two workers "
                  "on one machine", "",
                  "Worker 0's peak resident memory less its resident set when training began (MB): the model, "
                  "its gradients, the optimizer's momentum, the buckets, the step's transients.  *Steps*: the "
                  "peak over the steps after the fifth (freed heap given back to the system first); *run*: "
                  "over the whole run, start-up's one-off transients included (DDP's parameter broadcast, "
                  "chameleon-ft's state broadcast).", "",
                  "| gradient_as_bucket_view | plain DDP, steps | chameleon-ft, steps | ours / DDP, steps | "
                  "plain DDP, run | chameleon-ft, run | ours / DDP, run | runs, steps (DDP; ours) |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for tag, label in (("", "off (as shipped)"), ("/gav", "on (DDP's docs, for memory)")):
            d, f = mem.get(f"ddp{tag}"), mem.get(f"ft{tag}")
            dr, fr = mem.get(f"ddp{tag}/run"), mem.get(f"ft{tag}/run")
            if d and f and dr and fr:
                lines.append(f"| {label} | {_med(d):.1f} | {_med(f):.1f} | {_med(f) / _med(d):.3f} | "
                             f"{_med(dr):.1f} | {_med(fr):.1f} | {_med(fr) / _med(dr):.3f} | "
                             f"{', '.join(f'{x:.1f}' for x in d)}; {', '.join(f'{x:.1f}' for x in f)} |")
        if mem.get("ddp") and mem.get("ft/gav"):
            lines += ["", f"Ours with `gradient_as_bucket_view` against DDP as shipped, steps: "
                          f"{_med(mem['ft/gav']) / _med(mem['ddp']):.3f}."]
        lines.append("")
    for case, _, title, names in TINY_CASES:
        runs = res["cases"].get(case)
        if not runs:
            continue
        d, f = _med(runs["ddp"]), _med(runs["ft"])
        paired = _med([y / x for x, y in zip(runs["ddp"], runs["ft"])])
        lines += [f"## {title}", "",
                  f"| {names[0]} | {names[1]} | overhead | median of the repeats' ratios | runs (plain; ours) |",
                  "| ---: | ---: | ---: | ---: | --- |",
                  f"| {d * 1e3:.3f} ms | {f * 1e3:.3f} ms | {100 * (f / d - 1):+.1f} % | {100 * (paired - 1):+.1f} % | "
                  f"{', '.join(f'{x * 1e3:.3f}' for x in runs['ddp'])}; {', '.join(f'{x * 1e3:.3f}' for x in runs['ft'])} |", ""]
        if runs.get("ddp_cpu") and runs.get("ft_cpu"):
            dc, fc = _med(runs["ddp_cpu"]), _med(runs["ft_cpu"])
            lines += [f"The lowest-ranked worker's main thread, CPU per step (the host's own work, what a "
                      f"launch-bound GPU step pays): {names[0]} {dc * 1e3:.3f} ms, {names[1]} {fc * 1e3:.3f} ms "
                      f"({100 * (fc / dc - 1):+.1f} %).  Ours less plain, medians: {(f - d) * 1e6:+.0f} us a "
                      f"step of wall clock, {(fc - dc) * 1e6:+.0f} us of main-thread CPU.", ""]
    calls = res["cases"].get("calls")
    if calls:
        names = {case: names for case, _, _, names in TINY_CASES}
        lines += ["## Python calls a step (worker 0 under cProfile; does not move with the machine's speed)", "",
                  "| the 1-2 ms step | plain | chameleon-ft | more calls a step |", "| --- | ---: | ---: | ---: |"]
        for case, got in calls.items():
            lines.append(f"| {names[case][0]} / {names[case][1]} | {got['plain']:.0f} | {got['ours']:.0f} | "
                         f"{got['ours'] - got['plain']:+.0f} ({100 * (got['ours'] / got['plain'] - 1):+.1f} %) |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
