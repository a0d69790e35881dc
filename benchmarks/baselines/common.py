"""What every benchmark worker shares: the training shape and one progress log.

The model, data, optimizer, batch shape and emulated compute come from
``benchmarks/_train_bench.py`` so that every system trains the same math: a 3-layer MLP on
4096 synthetic samples, SGD(lr 0.05, momentum 0.9), global batch 64 in micro-batches of 8,
each micro-batch's forward+backward padded to ``--mb-sleep`` seconds (accelerator emulation).
Global step ``t`` covers samples ``[t*64, (t+1)*64) mod 4096``; a worker's share is a
contiguous slice of it.

Progress log: every worker appends one JSON line per event to ``$BENCH_OUT/steps.jsonl``
(``O_APPEND``, one ``os.write`` a line, as ``chameleon_ft.runtime.eventlog`` does):

  ``{"kind": "start", "pid", "rank", "restart", "ts"}``                     at start
  ``{"kind": "attempt", "step", "key", "ids", ...}``  before each all-reduce of a step
  ``{"kind": "step", "step", "key", "world", "samples", "batch", "epoch", "trained", "restart", "rss_kb", "pid", "ts"}``
                                                                            per committed step
  ``{"kind": "final", "loss", "step", "pid", "ts"}``                        lowest live rank at the end

``world`` is the number of workers whose gradients went into the step, ``samples`` the
samples the step's update covered (as the script sees it; the harness counts ids instead),
``batch`` the step's global batch (64, or less after chameleon-ft's shrink), ``restart`` the
launcher's restart count (``TORCHELASTIC_RESTART_COUNT``), ``epoch`` the pass over the dataset.

Sample ids: before its gradients go into an all-reduce, a worker logs the dataset indices it
trained for the step (``attempt``), tagged with a ``key`` that all members of that all-reduce
share (``restart.try``: the how-many-th try of the step in this process; chameleon-ft: the
generation's token, from its own event log).  An attempt counts when some worker committed the
step under the same key: a worker killed after the all-reduce but before logging its commit
still trained its samples.  ``trained: false`` (a TorchFT replica sitting the quorum out, its
gradients zeroed) drops the worker's own attempt.  ``harness/metrics.py`` counts lost and
duplicated samples from these.

Straggler knob: ``BENCH_SLOW=rank:factor:from_step`` pads that rank's emulated compute per
micro-batch to ``factor x --mb-sleep`` from that step on (``compute_s``): a slower
accelerator, for every system alike.  The harness derives every metric from this file, the same way for each system.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _train_bench as tb  # noqa: E402  (model, dataset, padded_loss, N)

GLOBAL_BATCH, MICRO_BATCH = 64, 8
EVAL_SAMPLES = 512


def add_args(ap) -> None:
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--mb-sleep", type=float, default=0.025)


class StepLog:
    def __init__(self, rank: int, restart: int = 0):
        out = os.environ["BENCH_OUT"]
        os.makedirs(out, exist_ok=True)
        self.fd = os.open(os.path.join(out, "steps.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.rank, self.restart = rank, restart
        self.tries: dict[int, int] = {}
        self.write("start", rank=rank)

    def write(self, kind: str, **fields) -> None:
        rec = {"kind": kind, "ts": time.time(), "pid": os.getpid(), "restart": self.restart, **fields}
        os.write(self.fd, (json.dumps(rec) + "\n").encode())

    def attempt(self, step: int, ids) -> str:
        """Log the sample ids this worker is about to all-reduce the gradients of; the key."""
        self.tries[step] = self.tries.get(step, 0) + 1
        key = f"{self.restart}.{self.tries[step]}"
        self.write("attempt", step=step, key=key, ids=[int(i) for i in ids], rank=self.rank)
        return key

    def step(self, step: int, world: int, samples: int, batch: int = GLOBAL_BATCH, *, key,
             epoch: int | None = None, trained: bool = True) -> None:
        self.write("step", step=step, key=key, world=world, samples=samples, batch=batch, rank=self.rank,
                   epoch=step * GLOBAL_BATCH // tb.N if epoch is None else epoch, trained=trained,
                   rss_kb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)

    def final(self, net, step: int) -> None:
        self.write("final", loss=eval_loss(net), step=step)


def compute_s(rank: int, step: int, mb_sleep: float) -> float:
    """Emulated compute of one micro-batch of ``rank`` at ``step`` (``BENCH_SLOW`` applied)."""
    spec = os.environ.get("BENCH_SLOW")
    if spec:
        r, factor, start = spec.split(":")
        if rank == int(r) and step >= int(start):
            return mb_sleep * float(factor)
    return mb_sleep


def microbatch_indices(step: int, share: range) -> list[list[int]]:
    """Sample ids of micro-batches ``share`` (indices into the global batch's micro-batches)."""
    base = (step * GLOBAL_BATCH) % tb.N
    return [list(range(base + k * MICRO_BATCH, base + (k + 1) * MICRO_BATCH)) for k in share]


def train_microbatch(net, data, idx: list[int], mb_sleep: float, scale: float, rank: int = -1, step: int = 0):
    x, y = data[idx]
    loss, pad = tb.padded_loss(net, x, y, compute_s(rank, step, mb_sleep))
    (loss * scale).backward()
    time.sleep(pad)
    return loss


def eval_loss(net) -> float:
    import torch

    x, y = tb.dataset()[list(range(EVAL_SAMPLES))]
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(net(x), y))
