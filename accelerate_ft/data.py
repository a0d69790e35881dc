"""The DataLoaders that ``FaultTolerantAccelerator.prepare`` returns.

``ElasticTrainLoader`` (the training loader): **one item is one micro-batch** of this member's
share of the current global step, taken from the runtime's exactly-once ``ElasticSampler``.
The global batch is fixed at launch (workers x ``batch_size`` x ``gradient_accumulation_steps``),
so a member runs ``gradient_accumulation_steps`` items per step while everyone is alive and
more after it took over a dead member's micro-batches.  The last item of the member's share is
flagged (``accelerator.sync_gradients`` is True while it runs); the user's ``optimizer.step()``
after it is where the gradient all-reduce and the commit happen.  When that step fails, the
loader goes on with the items the recovery gave this member (the orphaned micro-batches), and
the step is committed at the next ``optimizer.step()``.  A member that has nothing to compute
in a step (nothing orphaned to redo, or an allocation that gave it no slot) gets one *ghost*
item: a real sample whose ``backward`` is skipped, so that every member runs the user's loop
body -- and its ``optimizer.step()`` -- the same number of times.

``len()`` is the launch-time count (``steps_per_epoch x gradient_accumulation_steps``), so the
usual ``len(train_dl) / gradient_accumulation_steps`` scheduler arithmetic keeps its meaning.

``ElasticEvalLoader`` (any other prepared loader): at each ``iter()`` the dataset is split over
the *current* members by ``chameleon_ft.runtime.adapters.eval_batches``: the same number of
batches on every member, every sample exactly once, no padding; ``gather_for_metrics`` drops
the ghost sample a member may get in the last round and returns the results in dataset order.

Limits: map-style datasets; the training DataLoader must use ``batch_size`` with
``shuffle=True/False`` (no custom sampler); evaluation loaders are read in order.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from accelerate.utils import send_to_device
from torch.utils.data import DataLoader

from chameleon_ft.runtime.errors import ConfigError
from chameleon_ft.runtime.adapters import MicroBatchSource, eval_batches
from chameleon_ft.runtime.sampler import MicroBatch

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

    def _load(self, step: int, mb: MicroBatch) -> Any:
        return self._to_device(self.fetch(step, mb))

    # ---------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[Any]:
        ctx = self.rt.ensure_started(self)
        self._feed = None
        epoch = ctx.epoch
        try:
            while ctx.epoch == epoch:
                yield from self._one_step(ctx)
        finally:
            self.rt.leave_step()

    def _one_step(self, ctx) -> Iterator[Any]:
        rt = self.rt
        cursor = ctx.sampler.cursor
        plan = ctx.pending_microbatches()
        if plan:
            self._feed_from(cursor)
            gen = ctx.microbatches()
            rt.enter_step(gen, len(plan))
            for i in range(len(plan)):
                mb = next(gen)  # fault hooks and the per-(step, slot) seed happen here
                rt.enter_microbatch(mb, last=i == len(plan) - 1)
                yield self._load(cursor, mb)
                rt.after_microbatch()
        else:
            ghost = ctx.sampler.microbatches(cursor)[0]
            rt.enter_step(None, 0)
            rt.enter_microbatch(None, last=True)
            yield self._to_device(self.load_now(MicroBatch(ghost.step, ghost.index, ghost.indices[:1], 0.0)))
        rt.after_microbatch()
        if not rt.sync_attempted:
            rt.finish_step()  # the user's loop did not call optimizer.step() for this step


class ElasticEvalLoader:
    """Evaluation batches over the current members (see module doc)."""

    def __init__(self, runtime, dataloader: DataLoader, device_placement: bool) -> None:
        if dataloader.batch_size is None:
            raise ConfigError("accelerate_ft: an evaluation DataLoader must use batch_size "
                             "(its samples are re-split over the current members)")
        self.rt = runtime
        self.dataloader = dataloader
        self.dataset = dataloader.dataset
        self.batch_size = dataloader.batch_size
        self.device_placement = device_placement

    def _batches(self) -> list[tuple[list[int], int]]:
        view = self.rt.view()
        return eval_batches(len(self.dataset), self.batch_size, view.rank, view.world_size)

    def __len__(self) -> int:
        return len(self._batches())

    def set_epoch(self, epoch: int) -> None:
        """Accepted for compatibility (evaluation order is fixed)."""

    def __iter__(self) -> Iterator[Any]:
        batches = self._batches()
        dl = self.dataloader
        kwargs = {}
        if dl.num_workers > 0:
            kwargs = {"prefetch_factor": dl.prefetch_factor, "multiprocessing_context": dl.multiprocessing_context}
        loader = DataLoader(self.dataset, batch_sampler=[b for b, _ in batches], collate_fn=dl.collate_fn,
                            num_workers=dl.num_workers, pin_memory=dl.pin_memory,
                            worker_init_fn=dl.worker_init_fn, timeout=dl.timeout, **kwargs)
        try:
            for (_, n_valid), batch in zip(batches, loader):
                self.rt.eval_valid = n_valid
                yield send_to_device(batch, self.rt.acc.device) if self.device_placement else batch
        finally:
            self.rt.eval_valid = None
