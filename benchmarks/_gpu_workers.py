"""Worker processes of ``benchmarks/gpu_check.py`` (issue 25): one model, one dataset, run by
every executor, by both adapters and by the baselines on the same device.

* ``elastic``: ``ElasticTrainer`` -- data parallel, ``stages=2`` (pipeline) or
  ``sharding="full"`` -- under ``chameleon-ft run``;
* ``accelerate``: an ordinary Accelerate loop with ``FaultTolerantAccelerator`` (the one-line
  change), ``cpu=`` only with ``--cpu``;
* ``lightning``: a ``LightningModule`` and ``Trainer(accelerator="gpu" | "cpu", strategy="ddp",
  callbacks=[FaultToleranceCallback()])``;
* ``perf`` / ``perf-ddp``: the step at size, failure-free -- a GPT-2-small-shaped causal LM in
  bf16 under ``ElasticTrainer`` and under plain DDP with the same loop (the same micro-batches,
  ``no_sync`` on all but the last, each collated from ``dataset[i]``): step time, peak memory and
  host syncs per step (``torch.cuda.set_sync_debug_mode``) after a warm-up;
* baselines under ``torchrun``, torch as shipped: plain DDP, plain FSDP2 (``fully_shard``),
  ``torch.distributed.pipelining`` (``Schedule1F1B``, 2 pipelines x 2 stages, the stages'
  gradients all-reduced between the pipelines).

The device: ``--cpu``; or ``--per-gpu`` (one worker per GPU, ``cuda:<local rank>``, NCCL); or
``cuda:0`` shared by every worker (gloo on CUDA tensors).  Each worker writes
``<out>/final_<worker id or rank>.json``: its parameters (data parallel, adapters, sharded: the
whole model; pipeline: its blocks), every committed step's wall time and memory (the device's
allocated and peak-since-the-last-step MB; the process's RSS on the CPU).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

STEPS_PER_EPOCH, DIM = 8, 32
MICRO = 4  # ElasticTrainer's micro-batch here (the baselines split their share alike)
LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))  # read before accelerate_ft hides it


def device_of(a):
    import torch

    if a.cpu:
        return torch.device("cpu")
    dev = torch.device("cuda", LOCAL_RANK % torch.cuda.device_count() if a.per_gpu else 0)
    torch.cuda.set_device(dev)
    return dev


def data(a):
    import torch

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(STEPS_PER_EPOCH * a.global_batch, DIM, generator=g)
    y = torch.tanh(x @ torch.randn(DIM, 4, generator=g))
    return torch.utils.data.TensorDataset(x, y)


def blocks(a):
    """The model as 4 blocks (the pipeline splits them 2 + 2); seeded alike everywhere."""
    import torch

    torch.manual_seed(7)
    out = [torch.nn.Sequential(torch.nn.Linear(DIM, a.hidden), torch.nn.Tanh())]
    out += [torch.nn.Sequential(torch.nn.Linear(a.hidden, a.hidden), torch.nn.Tanh()) for _ in range(2)]
    out.append(torch.nn.Linear(a.hidden, 4))
    return out


class Memory:
    """Per committed step: (step, wall time, allocated MB, peak MB since the last record)."""

    def __init__(self, device):
        self.device, self.rows = device, []

    def mb(self) -> tuple[float, float]:
        import torch

        if self.device.type == "cuda":
            a, p = torch.cuda.memory_allocated(self.device), torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return a / 2**20, p / 2**20
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        return rss, rss

    def step(self, step: int) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        self.rows.append([int(step), time.time(), *self.mb()])


def write(a, who: int, params: dict, mem: Memory, **extra) -> None:
    Path(a.out, f"final_{who}.json").write_text(json.dumps(
        {"params": {k: v.detach().cpu().tolist() for k, v in params.items()}, "steps": mem.rows,
         "device": str(mem.device), **extra}))


def mse(out, y):
    import torch

    return torch.nn.functional.mse_loss(out, y.to(out.device))


# ------------------------------------------------------------------ chameleon-ft
def elastic(a) -> None:
    import torch

    from chameleon_ft import ElasticTrainer, elastic_main
    from chameleon_ft.runtime.recovery import ElasticConfig

    def main():
        torch.set_num_threads(1)
        device = device_of(a)
        model = torch.nn.Sequential(*blocks(a)).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        mem = Memory(device)
        cfg = ElasticConfig(stragglers=False)
        on_step = lambda ctx: mem.step(ctx.step)  # noqa: E731
        if a.kind == "pipeline":
            tr = ElasticTrainer(model, opt, data(a), lambda out, b: mse(out, b[1]), a.global_batch, MICRO, stages=2,
                                on_step=on_step,
                                input_fn=lambda b: b[0].to(device), config=cfg)
        else:
            def loss_fn(m, batch):
                return mse(m(batch[0].to(device)), batch[1])
            tr = ElasticTrainer(model, opt, data(a), loss_fn, a.global_batch, MICRO, on_step=on_step, config=cfg,
                                sharding="full" if a.kind == "sharded" else None, snapshot_every=2)
        tr.fit(epochs=a.epochs)
        ctx = tr.ctx
        if a.kind == "pipeline":
            params = {f"{b}.{k}": v for b in sorted(ctx.held) for k, v in ctx.blocks[b].state_dict().items()}
        else:
            params = dict(model.state_dict())
        write(a, ctx.worker_id, params, mem)

    elastic_main(main)


def accelerate(a) -> None:
    import torch
    from torch.utils.data import DataLoader

    from accelerate_ft import FaultTolerantAccelerator

    torch.set_num_threads(1)
    acc = FaultTolerantAccelerator(cpu=a.cpu)
    model = torch.nn.Sequential(*blocks(a))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    dl = DataLoader(data(a), batch_size=a.global_batch // a.world, shuffle=True)
    model, opt, dl = acc.prepare(model, opt, dl)
    mem = Memory(acc.device)
    for _ in range(a.epochs):
        for x, y in dl:
            loss = mse(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            if acc.sync_gradients:
                mem.step(acc.ft_context.step)
    acc.wait_for_everyone()
    write(a, int(os.environ["CHAMELEON_FT_WORKER_ID"]), dict(acc.unwrap_model(model).state_dict()), mem)
    acc.end_training()


def lightning(a) -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from lightning_ft import FaultToleranceCallback

    torch.set_num_threads(1)

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(*blocks(a))

        def training_step(self, batch, i):
            return mse(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=3e-3)

    class Record(pl.Callback):
        def __init__(self):
            self.mem = None

        def on_train_batch_end(self, trainer, lm, *args):
            self.mem = self.mem or Memory(lm.device)
            self.mem.step(trainer.global_step)

    rec = Record()
    # One GPU shared by every worker: Lightning is given that one device (devices=N would ask
    # for N GPUs); one GPU per worker: devices=N, each worker on its local rank's.
    trainer = pl.Trainer(accelerator="cpu" if a.cpu else "gpu", devices=a.world if a.per_gpu else 1,
                         strategy="ddp", max_epochs=a.epochs, callbacks=[FaultToleranceCallback(), rec],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    model = Net()
    trainer.fit(model, DataLoader(data(a), batch_size=a.global_batch // a.world, shuffle=True))
    write(a, int(os.environ["CHAMELEON_FT_WORKER_ID"]), {f"net.{k}": v for k, v in model.net.state_dict().items()},
          rec.mem)


# ------------------------------------------------------------------ the step at size (perf)
PERF_SIZES = {  # layers, width, heads, vocabulary, sequence
    "gpt2": (12, 768, 12, 50257, 256),  # GPT-2 small: 124 M parameters (tied embedding)
    "tiny": (2, 128, 4, 1024, 64),  # the CPU's stand-in (--cpu): the same code, seconds not hours
}


def perf_model(a):
    """A GPT-2-shaped causal LM (pre-norm blocks, GELU, tied embedding) in bf16, seeded alike."""
    import torch

    layers, width, heads, vocab, seq = PERF_SIZES[a.perf_size]

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = torch.nn.Embedding(vocab, width)
            self.pos = torch.nn.Embedding(seq, width)
            block = dict(d_model=width, nhead=heads, dim_feedforward=4 * width, dropout=0.0, activation="gelu",
                         batch_first=True, norm_first=True)
            self.blocks = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(**block) for _ in range(layers))
            self.norm = torch.nn.LayerNorm(width)
            self.head = torch.nn.Linear(width, vocab, bias=False)
            self.head.weight = self.tok.weight
            self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

        def forward(self, x):
            h = self.tok(x) + self.pos.weight[:x.shape[1]]
            for b in self.blocks:
                h = b(h, src_mask=self.mask[:x.shape[1], :x.shape[1]].to(h.dtype), is_causal=True)
            return self.head(self.norm(h))

    torch.manual_seed(11)
    return LM().to(torch.bfloat16)


def perf_data(a, n: int):
    import torch

    *_, vocab, seq = PERF_SIZES[a.perf_size]
    tokens = torch.randint(0, vocab, (n, seq + 1), generator=torch.Generator().manual_seed(5))
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def perf_loss(model, batch, device):
    import torch

    x, y = batch
    logits = model(x.to(device, non_blocking=True))
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.to(device, non_blocking=True).flatten())


class PerfRecord:
    """Step ends after ``warmup`` steps: wall time per step, peak memory, and the host syncs
    ``torch.cuda.set_sync_debug_mode("warn")`` reported (CUDA; None on the CPU).  The device is
    synchronised at the window's two ends only, outside the count."""

    def __init__(self, device, warmup: int, steps: int):
        import warnings

        import torch

        self.device, self.warmup, self.steps, self.n = device, warmup, steps, 0
        self.cuda = device.type == "cuda"
        self._catch = warnings.catch_warnings(record=True)
        self.caught = self._catch.__enter__()
        warnings.simplefilter("always")
        self.t0 = self.t1 = self.w0 = self.syncs = None
        self.start_mb = self._rss_mb() if not self.cuda else 0.0
        if self.cuda:
            torch.cuda.set_sync_debug_mode("warn")

    @staticmethod
    def _rss_mb() -> float:
        from _step_bench import _status_kb

        return _status_kb("VmRSS") / 1024

    def step(self, *_) -> None:
        import torch

        self.n += 1
        if self.n == self.warmup:
            if self.cuda:
                torch.cuda.synchronize(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
            else:
                from _step_bench import Memory

                Memory._reset()
            self.w0, self.t0 = self._syncs(), time.perf_counter()
        elif self.n == self.steps:
            self.syncs = self._syncs() - self.w0
            if self.cuda:
                torch.cuda.synchronize(self.device)
            self.t1 = time.perf_counter()

    def _syncs(self) -> int:
        return sum("synchronizing" in str(w.message) for w in self.caught) if self.cuda else 0

    def result(self) -> dict:
        import torch

        self._catch.__exit__(None, None, None)
        n = self.steps - self.warmup
        if self.cuda:
            torch.cuda.set_sync_debug_mode(0)
            peak = torch.cuda.max_memory_allocated(self.device) / 2**20
        else:
            from _step_bench import _status_kb

            peak = _status_kb("VmHWM") / 1024 - self.start_mb
        return {"step_s": (self.t1 - self.t0) / n, "syncs_per_step": self.syncs / n if self.cuda else None,
                "peak_mb": peak, "device": str(self.device)}


def _perf_shape(a) -> tuple[int, int, int]:
    """(micro-batch, micro-batches per worker and step, global batch)."""
    return a.perf_micro, 2, a.world * a.perf_micro * 2


def perf(a) -> None:
    """``ElasticTrainer`` at size (``perf_model``), failure-free."""
    import torch

    from chameleon_ft import ElasticTrainer, elastic_main

    def main():
        torch.set_num_threads(1)
        device = device_of(a)
        micro, _, glob = _perf_shape(a)
        rec = PerfRecord(device, a.perf_warmup, a.perf_steps)
        model = perf_model(a).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tr = ElasticTrainer(model, opt, perf_data(a, glob * a.perf_steps), lambda m, b: perf_loss(m, b, device),
                            glob, micro, shuffle=False, on_step=rec.step)
        tr.fit(max_steps=a.perf_steps)
        if tr.ctx.rank == 0:
            Path(a.out, "perf_0.json").write_text(json.dumps(rec.result()))

    elastic_main(main)


def perf_ddp(a) -> None:
    """Plain DDP, the same loop as ``ElasticTrainer``'s: each worker's micro-batches of the step
    collated from ``dataset[i]``, ``no_sync`` on all but the last, each loss weighted by its share."""
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.utils.data import default_collate

    dist.init_process_group(_backend(a))
    torch.set_num_threads(1)
    device = device_of(a)
    r, n = dist.get_rank(), dist.get_world_size()
    micro, mbs, glob = _perf_shape(a)
    rec = PerfRecord(device, a.perf_warmup, a.perf_steps)
    net = torch.nn.parallel.DistributedDataParallel(perf_model(a).to(device))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    ds = perf_data(a, glob * a.perf_steps)
    for step in range(a.perf_steps):
        for k in range(mbs):
            lo = step * glob + (r * mbs + k) * micro
            batch = default_collate([ds[i] for i in range(lo, lo + micro)])
            with net.no_sync() if k < mbs - 1 else contextlib.nullcontext():
                (perf_loss(net, batch, device) / mbs).backward()  # DDP averages over the n workers
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec.step()
    if r == 0:
        Path(a.out, "perf_0.json").write_text(json.dumps(rec.result()))
    dist.destroy_process_group()


# ------------------------------------------------------------------ baselines (torchrun)
def _share(a, step: int, r: int, n: int):
    ds = data(a)
    i = (step % STEPS_PER_EPOCH) * a.global_batch
    per = a.global_batch // n
    return ds.tensors[0][i + r * per:i + (r + 1) * per], ds.tensors[1][i + r * per:i + (r + 1) * per]


def _backend(a) -> str:
    return "nccl" if a.per_gpu else "gloo"


def _plain_loop(a, model, r: int, n: int, device) -> None:
    """The data-parallel baselines' loop, on equal terms with what they are compared to: each
    rank's share of the step's batch in ``a.plain_mbs`` micro-batches (``ElasticTrainer``'s
    micro-batches of 4; the adapters' one batch per worker), each collated from ``dataset[i]``,
    the gradient reduced after the last only (DDP's ``no_sync``, FSDP2's
    ``set_requires_gradient_sync``)."""
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.utils.data import default_collate

    ds = data(a)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    mem = Memory(device)
    per = a.global_batch // n
    micro = per // a.plain_mbs
    for step in range(STEPS_PER_EPOCH * a.epochs):
        lo = (step % STEPS_PER_EPOCH) * a.global_batch + r * per
        for k in range(a.plain_mbs):
            last = k == a.plain_mbs - 1
            x, y = default_collate([ds[i] for i in range(lo + k * micro, lo + (k + 1) * micro)])
            if hasattr(model, "set_requires_gradient_sync"):
                model.set_requires_gradient_sync(last)
            with model.no_sync() if hasattr(model, "no_sync") and not last else contextlib.nullcontext():
                (mse(model(x.to(device)), y) / a.plain_mbs).backward()
        opt.step()
        opt.zero_grad()
        mem.step(step + 1)
    write(a, r, {}, mem)
    dist.destroy_process_group()


def plain_ddp(a) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(_backend(a))
    device = device_of(a)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*blocks(a)).to(device))
    _plain_loop(a, model, dist.get_rank(), dist.get_world_size(), device)


