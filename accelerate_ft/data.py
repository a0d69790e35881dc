"""The DataLoaders that ``FaultTolerantAccelerator.prepare`` returns.

``ElasticTrainLoader`` (the training loader) yields **the same items as without a failure**:
``gradient_accumulation_steps`` items per global step on every member, whatever its share of
the step, so ``len()``, the items of an epoch, ``sync_gradients`` and the user's
``optimizer.step()`` calls are those of the failure-free run.  The global batch is fixed at
launch (workers x ``batch_size`` x ``gradient_accumulation_steps``) and comes from the
runtime's exactly-once ``ElasticSampler``; a member's share of a step is cut into the items by
``DataParallelExecutor.items``: while everyone is alive one item is one micro-batch; after this member
took over a dead member's micro-batches, an item holds several of them, collated together by the
user's ``collate_fn`` (its activations grow accordingly: the memory trade-off is in
docs/accelerate.md); with fewer micro-batches than items (a rebalanced straggler), micro-batches
are cut, and an item with no sample is a *ghost* (a real sample whose ``backward`` is skipped).
The last item of a step is flagged (``accelerator.sync_gradients`` is True while it runs); the
user's ``optimizer.step()`` after it all-reduces and commits.  When a failure interrupts that
step, the survivors redo the missing micro-batches inside that same ``optimizer.step()``
(``accelerate_ft/replay.py``) and commit, so the loop does not see it -- unless the loss is
computed outside the model, in which case the redo takes one more item.

``len()`` is the launch-time count (``steps_per_epoch x gradient_accumulation_steps``), so the
usual ``len(train_dl) / gradient_accumulation_steps`` scheduler arithmetic keeps its meaning.

``ElasticEvalLoader`` (any other prepared loader): at each ``iter()`` the dataset is split over
the *current* members by ``chameleon_ft.runtime.adapter_kit.eval_batches``: the same number of
batches on every member, every sample exactly once, no padding; ``gather_for_metrics`` drops
the ghost sample a member may get in the last round and returns the results in dataset order.

Limits: map-style datasets; the training DataLoader must use ``batch_size`` with
``shuffle=True/False`` (no custom sampler); evaluation loaders are read in order.
"""

from __future__ import annotations

import logging

from typing import Any, Iterator, Optional

from accelerate.utils import send_to_device
from torch.utils.data import DataLoader

from chameleon_ft.runtime.errors import ConfigError
from chameleon_ft.runtime.adapter_kit import MicroBatchSource, eval_batches
from chameleon_ft.runtime.sampler import MicroBatch, StepItem, step_items

log = logging.getLogger(__name__)

__all__ = ["ElasticTrainLoader", "ElasticEvalLoader"]


class ElasticTrainLoader(MicroBatchSource):
    """Training items: this member's micro-batches, step after step (see module doc)."""

    def __init__(self, runtime, dataloader: DataLoader, device_placement: bool) -> None:
        super().__init__(lambda: runtime.ctx, dataloader)
        self.rt = runtime
        self.device_placement = device_placement
        self.batch_size = dataloader.batch_size
        self._launch_len: Optional[int] = None

    # ---------------------------------------------------------------- DataLoader look-alike
    def __len__(self) -> int:
        if self._launch_len is None:
            self._launch_len = self.rt.launch_items_per_epoch(self)
        return self._launch_len

    def set_epoch(self, epoch: int) -> None:
        """Accepted for compatibility: the runtime's sampler owns the epoch."""

    def _to_device(self, batch: Any) -> Any:
        if self.device_placement:
            return send_to_device(batch, self.rt.acc.device)
        return batch

    def load_item(self, item: "MicroBatch | StepItem", step: Optional[int] = None, n_items: Optional[int] = None) -> Any:
        """The data of ``item``, collated by the user's ``collate_fn`` and placed on the device
        (prefetched when it is on this member's plan)."""
        if step is None:
            return self._to_device(self.load_now(item.indices))
        return self._to_device(self.fetch(step, item, n_items))

    # ---------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[Any]:
        ctx = self.rt.ensure_started(self)
        self._feed = None
        epoch = ctx.epoch
        try:
            yield from self._replayed(ctx)
            while ctx.epoch == epoch:
                yield from self._one_step(ctx)
        finally:
            self.rt.leave_step()

    def _replayed(self, ctx) -> Iterator[Any]:
        """After ``load_state``: the items of the epoch's steps the checkpoint already holds,
        as a run without the interruption would have iterated them, training nothing
        (``backward``/``optimizer.step`` are no-ops on them).  Accelerate's examples resume by
        skipping that many items (``continue``, or ``skip_first_batches``); with this their
        ``step``/``overall_step`` counters and save points stay those of the original run."""
        rt = self.rt
        steps, rt.replay_steps = rt.replay_steps, 0
        n = rt.items_per_step
        try:
            for t in range(steps):
                share = ctx.sampler.local_microbatches(ctx.worker_id, t) or ctx.sampler.microbatches(t)[:1]
                for i, item in enumerate(step_items(share, n)):
                    rt.skipping = True
                    rt.acc.gradient_state._set_sync_gradients(i == n - 1)
                    idx = item.indices or share[0].indices[:1]
                    yield self._to_device(self.load_now(idx))
        finally:
            rt.skipping = False

    def _one_step(self, ctx) -> Iterator[Any]:
        """The items of one global step: ``items_per_step`` of them whatever this member's
        share (one, after a step that has to be redone through the loop: ``StepProtocol.loop_items``)."""
        rt = self.rt
        cursor = ctx.sampler.cursor
        n = rt.loop_items()
        # With a loss recipe, a share larger than n is not merged: the extra micro-batches are
        # computed inside optimizer.step() (same memory and per-slot seeds as without a failure).
        # (sharded: every member's passes must pair up: StepProtocol's module doc)
        spill = rt.spill_rule(n)
        grain = None if spill(0) else n
        if not rt.redo_items:
            self._feed_from(cursor, grain)
        gen = ctx.items(n, spill=spill)
        rt.enter_step(gen, n)
        for i in range(n):
            item = next(gen)  # fault hooks and the per-(step, slot) seed happen here
            if item.ghost:
                # Nothing (left) to compute for this member: a real sample whose backward is
                # skipped, so that its loop body -- and its optimizer.step() -- still runs.
                ghost = ctx.sampler.microbatches(cursor)[0]
                batch = self.load_item(MicroBatch(ghost.step, ghost.index, ghost.indices[:1], 0.0))
                rt.enter_microbatch(None, last=i == n - 1, batch=batch)
            else:
                batch = self.load_item(item, cursor, grain)
                rt.enter_microbatch(item, last=i == n - 1, batch=batch)
            yield batch
            rt.after_microbatch()
        if not rt.sync_attempted:
            rt.finish_step()  # the user's loop did not call optimizer.step() for this step


