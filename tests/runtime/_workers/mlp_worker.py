"""Test worker: a 2-layer MLP on a seeded synthetic map-style dataset, trained with
``ElasticTrainer`` under ``chameleon-ft run``.  At the end each worker saves its final
parameters and optimizer state to ``<out>/final_<worker id>.pt`` for the tests to compare.

    python -m chameleon_ft.cli.launch --nproc-per-node 4 --run-dir D mlp_worker.py --out D
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from chameleon_ft.runtime.trainer import ElasticTrainer, elastic_main
from chameleon_ft.runtime.recovery import ElasticConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the shared helpers
from _helpers.allocation import force_allocations  # noqa: E402


class Synthetic(torch.utils.data.Dataset):
    def __init__(self, n=256, dim=16, classes=4, seed=1234):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randint(0, classes, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--mb-sleep", type=float, default=0.0, help="emulated compute per micro-batch (s)")
    p.add_argument("--slow-below", default=None, metavar="WORLD:SECONDS",
                   help="emulated compute per micro-batch while the job has fewer than WORLD members")
    p.add_argument("--no-stragglers", action="store_true")
    p.add_argument("--min-world", type=int, default=1, help="ElasticConfig.min_world_size")
    p.add_argument("--checkpoint", default=None, help="resume from / write this checkpoint")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--allowed", default=None, help="comma-separated policies the engine may choose")
    p.add_argument("--allow-batch-change", action="store_true")
    p.add_argument("--bucket-mb", type=float, default=None, help="ElasticConfig.bucket_cap_mb")
    p.add_argument("--compress", choices=["fp16", "bf16"], default=None, help="ElasticConfig.grad_compression")
    p.add_argument("--gav", action="store_true", help="ElasticConfig.gradient_as_bucket_view")
    # for the fidelity trials (tests/fidelity): the defaults are the recovery tests' set-up
    p.add_argument("--dataset", type=int, default=256)
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    p.add_argument("--lr-step", type=int, default=5, help="StepLR step_size (stepped every step)")
    p.add_argument("--force-alloc", default=None, help="test-only: see tests/_helpers/allocation.py")
    p.add_argument("--raise-at", default=None, metavar="WORKER:STEP",
                   help="that worker's code raises after step STEP (a bug in the user's code)")
    p.add_argument("--raise-when-saving", type=int, default=None, metavar="WORKER",
                   help="that worker's code raises after fit(), while it saves the model")
    a = p.parse_args()
    torch.set_num_threads(1)
    force_allocations(a.force_alloc)
    # A different init per worker: the start-up broadcast must make the replicas equal.
    torch.manual_seed(int(os.environ.get("CHAMELEON_FT_WORKER_ID", "0")) + 7)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    if a.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=a.lr_step, gamma=0.7)
    ce = torch.nn.CrossEntropyLoss()

    slow_below = (int(a.slow_below.split(":")[0]), float(a.slow_below.split(":")[1])) if a.slow_below else None

    def loss_fn(m, batch):
        if slow_below is not None and len(trainer.ctx.members) < slow_below[0]:
            time.sleep(slow_below[1])
        elif a.mb_sleep:
            time.sleep(a.mb_sleep)
        x, y = batch
        return ce(m(x), y)

    raise_at = tuple(int(x) for x in a.raise_at.split(":")) if a.raise_at else None

    def on_step(ctx):
        if raise_at is not None and (ctx.worker_id, ctx.step) == raise_at:
            raise ValueError(f"bad value at step {ctx.step}")

    trainer = ElasticTrainer(model, opt, Synthetic(a.dataset), loss_fn, a.global_batch, a.micro_batch, sched,
                             seed=3, config=ElasticConfig(
                                 stragglers=not a.no_stragglers, min_world_size=a.min_world,
                                 allowed_policies=frozenset(a.allowed.split(",")) if a.allowed else None,
                                 allow_batch_change=a.allow_batch_change,
                                 grad_compression=a.compress, gradient_as_bucket_view=a.gav,
                                 **({"bucket_cap_mb": a.bucket_mb} if a.bucket_mb else {})),
                             checkpoint=a.checkpoint, checkpoint_every=a.checkpoint_every,
                             on_step=on_step)
    result = trainer.fit(epochs=a.epochs)
    ctx = trainer.ctx
    if a.raise_when_saving == ctx.worker_id:
        raise OSError(28, "No space left on device", os.path.join(a.out, "model.pt"))
    torch.save({"params": [p.detach().clone() for p in model.parameters()],
                "momentum": [t.clone() for p in model.parameters() for t in opt.state[p].values()
                             if torch.is_tensor(t) and t.ndim > 0],
                "step": ctx.step, "members": list(ctx.members), "lr": sched.get_last_lr(),
                "base_lr": list(sched.base_lrs)},
               os.path.join(a.out, f"final_{ctx.worker_id}.pt"))
    print(f"worker {ctx.worker_id} done: {result}", flush=True)


if __name__ == "__main__":
    elastic_main(main)
