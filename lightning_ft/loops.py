"""``LoopWrappers``: what ``FaultTolerantDDPStrategy`` wraps around Lightning's loops (a mixin).

* **Validation/test loops** (``_run_evaluation``): a worker lost inside one cannot leave
  partial metrics behind -- a failed collective unwinds the loop, the job recovers at once and,
  when every member recovered from this same evaluation, it runs again over the survivors;
  otherwise its metrics are flagged partial (``ft/eval_complete`` = 0).
* **The training epoch loop's reset** (``_reset_epoch_loop``): a mid-epoch resume continues
  from the checkpoint's sampler cursor.
* **Lightning's warnings that are wrong here** -- the one-device advice for
  ``validate()``/``test()`` (we shard without padding) and the "unreliable results" of a
  mid-epoch resume -- are filtered where they are emitted and replaced by true lines.

The mixin uses the strategy's ``ctx``, ``_coll``, ``lightning_module``
and its evaluation counters.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import warnings
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities.warnings import PossibleUserWarning

from chameleon_ft.runtime.groups import CollectiveFailure

log = logging.getLogger("lightning_ft.strategy")

__all__ = ["LoopWrappers"]

# Lightning warnings that are wrong under this strategy (their opening words; see
# _run_evaluation and _reset_epoch_loop).
_SAMPLER_ADVICE = "Using `DistributedSampler` with the dataloaders. During `trainer."
_RESUME_ADVICE = "You're resuming from a checkpoint that ended before the epoch ended"


@contextlib.contextmanager
def _ignoring(message_start: str):
    """Ignore Lightning's ``PossibleUserWarning`` that starts with ``message_start`` inside."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape(message_start), category=PossibleUserWarning)
        yield



class LoopWrappers:
    """Evaluation reruns and the epoch loop's reset (see module doc)."""

    # No slots of its own, and listed after Lightning's strategy among the bases: the
    # strategies it mixes into keep the memory layout of Lightning's, so that a
    # ModelParallelStrategy object can become FaultTolerantModelParallelStrategy in place.
    __slots__ = ()

    def _wrap_loops(self, trainer) -> None:
        """The validation/test loops' ``run`` (``_run_evaluation``) and the training epoch
        loop's ``reset`` (``_reset_epoch_loop``), once per loop object."""
        for loop in (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop):
            if "_cft_run" not in vars(loop):
                loop._cft_run = loop.run
                loop.run = functools.partial(self._run_evaluation, loop)
        epoch_loop = trainer.fit_loop.epoch_loop
        if "_cft_reset" not in vars(epoch_loop):
            epoch_loop._cft_reset = epoch_loop.reset
            epoch_loop.reset = functools.partial(self._reset_epoch_loop, epoch_loop)

    def _reset_epoch_loop(self, loop) -> None:
        """Lightning warns, on a resume from a mid-epoch checkpoint, that a DataLoader without
        ``state_dict`` "can cause unreliable results".  Not here: the checkpoint holds the
        sampler's cursor and ``StepLoader`` continues the epoch from it, each remaining sample
        once; the warning is replaced by a line that says so."""
        restarting = loop.restarting
        with _ignoring(_RESUME_ADVICE):
            loop._cft_reset()
        ctx = self.ctx
        if restarting and ctx is not None and ctx.sampler.cursor > 0:
            rank_zero_info(f"lightning_ft: resuming epoch {ctx.epoch} at step {ctx.sampler.cursor} of "
                           f"{ctx.sampler.steps_per_epoch} from the checkpoint's sampler cursor: the "
                           "epoch's remaining samples follow, each once")

    def _run_evaluation(self, loop) -> Any:
        # Lightning's advice to evaluate on one device under a DistributedSampler (which pads)
        # does not apply: process_dataloader gives every loader a ShardSampler (no padding).
        with _ignoring(_SAMPLER_ADVICE):
            return self._run_evaluation_ft(loop)

    def _run_evaluation_ft(self, loop) -> Any:
        """Run a validation/test loop so that a worker lost inside it cannot leave partial
        metrics behind.  A failed collective (metric sync, ``sync_dist``, ``all_gather``,
        barrier) unwinds the loop; the job recovers at once (``DataParallelExecutor.recover``: the
        survivors agree, form their group, re-shard the evaluation data) and, when every
        member recovered from this same evaluation, they run it again from its start over
        the survivors, so the metrics cover every sample once.  When a member was elsewhere
        (it finished this evaluation before the failure reached it) the others cannot rerun
        it with it: they finish it on their own shard, with local collectives, and flag it
        (``ft/eval_complete`` = 0 in ``trainer.callback_metrics``, a warning).  Without a
        training context (sanity check, validate/test before any fit) the old behaviour
        stays: local values with a warning."""
        trainer = self.lightning_module.trainer
        ctx = self.ctx
        if ctx is None or trainer.sanity_checking:
            return loop._cft_run()
        self._eval_runs += 1
        tag = self._eval_runs
        complete = not self._coll.stays_local
        try:
            while True:
                self._set_eval_complete(trainer, complete)
                if not complete:
                    ctx.activity = 0
                    self._warn_partial(trainer)
                    return loop._cft_run()
                modes = {m: m.training for m in self.lightning_module.modules()}
                updates = self._metric_updates()
                ctx.activity, self._coll.reraise = tag, True
                try:
                    return loop._cft_run()
                except CollectiveFailure as failure:
                    self._coll.reraise = False
                    everyone_here = ctx.recover_off_step(failure, tag)
                    self._reset_evaluation(loop, modes, updates)
                    if everyone_here:
                        self.eval_reruns += 1
                        log.warning("lightning_ft: a worker was lost during %s; it runs again over "
                                    "the %d survivors", trainer.state.stage.value, ctx.view.world_size)
                    else:
                        complete = False
                        self._coll.catch_up = True  # local until our next training step
        finally:
            ctx.activity, self._coll.reraise = 0, False

    def _set_eval_complete(self, trainer, complete: bool) -> None:
        if not complete:
            self.eval_partial += 1
        trainer._logger_connector._callback_metrics["ft/eval_complete"] = torch.tensor(float(complete))

    def _warn_partial(self, trainer) -> None:
        warnings.warn(f"lightning_ft: this {trainer.state.stage.value} runs with worker "
                      f"{self.ctx.worker_id}'s local collectives (a worker was lost and not every "
                      "member can run it again): its metrics cover this worker's shard only and are "
                      "partial (ft/eval_complete = 0)", stacklevel=2)

    def _metric_updates(self) -> dict:
        try:
            from torchmetrics import Metric
        except ImportError:
            return {}
        return {m: m._update_count for m in self.lightning_module.modules() if isinstance(m, Metric)}

    def _reset_evaluation(self, loop, modes: dict, updates: dict) -> None:
        """Undo what the interrupted attempt left: module modes, the data fetcher, the logged
        results and every torchmetrics ``Metric`` it updated (reset)."""
        for m, training in modes.items():
            m.training = training
        if loop._data_fetcher is not None:
            loop._data_fetcher.teardown()
            loop._data_fetcher = None
        loop._results.reset()
        loop.trainer._logger_connector.reset_results()
        for m, count in updates.items():
            if m._is_synced and m._cache is not None:
                m.unsync()  # synced when the failure unwound its compute: back to local state
            if m._update_count != count:
                m.reset()
