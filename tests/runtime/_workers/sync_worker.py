"""Test worker: counts the host reads of tensors (the calls that make a host wait for a device:
``item``, ``tolist``, ``float(t)``, ``bool(t)``, ``cpu()``, ``numpy()``...) that chameleon-ft's own
code makes during data-parallel steps, with ``DataParallelExecutor`` under ``chameleon-ft run``.

A call counts when its direct caller is a function of the package (the user's loss code and
torch's optimizer are not counted).  With the gradients on the host the step's one read of the
reduced tail after the commit point goes through the tail's numpy view, not a tensor API, so the
steps count nothing.  At the end ``ctx.last_loss`` is read (``deliberate``): a number taken from
that same read, so it reads nothing more; then ``_read_tail`` is given a tensor (``control``: the
counter sees the package's reads).  Writes ``<out>/syncs_<worker id>.json``.
"""

import argparse
import collections
import json
import os
import sys

import torch

from chameleon_ft.runtime.executors.dp import DataParallelExecutor
from chameleon_ft.runtime.recovery import ElasticConfig
from chameleon_ft.runtime.trainer import elastic_main

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["chameleon_ft"].__file__)))
NAMES = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu")


def build():
    """The model, its optimizer and the data (inputs, labels, tokens per sample): the test
    computes the same steps again in one process."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(256, 16, generator=g), torch.randint(0, 4, (256,), generator=g)
    return model, opt, (x, y, torch.randint(1, 9, (256,), generator=g).float())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--control", action="store_true", help="control_collectives=True (the adapters' step)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--tokens", action="store_true",
                   help="token-weighted: sample i stands for TOKENS[i] items of its loss (backward(tokens=))")
    a = p.parse_args()
    torch.set_num_threads(1)
    model, opt, (x, y, tokens) = build()
    ctx = DataParallelExecutor(model, opt, 256, 32, 4, seed=3, control_collectives=a.control,
                               config=ElasticConfig(stragglers=False, bucket_cap_mb=26 * 4 / 2 ** 20))
    ctx.start()
    counts: collections.Counter = collections.Counter()
    counting = [False]
    originals = {name: getattr(torch.Tensor, name) for name in NAMES}

    def counted(name, fn):
        def wrapper(self, *args, **kwargs):
            if counting[0]:
                caller = sys._getframe(1)
                if caller.f_code.co_filename.startswith(os.path.join(PACKAGE, "chameleon_ft")):
                    counts[f"{name} in {caller.f_code.co_name}"] += 1
            return fn(self, *args, **kwargs)
        return wrapper

    for name, fn in originals.items():
        setattr(torch.Tensor, name, counted(name, fn))
    try:
        for i in range(3 + a.steps):  # three warm-up steps (the engine's first plan, first buckets)
            counting[0] = i >= 3
            for mb in ctx.microbatches():
                idx = list(mb.indices)
                if a.tokens:  # the micro-batch's token mean and its token count (a tensor: not read)
                    per = torch.nn.functional.cross_entropy(model(x[idx]), y[idx], reduction="none")
                    count = tokens[idx].sum()
                    ctx.backward((per * tokens[idx]).sum() / count, mb, tokens=count)
                    continue
                loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
                ctx.backward(loss, mb)
            assert ctx.sync_and_step(), "no failure is expected in this test"
        counting[0] = True
        steps_counted = dict(counts)
        counts.clear()
        value = ctx.last_loss  # on the host: a number from the tail's one read (no further read)
        deliberate = dict(counts)
        counts.clear()
        # The counter's own check: the package's read of a reduced tail given as a tensor (as on
        # a GPU, where the timings come back in a host tensor) is seen.
        ctx._read_tail(torch.zeros(7 * ctx.view.world_size, dtype=torch.float64))
        control = dict(counts)
    finally:
        counting[0] = False
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
        ctx.close()
    torch.save([p.detach().clone() for p in model.parameters()], os.path.join(a.out, f"params_{ctx.worker_id}.pt"))
    with open(os.path.join(a.out, f"syncs_{ctx.worker_id}.json"), "w") as f:
        json.dump({"steps": a.steps, "counts": steps_counted, "deliberate": deliberate, "control": control,
                   "loss": value}, f)


if __name__ == "__main__":
    elastic_main(main)
