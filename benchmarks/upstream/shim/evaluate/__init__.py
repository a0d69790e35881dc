"""Offline stand-in for `evaluate.load("glue", "mrpc")`: accuracy and F1 from add_batch."""


class _Metric:
    def __init__(self):
        self.p, self.r = [], []

    def add_batch(self, predictions, references):
        self.p += [int(x) for x in predictions]
        self.r += [int(x) for x in references]

    def compute(self):
        p, r = self.p, self.r
        self.p, self.r = [], []
        tp = sum(1 for a, b in zip(p, r) if a == b == 1)
        fp = sum(1 for a, b in zip(p, r) if a == 1 and b == 0)
        fn = sum(1 for a, b in zip(p, r) if a == 0 and b == 1)
        f1 = 2 * tp / max(1, 2 * tp + fp + fn)
        return {"accuracy": sum(a == b for a, b in zip(p, r)) / max(1, len(p)), "f1": f1, "n": len(p)}


def load(*a, **k):
    return _Metric()
