"""Test worker: ``mlp_worker``'s model and data in a plain ``DataParallelExecutor`` loop, plus
deliberately mismatched collectives through ``LiveCollectives`` (what an adapter gives the
user's ``wait_for_everyone`` / ``gather`` / ``reduce``):

* ``--stray-barrier S``: at step ``S`` the member of rank 1 calls a barrier in the middle of
  the step, after its micro-batches and ``--stray-delay`` seconds, so that its peers are
  already in the step's gradient all-reduce;
* ``--mismatch S``: after committing step ``S``, rank 0 calls a barrier while the others
  gather a tensor; after step ``S + 1`` rank 0 reduces a tensor of 3 elements while the others
  reduce 5; after step ``S + 2`` every member reduces the same tensor (live again).

Each worker saves its final parameters, optimizer state and what its collectives returned to
``<out>/final_<worker id>.pt``.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from chameleon_ft.runtime.adapter_kit import LiveCollectives
from chameleon_ft.runtime.trainer import elastic_main
from chameleon_ft.runtime.recovery import ElasticConfig
from chameleon_ft.runtime.executors.dp import DataParallelExecutor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mlp_worker import Synthetic  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--stray-barrier", type=int, default=-1)
    p.add_argument("--stray-delay", type=float, default=0.3)
    p.add_argument("--mismatch", type=int, default=-1)
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(int(os.environ.get("CHAMELEON_FT_WORKER_ID", "0")) + 7)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = Synthetic()
    ce = torch.nn.CrossEntropyLoss()
    ctx = DataParallelExecutor(model, opt, len(data), 32, 4, seed=3,
                               config=ElasticConfig(stragglers=False), control_collectives=True)
    coll = LiveCollectives(lambda: ctx.gm, lambda: ctx.view, lambda: ctx.hang_timeout_s,
                           who="mismatch_worker")
    seen: dict = {}
    ctx.start()
    try:
        while ctx.epoch < a.epochs:
            for mb in ctx.microbatches():
                x, y = torch.utils.data.default_collate([data[i] for i in mb.indices])
                ctx.backward(ce(model(x), y), mb)
            if ctx.step == a.stray_barrier and ctx.rank == 1:
                time.sleep(a.stray_delay)  # the peers are in the all-reduce by now
                coll.barrier()
                seen["stray_barrier_realigning"] = coll.realigning
            if not ctx.sync_and_step():
                continue
            coll.reset()
            k = ctx.step - 1 - a.mismatch  # steps committed since the mismatch step
            if a.mismatch < 0 or not 0 <= k <= 2:
                continue
            if k == 0:  # a barrier against a gather
                if ctx.rank == 0:
                    coll.barrier()
                    seen["barrier"] = "returned"
                else:
                    seen["gather"] = [t.tolist() for t in coll.all_gather(torch.tensor([float(ctx.rank)]))]
                seen["realigning"] = coll.realigning
            elif k == 1:  # reduces of different shapes
                seen["reduce_mismatch"] = coll.allreduce(torch.ones(3 if ctx.rank == 0 else 5)).tolist()
            else:  # the same reduce everywhere: live again
                seen["reduce_live"] = coll.allreduce(torch.ones(2)).tolist()
                seen["gather_live"] = [t.tolist() for t in coll.all_gather(torch.tensor([float(ctx.rank)]))]
    finally:
        ctx.close()
    torch.save({"params": [q.detach().clone() for q in model.parameters()],
                "momentum": [t.clone() for q in model.parameters() for t in opt.state[q].values()
                             if torch.is_tensor(t) and t.ndim > 0],
                "step": ctx.step, "members": list(ctx.members), "seen": seen},
               os.path.join(a.out, f"final_{ctx.worker_id}.pt"))
    print(f"worker {ctx.worker_id} done at step {ctx.step}", flush=True)


if __name__ == "__main__":
    elastic_main(main)
