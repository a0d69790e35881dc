"""The demo's training script: a small MLP classifier on a seeded synthetic dataset.

Run by ``chameleon-ft demo`` under ``chameleon-ft run``; also usable on its own::

    chameleon-ft run --nproc-per-node 4 "$(python -c "import chameleon_ft.examples.demo_train as m; print(m.__file__)")"

``--mb-sleep`` pads every micro-batch's compute to a fixed duration (accelerator emulation:
on 2 shared CPU cores a dead worker would otherwise speed the others up).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from chameleon_ft import ElasticConfig, ElasticTrainer, elastic_main


class Blobs(torch.utils.data.Dataset):
    """Gaussian blobs in ``dim`` dimensions, one per class: learnable, seeded, no download."""

    def __init__(self, n: int = 1024, dim: int = 16, classes: int = 4, seed: int = 1234):
        g = torch.Generator().manual_seed(seed)
        centres = torch.randn(classes, dim, generator=g) * 2.0
        self.y = torch.randint(0, classes, (n,), generator=g)
        self.x = centres[self.y] + torch.randn(n, dim, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--mb-sleep", type=float, default=0.02, help="emulated compute per micro-batch (s)")
    ap.add_argument("--out", default=None, help="where to write this worker's final metrics")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = Blobs()
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.epochs * len(data) // a.global_batch)
    ce = torch.nn.CrossEntropyLoss()

    def loss_fn(m, batch):
        t0 = time.perf_counter()
        x, y = batch
        loss = ce(m(x), y)
        if a.mb_sleep:
            time.sleep(max(0.0, a.mb_sleep - (time.perf_counter() - t0)))
        return loss

    trainer = ElasticTrainer(model, opt, data, loss_fn, a.global_batch, a.micro_batch, sched, seed=0,
                             config=ElasticConfig())
    result = trainer.fit(epochs=a.epochs)
    with torch.no_grad():
        acc = (model(data.x).argmax(1) == data.y).float().mean().item()
        loss = ce(model(data.x), data.y).item()
    ctx = trainer.ctx
    if a.out:
        with open(os.path.join(a.out, f"final_{ctx.worker_id}.json"), "w") as f:
            json.dump({"worker": ctx.worker_id, "step": ctx.step, "members": list(ctx.members),
                       "accuracy": acc, "loss": loss, "result": {k: v for k, v in result.items()
                                                                 if isinstance(v, (int, float, str))}}, f)
    print(f"worker {ctx.worker_id}: {ctx.step} steps, accuracy {acc:.3f}, loss {loss:.4f}", flush=True)


if __name__ == "__main__":
    elastic_main(main)
