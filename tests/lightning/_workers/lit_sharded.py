"""Lightning's own FSDP2 recipe (``ModelParallelStrategy`` with ``fully_shard`` on submodules
in ``configure_model``, as in Lightning's model-parallel guide), on CPU; the only
fault-tolerance line is the callback.

    chameleon-ft run --nproc-per-node 4 --run-dir D lit_sharded.py --out D [--plain]

At the end each worker writes ``<out>/final_<worker id>.pt``: global step, epoch, the logged
``train_loss`` per step (what the loggers got), the last validation loss, the whole parameters
(from the checkpoint it saved, ``<out>/last.ckpt``).  ``--plain`` runs without the callback
(Lightning's own ``ModelParallelStrategy`` under torchrun-style env: the failure-free
baseline).  ``--mb-sleep`` pads each training step (accelerator emulation), ``--val-sleep`` each
validation batch; ``<out>/markers/val_w<worker>_e<epoch>`` appears when a validation starts.  ``--ckpt`` resumes
from a checkpoint (on any number of workers).
"""

import argparse
import faulthandler
import os
import signal
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset


class FeedForward(torch.nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = torch.nn.Linear(dim, hidden, bias=False)
        self.w2 = torch.nn.Linear(hidden, dim, bias=False)
        self.w3 = torch.nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LitModel(pl.LightningModule):
    def __init__(self, mb_sleep=0.0, markers=None, val_sleep=0.0):
        super().__init__()
        self.model = FeedForward(32, 64)
        self.head = torch.nn.Linear(32, 1)
        self.mb_sleep, self.markers, self.val_sleep = mb_sleep, markers, val_sleep
        self.losses = {}  # global step -> logged train loss (this worker's view)
        self.val_losses = []
        self.step_lr = False

    def configure_model(self):
        dp_mesh = self.device_mesh["data_parallel"]
        fully_shard(self.model.w1, mesh=dp_mesh)
        fully_shard(self.model.w2, mesh=dp_mesh)
        fully_shard(self.model.w3, mesh=dp_mesh)
        fully_shard(self.model, mesh=dp_mesh)
        fully_shard(self.head, mesh=dp_mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.mb_sleep:
            time.sleep(self.mb_sleep)
        loss = F.mse_loss(self.head(self.model(x)).squeeze(-1), y)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses[self.global_step] = float(self.trainer.callback_metrics["train_loss"])
        if self.markers is not None:
            Path(self.markers, f"step{self.global_step}_w{self.trainer.global_rank}").touch()

    def on_validation_start(self):
        if self.markers is not None and not self.trainer.sanity_checking:
            wid = os.environ.get("CHAMELEON_FT_WORKER_ID", self.trainer.global_rank)
            Path(self.markers, f"val_w{wid}_e{self.current_epoch}").touch()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        if self.val_sleep:
            time.sleep(self.val_sleep)
        self.log("val_loss", F.mse_loss(self.head(self.model(x)).squeeze(-1), y), sync_dist=True)

    def on_validation_end(self):
        if "val_loss" in self.trainer.callback_metrics:
            self.val_losses.append(float(self.trainer.callback_metrics["val_loss"]))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        if self.step_lr:  # chainable, per step: halves after every 5th optimizer step
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 5, 0.5),
                                                       "interval": "step"}}
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 6, 0.5)}


def data(n, seed):
    w = torch.randn(32, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    return TensorDataset(x, torch.tanh(x @ w / 4) + 0.05 * torch.randn(n, generator=g))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--mb-sleep", type=float, default=0.0)
    ap.add_argument("--val-sleep", type=float, default=0.0)
    ap.add_argument("--snapshot-every", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--ckpt", default=None, help="resume: trainer.fit(..., ckpt_path=CKPT)")
    ap.add_argument("--step-lr", action="store_true", help="a per-step StepLR (5 steps, x0.5)")
    args = ap.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    pl.seed_everything(args.seed)
    out = Path(args.out)
    (out / "markers").mkdir(parents=True, exist_ok=True)
    callbacks = []
    if not args.plain:
        from lightning_ft import FaultToleranceCallback
        callbacks.append(FaultToleranceCallback(snapshot_every=args.snapshot_every))
    n = int(os.environ.get("LOCAL_WORLD_SIZE", 4))
    trainer = pl.Trainer(accelerator="cpu", devices=n, max_epochs=args.epochs, callbacks=callbacks,
                         strategy=ModelParallelStrategy(data_parallel_size=n, tensor_parallel_size=1),
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         num_sanity_val_steps=0, log_every_n_steps=1)
    model = LitModel(args.mb_sleep, str(out / "markers"), args.val_sleep)
    model.step_lr = args.step_lr
    train = DataLoader(data(256, 1), batch_size=8, shuffle=True)
    val = DataLoader(data(100, 2), batch_size=8)
    t0 = time.perf_counter()
    trainer.fit(model, train, val, ckpt_path=args.ckpt)
    fit_s = time.perf_counter() - t0
    if not args.plain:  # Lightning's own strategy writes a distributed checkpoint (a directory)
        trainer.save_checkpoint(str(out / "last.ckpt"))
    wid = trainer.global_rank if args.plain else int(os.environ["CHAMELEON_FT_WORKER_ID"])
    ckpt = None if args.plain else torch.load(out / "last.ckpt", weights_only=True)
    torch.save({"fit_s": fit_s, "global_step": trainer.global_step, "epoch": trainer.current_epoch,
                "losses": model.losses, "val_losses": model.val_losses,
                "eval_reruns": getattr(trainer.strategy, "eval_reruns", 0),
                "params": ckpt["state_dict"] if ckpt is not None else None},
               out / f"final_{wid}.pt")


if __name__ == "__main__":
    main()
