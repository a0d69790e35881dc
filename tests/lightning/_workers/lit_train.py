"""An ordinary Lightning training script (LightningModule with a torchmetrics Accuracy,
ModelCheckpoint, CSVLogger or TensorBoardLogger, an LR scheduler); the only fault-tolerance line
is the callback.

    chameleon-ft run --nproc-per-node 4 --run-dir D lit_train.py --out D [--ckpt PATH]
        [--logger csv|tb] [--precision bf16-mixed] [--test]

At the end each worker writes ``<out>/final_<worker id>.pt`` (parameters, optimizer moments,
global step, epoch, validation accuracy; with ``--test`` also the ``trainer.test()`` metrics
after the fit and the test sample ids this worker evaluated) for the tests to compare.
Every ``on_train_batch_end`` appends (epoch, batch_idx, global_step, num_training_batches) to
``batch_log``, and every completed validation what the loggers got (accuracy, per-sample loss,
the number of samples covered, ``ft/eval_complete``) to ``val_history``; both are saved too.  ``--val-sleep``
slows each validation batch and ``<out>/markers/val_w<worker>_e<epoch>`` appears when a worker
starts a validation, so that a test can kill a worker inside it (``--val-size``: the number of
validation samples).  ``--epoch-end-sleep`` sleeps in ``on_train_epoch_end`` after writing
``<out>/markers/epochend_w<worker>_e<epoch>``, and ``--ckpt-on-train-epoch-end`` makes the
``ModelCheckpoint`` save there too (after that sleep), so that a test can kill a worker in the
window between an epoch's last training step and the next epoch's first.
``--save-every-n-steps K`` adds a mid-epoch ``ModelCheckpoint`` (``step<K>-*.ckpt``).
``--steer`` adds an ``EarlyStopping`` and a best-only ``ModelCheckpoint`` (``best/``) on
metrics logged in ``on_train_epoch_end`` (after that sleep) whose values differ by worker:
``stop_signal`` (max over members: worker 1's is 1 in epoch 0) and ``score`` (the mean worker
id); the final file then holds each worker's bookkeeping of both callbacks.
``--validate`` runs ``trainer.validate()`` after the fit.  ``--sync-train-loss`` logs
``train_loss`` with ``sync_dist=True`` (a collective per micro-batch).
``--plain`` runs the same script with strategy="ddp" and no callback (for the overhead
benchmark, under torchrun-style env).  ``--mb-sleep`` pads each micro-batch's compute
(accelerator emulation).  ``kill -USR1 <pid>`` prints a worker's stacks (faulthandler).
"""

import argparse
import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torchmetrics
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the shared helpers
from _helpers.allocation import force_allocations  # noqa: E402
from _helpers.data import Blobs  # noqa: E402


