"""The training script both sides of the pipeline benchmark run: plain ``torch.distributed.pipelining``
(``--mode torch``) or chameleon-ft's DP x PP runtime (``--mode ft``).

    python -m torch.distributed.run --standalone --nproc-per-node 8 benchmarks/_pipe_bench.py --mode torch --out F
    python -m chameleon_ft.cli.launch --nproc-per-node 8 --run-dir D benchmarks/_pipe_bench.py --mode ft --out F

Same model (``--blocks`` MLP blocks), data, global batch, micro-batches, layout (2 pipelines x
``--stages`` stages, blocks split evenly) and emulated compute on both sides: accelerator
emulation, every block's forward padded by ``--block-sleep`` seconds and its backward by twice
that (``_Pad``, a custom autograd function on the block's output), so that a step's time follows
the schedule and the worker count as on accelerators although 8 workers share 2 CPU cores.

The baseline: ranks ``4j..4j+3`` are pipeline ``j`` (stage = rank % stages), each stage a
``PipelineStage`` on the pipeline's own group run by ``Schedule1F1B``; after each step the
gradients are averaged between the two pipelines' same-stage ranks (one all-reduce per stage
group, a flat buffer), then SGD steps.  No fault tolerance.

The writer (rank 0 / worker 0) dumps the wall-clock time of every committed step to ``--out``
(JSON: ``{"mode", "stamps": [[step, time], ...]}``).

Failure-trace knobs (``benchmarks/pipeline_trace.py``):

* ``--slow worker:factor:from_step``: from global step ``from_step`` on, worker ``worker``'s
  emulated compute (the block padding, forward and backward) is ``factor`` times longer -- a
  slower accelerator, the same on both sides (worker = ``CHAMELEON_FT_WORKER_ID`` in ft mode,
  the rank in torch mode; both stay with their slot across replacements / restarts).
* ``--ckpt-dir D`` (torch mode): checkpoint-restart for ``torchrun --max-restarts``.  Every
  ``--ckpt-every`` steps each rank saves its stage's parameters, optimizer state and step
  (``D/rank{r}-{step}.pt``, atomically, the newest two kept); on start every rank loads the
  newest step that *all* ranks saved (an all-reduce MIN: a kill between two ranks' saves leaves
  them one checkpoint apart) with ``weights_only=True`` and resumes after it.  Rank 0 appends
  one line per committed step to ``D/stamps.jsonl`` (``{"step", "ts", "restart"}``: the
  timeline continues across restarts; redone steps appear twice) and every rank appends its
  PID to ``D/pids.jsonl`` on start (so that a benchmark can SIGKILL a rank from outside).

Limits: CPU + gloo only; the baseline assumes exactly two pipelines and ``world == 2 * stages``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

IN, CLASSES, N = 16, 4, 8192
DIM = {"width": 64}  # hidden width (``--dim``)

# Emulated compute multiplier of this worker (``--slow``); set per step by the training loop.
SLOW = {"factor": 1.0}


def slow_factor(spec, worker: int, step: int) -> float:
    """``--slow worker:factor:from_step`` applied to ``worker`` about to run global step ``step``."""
    if not spec:
        return 1.0
    w, factor, start = spec.split(":")
    return float(factor) if worker == int(w) and step >= int(start) else 1.0


class _Pad(torch.autograd.Function):
    """Identity whose forward sleeps ``s`` and backward ``2 s`` (emulated accelerator compute)."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        if s:
            _sleep(s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if ctx.s:
            _sleep(2 * ctx.s)
        return g, None


PADDED = {"s": 0.0}  # seconds this worker spent in the emulated compute's sleeps (``--phases``)


def _sleep(s: float) -> None:
    t0 = time.perf_counter()
    time.sleep(s)
    PADDED["s"] += time.perf_counter() - t0


class Block(torch.nn.Module):
    def __init__(self, i: int, o: int, sleep: float, act: bool):
        super().__init__()
        self.lin, self.sleep, self.act = torch.nn.Linear(i, o), sleep, act

    def forward(self, x):
        y = _Pad.apply(self.lin(x), self.sleep * SLOW["factor"])
        return torch.tanh(y) if self.act else y


def block(i: int, blocks: int, sleep: float) -> Block:
    """Block ``i`` of the MLP (the same on both sides)."""
    dims = [IN] + [DIM["width"]] * (blocks - 1) + [CLASSES]
    return Block(dims[i], dims[i + 1], sleep, i < blocks - 1)


def stage_blocks(lo: int, hi: int, blocks: int, sleep: float) -> torch.nn.Sequential:
    """Blocks ``lo..hi-1`` only, each under its own seed: what a pipeline stage builds (torch's
    pipelining docs: build only the stage's part of the model, e.g. on ``meta``)."""
    mods = []
    for i in range(lo, hi):
        torch.manual_seed(1000 + i)
        mods.append(block(i, blocks, sleep))
    return torch.nn.Sequential(*mods)


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux ``ru_maxrss`` is in kB)."""
    import resource
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def write_memory(path: str, who: int, extra: dict) -> None:
    """``<out>.mem/<who>.json``: this worker's peak RSS and what it held."""
    d = path + ".mem"
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"{who}.json"), "w") as f:
        json.dump({"worker": who, "peak_rss": peak_rss_bytes(), **extra}, f)


