"""An ordinary Accelerate training script; the fault-tolerance change is the Accelerator class.

    chameleon-ft run --nproc-per-node 4 --run-dir D acc_train.py --out D [--resume DIR]

The loop is the plain one from Accelerate's examples (accumulate, backward, clip, optimizer /
scheduler step, zero_grad, ``if accelerator.sync_gradients`` step counting, gather_for_metrics
evaluation each epoch, a tracker, save_state).  At the end each worker writes
``<out>/final_<worker id>.pt`` (parameters, momentum, counters, LR, the evaluation sample ids
gathered in each epoch, accuracy) for the tests to compare.  ``--trigger-at K``: after step K
worker 1 calls ``set_trigger()``, every worker writes ``<out>/markers/window_w<id>`` and sleeps
``--window-sleep`` s, and the loop ends at the first step after which ``check_trigger()`` (asked
after every step) is True (Accelerate's early-stopping idiom).
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from accelerate.utils import DistributedDataParallelKwargs, set_seed
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the shared helpers
import _helpers.data  # noqa: E402
from _helpers.trackers import JsonlTracker  # noqa: E402
from _helpers.allocation import force_allocations  # noqa: E402

from accelerate_ft import FaultTolerantAccelerator, wrap


class Blobs(_helpers.data.Blobs):
    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i], "id": torch.tensor(i)}


class Net(torch.nn.Module):
    """The model; like a HuggingFace model it returns its loss when given the labels."""

    def __init__(self, dropout: float):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Dropout(dropout),
                                        torch.nn.Linear(32, 4))

    def forward(self, x, y=None):
        logits = self.body(x)
        loss = torch.nn.functional.cross_entropy(logits, y) if y is not None else None
        return {"logits": logits, "loss": loss}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--mb-sleep", type=float, default=0.0)
    p.add_argument("--wrap", action="store_true", help="use wrap(Accelerator(...))")
    p.add_argument("--save-at", type=int, default=None, help="save_state after this many steps")
    p.add_argument("--resume", default=None)
    # for the fidelity trials (tests/fidelity): the defaults are the recovery tests' set-up
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--accum", type=int, default=2, help="gradient_accumulation_steps")
    p.add_argument("--dataset", type=int, default=256)
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    p.add_argument("--lr-step", type=int, default=20, help="StepLR step_size (stepped every step)")
    p.add_argument("--loss", choices=["model", "external"], default="model",
                   help="model: loss = model(x, y)['loss'] (HF style); external: cross_entropy(model(x)['logits'], y)")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--fsdp", action="store_true",
                   help="FSDP2: FullyShardedDataParallelPlugin(fsdp_version=2), every Linear a unit")
    p.add_argument("--force-alloc", default=None, help="test-only: see tests/_helpers/allocation.py")
    p.add_argument("--trigger-at", type=int, default=None, help="worker 1 sets the trigger after this step")
    p.add_argument("--gav", action="store_true",
                   help="DistributedDataParallelKwargs(gradient_as_bucket_view=True), as a DDP user sets it")
    p.add_argument("--window-sleep", type=float, default=0.0, help="sleep after the trigger step (doc)")
    a = p.parse_args()
    torch.set_num_threads(1)
    force_allocations(a.force_alloc)
    set_seed(7)
    tracker = JsonlTracker(os.path.join(a.out, "tracker.jsonl"))
    handlers = [DistributedDataParallelKwargs(gradient_as_bucket_view=True)] if a.gav else []
    if a.wrap:
        from accelerate import Accelerator
        acc = wrap(Accelerator(cpu=True, gradient_accumulation_steps=a.accum, log_with=[tracker],
                               kwargs_handlers=handlers))
    else:
        fsdp = {}
        if a.fsdp:
            from accelerate.utils import FullyShardedDataParallelPlugin
            fsdp = {"fsdp_plugin": FullyShardedDataParallelPlugin(
                fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap="Linear")}
        acc = FaultTolerantAccelerator(gradient_accumulation_steps=a.accum, log_with=[tracker],
                                       kwargs_handlers=handlers, **fsdp)
    acc.init_trackers("acc")
    model = Net(a.dropout)
    if a.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=a.lr_step, gamma=0.7)
    train = DataLoader(Blobs(a.dataset), batch_size=a.batch_size, shuffle=True)
    val = DataLoader(Blobs(100, seed=99), batch_size=8)
    model, opt, train, val, sched = acc.prepare(model, opt, train, val, sched)
    if a.resume:
        acc.load_state(a.resume)
    completed, eval_ids, accs, stopped = 0, [], [], False
    wid = int(os.environ.get("CHAMELEON_FT_WORKER_ID", acc.process_index))
    t0 = time.perf_counter()
    for epoch in range(a.epochs):
        if acc.ft_context is not None and acc.ft_context.epoch > epoch:
            continue  # resumed past this epoch
        model.train()
        for batch in train:
            with acc.accumulate(model):
                if a.mb_sleep:
                    time.sleep(a.mb_sleep)
                if a.loss == "model":
                    loss = model(batch["x"], batch["y"])["loss"]
                else:
                    loss = torch.nn.functional.cross_entropy(model(batch["x"])["logits"], batch["y"])
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
                sched.step()
                opt.zero_grad()
            if acc.sync_gradients:
                completed += 1
                acc.log({"train_loss": loss.item()}, step=acc.ft_context.step)
                if a.save_at is not None and acc.ft_context.step == a.save_at:
                    acc.save_state(os.path.join(a.out, "ckpt"))
                if a.trigger_at is not None:
                    if acc.ft_context.step == a.trigger_at:
                        if wid == 1:
                            acc.set_trigger()
                        os.makedirs(os.path.join(a.out, "markers"), exist_ok=True)
                        open(os.path.join(a.out, "markers", f"window_w{wid}"), "w").close()
                        time.sleep(a.window_sleep)
                    if acc.check_trigger():
                        stopped = True
                        break
        model.eval()
        ids, correct = [], 0
        for batch in val:
            with torch.no_grad():
                pred = model(batch["x"])["logits"].argmax(-1)
            g_pred, g_y, g_id = acc.gather_for_metrics((pred, batch["y"], batch["id"]))
            correct += int((g_pred == g_y).sum())
            ids += g_id.tolist()
        eval_ids.append(ids)
        accs.append(correct / len(ids))
        acc.log({"val_acc": accs[-1]}, step=acc.ft_context.step)
        if stopped:
            break
    fit_s = time.perf_counter() - t0
    acc.wait_for_everyone()
    ctx = acc.ft_context
    whole = acc.get_state_dict(model) if a.fsdp else None  # sharded: the whole weights (every worker)
    torch.save({"params": [q.detach().clone() for q in model.parameters()] if whole is None
                else [t.clone() for n, t in whole.items()],
                "momentum": [t.clone() for q in model.parameters() for t in opt.state[q].values()
                             if torch.is_tensor(t) and t.ndim > 0] if whole is None else [],
                "step": ctx.step, "epoch": ctx.epoch, "completed": completed,
                "lr": sched.get_last_lr(), "eval_ids": eval_ids, "val_acc": accs,
                "num_processes": acc.num_processes, "process_index": acc.process_index,
                "is_main": acc.is_main_process, "fit_s": fit_s,
                "released": getattr(getattr(ctx, "buckets", None), "release", None)},
               os.path.join(a.out, f"final_{wid}.pt"))
    acc.end_training()
    print(f"worker {wid} done: step {ctx.step} completed {completed} val_acc {accs}", flush=True)


if __name__ == "__main__":
    main()
