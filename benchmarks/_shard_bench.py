"""Worker of the sharded benchmarks (``sharded_bench.py``, ``sharded_matrix.py``): a model of
``_shard_tasks`` (``--kind``: the MLP regression with Adam, or the matrix's classifiers with
AdamW) trained with FSDP2, either on the chameleon-ft runtime (``--mode ours``:
``ElasticTrainer(sharding="full")`` under ``chameleon-ft run``, every setting default unless a
flag sets it) or as plain FSDP2 (``--mode plain``: ``fully_shard`` on a gloo default group under
``torchrun``, torch's own collectives; regression only).

Accelerator-emulation mode: each member's forward is padded by ``--sample-sleep`` seconds per
sample it computes, so a step costs what its share costs on a device, not what 2 shared cores
make of it.  Each member writes ``<out>/final_<rank or worker id>.json``: per committed step
(step, wall time, loss), its peak RSS, the shard recovery taken, the heal checks; the lowest
member also the user's own model's test loss and accuracy after ``fit()`` (classifiers).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

import torch
import torch.nn as nn

from _shard_tasks import KINDS, evaluate, model as task_model, regression, regression_model, task


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["ours", "plain"], default="ours")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-sleep", type=float, default=0.002)
    p.add_argument("--snapshot-every", type=int, default=None, help="0: no snapshots; default: Young/Daly")
    p.add_argument("--paths", default=None)
    p.add_argument("--kind", choices=("regression",) + KINDS, default="regression")
    p.add_argument("--recipe", default="", help="RehabRecipe fields, e.g. warmup_steps=0,extrapolate_snapshots=2")
    p.add_argument("--default-config", action="store_true",
                   help="ElasticConfig's defaults (straggler handling on) besides --paths")
    p.add_argument("--perturb-step", type=int, default=None,
                   help="a harmless change (the quality control of sharded_controls.py): step N trains on "
                        "another random draw of samples than its scheduled batch")
    a = p.parse_args()
    torch.set_num_threads(1)
    test = None
    if a.kind == "regression":
        data = regression()
        model = regression_model(a.hidden, a.layers, a.seed)
        opt = torch.optim.Adam(model.parameters(), lr=a.lr)
        loss_of = nn.functional.mse_loss
    else:
        from _shard_tasks import cross_entropy as loss_of
        data, test = task(a.kind)
        model = task_model(a.kind, a.seed)
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    rows: list[list[float]] = []
    holder: dict = {}

    def loss_fn(m, batch):
        x, y = batch
        ctx = getattr(holder.get("trainer"), "ctx", None)
        if a.perturb_step is not None and ctx is not None and ctx.step + 1 == a.perturb_step:
            x, y = redraw(data, len(x), a.seed, a.perturb_step, holder)
        if a.sample_sleep:
            time.sleep(a.sample_sleep * len(x))
        return loss_of(m(x), y)

    if a.mode == "plain":
        rank = plain(a, data, model, opt, loss_fn, rows)
        extra = {}
    else:
        from chameleon_ft import ElasticConfig, ElasticTrainer

        def on_step(ctx):
            rows.append([ctx.step, time.time(), ctx.loss_history[-1][1]])

        paths = frozenset(a.paths.split(",")) if a.paths else None
        cfg = (ElasticConfig(shard_recovery=paths) if a.default_config
               else ElasticConfig(stragglers=False, shard_recovery=paths))
        tr = ElasticTrainer(model, opt, data, loss_fn, a.global_batch, a.micro_batch, seed=a.seed, config=cfg,
                            sharding="full", snapshot_every=a.snapshot_every, on_step=on_step,
                            recipe=recipe(a.recipe))
        holder["trainer"] = tr
        tr.fit(max_steps=a.steps)
        ctx = tr.ctx
        rank = ctx.worker_id
        extra = {"decision": ctx.last_shard_decision, "k": ctx.k, "snapshot_cost_s": ctx.snapshot_cost_s,
                 "redone": tr.redone_steps, "heal_checks": ctx.heal_checks, "heal_scale": ctx.heal_scale}
        if test is not None and ctx.rank == 0:
            extra.update(evaluate(model, test))  # the user's own module holds the trained model
    with open(os.path.join(a.out, f"final_{rank}.json"), "w") as f:
        json.dump({"rows": rows, "rss_mb": rss_mb(), **extra}, f)


def redraw(data, n: int, seed: int, step: int, holder: dict):
    """``n`` samples drawn at random from ``data`` in place of a micro-batch of step ``step``
    (seeded by the seed, the step, the worker and its count of redraws): SGD's batch is itself
    a random draw, so this changes the trajectory without changing what training is."""
    holder["redraws"] = holder.get("redraws", 0) + 1
    wid = int(os.environ.get("CHAMELEON_FT_WORKER_ID", os.environ.get("RANK", "0")))
    g = torch.Generator().manual_seed(((seed * 1009 + step) * 101 + wid) * 1013 + holder["redraws"])
    idx = torch.randperm(len(data), generator=g)[:n].tolist()
    return torch.utils.data.default_collate([data[j] for j in idx])


def recipe(text: str):
    """``RehabRecipe`` with the named fields changed (None: the default recipe)."""
    if not text:
        return None
    from chameleon_ft.engine.rehab import RehabRecipe
    fields = dict(kv.split("=") for kv in text.split(","))
    return RehabRecipe(**{k: (v == "True" if v in ("True", "False") else float(v) if "." in v else int(v))
                          for k, v in fields.items()})


def plain(a, data, model, opt, loss_fn, rows) -> int:
    """Plain FSDP2: torch's collectives on a gloo default group; each rank computes its
    contiguous share of the same global batches (a seeded order per epoch)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    r, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    per_epoch = len(data) // a.global_batch
    for step in range(a.steps):
        epoch, i = divmod(step, per_epoch)
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(a.seed + epoch))
        idx = order[i * a.global_batch:(i + 1) * a.global_batch].tolist()
        mine = idx[r * len(idx) // n:(r + 1) * len(idx) // n]
        x, y = torch.utils.data.default_collate([data[j] for j in mine])
        loss = loss_fn(model, (x, y)) * (len(mine) / len(idx))
        loss.backward()  # FSDP2 averages the reduce-scatter over n: scale back below
        for prm in model.parameters():
            if prm.grad is not None:
                prm.grad.mul_(n)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        rows.append([step + 1, time.time(), float(total)])
    dist.barrier()
    dist.destroy_process_group()
    return r


if __name__ == "__main__":
    from chameleon_ft import elastic_main
    import sys
    if "--mode" in sys.argv and sys.argv[sys.argv.index("--mode") + 1] == "plain":
        main()
    else:
        elastic_main(main)