class Phases:
    """Per-step seconds of a step's phases on this worker (``--phases``: the profile of
    ``benchmarks/pipeline_profile.py``), written to ``<out>.phases/<who>.json``."""

    def __init__(self, out: str | None):
        self.out, self.rows, self.cur = out, [], {}

    def add(self, name: str, seconds: float) -> None:
        self.cur[name] = self.cur.get(name, 0.0) + seconds

    def step(self, step: int, ts: float) -> None:
        if self.out:
            self.rows.append({"step": step, "ts": ts, "emulated compute (sleeps)": PADDED["s"], **self.cur})
        self.cur, PADDED["s"] = {}, 0.0

    def write(self, who: int) -> None:
        if self.out:
            d = self.out + ".phases"
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, f"{who}.json"), "w") as f:
                json.dump(self.rows, f)


def dataset():
    g = torch.Generator().manual_seed(1234)
    return torch.utils.data.TensorDataset(torch.randn(N, IN, generator=g),
                                          torch.randint(0, CLASSES, (N,), generator=g))


def write(path: str, mode: str, stamps: list, predicted: list = ()) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"mode": mode, "stamps": stamps, "predicted": list(predicted)}, f)
    os.replace(tmp, path)


def run_torch(a) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    P = a.stages
    if world != 2 * P:
        raise SystemExit(f"the baseline runs 2 pipelines x {P} stages: world must be {2 * P}")
    pipe, stage = divmod(rank, P)
    # Every rank creates every group, in the same order (new_group is collective).
    pp = [dist.new_group([j * P + s for s in range(P)]) for j in range(2)]
    dp = [dist.new_group([s, s + P]) for s in range(P)]
    per = a.blocks // P
    sub = stage_blocks(stage * per, (stage + 1) * per, a.blocks, a.block_sleep)
    mbs = a.global_batch // a.micro_batch // 2  # micro-batches per pipeline
    mb_in = torch.zeros(a.micro_batch, IN if stage == 0 else DIM["width"])
    st = PipelineStage(sub, stage, P, torch.device("cpu"), input_args=mb_in, group=pp[pipe])
    ce = torch.nn.CrossEntropyLoss()
    sched = Schedule1F1B(st, mbs, loss_fn=lambda out, y: ce(out, y))
    opt = torch.optim.SGD(sub.parameters(), lr=0.05, momentum=0.9)
    x_all, y_all = dataset().tensors
    half = a.global_batch // 2
    stamps = []
    phases = Phases(a.phases)
    ck = _Checkpoints(a.ckpt_dir, rank) if a.ckpt_dir else None
    start = ck.resume(sub, opt) if ck else 0
    for step in range(start, a.steps):
        SLOW["factor"] = slow_factor(a.slow, rank, step + 1)
        base = (step * a.global_batch) % N + pipe * half
        x, y = x_all[base:base + half], y_all[base:base + half]
        t0 = time.perf_counter()
        if stage == 0:
            sched.step(x)
        elif stage == P - 1:
            sched.step(target=y)
        else:
            sched.step()
        t1 = time.perf_counter()
        grads = [p.grad.reshape(-1) for p in sub.parameters()]
        flat = torch.cat(grads)
        dist.all_reduce(flat, group=dp[stage])
        flat /= 2
        at = 0
        for p in sub.parameters():
            p.grad.copy_(flat[at:at + p.numel()].view_as(p))
            at += p.numel()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        stamps.append([step + 1, time.time()])
        phases.add("pipeline", t1 - t0)
        phases.add("grad reduce", t2 - t1)
        phases.add("optimizer", t3 - t2)
        phases.step(step + 1, t3)
        if ck:
            ck.committed(step + 1, stamps[-1][1])
            if (step + 1) % a.ckpt_every == 0:
                ck.save(step + 1, sub, opt)
    if rank == 0:
        write(a.out, "torch", stamps)
    write_memory(a.out, rank, {"params": sum(p.numel() for p in sub.parameters())})
    phases.write(rank)
    dist.barrier()
    dist.destroy_process_group()


