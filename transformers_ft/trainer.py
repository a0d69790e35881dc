"""``FaultTolerantTrainer``: the HuggingFace ``Trainer`` whose workers survive failures in place.

A subclass of ``transformers.Trainer`` with the same arguments (docs/transformers.md).  The
``Trainer`` already trains through an ``Accelerator`` it builds itself
(``create_accelerator_and_postprocess``); this class builds accelerate_ft's
``FaultTolerantAccelerator`` there instead, so the data, the step and the recovery are
accelerate_ft's (docs/accelerate.md), and translates the four places where the ``Trainer``
does something a plain Accelerate loop does not:

* **Gradient accumulation.**  The ``Trainer`` accumulates itself (Accelerate's
  ``num_steps`` = 1) and divides each micro-batch loss by ``gradient_accumulation_steps``;
  here the Accelerator knows the real count (the training loader yields that many items per
  global step) and ``backward`` multiplies the loss back, so every item contributes its
  mean loss weighted by its share of the global batch (``StepProtocol.loss_scale``).
  Where the ``Trainer`` weights by tokens (``num_items_in_batch``, a causal LM), each
  micro-batch's loss is its own token mean weighted by its token count, and the reduced
  token count of the global batch divides the update (``training_step``).
* **Prefetching.**  The ``Trainer`` takes all of a step's batches from the loader before the
  first forward; here they are taken one at a time as the loop reaches them (the loader
  knows which micro-batch each item is).
* **The logged loss** is the global batch's mean loss of each committed step (reduced with
  the gradients, ``DataParallelExecutor.last_loss``), not the local worker's, so
  ``state.log_history`` holds the failure-free values whoever computed what.
* **Rank zero follows the live membership**: ``args.process_index``/``world_size`` read
  Accelerate's state, which accelerate_ft keeps live; ``state.is_world_process_zero`` is
  refreshed before every callback, so after worker 0 dies the next lowest one saves the
  checkpoints, writes ``trainer_state.json`` and logs.  Every log also carries the ``ft/*``
  metrics (``ft/world_size``, ``ft/recoveries`` ...; the first one after a recovery
  ``ft/mttr_s`` and ``ft/policy/<chosen>``), and the live rank 0 prints one line per recovery.

Started by ``chameleon-ft run`` (or ``accelerate launch`` / torchrun, which hand the job to it:
``runtime/relaunch.py``); under plain ``python train.py`` it is the ``Trainer``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterator, Optional

import torch
import transformers.trainer as hf_trainer
from transformers import Trainer, TrainerCallback

from accelerate_ft import FaultTolerantAccelerator
from accelerate_ft._env import launch_env, other_launcher
from accelerate_ft.accelerator import relaunch_torchrun
from accelerate_ft.sharded import gathered

__all__ = ["FaultTolerantTrainer", "TRAINER_PRELOAD"]

# What ``chameleon-ft run``'s template imports for a Trainer script besides its default
# (``cli/warmstart.py``): ``transformers.trainer`` is a worker's longest import (~4.5 s of CPU
# beyond torch on 2 cores), and this package (each fork runs accelerate_ft's capture of the
# launch environment again: ``warmstart._rerun_import_hooks``).  Given when this module
# hands a job to ``chameleon-ft run``; pass it yourself otherwise (docs/transformers.md).
TRAINER_PRELOAD = ("--preload", "+transformers.trainer,transformers_ft")


class _OneAtATime:
    """A step's batches, taken from the loader as the loop reaches them (``len`` known: the
    training loader yields ``gradient_accumulation_steps`` items per step)."""

    def __init__(self, iterator: Iterator, n: int) -> None:
        self.iterator, self.n = iterator, n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[Any]:
        for _ in range(self.n):
            try:
                yield next(self.iterator)
            except StopIteration:
                return


class _LiveRankZero(TrainerCallback):
    """First in the callback list: ``state.is_world_process_zero`` and
    ``is_local_process_zero`` follow the live membership before any other callback runs."""

    def __init__(self, trainer: "FaultTolerantTrainer") -> None:
        self.trainer = trainer

    def _refresh(self, args, state, control, **kwargs):
        state.is_world_process_zero = self.trainer.is_world_process_zero()
        state.is_local_process_zero = self.trainer.is_local_process_zero()

    on_train_begin = on_epoch_begin = on_step_begin = on_substep_end = on_pre_optimizer_step = _refresh
    on_optimizer_step = on_step_end = on_epoch_end = on_evaluate = on_predict = on_save = on_log = _refresh
    on_prediction_step = on_train_end = _refresh


_log = logging.getLogger("transformers_ft")


class FaultTolerantTrainer(Trainer):
    """``transformers.Trainer`` with in-place fault tolerance (see module doc); same arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if launch_env() is None and other_launcher():  # accelerate launch / torchrun
            relaunch_torchrun(extra=TRAINER_PRELOAD)
        self._ft_loss = 0.0          # the global losses of the steps since the last log
        self._ft_counted = -1        # the global_step whose loss is in _ft_loss
        targs = kwargs.get("args", args[1] if len(args) > 1 else None)
        # fsdp=: the FSDP2 plugin goes to FaultTolerantAccelerator, which shards the model
        # itself (Accelerate sees one process, so the Trainer would refuse fsdp as "not distributed").
        fsdp = getattr(targs, "fsdp", None) if launch_env() is not None else None
        if fsdp:
            targs.fsdp = False
        try:
            super().__init__(*args, **kwargs)
        finally:
            if fsdp:
                targs.fsdp = fsdp
        if self._ft is not None:
            self.callback_handler.callbacks.insert(0, _LiveRankZero(self))

    # ---------------------------------------------------------------- the accelerator
    def create_accelerator_and_postprocess(self) -> None:
        saved = hf_trainer.Accelerator
        hf_trainer.Accelerator = FaultTolerantAccelerator
        try:
            super().create_accelerator_and_postprocess()
        finally:
            hf_trainer.Accelerator = saved
        if self._ft is not None:
            # The Trainer accumulates itself: the training loader must still yield a step's
            # items, and only the Trainer's optimizer.step() commits.
            self.accelerator.gradient_accumulation_steps = self.args.gradient_accumulation_steps
            self._ft.replay.count_items = self._items_of  # a redone micro-batch is counted alike

    @contextlib.contextmanager
    def _tokens_per_process(self):
        """``average_tokens_across_devices`` off meanwhile: the ``Trainer`` then counts, and
        scales the loss by, this process's tokens only (``_get_num_items_in_batch``,
        ``compute_loss``) -- the runtime reduces the counts itself."""
        averaged = self.args.average_tokens_across_devices
        self.args.average_tokens_across_devices = False
        try:
            yield
        finally:
            self.args.average_tokens_across_devices = averaged

    def is_world_process_zero(self) -> bool:
        return self.accelerator.is_main_process if self._ft is not None else super().is_world_process_zero()

    def is_local_process_zero(self) -> bool:
        return self.accelerator.is_local_main_process if self._ft is not None else super().is_local_process_zero()

    def evaluation_loop(self, *args, **kwargs):
        """The ``Trainer``'s evaluation over the current members, with a loss that does not
        depend on their number, run again over the survivors when a member died during it.

        The loss: with ``average_tokens_across_devices`` (the default) the ``Trainer`` divides
        each batch's token loss by the tokens of every process's batch of that round and
        multiplies by the number of processes, so a token-mean loss (a causal LM over padded
        batches) depends on the world size and on which batches share a round.  Here each batch
        is normalised by its own tokens -- the loss the ``Trainer`` computes on one process --
        and the batches are the dataset's runs of ``per_device_eval_batch_size`` whatever the
        membership (``adapter_kit.eval_batches``): the same ``eval_loss`` before and after a
        failure.  (Training is not affected: its token count is the global batch's.)

        Run again, on this member alone (every sample, no collective): the loop gathers the
        labels, the logits and the losses of a batch in separate calls; a death between two of
        them leaves rows of the dead member in one and not in the others (``compute_metrics``
        would see 100 predictions against 96 labels), and a member that adopted the step its
        peers committed meanwhile evaluates alone while theirs gather a shard
        (``eval_complete`` false).  Alone, the batches and the loss are the failure-free run's."""
        for attempt in range(3):
            ft = self._ft
            before = ft.eval_failures if ft is not None else 0
            try:
                with self._tokens_per_process() if ft is not None else contextlib.nullcontext():
                    out, error = super().evaluation_loop(*args, **kwargs), None
            except Exception as exc:
                out, error = None, exc
            if ft is None or (ft.eval_failures == before and ft.eval_complete is not False) or attempt == 2:
                if error is not None:
                    raise error  # the user's own error (or a third death in a row): not ours to hide
                return out
            ft.eval_alone_next = True
            _log.warning("transformers_ft: a worker died during the evaluation; this worker "
                         "evaluates again, every sample on its own")

    @property
    def _ft(self):
        acc = getattr(self, "accelerator", None)
        return getattr(acc, "_ft", None)

    def _get_dataloader(self, *args: Any, **kwargs: Any):
        """The ``Trainer``'s loaders, each prepared as what it is: only the one built with
        ``is_training`` is the training loader (``trainer.evaluate()`` may come first)."""
        acc = getattr(self, "accelerator", None)
        if self._ft is None:
            return super()._get_dataloader(*args, **kwargs)
        acc.next_loader_trains = bool(kwargs.get("is_training", args[4] if len(args) > 4 else False))
        try:
            return super()._get_dataloader(*args, **kwargs)
        finally:
            acc.next_loader_trains = None

    # ---------------------------------------------------------------- the step
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        if self._ft is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        return _OneAtATime(epoch_iterator, num_batches), None

    def _loss_is_scaled_for_ga(self) -> bool:
        """The Trainer's own rule (``training_step``) with no ``num_items_in_batch``."""
        if self.loss_is_scaled_for_ga is not None:
            return bool(self.loss_is_scaled_for_ga)
        return self.compute_loss_func is not None

    def _items_of(self, batch) -> Optional[Any]:
        """The ``Trainer``'s ``num_items_in_batch`` of this one micro-batch (None: not token-weighted)."""
        with self._tokens_per_process():
            return self._get_num_items_in_batch([batch], self.args.device)

    def training_step(self, model, inputs, num_items_in_batch: Optional[Any] = None):
        """The ``Trainer``'s step of one micro-batch.  Where the ``Trainer`` weights the loss by
        tokens (``num_items_in_batch``: a model that takes loss kwargs, or a
        ``compute_loss_func``, and labels), the micro-batch's loss is its own token mean and the
        runtime weights it by its token count (``accelerator.backward(num_items=)``): the update
        is the global batch's token mean, as the plain ``Trainer``'s, whoever computes which
        micro-batch."""
        ft = self._ft
        if ft is None:
            return super().training_step(model, inputs, num_items_in_batch)
        count = self._items_of(inputs)
        if count is not None:
            ft.loss_scale, ft.items_of_next_backward = 1.0, count
            try:
                with self._tokens_per_process():
                    return super().training_step(model, inputs, count)
            finally:
                ft.items_of_next_backward = None
        ft.loss_scale = 1.0 if self._loss_is_scaled_for_ga() else float(self.current_gradient_accumulation_steps)
        return super().training_step(model, inputs, None)

    # ---------------------------------------------------------------- checkpoints
    # The Trainer synchronizes its processes around a checkpoint only through
    # ``torch.distributed`` (its ``parallel_mode``), which the live group replaces: without a
    # barrier the others would look for the new folder (``best_model_checkpoint``) or load the
    # best model before the main process wrote it.  A member dying while a checkpoint is
    # written makes the barrier recover the job; the (new) main process then writes it again.
    def _written_by_everyone(self, write) -> None:
        ft = self._ft
        while True:
            before = ft.ctx.recoveries
            self._whole_model(optimizer=True)
            write()
            self.accelerator.wait_for_everyone()
            if ft.ctx.recoveries == before:
                return

    def _whole_model(self, optimizer: bool = False) -> None:
        """Sharded (``fsdp=``): the model object (``self.model``, what the ``Trainer`` saves and
        evaluates) holds the committed weights -- and with ``optimizer`` the optimizer's whole
        state is gathered for its ``state_dict()`` -- on every member at this same point."""
        ft = self._ft
        ctx = ft.sharded_ctx if ft is not None else None
        if ctx is not None:
            gathered(ft, ctx.whole_state if optimizer else ctx.refresh_model, 0)

    def train(self, *args: Any, **kwargs: Any):
        """``Trainer.train``; it returns once every member has committed the last step (a member
        whose last commit failed after its peers' succeeded adopts it from them:
        ``RecoveryCore.depart``); sharded, ``self.model`` then holds the trained (or best) weights."""
        out = super().train(*args, **kwargs)
        if self._ft is not None:
            self._ft.end_training()
        self._whole_model()
        return out

    def _load_best_model(self) -> None:
        super()._load_best_model()
        ctx = self._ft.sharded_ctx if self._ft is not None else None
        if ctx is not None:  # the best weights, loaded into self.model, become the rows' (training is over)
            ctx.load_whole(None)

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        ft = self._ft
        if ft is not None and not _internal_call:
            self._whole_model()  # (every process calls save_model, as the Trainer's docs ask)
        if ft is None or ft.ctx is None or not _internal_call:
            return super().save_model(output_dir, _internal_call)
        self._written_by_everyone(lambda: super(FaultTolerantTrainer, self).save_model(output_dir, _internal_call))

    def _save_checkpoint(self, model, trial) -> None:
        """The ``Trainer``'s checkpoint plus the runtime's state (the sampler's cursor and
        global batch, the engine's), so that ``resume_from_checkpoint`` continues the same
        sample order on however many workers run then."""
        ft = self._ft
        if ft is None or ft.ctx is None:
            return super()._save_checkpoint(model, trial)

        def write() -> None:
            super(FaultTolerantTrainer, self)._save_checkpoint(model, trial)
            if self.args.should_save:
                ft.save_ft_state(os.path.join(self._get_output_dir(trial), f"checkpoint-{self.state.global_step}"))
        self._written_by_everyone(write)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        if self._ft is not None:
            self._ft.load_ft_state(resume_from_checkpoint)

    def get_resumed_dataloader(self, dataloader, num_batches: int):
        """The epoch's items the checkpoint holds are handed out again without training
        (``accelerate_ft``'s ``skip_first_batches``), so the loop's counters line up."""
        if self._ft is None:
            return super().get_resumed_dataloader(dataloader, num_batches)
        return self.accelerator.skip_first_batches(dataloader, num_batches)

    # ---------------------------------------------------------------- logging
    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        ft = self._ft
        if ft is None or ft.ctx is None:
            return super()._maybe_log_save_evaluate(tr_loss, *args, **kwargs)
        last = ft.ctx.last_loss_tensor  # on the device: nothing is read until the Trainer logs
        if self.state.global_step != self._ft_counted and last is not None:
            self._ft_loss = self._ft_loss + last.to(tr_loss.device, tr_loss.dtype)
            self._ft_counted = self.state.global_step
        with torch.no_grad():
            # the global losses since the last log, not the local ones
            tr_loss.copy_(self._ft_loss) if torch.is_tensor(self._ft_loss) else tr_loss.fill_(self._ft_loss)
        logged = self._globalstep_last_logged
        super()._maybe_log_save_evaluate(tr_loss, *args, **kwargs)
        if self._globalstep_last_logged != logged:
            self._ft_loss = 0.0

    def log(self, logs: dict, start_time: Optional[float] = None) -> None:
        ft = self._ft
        if ft is not None and "loss" in logs:  # training logs carry the ft/* metrics
            logs = ft.log_values(logs)
        super().log(logs, start_time)
