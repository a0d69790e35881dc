"""The sharded benchmarks' models and synthetic tasks (shared by ``_shard_bench.py`` and
``_shard_bench_lightning.py``; no processes, no runtime).

Kinds: ``regression`` (an MLP regression with Adam: the memory and overhead parts), and the
three of issue 23's matrix, each a classifier trained with AdamW on its own synthetic task with
a held-out test set: ``mlp`` (a residual MLP, 4-class teacher classification), ``lm`` (embedding
+ one causal transformer layer + head, next-token prediction of a noisy 16-token Markov chain)
and ``conv`` (two convolutions + head, 4-class 8x8 one-channel patterns).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

KINDS = ("mlp", "lm", "conv")
DIM, CLASSES, TRAIN = 32, 4, 4096


def regression(n=4096, dim=32, out=8, seed=1234) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, out, generator=g) / dim ** 0.5
    return torch.utils.data.TensorDataset(x, torch.tanh(2 * x @ w) + 0.02 * torch.randn(n, out, generator=g))


def regression_model(hidden: int, layers: int, seed: int) -> nn.Module:
    torch.manual_seed(100 + seed)
    mods = [nn.Linear(32, hidden), nn.Tanh()]
    for _ in range(layers - 2):
        mods += [nn.Linear(hidden, hidden), nn.Tanh()]
    mods.append(nn.Linear(hidden, 8))
    return nn.Sequential(*mods)


def task(kind: str, seed: int = 1234, n: int = TRAIN + 1024):
    """(train dataset, (test inputs, test labels)) of ``kind``'s synthetic task."""
    g = torch.Generator().manual_seed(seed)
    if kind == "lm":
        trans = torch.softmax(3 * torch.randn(16, 16, generator=g), 1)
        seq = torch.zeros(n, 9, dtype=torch.long)
        seq[:, 0] = torch.randint(0, 16, (n,), generator=g)
        for t in range(1, 9):
            seq[:, t] = torch.multinomial(trans[seq[:, t - 1]], 1, generator=g).squeeze(1)
        x, y = seq[:, :8], seq[:, 1:]
    elif kind == "conv":
        protos = torch.randn(CLASSES, 1, 8, 8, generator=g)
        y = torch.randint(0, CLASSES, (n,), generator=g)
        x = protos[y] + 1.5 * torch.randn(n, 1, 8, 8, generator=g)
    elif kind == "mlp":
        x = torch.randn(n, DIM, generator=g)
        teacher = torch.randn(DIM, CLASSES, generator=g)
        y = (torch.tanh(x @ teacher) + 0.3 * torch.randn(n, CLASSES, generator=g)).argmax(1)
    else:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    return torch.utils.data.TensorDataset(x[:TRAIN], y[:TRAIN]), (x[TRAIN:], y[TRAIN:])


class _Block(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.lin = nn.Linear(h, h)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class TinyLM(nn.Module):
    """Embedding, one causal transformer layer, head: a small language model."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 32)
        self.pos = nn.Embedding(8, 32)
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 16)

    def forward(self, x):
        h = self.emb(x) + self.pos(torch.arange(x.shape[1]))
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.layer(h, src_mask=mask, is_causal=True))


def model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(100 + seed)
    if kind == "lm":
        return TinyLM()
    if kind == "conv":
        return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                             nn.ReLU(), nn.Flatten(), nn.Linear(8 * 64, CLASSES))
    if kind == "mlp":
        return nn.Sequential(nn.Linear(DIM, 64), _Block(64), _Block(64), nn.Linear(64, CLASSES))
    raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")


def cross_entropy(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def evaluate(module: nn.Module, test) -> dict:
    """Test loss and accuracy of ``module`` (the user's own model after ``fit()``)."""
    xt, yt = test
    logits = module(xt)
    return {"test_loss": float(cross_entropy(logits, yt)),
            "test_acc": float((logits.argmax(-1) == yt).float().mean())}
