"""Offline stand-in for `datasets.load_dataset("nyu-mll/glue", "mrpc")`: synthetic sentence pairs
whose label is learnable (shared words), same columns and the few methods the examples use."""
import random

WORDS = [f"w{i}" for i in range(200)]


class Dataset:
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def map(self, fn, batched=True, remove_columns=()):
        cols = {k: [r[k] for r in self.rows] for k in self.rows[0]}
        out = fn(cols)
        n = len(self.rows)
        new = []
        for i in range(n):
            r = {k: v for k, v in self.rows[i].items() if k not in remove_columns}
            r.update({k: out[k][i] for k in out})
            new.append(r)
        return Dataset(new)

    def rename_column(self, a, b):
        return Dataset([{(b if k == a else k): v for k, v in r.items()} for r in self.rows])


class DatasetDict(dict):
    def map(self, *a, **k):
        return DatasetDict({s: d.map(*a, **k) for s, d in self.items()})

    def rename_column(self, a, b):
        return DatasetDict({s: d.rename_column(a, b) for s, d in self.items()})


def _split(n, seed):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        s1 = [rng.choice(WORDS) for _ in range(rng.randint(5, 12))]
        label = rng.randint(0, 1)
        s2 = (s1[: len(s1) // 2] + [rng.choice(WORDS) for _ in range(3)]) if label else [rng.choice(WORDS) for _ in range(rng.randint(5, 12))]
        rows.append({"sentence1": " ".join(s1), "sentence2": " ".join(s2), "label": label, "idx": i})
    return Dataset(rows)


def load_dataset(name, config=None, **kw):
    import os
    return DatasetDict(train=_split(int(os.environ.get("SHIM_TRAIN", 256)), 1),
                       validation=_split(int(os.environ.get("SHIM_VAL", 64)), 2))
