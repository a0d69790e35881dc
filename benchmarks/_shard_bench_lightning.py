"""Worker of the sharded matrix's Lightning cells (``sharded_matrix.py --lightning``): a model
of ``_shard_tasks`` as a LightningModule, Lightning's own FSDP2 recipe
(``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)``, ``fully_shard`` on
every child with parameters and on the model in ``configure_model``) plus
``FaultToleranceCallback()`` with every setting default (``--snapshot-every`` for the tuned
interval).  Accelerator emulation as in ``_shard_bench.py`` (``--sample-sleep`` per sample).

Each worker writes ``<out>/final_<worker id>.json`` in ``_shard_bench.py``'s form: per
committed step (step, wall time, the global loss), the shard recovery, the heal checks, K; the
lowest member also the test loss and accuracy of the user's own module after ``fit()``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

from _shard_bench import redraw
from _shard_tasks import KINDS, cross_entropy, evaluate, model as task_model, task


class Lit(pl.LightningModule):
    def __init__(self, kind: str, seed: int, lr: float, sample_sleep: float, perturb_step=None, data=None):
        super().__init__()
        self.net = task_model(kind, seed)
        self.lr, self.sample_sleep = lr, sample_sleep
        self.seed, self.perturb_step, self.data, self.redraws = seed, perturb_step, data, {}

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for child in self.net.children():
            if any(True for _ in child.parameters()):
                fully_shard(child, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        ctx = self.trainer.strategy.ctx
        if self.perturb_step is not None and ctx is not None and ctx.step + 1 == self.perturb_step:
            x, y = redraw(self.data, len(x), self.seed, self.perturb_step, self.redraws)
        if self.sample_sleep:
            time.sleep(self.sample_sleep * len(x))
        loss = cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class Rows(pl.Callback):
    """(step, wall time, the step's global loss) after every committed step."""

    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        ctx = trainer.strategy.ctx
        if ctx is not None and ctx.loss_history:
            self.rows.append([ctx.step, time.time(), ctx.loss_history[-1][1]])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--kind", choices=KINDS, default="mlp")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--sample-sleep", type=float, default=0.001)
    p.add_argument("--snapshot-every", type=int, default=None)
    p.add_argument("--perturb-step", type=int, default=None, help="as _shard_bench.py's")
    a = p.parse_args()
    torch.set_num_threads(1)
    from lightning_ft import FaultToleranceCallback

    pl.seed_everything(a.seed, verbose=False)
    train, test = task(a.kind)
    n = int(os.environ.get("LOCAL_WORLD_SIZE", 4))
    rows = Rows()
    trainer = pl.Trainer(accelerator="cpu", devices=n, max_steps=a.steps, logger=False,
                         callbacks=[FaultToleranceCallback(snapshot_every=a.snapshot_every), rows],
                         strategy=ModelParallelStrategy(data_parallel_size=n, tensor_parallel_size=1),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    lit = Lit(a.kind, a.seed, a.lr, a.sample_sleep, a.perturb_step, train)
    trainer.fit(lit, DataLoader(train, batch_size=a.global_batch // n, shuffle=True))
    ckpt = Path(a.out, "last.ckpt")
    trainer.save_checkpoint(str(ckpt))  # whole (gathered from the shards), on every member
    ctx = trainer.strategy.ctx
    out = {"rows": rows.rows, "decision": ctx.last_shard_decision, "k": ctx.k, "heal_checks": ctx.heal_checks,
           "heal_scale": ctx.heal_scale, "redone": ctx.redone_steps}
    if ctx.rank == 0:  # the trained model, loaded with plain torch into a plain copy of the user's
        state = torch.load(ckpt, weights_only=True)["state_dict"]
        plain = task_model(a.kind, a.seed)
        plain.load_state_dict({k.removeprefix("net."): v for k, v in state.items()})
        out.update(evaluate(plain, test))
    Path(a.out, f"final_{ctx.worker_id}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
