"""The loop logic of Accelerate's own examples ``by_feature/checkpointing.py`` and
``by_feature/tracking.py`` (and the evaluation of ``nlp_example.py``), written anew for the tests
with an offline model and data; the one change for fault tolerance is the Accelerator class.

    chameleon-ft run --nproc-per-node 4 --run-dir D acc_examples.py --out D
        [--checkpointing-steps N] [--resume-from-checkpoint DIR] [--eval-size N --eval-sleep S]

What the examples do and this script keeps: a HuggingFace-style model called as
``model(**batch)`` whose output carries ``.loss``; ``overall_step`` counted per loader item and
``save_state(f"step_{overall_step}")`` every N items; resuming by ``load_state`` and *skipping*
the items of the checkpoint's epoch before ``resume_step`` (parsed from the folder name);
``total_loss += loss`` per item, logged as ``total_loss / len(train_dataloader)`` with
``step=epoch``; an evaluation that ``gather_for_metrics`` the predictions each epoch.
Each worker writes ``<out>/final_<worker id>.pt`` with its counters, parameters and the
gathered evaluation ids; the main process appends what it logs to ``<out>/tracker.jsonl``
and writes ``<out>/eval_start`` when an evaluation begins (for the tests to time a kill).
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the shared helpers
import _helpers.data  # noqa: E402
from _helpers.trackers import JsonlTracker  # noqa: E402

from accelerate_ft import FaultTolerantAccelerator  # noqa: E402


class Blobs(_helpers.data.Blobs):
    def __getitem__(self, i):
        return {"input": self.x[i], "labels": self.y[i], "idx": torch.tensor(i)}


class Output(dict):
    """Like transformers' ModelOutput: keys and attributes."""

    __getattr__ = dict.__getitem__


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Dropout(0.1),
                                        torch.nn.Linear(32, 4))

    def forward(self, input, labels=None, idx=None):
        logits = self.body(input)
        loss = torch.nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return Output(loss=loss, logits=logits)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--checkpointing-steps", type=int, default=None)
    p.add_argument("--resume-from-checkpoint", default=None)
    p.add_argument("--eval-size", type=int, default=64)
    p.add_argument("--eval-sleep", type=float, default=0.0, help="seconds per evaluation batch")
    p.add_argument("--mb-sleep", type=float, default=0.0)
    a = p.parse_args()
    acc = FaultTolerantAccelerator(log_with=[JsonlTracker(os.path.join(a.out, "tracker.jsonl"))])
    set_seed(42)
    acc.init_trackers("examples")
    train_dl = DataLoader(Blobs(256), batch_size=8, shuffle=True)
    eval_dl = DataLoader(Blobs(a.eval_size, seed=99, centers_seed=1234), batch_size=8)
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=len(train_dl) * a.epochs)
    model, optimizer, train_dl, eval_dl, lr_scheduler = acc.prepare(model, optimizer, train_dl, eval_dl, lr_scheduler)

    overall_step, starting_epoch, resume_step = 0, 0, None
    if a.resume_from_checkpoint:
        acc.load_state(a.resume_from_checkpoint)
        resume_step = int(os.path.basename(a.resume_from_checkpoint).replace("step_", ""))
        starting_epoch = resume_step // len(train_dl)
        resume_step -= starting_epoch * len(train_dl)

    items, saved, losses, eval_ids, accs = 0, [], [], [], []
    for epoch in range(starting_epoch, a.epochs):
        model.train()
        total_loss = 0
        for step, batch in enumerate(train_dl):
            if a.resume_from_checkpoint and epoch == starting_epoch:
                if resume_step is not None and step < resume_step:
                    overall_step += 1
                    continue
            if a.mb_sleep:
                time.sleep(a.mb_sleep)
            outputs = model(**batch)
            loss = outputs.loss
            total_loss += loss.detach().float()
            acc.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            overall_step += 1
            items += 1
            if a.checkpointing_steps and overall_step % a.checkpointing_steps == 0:
                acc.save_state(os.path.join(a.out, f"step_{overall_step}"))
                saved.append(overall_step)

        model.eval()
        if acc.is_main_process:
            Path(a.out, "eval_start").write_text(str(epoch))
        ids, correct = [], 0
        for batch in eval_dl:
            if a.eval_sleep:
                time.sleep(a.eval_sleep)
            with torch.no_grad():
                outputs = model(**batch)
            predictions, references, idx = acc.gather_for_metrics(
                (outputs.logits.argmax(dim=-1), batch["labels"], batch["idx"]))
            correct += int((predictions == references).sum())
            ids += idx.tolist()
        eval_ids.append(ids)
        accs.append(correct / max(1, len(ids)))
        losses.append(float(total_loss) / len(train_dl))
        acc.log({"accuracy": accs[-1], "train_loss": losses[-1], "epoch": epoch}, step=epoch)
    acc.wait_for_everyone()
    wid = int(os.environ.get("CHAMELEON_FT_WORKER_ID", acc.process_index))
    torch.save({"params": [q.detach().clone() for q in model.parameters()],
                "step": acc.ft_context.step, "overall_step": overall_step, "items": items,
                "saved": saved, "eval_ids": eval_ids, "accuracy": accs, "train_loss": losses,
                "len": len(train_dl), "num_processes": acc.num_processes},
               os.path.join(a.out, f"final_{wid}.pt"))
    acc.end_training()


if __name__ == "__main__":
    main()
