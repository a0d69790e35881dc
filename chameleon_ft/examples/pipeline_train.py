"""The pipeline demo's training script: an 8-block MLP classifier trained DP x PP.

Run by ``chameleon-ft demo --pipeline`` under ``chameleon-ft run`` (8 workers: 2 pipelines x
4 stages of 2 blocks); also usable on its own::

    chameleon-ft run --nproc-per-node 8 "$(python -c "import chameleon_ft.examples.pipeline_train as m; print(m.__file__)")" --allowed replan

``--block-sleep`` pads every block's forward to a fixed duration (accelerator emulation: on a
few shared CPU cores the blocks' real compute is tiny and noisy).  The blocks are given as
per-block factories: each worker builds only the blocks its stage holds, each under its own
seed, so replicas start equal without any transfer.  At the end the lowest surviving member writes
``<out>/final.json`` (steps, members, the last step's global loss, its held blocks).

Limits: a toy -- synthetic Gaussian blobs, no evaluation (no worker holds the whole model).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import torch

from chameleon_ft.examples.demo_train import Blobs
from chameleon_ft import ElasticConfig, ElasticTrainer, elastic_main


class Block(torch.nn.Module):
    """Linear (+ tanh), its forward padded to ``sleep`` seconds."""

    def __init__(self, i: int, o: int, sleep: float, act: bool = True):
        super().__init__()
        self.lin, self.act, self.sleep = torch.nn.Linear(i, o), act, sleep

    def forward(self, x):
        t0 = time.perf_counter()
        y = self.lin(x)
        y = torch.tanh(y) if self.act else y
        if self.sleep:
            time.sleep(max(0.0, self.sleep - (time.perf_counter() - t0)))
        return y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--block-sleep", type=float, default=0.01, help="emulated compute per block forward (s)")
    ap.add_argument("--allowed", default=None, help="comma-separated policies the engine may choose")
    ap.add_argument("--out", default=None, help="where to write final.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = Blobs(n=a.samples)
    dims = [16] + [a.width] * (a.blocks - 1) + [4]
    # One factory per block: a worker builds only the blocks it holds (docs/runtime-pipeline.md).
    blocks = [functools.partial(Block, dims[i], dims[i + 1], a.block_sleep, act=i < a.blocks - 1)
              for i in range(a.blocks)]
    ce = torch.nn.CrossEntropyLoss()
    allowed = frozenset(a.allowed.split(",")) if a.allowed else None
    trainer = ElasticTrainer(blocks, functools.partial(torch.optim.AdamW, lr=3e-3), data,
                             lambda out, batch: ce(out, batch[1]), a.global_batch, a.micro_batch,
                             seed=0, stages=a.stages, config=ElasticConfig(allowed_policies=allowed))
    result = trainer.fit(epochs=a.epochs)
    ctx = trainer.ctx
    if a.out and ctx.worker_id == min(ctx.members):
        with open(os.path.join(a.out, "final.json"), "w") as f:
            json.dump({"worker": ctx.worker_id, "step": result["step"], "members": result["members"],
                       "loss": ctx.last_loss, "held": sorted(ctx.held)}, f)
    if ctx.worker_id == min(ctx.members):
        print(f"worker {ctx.worker_id}: {ctx.step} steps, members {list(ctx.members)}, "
              f"last step's loss {ctx.last_loss:.4f}", flush=True)


if __name__ == "__main__":
    elastic_main(main)