class WithIds(Dataset):
    """``(x, y, index)``: lets a worker record which samples it evaluated."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        return (*self.base[i], i)


class Classifier(pl.LightningModule):
    def __init__(self, mb_sleep=0.0, lr=0.05, val_sleep=0.0, markers=None, sync_train_loss=False,
                 optimizer="sgd", lr_step=5, epoch_end_sleep=0.0, steer=False):
        super().__init__()
        self.save_hyperparameters()
        self.val_history = []  # one entry per completed validation: what the loggers got
        self.batch_log = []  # (epoch, batch_idx, global_step, num_training_batches) per batch end
        self.no_outputs = []  # global steps whose on_train_batch_end got no training_step output
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                       torch.nn.Dropout(0.1), torch.nn.Linear(32, 4))
        self.train_acc = torchmetrics.Accuracy(task="multiclass", num_classes=4)
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=4)
        self.val_n = torchmetrics.SumMetric()  # samples the validation metrics cover
        self.val_nll = torchmetrics.MeanMetric()  # per-sample mean: exact however sharded
        self.test_acc = torchmetrics.Accuracy(task="multiclass", num_classes=4)
        self.test_loss = torchmetrics.MeanMetric()  # per-sample mean: exact however sharded
        self.test_seen = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if self.hparams.mb_sleep:
            time.sleep(self.hparams.mb_sleep)
        x, y = batch
        logits = self(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, sync_dist=self.hparams.sync_train_loss)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def _marker(self, name):
        wid = os.environ.get("CHAMELEON_FT_WORKER_ID", "0")
        open(os.path.join(self.hparams.markers, f"{name}_w{wid}_e{self.current_epoch}"), "a").close()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        t = self.trainer
        self.batch_log.append((t.current_epoch, batch_idx, t.global_step, int(t.num_training_batches)))
        if not outputs:  # Lightning's closure did not run training_step on Lightning's batch ({} or None)
            self.no_outputs.append(t.global_step)

    def on_train_epoch_end(self):
        if self.hparams.epoch_end_sleep:  # for tests that kill a worker between two epochs
            self._marker("epochend")
            time.sleep(self.hparams.epoch_end_sleep)
        if self.hparams.steer:  # decisions whose local values differ by worker (--steer)
            wid = int(os.environ.get("CHAMELEON_FT_WORKER_ID", self.global_rank))
            self.log("stop_signal", float(wid == 1 and self.current_epoch == 0), sync_dist=True, reduce_fx="max")
            self.log("score", float(wid), sync_dist=True)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        if self.hparams.markers and batch_idx == 0:  # for tests that kill a worker mid-validation
            self._marker("val")
        if self.hparams.val_sleep:
            time.sleep(self.hparams.val_sleep)
        logits = self(x)
        self.val_acc(logits, y)
        self.val_n.update(torch.tensor(float(len(y))))
        self.val_nll.update(torch.nn.functional.cross_entropy(logits.float(), y, reduction="none"))
        self.log("val_loss", torch.nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", self.val_acc)
        self.log("val_n", self.val_n)
        self.log("val_nll", self.val_nll)

    def on_validation_end(self):
        m = self.trainer.callback_metrics
        self.val_history.append({"epoch": self.current_epoch, "val_acc": float(m["val_acc"]),
                                 "val_n": float(m["val_n"]), "val_nll": float(m["val_nll"]),
                                 "complete": float(m.get("ft/eval_complete", -1.0))})

    def on_test_epoch_start(self):
        self.test_seen = []

    def test_step(self, batch, batch_idx):
        x, y, ids = batch
        logits = self(x)
        self.test_acc(logits, y)
        self.test_loss.update(torch.nn.functional.cross_entropy(logits.float(), y, reduction="none"))
        self.test_seen.extend(ids.tolist())
        self.log("test_acc", self.test_acc)
        self.log("test_loss", self.test_loss)

    def configure_optimizers(self):
        if self.hparams.optimizer == "adamw":
            opt = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.01)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=self.hparams.lr_step, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    p.add_argument("--mb-sleep", type=float, default=0.0)
    p.add_argument("--ckpt", default=None, help="resume from this checkpoint")
    p.add_argument("--hang-timeout", type=float, default=None)
    p.add_argument("--plain", action="store_true", help="strategy='ddp', no fault tolerance")
    p.add_argument("--dataset", type=int, default=256)
    p.add_argument("--logger", choices=["csv", "tb"], default="csv")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--test", action="store_true", help="trainer.test() after the fit")
    p.add_argument("--val-sleep", type=float, default=0.0, help="sleep per validation batch")
    p.add_argument("--val-size", type=int, default=100, help="validation samples")
    p.add_argument("--epoch-end-sleep", type=float, default=0.0, help="sleep in on_train_epoch_end")
    p.add_argument("--ckpt-on-train-epoch-end", action="store_true",
                   help="ModelCheckpoint saves in on_train_epoch_end (not after validation)")
    p.add_argument("--save-every-n-steps", type=int, default=0, help="also a mid-epoch checkpoint")
    p.add_argument("--validate", action="store_true", help="trainer.validate() after the fit")
    p.add_argument("--steer", action="store_true", help="EarlyStopping and a best ModelCheckpoint (doc)")
    p.add_argument("--sync-train-loss", action="store_true", help="log train_loss with sync_dist=True")
    # for the fidelity trials (tests/fidelity): the defaults are the recovery tests' set-up
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    p.add_argument("--lr-step", type=int, default=5, help="StepLR step_size (stepped every step)")
    p.add_argument("--force-alloc", default=None, help="test-only: see tests/_helpers/allocation.py")
    p.add_argument("--ddp-object", action="store_true",
                   help="strategy=DDPStrategy(gradient_as_bucket_view=True, bucket_cap_mb=...) as an object")
    a = p.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 <pid>: where is it stuck?
    torch.set_num_threads(1)
    force_allocations(a.force_alloc)
    pl.seed_everything(7, workers=True, verbose=False)
    markers = os.path.join(a.out, "markers")
    os.makedirs(markers, exist_ok=True)
    model = Classifier(mb_sleep=a.mb_sleep, val_sleep=a.val_sleep, markers=markers,
                       sync_train_loss=a.sync_train_loss, optimizer=a.optimizer, lr_step=a.lr_step,
                       epoch_end_sleep=a.epoch_end_sleep, steer=a.steer)
    callbacks = [ModelCheckpoint(dirpath=os.path.join(a.out, "ckpt"), save_top_k=-1,
                                 filename="{epoch}-{step}",
                                 save_on_train_epoch_end=a.ckpt_on_train_epoch_end or None)]
    if a.save_every_n_steps:
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(a.out, "ckpt"), save_top_k=-1,
                                         filename="step{step}-{epoch}", auto_insert_metric_name=False,
                                         every_n_train_steps=a.save_every_n_steps))
    if a.steer:
        callbacks += [EarlyStopping(monitor="stop_signal", mode="max", stopping_threshold=0.5, patience=1000,
                                    check_on_train_epoch_end=True),
                      ModelCheckpoint(dirpath=os.path.join(a.out, "best"), monitor="score", mode="max",
                                      save_top_k=1, filename="best-{epoch}-{step}", save_on_train_epoch_end=True)]
    if not a.plain:
        from lightning_ft import FaultToleranceCallback
        callbacks.append(FaultToleranceCallback(hang_timeout_s=a.hang_timeout))
    logger_cls = TensorBoardLogger if a.logger == "tb" else CSVLogger
    logger = logger_cls(os.path.join(a.out, "logs"), name="lit")
    # As many users write it: a DDPStrategy object with DDP settings (the callback carries it).
    strategy = (pl.strategies.DDPStrategy(gradient_as_bucket_view=True, bucket_cap_mb=64 * 4 / 2 ** 20)
                if a.ddp_object else "ddp")
    trainer = pl.Trainer(accelerator="cpu", devices=a.devices, strategy=strategy, max_epochs=a.epochs,
                         accumulate_grad_batches=a.accumulate, callbacks=callbacks,
                         logger=logger, precision=a.precision,
                         log_every_n_steps=2, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    train = DataLoader(Blobs(a.dataset), batch_size=a.batch_size, shuffle=True)
    val = DataLoader(Blobs(a.val_size, seed=99, centers_seed=1234), batch_size=8)
    t0 = time.perf_counter()
    trainer.fit(model, train, val, ckpt_path=a.ckpt)
    fit_s = time.perf_counter() - t0
    wid = int(os.environ.get("CHAMELEON_FT_WORKER_ID", trainer.global_rank))
    opt = trainer.optimizers[0]
    val_acc = float(trainer.callback_metrics["val_acc"])
    final = {"params": [q.detach().clone() for q in model.parameters()],
             "momentum": [t.clone() for q in model.parameters() for t in opt.state[q].values()
                          if torch.is_tensor(t) and t.ndim > 0],
             "global_step": trainer.global_step, "epoch": trainer.current_epoch, "val_acc": val_acc,
             "lr": trainer.lr_scheduler_configs[0].scheduler.get_last_lr(),
             "world_size": trainer.world_size, "fit_s": fit_s, "val_history": model.val_history,
             "batch_log": model.batch_log, "no_outputs": model.no_outputs,
             "checkpoints": [{"best_model_path": cb.best_model_path, "best_model_score":
                              None if cb.best_model_score is None else float(cb.best_model_score)}
                             for cb in trainer.checkpoint_callbacks],
             "stopped_epoch": [cb.stopped_epoch for cb in trainer.early_stopping_callbacks],
             "strategy": type(trainer.strategy).__name__}
    ctx = getattr(trainer.strategy, "ctx", None)
    if ctx is not None and hasattr(ctx, "buckets"):
        final.update(buckets=len(ctx.buckets), released=ctx.buckets.release)
    if a.validate:
        metrics = trainer.validate(model, val, verbose=False)[0]
        final.update(validate_acc=float(metrics["val_acc"]), validate_n=float(metrics["val_n"]),
                     validate_world_size=trainer.world_size)
    if a.test:
        test = DataLoader(WithIds(Blobs(120, seed=77, centers_seed=1234)), batch_size=8)
        metrics = trainer.test(model, test, verbose=False)[0]
        final.update(test_acc=float(metrics["test_acc"]), test_loss=float(metrics["test_loss"]),
                     test_ids=list(model.test_seen), test_world_size=trainer.world_size)
    torch.save(final, os.path.join(a.out, f"final_{wid}.pt"))
    print(f"worker {wid} done: step {trainer.global_step} epoch {trainer.current_epoch} "
          f"val_acc {val_acc:.4f}", flush=True)


if __name__ == "__main__":
    main()
