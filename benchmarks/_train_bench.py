"""The training script both sides of the runtime benchmarks run: plain torch DDP or chameleon-ft.

    python -m torch.distributed.run --nproc-per-node 4 benchmarks/_train_bench.py --mode ddp --out F
    chameleon-ft run --nproc-per-node 4 benchmarks/_train_bench.py --mode ft --out F

Same model, data, micro-batches per worker and emulated compute (``--mb-sleep``: every
micro-batch's forward+backward padded to a fixed duration, so that throughput follows the worker
count as on accelerators although 4 workers share 2 cores).  Rank 0 / the lowest member writes
the wall-clock time of every committed step to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

DIM, CLASSES, N = 64, 8, 4096


def dataset():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N, DIM, generator=g)
    y = torch.randint(0, CLASSES, (N,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, CLASSES))


def padded_loss(m, x, y, mb_sleep):
    t0 = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(m(x), y)
    return loss, max(0.0, mb_sleep - (time.perf_counter() - t0))


def run_ddp(a) -> list[float]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    net = DDP(model())
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    data = dataset()
    per_worker = a.global_batch // world // a.micro_batch
    stamps = []
    for step in range(a.steps):
        base = (step * a.global_batch) % N + rank * per_worker * a.micro_batch
        for k in range(per_worker):
            idx = range(base + k * a.micro_batch, base + (k + 1) * a.micro_batch)
            x, y = data[list(idx)]
            ctx = net.no_sync() if k < per_worker - 1 else torch.enable_grad()
            with ctx:
                loss, pad = padded_loss(net, x, y, a.mb_sleep)
                (loss / per_worker).backward()
                time.sleep(pad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        stamps.append(time.time())
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"mode": "ddp", "stamps": stamps}, f)
    dist.barrier()
    dist.destroy_process_group()
    return stamps


def run_ft(a) -> None:
    from chameleon_ft import ElasticConfig, ElasticTrainer, elastic_main

    def main():
        net = model()
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        stamps = []

        def loss_fn(m, batch):
            x, y = batch
            loss, pad = padded_loss(m, x, y, a.mb_sleep)
            time.sleep(pad)
            return loss

        trainer = ElasticTrainer(net, opt, dataset(), loss_fn, a.global_batch, a.micro_batch, shuffle=False,
                                 config=ElasticConfig(stragglers=False, log_samples=False),
                                 on_step=lambda ctx: stamps.append(time.time()))
        from _profiled import fit

        fit(trainer, a.steps, a.out, a.profile)
        if trainer.ctx.rank == 0:
            with open(a.out, "w") as f:
                json.dump({"mode": "ft", "stamps": stamps}, f)

    elastic_main(main)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ddp", "ft"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--mb-sleep", type=float, default=0.025)
    ap.add_argument("--profile", action="store_true", help="cProfile worker 0 (ft mode) into OUT.prof")
    a = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_ddp(a) if a.mode == "ddp" else run_ft(a)
