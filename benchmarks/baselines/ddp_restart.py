"""Baseline: plain torch DDP under ``torchrun --max-restarts`` with checkpoint resume.

    BENCH_OUT=D torchrun --standalone --nproc-per-node 4 --max-restarts 3 \
        benchmarks/baselines/ddp_restart.py --ckpt D/ckpt.pt --ckpt-every 10

What a user does without a fault-tolerance library: on any worker's death torchrun kills the
survivors and relaunches all workers, which resume from the last checkpoint (rank 0 writes
model, optimizer and step every ``--ckpt-every`` steps, atomically).  Steps after the
checkpoint are computed twice (duplicated samples); the restart costs process start, imports,
rendezvous and the checkpoint load.

Pitfall (torch 2.13): on a restart the new workers re-form the gloo mesh in the rendezvous's
shared TCPStore, which still holds the previous round's keys, and hang or fail unless
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is set (the harness runs both, labelled).
Without ``--ckpt`` this is the failure-free plain-DDP reference.
"""

from __future__ import annotations

import argparse
import os

import torch

from common import GLOBAL_BATCH, MICRO_BATCH, StepLog, add_args, microbatch_indices, tb, train_microbatch


def main() -> None:
    ap = argparse.ArgumentParser()
    add_args(ap)
    ap.add_argument("--ckpt")
    ap.add_argument("--ckpt-every", type=int, default=10)
    a = ap.parse_args()
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log = StepLog(rank, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
    net = DDP(tb.model())
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    start = 0
    if a.ckpt and os.path.exists(a.ckpt):
        st = torch.load(a.ckpt, weights_only=True)
        net.module.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        start = st["step"]
    data = tb.dataset()
    per = GLOBAL_BATCH // MICRO_BATCH // world
    for step in range(start, a.steps):
        mbs = microbatch_indices(step, range(rank * per, (rank + 1) * per))
        for k, idx in enumerate(mbs):
            if k == per - 1:   # DDP all-reduces in this micro-batch's backward
                key = log.attempt(step, [i for idx in mbs for i in idx])
            with (net.no_sync() if k < per - 1 else torch.enable_grad()):
                train_microbatch(net, data, idx, a.mb_sleep, 1.0 / per, rank, step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        log.step(step, world, GLOBAL_BATCH, key=key)
        if a.ckpt and rank == 0 and (step + 1) % a.ckpt_every == 0:
            torch.save({"model": net.module.state_dict(), "opt": opt.state_dict(), "step": step + 1}, a.ckpt + ".tmp")
            os.replace(a.ckpt + ".tmp", a.ckpt)
    if rank == 0:
        log.final(net.module, a.steps)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
