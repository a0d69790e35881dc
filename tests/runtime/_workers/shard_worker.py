"""Test worker: a small MLP trained sharded (FSDP2 over all workers, or HSDP) with
``ElasticTrainer`` under ``chameleon-ft run``.  At the end each worker saves the *full* final
parameters (gathered from the shards), its loss history and the shard recovery it took to
``<out>/final_<worker id>.pt``.

    python -m chameleon_ft.cli.launch --nproc-per-node 4 --run-dir D shard_worker.py --out D
"""

import argparse
import os
import time

import torch

from chameleon_ft.engine.rehab import RehabRecipe
from chameleon_ft.runtime.trainer import ElasticTrainer, elastic_main
from chameleon_ft.runtime.recovery import ElasticConfig


def synthetic(n=512, dim=16, out=4, seed=1234) -> torch.utils.data.TensorDataset:
    """A learnable regression: y = tanh(x W) + noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, out, generator=g)
    return torch.utils.data.TensorDataset(x, torch.tanh(x @ w) + 0.05 * torch.randn(n, out, generator=g))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--sharding", choices=["full", "hybrid"], default="full")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--snapshot-every", type=int, default=None)
    p.add_argument("--paths", default=None, help="comma-separated recovery paths allowed")
    p.add_argument("--checkpoint", default=None, help="resume from / write this checkpoint")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--token-weighted", action="store_true",
                   help="loss_fn returns (sum, count) over the targets of the samples with x[0] > 0")
    p.add_argument("--step-sleep", type=float, default=0.0, help="emulated compute per step (s)")
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(100 + a.seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, a.hidden), torch.nn.Tanh(),
                                torch.nn.Linear(a.hidden, a.hidden), torch.nn.Tanh(),
                                torch.nn.Linear(a.hidden, 4))
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)

    def loss_fn(m, batch):
        if a.step_sleep:
            time.sleep(a.step_sleep)
        x, y = batch
        if a.token_weighted:  # a varying number of items per sample (a padded batch's tokens)
            mask = (x[:, :1] > 0).expand_as(y)
            return ((m(x) - y) ** 2 * mask).sum(), int(mask.sum())
        return torch.nn.functional.mse_loss(m(x), y)

    cfg = ElasticConfig(stragglers=False,
                        shard_recovery=frozenset(a.paths.split(",")) if a.paths else None)
    final = {}

    def on_step(ctx):
        if ctx.step == a.steps:  # every member, at the same committed step
            final.update(ctx.full_parameters())

    trainer = ElasticTrainer(model, opt, synthetic(), loss_fn, a.global_batch, a.micro_batch,
                             seed=a.seed, config=cfg, sharding=a.sharding, replicas=a.replicas,
                             snapshot_every=a.snapshot_every, recipe=RehabRecipe(), on_step=on_step,
                             checkpoint=a.checkpoint, checkpoint_every=a.checkpoint_every)
    result = trainer.fit(max_steps=a.steps)
    ctx = trainer.ctx
    full = final
    torch.save({"params": full, "step": ctx.step, "members": list(ctx.members),
                # what a torch user reaches after fit(): their own module, and the gathered copy
                "model_state": {k: v.clone() for k, v in model.state_dict().items()},
                "full_after_fit": ctx.full_parameters(),
                "loss": [[s, v] for s, v in ctx.loss_history],
                "decision": ctx.last_shard_decision, "heal_checks": ctx.heal_checks,
                "k": ctx.k, "snapshot_cost_s": ctx.snapshot_cost_s,
                "same_optimizer": ctx.optimizer is opt and all(
                    p is q for g in opt.param_groups for p, q in zip(g["params"], ctx.shard_params))},
               os.path.join(a.out, f"final_{ctx.worker_id}.pt"))
    print(f"worker {ctx.worker_id} done: {result}", flush=True)


if __name__ == "__main__":
    elastic_main(main)
