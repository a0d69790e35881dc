"""Test worker: an 8-block MLP trained DP x PP with ``ElasticTrainer(stages=...)`` under
``chameleon-ft run``.  At the end each worker saves the blocks it holds (weights and optimizer
state) to ``<out>/final_<worker id>.pt`` and its last migration to ``migration_<id>.json``.

    python -m chameleon_ft.launch --nproc-per-node 8 --run-dir D pipe_worker.py --out D --stages 4
"""

import argparse
import json
import os
import time

import torch

from chameleon_ft.runtime.trainer import ElasticTrainer, elastic_main
from chameleon_ft.runtime.worker import ElasticConfig
from mlp_worker import Synthetic  # the same seeded data as the data-parallel tests


class Block(torch.nn.Module):
    def __init__(self, i, o, sleep, act=True, dropout=0.0):
        super().__init__()
        self.lin, self.act, self.sleep = torch.nn.Linear(i, o), act, sleep
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x):
        if self.sleep:
            time.sleep(self.sleep)
        y = self.lin(x)
        return self.drop(torch.tanh(y)) if self.act else y


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--block-sleep", type=float, default=0.0, help="emulated compute per block forward (s)")
    p.add_argument("--allowed", default=None, help="comma-separated policies the engine may choose")
    p.add_argument("--mttf", type=float, default=None, help="ElasticConfig.mttf_s")
    a = p.parse_args()
    torch.set_num_threads(1)
    # A different init per worker: the start-up migration must make the replicas equal.
    torch.manual_seed(int(os.environ.get("CHAMELEON_FT_WORKER_ID", "0")) + 7)
    dims = [16] + [32] * (a.blocks - 1) + [4]
    blocks = torch.nn.Sequential(*[Block(dims[i], dims[i + 1], a.block_sleep, act=i < a.blocks - 1,
                                         dropout=0.1 if 0 < i < a.blocks - 1 else 0.0)
                                   for i in range(a.blocks)])
    opt = torch.optim.AdamW(blocks.parameters(), lr=0.01, weight_decay=0.01)
    ce = torch.nn.CrossEntropyLoss()
    trainer = ElasticTrainer(
        blocks, opt, Synthetic(), lambda out, batch: ce(out, batch[1]), a.global_batch, a.micro_batch,
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.7),
        seed=3, stages=a.stages,
        config=ElasticConfig(allowed_policies=frozenset(a.allowed.split(",")) if a.allowed else None,
                             mttf_s=a.mttf))
    result = trainer.fit(epochs=a.epochs)
    ctx = trainer.ctx
    final = {"step": result["step"], "members": result["members"], "held": sorted(ctx.held),
             "blocks": {str(b): {"params": [t.clone() for t in s["params"].values()],
                                 "optim": [v.clone() for st in s["optim"]["state"].values()
                                           for v in st.values()]}
                        for b, s in ctx.block_states().items()}}
    wid = ctx.worker_id
    torch.save(final, os.path.join(a.out, f"final_{wid}.pt"))
    with open(os.path.join(a.out, f"result_{wid}.json"), "w") as f:
        json.dump({"plan": ctx.policy.plan.to_json(), "loss": ctx.last_loss,
                   "migration": ctx.last_migration, "decisions": ctx.last_decisions}, f)


if __name__ == "__main__":
    elastic_main(main)
