"""Baseline: plain Lightning ``strategy="ddp"`` (no fault tolerance), under torchrun.

    BENCH_OUT=D torchrun --standalone --nproc-per-node 4 benchmarks/baselines/lightning_ddp.py

Same model, data, optimizer and emulated compute; ``accumulate_grad_batches=2`` of micro-batches
of 8 on 4 workers makes the global batch of 64 (an unshuffled ``DistributedSampler`` strides the
samples over ranks, so global step t covers samples [64 t, 64 t + 64), as for every system).  Expected on a worker's death: the survivors' next all-reduce fails and
the job crashes (torchrun without ``--max-restarts``); the harness records that.
"""

from __future__ import annotations

import argparse
import os

import torch

from common import GLOBAL_BATCH, MICRO_BATCH, StepLog, add_args, compute_s, tb


def main() -> None:
    ap = argparse.ArgumentParser()
    add_args(ap)
    a = ap.parse_args()
    torch.set_num_threads(1)
    import lightning as L

    log = StepLog(int(os.environ.get("RANK", 0)))
    world = int(os.environ.get("WORLD_SIZE", 1))
    accumulate = GLOBAL_BATCH // MICRO_BATCH // world
    ids: list[int] = []   # this rank's sample ids since its last optimizer step
    keys: list[str] = []

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = tb.model()

        def training_step(self, batch, batch_idx):
            import time

            x, y, idx = batch
            ids.extend(idx.tolist())
            if len(ids) == accumulate * MICRO_BATCH:   # DDP all-reduces in this micro-batch's backward
                keys.append(log.attempt(self.trainer.global_step, ids))
            loss, pad = tb.padded_loss(self.net, x, y, compute_s(log.rank, self.trainer.global_step, a.mb_sleep))
            time.sleep(pad)  # before backward: the padding stands for forward+backward
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if (batch_idx + 1) % accumulate == 0:
                log.step(self.trainer.global_step - 1, world, GLOBAL_BATCH, key=keys.pop())
                ids.clear()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    module = Module()
    # The sample's index rides along, so each rank logs the ids its sampler really dealt it.
    data = tb.dataset()
    data = torch.utils.data.TensorDataset(*data.tensors, torch.arange(len(data)))
    # Our own unshuffled DistributedSampler: the one Lightning injects shuffled the samples here
    # (the logged ids showed it), so its steps held other samples than every other system's.
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=log.rank, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO_BATCH, sampler=sampler)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_steps=a.steps,
                        use_distributed_sampler=False,
                        accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)
    if trainer.global_rank == 0:
        log.final(module.net, a.steps)


if __name__ == "__main__":
    main()