class SkipFirst:
    """``accelerator.skip_first_batches(train_dl, n)``: the training loader without its first
    ``n`` items.  After ``load_state`` those are the steps the checkpoint holds (see
    ``ElasticTrainLoader._replayed``); skipping more than that skips untrained items, which
    is said once."""

    def __init__(self, loader: ElasticTrainLoader, n: int) -> None:
        self.loader, self.n = loader, int(n)
        self.batch_size = loader.batch_size

    def __len__(self) -> int:
        return max(0, len(self.loader) - self.n)

    def __iter__(self) -> Iterator[Any]:
        rt, untrained = self.loader.rt, 0
        for k, batch in enumerate(self.loader):
            if k >= self.n:
                yield batch
            elif not rt.skipping:
                untrained += 1
                if untrained == 1:
                    log.warning("accelerate_ft: skip_first_batches(%d) skips items past the checkpoint's "
                                "position: their samples are not trained this epoch", self.n)


class ElasticEvalLoader:
    """Evaluation batches over the current members (see module doc).  When a member dies during
    the evaluation, the survivors recover at once (in ``gather_for_metrics``) and go on from
    the first sample that not all of them have gathered, re-split over the new members --
    or, when not every survivor was in this evaluation, each finishes it alone -- so that
    every member's gathered results cover every sample once (``StepProtocol.eval_*``)."""

    def __init__(self, runtime, dataloader: DataLoader, device_placement: bool) -> None:
        if dataloader.batch_size is None:
            raise ConfigError("accelerate_ft: an evaluation DataLoader must use batch_size "
                             "(its samples are re-split over the current members)")
        self.rt = runtime
        self.dataloader = dataloader
        self.dataset = dataloader.dataset
        self.batch_size = dataloader.batch_size
        self.device_placement = device_placement

    def _batches(self, start: int = 0, alone: Optional[bool] = None) -> list[tuple[list[int], int]]:
        if alone is None:
            alone = self.rt.eval_alone if self.rt.in_eval else self.rt.eval_goes_local()
        view = self.rt.view()
        rank, world = (0, 1) if alone else (view.rank, view.world_size)
        return eval_batches(len(self.dataset), self.batch_size, rank, world, start)

    def __len__(self) -> int:
        return len(self._batches())

    def set_epoch(self, epoch: int) -> None:
        """Accepted for compatibility (evaluation order is fixed)."""

    def _loader(self, batches) -> DataLoader:
        dl = self.dataloader
        kwargs = {}
        if dl.num_workers > 0:
            kwargs = {"prefetch_factor": dl.prefetch_factor, "multiprocessing_context": dl.multiprocessing_context}
        return DataLoader(self.dataset, batch_sampler=[b for b, _ in batches], collate_fn=dl.collate_fn,
                          num_workers=dl.num_workers, pin_memory=dl.pin_memory,
                          worker_init_fn=dl.worker_init_fn, timeout=dl.timeout, **kwargs)

    def __iter__(self) -> Iterator[Any]:
        rt = self.rt
        rt.begin_eval()
        start, alone = 0, rt.eval_alone
        try:
            while True:
                batches = self._batches(start, alone)
                world = 1 if alone else rt.view().world_size
                span = max(1, world) * self.batch_size
                for k, ((_, n_valid), batch) in enumerate(zip(batches, self._loader(batches))):
                    lo = start + k * span
                    rt.eval_batch(n_valid, lo, min(lo + span, len(self.dataset)))
                    yield send_to_device(batch, rt.acc.device) if self.device_placement else batch
                    if rt.eval_restart is not None:
                        break
                if rt.eval_restart is None:
                    return
                start, alone = rt.eval_restart
                rt.eval_restart = None
        finally:
            rt.end_eval()
