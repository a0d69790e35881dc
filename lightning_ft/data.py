"""Data for fault-tolerant Lightning training: one Lightning batch per global step, loaded from
the runtime's exactly-once ``ElasticSampler``; evaluation shards that follow the membership.

``StepLoader`` replaces the training DataLoader (and Lightning's ``DistributedSampler``).  It
yields one item per global step of the epoch, the same number on every worker: the member's
first micro-batch of that step, collated exactly as the user's DataLoader would (same
``collate_fn``, ``num_workers``, ``pin_memory``).  The strategy runs the member's other
micro-batches of the step itself (``fetch``).  Lightning's fetcher reads one item ahead, so
an item may have been loaded under an allocation that a failure changed since; every item is
recorded with the allocation it was loaded for, and ``resolve`` (called by the strategy's
``batch_to_device``) swaps a stale one for the right micro-batch.

``ShardSampler`` replaces the ``DistributedSampler`` of validation/test loaders: rank ``r`` of
``n`` current members gets samples ``r, r+n, ...`` -- every sample exactly once, no padding (a
``DistributedSampler`` repeats samples to even out ranks, which double counts in metrics).

Limits, honestly: map-style datasets only; the user's DataLoader must use ``batch_size`` (no
custom ``batch_sampler``) and a plain random or sequential order (a custom sampler's order
cannot be kept exactly-once under membership changes); the samples of a micro-batch that is
redone by another member after a failure are loaded in the main process.  The loading itself
(``MicroBatchSource``) and the shards are shared with accelerate_ft in
``chameleon_ft/runtime/adapter_kit.py``.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator, NamedTuple, Optional

from torch.utils.data import DataLoader

from chameleon_ft.runtime.adapter_kit import MicroBatchSource
from chameleon_ft.runtime.adapter_kit import ShardSampler as _ShardSampler
from chameleon_ft.runtime.sampler import MicroBatch

__all__ = ["StepLoader", "ShardSampler", "NoMicroBatch"]


class NoMicroBatch:
    """The Lightning batch of a step in which this member has no micro-batch (the allocation
    gave it none); it still takes part in the step's gradient all-reduce."""

    def __init__(self, step: int) -> None:
        self.step = step

    def __repr__(self) -> str:
        return f"NoMicroBatch(step={self.step})"


class _Handed(NamedTuple):
    epoch: int
    step: int
    mb: Optional[MicroBatch]
    signature: tuple


class StepLoader(MicroBatchSource):
    """What Lightning iterates for training: one item per global step (see module doc)."""

    def __init__(self, strategy, dataloader: DataLoader) -> None:
        super().__init__(lambda: strategy.ctx, dataloader)
        self.strategy = strategy
        self.worker_init_fn = dataloader.worker_init_fn
        self._handed: deque[_Handed] = deque()

    # ---------------------------------------------------------------- Lightning side
    def __len__(self) -> int:
        return self.sampler.steps_per_epoch

    def __iter__(self) -> Iterator[Any]:
        self._handed.clear()
        self._feed = None
        s = self.sampler
        epoch, start = s.epoch, s.cursor
        for step in range(start, s.steps_per_epoch):
            if s.epoch != epoch:
                return
            mbs = s.local_microbatches(self.worker_id, step)
            sig = self.signature()
            if not mbs:
                self._handed.append(_Handed(epoch, step, None, sig))
                yield NoMicroBatch(step)
                continue
            data = self._feed_from(step).get(step, mbs[0].indices)
            self._handed.append(_Handed(epoch, step, mbs[0], sig))
            yield data

    def resolve(self, batch: Any, prepare) -> tuple[Optional[tuple[int, int]], Any]:
        """For the item Lightning is about to train on: its (step, slot) key and the batch,
        swapped for the right micro-batch (through ``prepare``) when it is not the first one
        this member computes in the step (``strategy.step_microbatches()``): a reconfiguration
        since it was loaded changed this member's share, or a recovery left it only part of the
        step to redo.  Lightning's closure, which zeroes the gradients before its backward, must
        run the step's first micro-batch."""
        if not self._handed:
            raise RuntimeError("lightning_ft: a training batch arrived that StepLoader did not hand out")
        h = self._handed.popleft()
        s = self.sampler
        if (h.epoch, h.step) != (s.epoch, s.cursor):
            raise RuntimeError(f"lightning_ft: training data of epoch {h.epoch} step {h.step} arrived "
                               f"while the job is at epoch {s.epoch} step {s.cursor}")
        mbs = self.strategy.step_microbatches()
        first = mbs[0] if mbs else None
        same = (h.mb is None) if first is None else (h.mb is not None and h.mb.index == first.index)
        if h.signature == self.signature() and same:
            return (None if h.mb is None else (h.step, h.mb.index)), batch
        if first is None:
            return None, NoMicroBatch(h.step)
        self._feed_from(h.step)  # (the feed follows the current allocation from here on)
        return (h.step, first.index), prepare(self.fetch(h.step, first))


class ShardSampler(_ShardSampler):
    """Evaluation sampler over the strategy's *current* members: rank r of n gets r, r+n, ...
    (no padding, so metrics count every sample once); computed at each ``iter()``."""

    def __init__(self, dataset_len: int, strategy) -> None:
        super().__init__(dataset_len, lambda: (strategy.global_rank, strategy.world_size))
        self.strategy = strategy
