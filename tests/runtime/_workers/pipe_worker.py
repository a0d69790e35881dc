"""Test worker: an 8-block MLP trained DP x PP with ``ElasticTrainer(stages=...)`` under
``chameleon-ft run``.  At the end each worker saves the blocks it holds (weights and optimizer
state) to ``<out>/final_<worker id>.pt`` and its last migration to ``migration_<id>.json``.

    python -m chameleon_ft.cli.launch --nproc-per-node 8 --run-dir D pipe_worker.py --out D --stages 4
"""

import argparse
import functools
import json
import os
import time

import torch

from chameleon_ft.runtime.trainer import ElasticTrainer, elastic_main
from chameleon_ft.runtime.recovery import ElasticConfig
from chameleon_ft.runtime.executors.pipeline.blocks import block_seed
from mlp_worker import Synthetic  # the same seeded data as the data-parallel tests


class _Pad(torch.autograd.Function):
    """Identity whose backward sleeps ``s`` (emulated accelerator compute of a backward)."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.s = s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.s)
        return g, None


class Block(torch.nn.Module):
    def __init__(self, i, o, sleep, act=True, dropout=0.0, bwd_sleep=0.0):
        super().__init__()
        self.lin, self.act, self.sleep, self.bwd_sleep = torch.nn.Linear(i, o), act, sleep, bwd_sleep
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x):
        if self.sleep:
            time.sleep(self.sleep * SLOW)
        y = self.lin(x)
        if self.bwd_sleep:
            y = _Pad.apply(y, self.bwd_sleep * SLOW)
        return self.drop(torch.tanh(y)) if self.act else y


SLOW = 1.0  # this worker's emulated slowdown (--slow)
SEED = 3
FIRST: dict = {}  # what this worker had materialised at its first committed step


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
    p.add_argument("--bwd-sleep", type=float, default=0.0, help="emulated compute per block backward (s)")
    p.add_argument("--slow", default=None, help="W:F: worker W's emulated compute F times slower")
    p.add_argument("--emulate-link", default=None, help="LATENCY_S:BANDWIDTH_BPS (ElasticConfig.emulate_link)")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--overlap", action="store_true", help="ElasticConfig.overlap_migration")
    p.add_argument("--straggler-window", type=int, default=None, help="the straggler detector's window (steps)")
    p.add_argument("--checkpoint", default=None, help="ElasticTrainer(checkpoint=...)")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--build", choices=["modules", "factories", "meta"], default="modules",
                   help="how the blocks are given: a built model, per-block factories, a meta-device model")
    a = p.parse_args()
    global SLOW
    if a.slow:
        w, f = a.slow.split(":")
        if int(w) == int(os.environ.get("CHAMELEON_FT_WORKER_ID", "-1")):
            SLOW = float(f)
    torch.set_num_threads(1)
    dims = [16] + [32] * (a.blocks - 1) + [4]

    def make(i):
        return Block(dims[i], dims[i + 1], a.block_sleep, act=i < a.blocks - 1,
                     dropout=0.1 if 0 < i < a.blocks - 1 else 0.0, bwd_sleep=a.bwd_sleep)
    worker = int(os.environ.get("CHAMELEON_FT_WORKER_ID", "0"))
    if a.build == "factories":  # each holder builds its blocks, under the block's seed
        blocks = [functools.partial(make, i) for i in range(a.blocks)]
    elif a.build == "meta":  # shapes only; held blocks reset_parameters() under their seed
        with torch.device("meta"):
            blocks = torch.nn.Sequential(*[make(i) for i in range(a.blocks)])
    else:
        # A built model, a different init per worker: the start-up migration must make the
        # replicas equal (worker 0's copy, made as the other forms make theirs, so that every
        # form trains the same model).
        mods = []
        for i in range(a.blocks):
            torch.manual_seed(block_seed(SEED, i) if worker == 0 else worker * 100 + i)
            mods.append(make(i))
        blocks = torch.nn.Sequential(*mods)
    opt = functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.01)
    ce = torch.nn.CrossEntropyLoss()
    trainer = ElasticTrainer(
        blocks, opt, Synthetic(), lambda out, batch: ce(out, batch[1]), a.global_batch, a.micro_batch,
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.7),
        seed=SEED, stages=a.stages, checkpoint=a.checkpoint, checkpoint_every=a.checkpoint_every,
        config=ElasticConfig(allowed_policies=frozenset(a.allowed.split(",")) if a.allowed else None,
                             mttf_s=a.mttf, overlap_migration=a.overlap,
                             straggler_options={"window": a.straggler_window} if a.straggler_window else None,
                             emulate_link=tuple(map(float, a.emulate_link.split(":"))) if a.emulate_link else None))
    def on_step(ctx):
        if not FIRST:
            FIRST.update(materialised=ctx.blockset.materialised(), slot=sorted(ctx.slot_blocks()),
                         made=list(ctx.blockset.made))
    trainer.on_step = on_step
    result = trainer.fit(epochs=a.epochs, max_steps=a.max_steps)
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
                   "migration": ctx.last_migration, "decisions": ctx.last_decisions,
                   "calibration": ctx.policy.calibration_json(), "predictions": ctx.predictions,
                   "first_step": FIRST, "made": ctx.blockset.made}, f)


if __name__ == "__main__":
    elastic_main(main)
