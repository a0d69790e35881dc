"""A plain HuggingFace ``Trainer`` script, one line changed (``FaultTolerantTrainer``): a small
classifier with dropout, AdamW, a linear schedule with warm-up, gradient accumulation 2,
``eval_strategy="steps"``, checkpoints every 4 steps with ``save_total_limit=2`` and
``load_best_model_at_end``; then one more ``trainer.evaluate()``.  With ``--model lm``: a
2-layer GPT-2 causal LM on 512 sequences of 6-24 tokens padded per batch (labels -100 on the
padding): 2 epochs of 16 steps on 4 workers, a cosine schedule with warm-up, evaluations and
checkpoints every 10 steps.  Writes
``<out>/final_<worker>.pt``
(and with ``--fsdp``, sharded, ``<out>/model``: ``trainer.save_model``): the final weights, ``state.global_step``, ``state.log_history``,
the checkpoint folders left, the best checkpoint and the last evaluation's metrics."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from transformers_ft import FaultTolerantTrainer

DATASET, EVAL, FEATURES, CLASSES = 256, 100, 16, 4


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, FEATURES, generator=g)
        w = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(0))
        self.y = (self.x @ w).argmax(-1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


class Classifier(nn.Module):
    def __init__(self, sleep: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, CLASSES))
        self.sleep = sleep

    def forward(self, x, labels=None):
        if self.sleep and self.training:
            time.sleep(self.sleep)
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return {"loss": loss, "logits": logits}


class Tokens(torch.utils.data.Dataset):
    """Sequences of 6-24 tokens from a fixed random bigram table: something to learn."""

    def __init__(self, n: int, seed: int, vocab: int = 48) -> None:
        g = torch.Generator().manual_seed(seed)
        table = torch.randint(1, vocab, (vocab, 3), generator=torch.Generator().manual_seed(0))
        self.rows = []
        for _ in range(n):
            length = int(torch.randint(6, 25, (1,), generator=g))
            t = [int(torch.randint(1, vocab, (1,), generator=g))]
            for _ in range(length - 1):
                t.append(int(table[t[-1], int(torch.randint(0, 3, (1,), generator=g))]))
            self.rows.append(t)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i]}


def pad(rows: list[dict]) -> dict:
    """Right-padded to the batch's longest row; padding masked out of attention and labels."""
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, :len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def accuracy(pred) -> dict:
    return {"accuracy": float((pred.predictions.argmax(-1) == pred.label_ids).mean())}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mb-sleep", type=float, default=0.0)
    p.add_argument("--model", choices=["cls", "lm"], default="cls")
    p.add_argument("--max-steps", type=int, default=-1)
    p.add_argument("--seed", type=int, default=0, help="lm: the model's initialisation and the Trainer's seed")
    p.add_argument("--plain", action="store_true", help="lm: transformers.Trainer itself (a torchrun baseline)")
    p.add_argument("--no-dropout", action="store_true", help="lm: dropout 0 (an update computed elsewhere again)")
    p.add_argument("--fsdp", action="store_true",
                   help="lm: sharded, FSDP2 (fsdp='full_shard', GPT2Block units); saves <out>/model (save_model)")
    p.add_argument("--resume", default=None, help="trainer.train(resume_from_checkpoint=...)")
    p.add_argument("--step-lr", action="store_true",
                   help="the user's own SGD + StepLR(step_size=5, gamma=0.5) (optimizers=...), not the Trainer's")
    a = p.parse_args()
    torch.manual_seed(0)
    if a.model == "lm":
        return causal_lm(a)
    args = TrainingArguments(
        output_dir=os.path.join(a.out, "ckpt"), per_device_train_batch_size=4, per_device_eval_batch_size=8,
        gradient_accumulation_steps=2, num_train_epochs=2, learning_rate=3e-3, warmup_steps=3,
        lr_scheduler_type="linear", weight_decay=0.01, max_grad_norm=1.0, logging_steps=2,
        eval_strategy="steps", eval_steps=4, save_strategy="steps", save_steps=4, save_total_limit=2,
        load_best_model_at_end=True, metric_for_best_model="eval_loss", use_cpu=True, report_to="none",
        seed=0, dataloader_num_workers=0, disable_tqdm=True)
    model = Classifier(a.mb_sleep)
    optimizers = (None, None)
    if a.step_lr:
        opt = torch.optim.SGD(model.parameters(), lr=3e-3, momentum=0.9)
        optimizers = (opt, torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5))
    trainer = FaultTolerantTrainer(model=model, optimizers=optimizers, args=args, train_dataset=Data(DATASET, 1),
                                   eval_dataset=Data(EVAL, 2), compute_metrics=accuracy)
    finish(a, trainer)


def causal_lm(a) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    args = TrainingArguments(
        output_dir=os.path.join(a.out, "ckpt"), per_device_train_batch_size=4, per_device_eval_batch_size=8,
        gradient_accumulation_steps=2, num_train_epochs=2, learning_rate=3e-3, warmup_steps=2,
        lr_scheduler_type="cosine", max_grad_norm=1.0, logging_steps=2, eval_strategy="steps", eval_steps=10,
        save_strategy="steps", save_steps=10, save_total_limit=2, load_best_model_at_end=True,
        metric_for_best_model="eval_loss", use_cpu=True, report_to="none", seed=a.seed, dataloader_num_workers=0,
        disable_tqdm=True, max_steps=a.max_steps,
        **({"fsdp": "full_shard", "fsdp_config": {"transformer_layer_cls_to_wrap": ["GPT2Block"]}} if a.fsdp else {}))
    drop = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0} if a.no_dropout else {}
    torch.manual_seed(a.seed)
    config = GPT2Config(vocab_size=48, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0, **drop)
    model = GPT2LMHeadModel(config)
    optimizers = (None, None)
    if a.step_lr:
        opt = torch.optim.SGD(model.parameters(), lr=3e-2)
        optimizers = (opt, torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5))
    if a.mb_sleep:
        model.register_forward_pre_hook(lambda m, _: time.sleep(a.mb_sleep) if m.training else None)
    cls = Trainer if a.plain else FaultTolerantTrainer
    trainer = cls(model=model, args=args, optimizers=optimizers, train_dataset=Tokens(2 * DATASET, 1),
                                   eval_dataset=Tokens(EVAL, 2), data_collator=pad)
    finish(a, trainer)


def finish(a, trainer) -> None:
    args = trainer.args
    result = trainer.train(resume_from_checkpoint=a.resume)
    metrics = trainer.evaluate()
    if getattr(a, "fsdp", False):
        trainer.save_model(os.path.join(a.out, "model"))
    wid = int(os.environ.get("CHAMELEON_FT_WORKER_ID", os.environ.get("RANK", "0")))
    ckpts = sorted(d for d in os.listdir(args.output_dir) if d.startswith("checkpoint-"))
    state = trainer.model.state_dict()
    torch.save({"params": [v.detach().clone() for v in state.values()], "names": list(state),
                "global_step": trainer.state.global_step, "log_history": json.dumps(trainer.state.log_history),
                "checkpoints": ckpts, "best": os.path.basename(trainer.state.best_model_checkpoint or ""),
                "eval": json.dumps(metrics), "train_loss": result.training_loss,
                "world_size": trainer.args.world_size}, os.path.join(a.out, f"final_{wid}.pt"))
    print(f"worker {wid} done: global_step {trainer.state.global_step} eval_loss {metrics['eval_loss']:.6f}",
          flush=True)


if __name__ == "__main__":
    main()