class _Checkpoints:
    """Per-rank stage checkpoints, the stamps log and the PID log of ``--ckpt-dir`` (torch mode)."""

    def __init__(self, root: str, rank: int):
        self.root, self.rank = root, rank
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        os.makedirs(root, exist_ok=True)
        self._append("pids.jsonl", {"rank": rank, "pid": os.getpid(), "restart": self.restart, "ts": time.time()})

    def _append(self, name: str, rec: dict) -> None:
        fd = os.open(os.path.join(self.root, name), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(rec) + "\n").encode())  # one write: lines never interleave
        finally:
            os.close(fd)

    def _path(self, step: int) -> str:
        return os.path.join(self.root, f"rank{self.rank}-{step}.pt")

    def _saved(self) -> list[int]:
        pre = f"rank{self.rank}-"
        return sorted(int(f[len(pre):-3]) for f in os.listdir(self.root) if f.startswith(pre) and f.endswith(".pt"))

    def resume(self, sub, opt) -> int:
        """Load the newest step every rank saved; the step to start from (0: none)."""
        import torch.distributed as dist

        saved = self._saved()
        t = torch.tensor([saved[-1] if saved else 0])
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        step = int(t)
        if step:
            st = torch.load(self._path(step), weights_only=True)
            sub.load_state_dict(st["model"])
            opt.load_state_dict(st["opt"])
        return step

    def save(self, step: int, sub, opt) -> None:
        tmp = self._path(step) + ".tmp"
        torch.save({"model": sub.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
        os.replace(tmp, self._path(step))
        for old in self._saved()[:-2]:
            os.remove(self._path(old))

    def committed(self, step: int, ts: float) -> None:
        if self.rank == 0:
            self._append("stamps.jsonl", {"step": step, "ts": ts, "restart": self.restart})


def _diag_no_start_check() -> None:
    """Diagnostic only (``--diag no-start-check``), not a fix: ``GroupManager.start`` without its
    abort-key look-up (a TCP-store round trip per point-to-point send and receive), to measure
    what that look-up costs a pipeline step.  A failure is still detected by ``wait_p2p``."""
    from chameleon_ft.runtime.groups import GroupManager

    def start(self, fn, check_abort=True):  # (since d5afd2f the runtime skips it for p2p too)
        pg = self.group()
        try:
            return fn(pg)
        except Exception as exc:
            raise self._local_failure(f"collective failed to start: {exc}", "peer_error")

    GroupManager.start = start


def _diag_blocking_p2p() -> None:
    """Diagnostic only (``--diag blocking-p2p``): also ``GroupManager.wait_p2p`` as a plain
    blocking ``Work.wait()`` on the calling thread -- no helper thread, no polling loop, no abort
    or watchdog checks (a dead peer is then only noticed by gloo's own timeout).  Measures what
    the fail-fast wait costs a step; unsafe under failures."""
    from chameleon_ft.runtime.groups import GroupManager

    _diag_no_start_check()

    def wait_p2p(self, works, timeout_s=None):
        for w in works:
            w.wait()

    GroupManager.wait_p2p = wait_p2p


def _time_ft_phases(phases: Phases) -> None:
    """``--phases`` in ft mode: the executor's step phases timed by wrapping its methods (a
    measurement, not a change: the same calls in the same order)."""
    from chameleon_ft.runtime.eventlog import EventLog
    from chameleon_ft.runtime.executors.pipeline import executor as ex, reduce as red

    def timed(name, fn, after=None):
        def wrapper(*args, **kw):
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kw)
            finally:
                phases.add(name, time.perf_counter() - t0)
            if after is not None:
                after(out)
            return out
        return wrapper

    def split(res):  # run_step's own account of its time
        phases.add("pipeline: blocks' compute", res.compute_s)
        phases.add("pipeline: waiting for a peer", res.waited_s)

    ex.run_step = timed("pipeline", ex.run_step, split)
    red.reduce_at_root = timed("commit: the sum through rank 0", red.reduce_at_root)
    EventLog.write = timed("event log writes", EventLog.write)
    cls = ex.PipelineExecutor
    cls._reduce_blocks = timed("grad reduce", cls._reduce_blocks)
    cls._reduce_step = timed("commit (step agreement)", cls._reduce_step)
    cls._apply_update = timed("optimizer", cls._apply_update)
    cls._finish_step = timed("step bookkeeping", cls._finish_step)
    cls._observe_calibration = timed("calibration (the engine's observe)", cls._observe_calibration)


def run_ft(a) -> None:
    from chameleon_ft import ElasticConfig, ElasticTrainer, elastic_main

    if a.diag == "no-start-check":
        _diag_no_start_check()
    elif a.diag == "blocking-p2p":
        _diag_blocking_p2p()

    phases = Phases(a.phases)
    if a.phases:
        _time_ft_phases(phases)

    def main():
        import functools
        if a.build == "factories":  # each worker builds only the blocks it holds
            net = [functools.partial(block, i, a.blocks, a.block_sleep) for i in range(a.blocks)]
        else:  # the whole model on every worker, its other blocks released after the first plan
            net = stage_blocks(0, a.blocks, a.blocks, a.block_sleep)
        opt = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
        ce = torch.nn.CrossEntropyLoss()
        stamps: list = []
        predicted: list = []  # [step, the engine's step time of the running plan, its plan]
        worker = int(os.environ.get("CHAMELEON_FT_WORKER_ID", -1))
        writer = worker == 0
        # A replacement joins mid-run: its first step comes from the trainer, not from 1.
        SLOW["factor"] = 1.0

        def on_step(ctx):
            stamps.append([ctx.step, time.time()])
            phases.step(ctx.step, time.perf_counter())
            SLOW["factor"] = slow_factor(a.slow, worker, ctx.step + 1)
            if writer and a.predict:
                from chameleon_ft.engine.perf import estimate
                pol = ctx.policy
                dead = frozenset(set(pol.plan.devices) - set(pol.alive))
                est = estimate(pol.plan, pol.workload(), pol.cluster(), pol.calibrator.coefficients(), dead)
                predicted.append([ctx.step, est.step_time, pol.plan.describe()])
            if writer and ctx.step % 5 == 0:  # partial results survive an unclean end
                write(a.out, "ft", stamps, predicted)

        allowed = frozenset(a.allowed.split(",")) if a.allowed else None
        trainer = ElasticTrainer(net, opt, dataset(), lambda out, batch: ce(out, batch[1]), a.global_batch,
                                 a.micro_batch, shuffle=False, stages=a.stages, seed=3, on_step=on_step,
                                 config=ElasticConfig(allowed_policies=allowed, log_samples=False,
                                                      emulate_link=tuple(map(float, a.emulate_link.split(":")))
                                                      if a.emulate_link else None,
                                                      device_memory_bytes=a.device_memory,
                                                      overlap_migration=a.overlap))
        trainer.fit(max_steps=a.steps)
        if writer:
            write(a.out, "ft", stamps, predicted)
        ctx = trainer.ctx
        write_memory(a.out, worker, {"params": sum(ctx.block_numel[b] for b in ctx.held),
                                     "made": list(ctx.blockset.made)})
        phases.write(worker)

    elastic_main(main)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["torch", "ft"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--block-sleep", type=float, default=0.004, help="emulated forward per block (s); backward 2x")
    ap.add_argument("--dim", type=int, default=64, help="hidden width of the MLP's blocks")
    ap.add_argument("--build", choices=["factories", "modules"], default="factories",
                    help="ft: blocks as per-block factories (each worker builds its own) or a built model")
    ap.add_argument("--predict", action="store_true",
                    help="ft: worker 0 records the engine's predicted step time of the running plan per step "
                         "(without the rerouted extra micro-batches; off in overhead runs)")
    ap.add_argument("--diag", choices=["no-start-check", "blocking-p2p"], default=None,
                    help="ft: a diagnostic patch of the runtime (see _diag_no_start_check); never in results")
    ap.add_argument("--allowed", default=None, help="ft: comma-separated policies the engine may choose")
    ap.add_argument("--emulate-link", default=None,
                    help="ft: LATENCY_S:BANDWIDTH_BPS, the emulated network of messages between stages and "
                         "migrations (ElasticConfig.emulate_link)")
    ap.add_argument("--device-memory", type=float, default=None,
                    help="ft: each emulated device's memory for the engine (ElasticConfig.device_memory_bytes)")
    ap.add_argument("--overlap", action="store_true",
                    help="ft: migrations run while the job trains rerouted (ElasticConfig.overlap_migration)")
    ap.add_argument("--slow", default=None, metavar="WORKER:FACTOR:FROM_STEP",
                    help="straggler: that worker's emulated compute FACTOR x longer from that step on")
    ap.add_argument("--phases", default=None, metavar="OUT",
                    help="time each step's phases on every worker into OUT.phases/<worker>.json "
                         "(benchmarks/pipeline_profile.py)")
    ap.add_argument("--ckpt-dir", default=None, help="torch: checkpoint-restart directory (see the doc)")
    ap.add_argument("--ckpt-every", type=int, default=10, help="torch: steps between checkpoints")
    a = ap.parse_args()
    DIM["width"] = a.dim
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_torch(a) if a.mode == "torch" else run_ft(a)