def plain_fsdp(a) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(_backend(a))
    device = device_of(a)
    model = torch.nn.Sequential(*blocks(a)).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for child in model:
        fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _plain_loop(a, model, dist.get_rank(), dist.get_world_size(), device)


def plain_pipe(a) -> None:
    """2 pipelines x 2 stages (world 4): Schedule1F1B on each pipeline's group, then each
    stage's gradients averaged with the other pipeline's same stage."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    dist.init_process_group(_backend(a))
    r, n = dist.get_rank(), dist.get_world_size()
    if n != 4:
        raise SystemExit("the pipelining baseline runs 2 pipelines x 2 stages: world 4")
    device = device_of(a)
    pipe, stage = divmod(r, 2)
    pp = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    sub = torch.nn.Sequential(*blocks(a)[2 * stage:2 * stage + 2]).to(device)
    micro = MICRO
    st = PipelineStage(sub, stage, 2, device, input_args=torch.zeros(micro, DIM if stage == 0 else a.hidden,
                                                                      device=device), group=pp[pipe])
    sched = Schedule1F1B(st, a.global_batch // 2 // micro, loss_fn=mse)
    opt = torch.optim.Adam(sub.parameters(), lr=3e-3)
    mem = Memory(device)
    for step in range(STEPS_PER_EPOCH * a.epochs):
        x, y = _share(a, step, pipe, 2)
        if stage == 0:
            sched.step(x.to(device))
        else:
            sched.step(target=y.to(device))
        grads = [p.grad for p in sub.parameters()]
        flat = torch.nn.utils.parameters_to_vector(grads)
        dist.all_reduce(flat, group=dp[stage])
        torch.nn.utils.vector_to_parameters(flat / 2, grads)  # the stage's gradients, averaged
        opt.step()
        opt.zero_grad()
        mem.step(step + 1)
    write(a, r, {}, mem)
    dist.destroy_process_group()


ADAPTERS = {"accelerate": accelerate, "lightning": lightning, "perf": perf}
BASELINES = {"dp": plain_ddp, "sharded": plain_fsdp, "pipeline": plain_pipe, "perf": perf_ddp}
