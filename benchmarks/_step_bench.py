"""One side of ``benchmarks/step_cost.py``: the same step under plain DDP, chameleon-ft's
``ElasticTrainer``, or an adapter (Lightning, Accelerate, the HF ``Trainer``) and its plain self.

    torchrun ... _step_bench.py --system ddp --model mlp6 --bucket-mb 4 --out F
    chameleon-ft run ... _step_bench.py --system ft --model mlp6 --bucket-mb 4 --out F
    torchrun ... _step_bench.py --system acc --out F         (plain Accelerate: DDP)
    chameleon-ft run ... _step_bench.py --system acc-ft --out F   (FaultTolerantAccelerator)
    torchrun ... _step_bench.py --system pl --out F          (Lightning, strategy="ddp")
    chameleon-ft run ... _step_bench.py --system pl-ft --out F    (+ FaultToleranceCallback)
    torchrun ... _step_bench.py --system hf --out F          (transformers.Trainer: DDP)
    torchrun ... _step_bench.py --system hf-tuned --out F    (the same, ddp_find_unused_parameters=False)
    chameleon-ft run ... _step_bench.py --system hf-ft --out F    (FaultTolerantTrainer)

Every system trains the same model on the same samples: one micro-batch per worker per step,
collated from ``dataset[i]`` the same way (``default_collate``), SGD with momentum.  Models:

* ``tiny``: a 2-layer MLP whose step is 1-2 ms of compute: what shows is the fixed cost per step;
* ``mlp6``: 6 x ``Linear(1024, 1024)`` (6.3 M parameters), each layer's backward followed by
  ``--device-ms`` of emulated device time (a sleep inside autograd: the CPU is free meanwhile,
  as while a GPU computes), so that a reduction that overlaps backward shows on a CPU.

The lowest-ranked worker writes the wall-clock seconds of every step's end to ``--out`` (JSON),
and its main thread's CPU seconds then (``cpu``), and its memory (``memory``): the resident set
when training began (before the model was built; the peak mark reset then through
``/proc/self/clear_refs``) and its peak until the end, in KiB -- what the model, its gradients,
the optimizer's state, the buckets and the step's transients took (Linux).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch.utils.data import default_collate

N = 4096


class DeviceTime(torch.autograd.Function):
    """Identity forward; the backward waits ``seconds`` (an accelerator's kernel time)."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.seconds)
        return g, None


class Emulated(torch.nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        return DeviceTime.apply(x, self.seconds) if self.seconds else x


def build(name: str, device_ms: float):
    torch.manual_seed(0)
    if name == "tiny":
        dim, classes = 32, 8
        model = torch.nn.Sequential(torch.nn.Linear(dim, 64), torch.nn.ReLU(), torch.nn.Linear(64, classes))
    else:
        dim, classes = 1024, 1024
        layers = []
        for _ in range(6):
            layers += [torch.nn.Linear(dim, dim), Emulated(device_ms / 1e3)]
        model = torch.nn.Sequential(*layers)
    g = torch.Generator().manual_seed(1234)
    data = torch.utils.data.TensorDataset(torch.randn(N, dim, generator=g), torch.randint(0, classes, (N,), generator=g))
    return model, data


def loss_of(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class Memory:
    """Worker 0's resident memory: the resident set when training begins, its peak over the run
    (``peak_kb``) and over the steps after ``warmup`` (``steady_peak_kb``: start-up's one-off
    transients -- DDP's parameter broadcast, chameleon-ft's state broadcast -- left out; freed
    heap given back to the system first, ``malloc_trim``).  The peak mark is reset through
    ``/proc/self/clear_refs`` (Linux), so imports and start-up before ``__init__`` do not count."""

    def __init__(self, warmup: int = 5) -> None:
        self.warmup = warmup
        self._reset()
        self.start_kb = _status_kb("VmRSS")
        self.early_peak_kb = 0

    @staticmethod
    def _reset() -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def at_step(self, n: int) -> None:
        if n == self.warmup:
            self.early_peak_kb = _status_kb("VmHWM")
            try:
                import ctypes
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            except OSError:
                pass
            self._reset()

    def result(self) -> dict:
        steady = _status_kb("VmHWM")
        return {"start_kb": self.start_kb, "peak_kb": max(self.early_peak_kb, steady), "steady_peak_kb": steady}


class Stamps(list):
    """The wall-clock time of every step's end, and (``cpu``) the main thread's CPU time then:
    the host's own work per step, which waits for the peers (or a device) do not count."""

    def __init__(self, memory: "Memory | None" = None) -> None:
        super().__init__()
        self.cpu: list[float] = []
        self.memory = memory

    def mark(self, *_) -> None:
        self.append(time.perf_counter())
        self.cpu.append(time.thread_time())
        if self.memory is not None:
            self.memory.at_step(len(self))


def write(out: str, stamps: Stamps, **extra) -> None:
    with open(out, "w") as f:
        json.dump({"stamps": list(stamps), "cpu": stamps.cpu, **extra}, f)


def run_ddp(a) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mem = Memory()
    model, data = build(a.model, a.device_ms)
    kw = {"bucket_cap_mb": a.bucket_mb} if a.bucket_mb else {}
    net = DDP(model, gradient_as_bucket_view=a.gav, **kw)
    if a.compress:  # DDP's own compression hook, as its docs advise
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        net.register_comm_hook(None, getattr(default_hooks, f"{a.compress}_compress_hook"))
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    stamps = Stamps(mem)

    def loop():
        for step in range(a.steps):
            lo = (step * a.micro_batch * world + rank * a.micro_batch) % N
            batch = default_collate([data[i] for i in range(lo, lo + a.micro_batch)])
            loss_of(net, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            stamps.mark()
    from _profiled import run

    run(loop, a.out, a.profile and rank == 0)
    if rank == 0:
        write(a.out, stamps, memory=mem.result())
    dist.barrier()
    dist.destroy_process_group()


def run_ft(a) -> None:
    from chameleon_ft import ElasticConfig, ElasticTrainer, elastic_main

    def main():
        mem = Memory()
        model, data = build(a.model, a.device_ms)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        stamps = Stamps(mem)
        world = int(os.environ.get("WORLD_SIZE", "2"))
        kw = {"bucket_cap_mb": a.bucket_mb} if a.bucket_mb else {}
        if a.compress:
            kw["grad_compression"] = a.compress
        if a.gav:
            kw["gradient_as_bucket_view"] = True
        trainer = ElasticTrainer(model, opt, data, loss_of, a.micro_batch * world, a.micro_batch, shuffle=False,
                                 config=ElasticConfig(**kw), on_step=stamps.mark)
        from _profiled import fit

        fit(trainer, a.steps, a.out, a.profile)
        if trainer.ctx.rank == 0:
            write(a.out, stamps, memory=mem.result())

    elastic_main(main)


def run_accelerate(a, ft: bool) -> None:
    """The same step as an Accelerate loop: ``Accelerator`` (DDP under torchrun) or
    ``FaultTolerantAccelerator`` (under ``chameleon-ft run``), one micro-batch per worker and step."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    if ft:
        from accelerate_ft import FaultTolerantAccelerator as Accelerator  # noqa: F811
    kw = {"bucket_cap_mb": a.bucket_mb} if a.bucket_mb else {}
    acc = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(**kw)])
    model, data = build(a.model, a.device_ms)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = torch.utils.data.DataLoader(data, batch_size=a.micro_batch, shuffle=False, collate_fn=default_collate)
    model, opt, loader = acc.prepare(model, opt, loader)
    stamps = Stamps()

    def loop():
        while len(stamps) < a.steps:
            for batch in loader:
                acc.backward(loss_of(model, batch))
                opt.step()
                opt.zero_grad(set_to_none=True)
                stamps.mark()
                if len(stamps) >= a.steps:
                    break

    from _profiled import run

    run(loop, a.out, a.profile and acc.is_main_process)
    if acc.is_main_process:
        write(a.out, stamps)
    acc.wait_for_everyone()
    acc.end_training()


def _is_worker0() -> bool:
    return int(os.environ.get("CHAMELEON_FT_WORKER_ID", os.environ.get("RANK", "0"))) == 0


def run_lightning(a, ft: bool) -> None:
    """The ``tiny`` step as a ``LightningModule`` under ``Trainer(strategy="ddp")`` (torchrun), or
    the same plus ``FaultToleranceCallback()`` (under ``chameleon-ft run``): one micro-batch per
    worker and step from a ``DataLoader``, no logger, checkpoint or progress bar on either side."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    model, data = build(a.model, a.device_ms)
    stamps = Stamps()

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = model

        def training_step(self, batch, i):
            return loss_of(self.net, batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class Mark(pl.Callback):
        def on_train_batch_end(self, *args):
            stamps.mark()

    callbacks = [Mark()]
    if ft:
        from lightning_ft import FaultToleranceCallback
        callbacks.append(FaultToleranceCallback())
    kw = {"bucket_cap_mb": a.bucket_mb} if a.bucket_mb else {}
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                         strategy=pl.strategies.DDPStrategy(**kw), max_steps=a.steps, callbacks=callbacks,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    from _profiled import run

    loader = DataLoader(data, batch_size=a.micro_batch, shuffle=False, collate_fn=default_collate)
    run(lambda: trainer.fit(Lit(), loader), a.out, a.profile and _is_worker0())
    if _is_worker0():
        write(a.out, stamps)


def run_trainer(a, ft: bool) -> None:
    """The ``tiny`` step under ``transformers.Trainer`` (torchrun: DDP over gloo) or
    ``FaultTolerantTrainer`` (``chameleon-ft run``): the same arguments on both sides (no saves,
    no reports, the default AdamW and logging), one micro-batch per worker and step."""
    import tempfile

    from transformers import Trainer, TrainerCallback, TrainingArguments

    if ft:
        from transformers_ft import FaultTolerantTrainer as Trainer  # noqa: F811
    model, data = build(a.model, a.device_ms)
    stamps = Stamps()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x, labels):
            return {"loss": torch.nn.functional.cross_entropy(self.net(x), labels)}

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(data)

        def __getitem__(self, i):
            x, y = data[i]
            return {"x": x, "labels": y}

    class Mark(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            stamps.mark()

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=a.micro_batch, max_steps=a.steps,
                                 save_strategy="no", report_to="none", use_cpu=True, dataloader_num_workers=0,
                                 disable_tqdm=True, seed=0, **({"ddp_bucket_cap_mb": int(a.bucket_mb)}
                                                               if a.bucket_mb else {}),
                                 **({"ddp_find_unused_parameters": False} if a.tuned else {}))
        from _profiled import run

        trainer = Trainer(model=Net(), args=args, train_dataset=Rows(), callbacks=[Mark()])
        run(trainer.train, a.out, a.profile and _is_worker0())
    if _is_worker0():
        write(a.out, stamps)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", choices=["ddp", "ft", "acc", "acc-ft", "pl", "pl-ft", "hf", "hf-tuned", "hf-ft"],
                    required=True)
    ap.add_argument("--model", choices=["tiny", "mlp6"], default="tiny")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--bucket-mb", type=float, default=None, help="bucket_cap_mb (default: DDP's 25)")
    ap.add_argument("--compress", choices=["fp16", "bf16"], default=None,
                    help="ddp, ft: DDP's fp16/bf16 compression hook (ft: ElasticConfig.grad_compression)")
    ap.add_argument("--gav", action="store_true",
                    help="ddp, ft: gradient_as_bucket_view (DDP's flag; ours: ElasticConfig's)")
    ap.add_argument("--tuned", action="store_true",
                    help="hf, hf-ft: ddp_find_unused_parameters=False (the Trainer's docs: True by default "
                         "for a model that is not a PreTrainedModel, which costs DDP a graph walk a step)")
    ap.add_argument("--device-ms", type=float, default=30.0, help="mlp6: emulated device time per layer backward")
    ap.add_argument("--profile", action="store_true", help="cProfile the lowest-ranked worker into OUT.prof")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.system.startswith("acc"):
        run_accelerate(a, a.system == "acc-ft")
    elif a.system.startswith("pl"):
        run_lightning(a, a.system == "pl-ft")
    elif a.system.startswith("hf"):
        a.tuned = a.tuned or a.system == "hf-tuned"
        run_trainer(a, a.system == "hf-ft")
    else:
        run_ddp(a) if a.system == "ddp" else run_ft(a)
