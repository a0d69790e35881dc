"""Causal-LM fine-tuning of a small GPT-2-style model (built from a config) with accelerate_ft.

    python recipes/causal_lm.py --workers 4 --kill-rank 2 --at-step 5

Model: ``GPT2LMHeadModel`` from a small ``GPT2Config`` (2 layers, 64-wide) by default, so it needs
no download; ``--model`` takes a local checkpoint (or a hub id when online) instead.  Tokens:
characters of the corpus (vocabulary built from the training text) for the default model, the
model's own tokenizer otherwise.  Data: the texts of ``recipes/data/sentiment_*.jsonl`` (written
for this project, Apache-2.0) as local text; ``--dataset`` takes any text file or JSONL with a
``text`` field.  Ends with the eval perplexity (``gather_for_metrics``: every block once).
"""

import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

BLOCK = 32


def load_text(dataset: str, split: str) -> str:
    p = Path(dataset)
    if p.is_dir():
        p = p / f"sentiment_{split}.jsonl"
    lines = [line for line in p.read_text().splitlines() if line.strip()]
    if p.suffix == ".jsonl":
        lines = [json.loads(line)["text"] for line in lines]
    if p.is_file() and not Path(dataset).is_dir():
        cut = int(len(lines) * 0.8)
        lines = lines[:cut] if split == "train" else lines[cut:]
    return "\n".join(lines)


def main():
    a = _common.parser(__doc__.splitlines()[0], "gpt2-tiny (from config)", str(_common.HERE / "data"),
                       "in blocks of 32 tokens").parse_args()
    _common.launch_if_needed(a, __file__)
    import torch
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from accelerate_ft import FaultTolerantAccelerator

    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    train_text, eval_text = load_text(a.dataset, "train"), load_text(a.dataset, "eval")
    if a.model.startswith("gpt2-tiny"):
        vocab = sorted(set(train_text) | set(eval_text))
        encode = (lambda s: [vocab.index(c) for c in s])
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(vocab), n_positions=BLOCK, n_embd=64,
                                           n_layer=2, n_head=2))
    else:
        tok = AutoTokenizer.from_pretrained(a.model)
        encode = (lambda s: tok(s)["input_ids"])
        model = AutoModelForCausalLM.from_pretrained(a.model)

    def blocks(text: str) -> list[torch.Tensor]:
        ids = torch.tensor(encode(text))
        return [ids[i:i + BLOCK] for i in range(0, len(ids) - BLOCK + 1, BLOCK)]

    train_blocks, eval_blocks = blocks(train_text), blocks(eval_text)
    if a.max_samples:
        train_blocks = train_blocks[:a.max_samples]

    def collate(rows):
        x = torch.stack(rows)
        return {"input_ids": x, "labels": x}

    acc = FaultTolerantAccelerator(gradient_accumulation_steps=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train = DataLoader(train_blocks, batch_size=a.batch_size, shuffle=True, collate_fn=collate)
    evl = DataLoader(eval_blocks, batch_size=16, collate_fn=collate)
    model, opt, train, evl = acc.prepare(model, opt, train, evl)
    seen = 0
    t0 = time.perf_counter()
    for epoch in range(a.epochs):
        seen = _common.train_epoch(acc, model, opt, train, t0=t0, seen=seen, log_every=8)
        model.eval()
        total_loss, total = 0.0, 0
        for batch in evl:
            with torch.no_grad():
                logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
                target = batch["labels"][:, 1:]
                per_block = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.size(-1)), target.reshape(-1), reduction="none"
                ).view(target.shape).mean(1)
            losses = acc.gather_for_metrics(per_block)
            total_loss += float(losses.sum())
            total += len(losses)
        ppl = math.exp(total_loss / total)
        acc.print(f"recipe: epoch {epoch} eval perplexity {ppl:.4f} ({total} blocks)")
    _common.write_result(acc, a.out, eval_perplexity=ppl, eval_samples=total)
    acc.print(f"recipe: done, eval perplexity {ppl:.4f}")


if __name__ == "__main__":
    main()
