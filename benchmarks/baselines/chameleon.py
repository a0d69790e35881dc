"""chameleon-ft on the shared benchmark shape (``chameleon-ft run --nproc-per-node 4 ...``).

``ElasticTrainer`` with the same model, data order (unshuffled), global batch, micro-batches,
optimizer and emulated compute as the baselines; ``--policy P`` restricts the engine to one
policy (the fixed-policy variants of the matrix).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from common import GLOBAL_BATCH, MICRO_BATCH, StepLog, add_args, compute_s, tb


def step_epoch(ctx) -> int:
    """The epoch of the step just committed (a commit that ends an epoch has started the next)."""
    return ctx.epoch - 1 if ctx.sampler.cursor == 0 else ctx.epoch


def main() -> None:
    ap = argparse.ArgumentParser()
    add_args(ap)
    ap.add_argument("--policy", help="fix the engine's policy (e.g. reroute)")
    ap.add_argument("--ckpt", help="checkpoint file (the restart policy resumes from it)")
    ap.add_argument("--ckpt-every", type=int, default=10)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from chameleon_ft import ElasticConfig, ElasticTrainer, elastic_main

    def run():
        log = StepLog(int(os.environ.get("CHAMELEON_FT_WORKER_ID", 0)),
                      int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))
        net = tb.model()
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)

        def loss_fn(m, batch):
            x, y = batch
            loss, pad = tb.padded_loss(m, x, y, compute_s(log.rank, trainer.ctx.step, a.mb_sleep))
            time.sleep(pad)
            return loss

        # log_samples: the runtime's event log holds each member's sample ids before every
        # all-reduce attempt, tagged with the generation's token; on_step logs the token it
        # committed under, so the harness knows which attempt's ids went into the update.
        cfg = ElasticConfig(log_samples=True, allow_batch_change=a.policy == "shrink",
                            allowed_policies=frozenset([a.policy]) if a.policy else None)
        trainer = ElasticTrainer(net, opt, tb.dataset(), loss_fn, GLOBAL_BATCH, MICRO_BATCH, shuffle=False,
                                 config=cfg,
                                 checkpoint=a.ckpt, checkpoint_every=a.ckpt_every if a.ckpt else 0,
                                 # shrink lowers the global batch: the step covers all of its batch
                                 on_step=lambda ctx: log.step(ctx.step - 1, len(ctx.members),
                                                              ctx.sampler.global_batch, ctx.sampler.global_batch,
                                                              key=ctx.view.token, epoch=step_epoch(ctx)))
        trainer.fit(max_steps=a.steps)
        if trainer.ctx.rank == 0:
            log.final(net, a.steps)

    elastic_main(run)


if __name__ == "__main__":
    main()
