"""``StepProtocol``: one worker's bridge between a ``FaultTolerantAccelerator`` and
``chameleon_ft.runtime.executors.dp.DataParallelExecutor``.

It owns the step protocol of the user's plain loop (see docs/accelerate.md):

* the training loader's items are the member's micro-batches (``accelerate_ft/data.py``);
* ``accelerator.backward(loss)`` weights the micro-batch's mean loss by its share of the global
  batch (instead of dividing by ``gradient_accumulation_steps``), so the SUM over members is the
  global-batch mean gradient whoever computed which micro-batch;
* the user's ``optimizer.step()`` after the member's last micro-batch runs
  ``DataParallelExecutor.sync_and_step``: the all-reduce, then -- only if it succeeded -- deferred
  gradient clipping, the real optimizer step, the LR schedulers (stepped by the runtime, so
  every member steps them once per committed step) and ``zero_grad``.  Any other
  ``optimizer.step()``, ``scheduler.step()`` and ``optimizer.zero_grad()`` is a no-op;
* on a failure the step is not committed; ``accelerator.sync_gradients`` turns False, and the
  loader goes on with what the recovery gave this member;
* a sharded step's forward/backward passes (each runs FSDP's collectives, which pair up across
  members by their order only) follow from the allocation, the loop's items
  (``loop_items``) and ``spill_rule`` alone, never from the path that runs the step: from the
  loop (its items, then the spilled surplus inside ``optimizer.step()``) or redone inside
  ``optimizer.step()`` (``_redo_inside``: the same passes).  A member that adopted the step its
  peers committed runs the next one from the loop while they redo it.

It also keeps Accelerate's view of the world current: ``num_processes``/``process_index`` (and
thus ``is_main_process``) are the live membership's, the trackers follow rank 0 (the new rank 0
starts them when the old one died) and receive the ``ft/*`` metrics.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from typing import Any, Callable, Optional

import torch
from accelerate import Accelerator
from accelerate.state import PartialState

from chameleon_ft.runtime.errors import ConfigError, install_excepthook
from chameleon_ft.runtime import codec as run_state
from chameleon_ft.runtime.adapter_kit import (LiveCollectives, UpdateHandle, ddp_reduction, ft_metrics,
                                          recovery_line, training_order)
from chameleon_ft.runtime.env import WorkerEnv
from chameleon_ft.runtime.eventlog import EventLog
from chameleon_ft.runtime.groups import CollectiveFailure
from chameleon_ft.runtime.sampler import ElasticSampler, StepItem
from chameleon_ft.runtime.codec import CheckpointError
from chameleon_ft.runtime.recovery import ElasticConfig, StepEnd, join_job
from chameleon_ft.runtime.executors.dp import DataParallelExecutor
from accelerate_ft.replay import LossReplay
from accelerate_ft.sharded import gathered, sharded_executor

log = logging.getLogger(__name__)

__all__ = ["StepProtocol", "FT_STATE_FILE"]

FT_STATE_FILE = "chameleon_ft_state.pt"
_SAVE_TAG = 1 << 40  # activity tags of save_state calls (evaluations use small numbers)
_STATE_VERSION = 1


class _SchedulerSteps:
    """What ``DataParallelExecutor`` sees as the scheduler: every prepared scheduler that steps with
    the optimizer, stepped as Accelerate would (``num_processes`` at launch times per step
    unless ``split_batches``), once per *committed* step."""

    def __init__(self, rt: "StepProtocol") -> None:
        self.rt = rt

    def step(self) -> None:
        # Accelerate steps a scheduler num_processes times per step because the global batch is
        # num_processes data-loader batches; the global batch is fixed here, and so is this count.
        s = self.rt.ctx.sampler
        ga = max(1, int(self.rt.acc.gradient_accumulation_steps))
        times = 1 if self.rt.acc.split_batches else max(1, s.global_batch // (s.micro_batch * ga))
        for s in self.rt.schedulers:
            if not s.step_with_optimizer:
                continue
            for _ in range(times):
                raw = s.scheduler
                if hasattr(raw, "total_steps") and raw._step_count > raw.total_steps:
                    break
                raw.step()

    def state_dict(self) -> dict:
        return {"schedulers": [s.scheduler.state_dict() for s in self.rt.schedulers]}

    def load_state_dict(self, state: dict) -> None:
        for s, st in zip(self.rt.schedulers, state["schedulers"]):
            s.scheduler.load_state_dict(st)


class StepProtocol:
    """See module doc.  Created by ``FaultTolerantAccelerator`` / ``wrap``; joins the job at once
    so that collectives (``wait_for_everyone``, ``gather``) work before training starts."""

    def __init__(self, acc: Accelerator, env: WorkerEnv, cfg: ElasticConfig,
                 event_log: Optional[str] = None) -> None:
        self.acc, self.env, self.cfg, self.event_log = acc, env, cfg, event_log
        # What ``backward`` multiplies the loop's loss by to get the item's mean loss: 1 for an
        # Accelerate loop; the HF Trainer divides by gradient_accumulation_steps itself.
        self.loss_scale = 1.0
        self.items_of_next_backward = None  # a wrapper's num_items for the next backward (the Trainer)
        self.sharding = None  # accelerate_ft.setups.FsdpSetup: FSDP2 (LoopShardedExecutor)
        if env.replacement:
            raise RuntimeError("accelerate_ft does not heal replacement workers (the user's loop "
                               "state cannot be replayed): run `chameleon-ft run` without --max-replacements")
        self.joined = join_job(env, cfg)
        self.ctx: Optional[DataParallelExecutor] = None
        self.coll = LiveCollectives(self.gm, self.view, self.timeout, lambda: self.ctx, who="accelerate_ft")
        self.model: Optional[torch.nn.Module] = None
        self.optimizer = None  # the prepared (FaultTolerant)AcceleratedOptimizer
        self.schedulers: list = []
        self.train_loader = None
        self.resume: Optional[dict] = None
        # the step in progress
        self.gen = None
        self.in_step = False
        self.current: Optional[StepItem] = None  # None while a ghost item runs
        self.batch: Any = None  # the data of the item being run (what the loader yielded)
        self.replay = LossReplay()
        self.redo_items = False  # redo the interrupted step through one more loop item
        # After load_state: the epoch's steps before the checkpoint's cursor are handed out
        # again as items that train nothing (the user's loop skips them, as in Accelerate's
        # examples), so the loop's counters line up with the run that saved the checkpoint.
        self.replay_steps = 0
        self.skipping = False
        self.last = False
        self.sync_attempted = True
        # Deferred clippings: (fn, the tensor clip_grad_norm_ returned to the loop, or None).
        self.clips: list[tuple[Callable[[], Any], Optional[torch.Tensor]]] = []
        self._mb_t0: Optional[float] = None
        self._step_t0 = 0.0
        self._compute = 0.0
        # evaluation (see ElasticEvalLoader and the eval_* methods)
        self.eval_valid: Optional[int] = None
        self.eval_runs = 0
        self.in_eval = False
        self.eval_span = (0, 0)  # samples [lo, hi) of the current round
        self.eval_position = 0  # samples of this evaluation this member has gathered (a prefix)
        self.eval_seen = 0  # rows of samples below this were gathered before a recovery: dropped
        self.eval_restart: Optional[tuple[int, bool]] = None  # (from sample, alone) after a recovery
        self.eval_alone = False  # this evaluation runs over every sample on this member
        self.eval_alone_next = False  # the next evaluation does (a wrapper's re-run: the Trainer)
        self.eval_complete: Optional[bool] = None  # of the last evaluation
        self.eval_failures = 0  # collectives that failed inside an evaluation, ever
        self.saves = 0  # save_state calls (their activity tag, see barrier_or_redo)
        self.last_step: dict = {}
        # trackers
        self.tracker_args: Optional[tuple] = None
        self.trackers_ready = False
        self.logged_recoveries = 0
        self.recovery_to_log = False
        self._warned: set = set()
        self.publish()
        atexit.register(self.close)
        install_excepthook(restart_hint="resume with accelerator.load_state(<last save_state dir>)")

    # ---------------------------------------------------------------- membership
    def view(self):
        if self.ctx is not None and self.ctx.view is not None:
            return self.ctx.view
        return self.joined.view

    def gm(self):
        if self.ctx is not None and self.ctx.gm is not None:
            return self.ctx.gm
        return self.joined.gm

    def timeout(self) -> float:
        return float(self.cfg.hang_timeout_s or self.env.hang_timeout_s)

    def publish(self) -> None:
        """Accelerate's ``num_processes``/``process_index``/``local_process_index`` are the live
        membership's (the HF Trainer's ``args`` read them too)."""
        v = self.view()
        lws = max(1, self.env.local_world_size)
        local = sorted(w for w in v.members if w // lws == self.env.worker_id // lws)
        for st in (self.acc.state, PartialState()):
            st.num_processes, st.process_index = v.world_size, v.rank
            st.local_process_index = local.index(self.env.worker_id) if self.env.worker_id in local else 0

    def is_main(self) -> bool:
        return self.view().rank == 0

    def is_local_main(self) -> bool:
        lws = max(1, self.env.local_world_size)
        mine = [w for w in self.view().members if w // lws == self.env.worker_id // lws]
        return bool(mine) and min(mine) == self.env.worker_id

    @property
    def sharded_ctx(self):
        """The ``LoopShardedExecutor`` once its sharded model exists (None: not sharded, or not
        started yet: the user's model object is then all there is)."""
        ctx = self.ctx
        return ctx if self.sharding is not None and ctx is not None and ctx.module is not None else None

    # ---------------------------------------------------------------- prepared objects
    def add_model(self, model: torch.nn.Module) -> None:
        if not any(p.requires_grad for p in model.parameters()):
            return  # a frozen model (teacher, reference) needs no reduction
        if self.model is not None and self.model is not model:
            raise ConfigError("accelerate_ft supports one trained model per Accelerator")
        if self.model is None:
            model.register_forward_hook(self._on_forward, with_kwargs=True)
        self.model = model

    def _on_forward(self, module, args, kwargs, output) -> None:
        if self.in_step and self.current is not None:
            self.replay.on_forward(args, kwargs, output, self.batch)

    def batch_sizes(self, dl) -> tuple[int, int]:
        """(global batch, micro-batch) for the training DataLoader ``dl``."""
        ga, world, bs = int(self.acc.gradient_accumulation_steps), self.env.world_size, int(dl.batch_size)
        if self.acc.split_batches:
            if bs % world:
                raise ConfigError(f"accelerate_ft: split_batches needs batch_size ({bs}) divisible by "
                                 f"the number of workers ({world})")
            return bs * ga, bs // world
        return world * bs * ga, bs

    @property
    def items_per_step(self) -> int:
        """Loop items per global step on every member, whatever its share: the
        ``gradient_accumulation_steps`` of the launch (see ``DataParallelExecutor.items``)."""
        return max(1, int(self.acc.gradient_accumulation_steps))

    def launch_items_per_epoch(self, loader) -> int:
        glob, micro = self.batch_sizes(loader.dataloader)
        if self.resume:
            glob = int(self.resume["global_batch"])
        s = ElasticSampler(len(loader.dataset), glob, micro, drop_last=loader.dataloader.drop_last)
        return s.steps_per_epoch * self.items_per_step

    def ensure_started(self, loader) -> DataParallelExecutor:
        """Start the runtime at the first iteration of the training loader."""
        if self.ctx is not None:
            if loader is not self.train_loader:
                raise RuntimeError("accelerate_ft: only one prepared training DataLoader can be "
                                   "iterated; pass the others as evaluation loaders")
            return self.ctx
        if self.model is None or self.optimizer is None:
            raise RuntimeError("accelerate_ft: prepare() the model and the optimizer before iterating "
                               "the training DataLoader")
        dl = loader.dataloader
        shuffle, seed = training_order(dl, int(self.acc.dataloader_config.data_seed or 0), "accelerate_ft")
        glob, micro = self.batch_sizes(dl)
        resume = self.resume
        if resume:
            if int(resume["micro_batch"]) != micro:
                raise ConfigError(f"accelerate_ft: the checkpoint was trained with micro-batches of "
                                 f"{resume['micro_batch']}, this run uses {micro}")
            glob = int(resume["global_batch"])
        self.cfg.items_per_step = self.items_per_step  # a share may be merged into the items
        for field, value in ddp_reduction(self.acc.ddp_handler, self.cfg).items():
            setattr(self.cfg, field, value)
        common = dict(scheduler=_SchedulerSteps(self), seed=seed, shuffle=shuffle, drop_last=dl.drop_last,
                      config=self.cfg, env=self.env)
        if self.sharding is not None:
            ctx = sharded_executor(self, self.model._original, self.optimizer.optimizer, len(dl.dataset),
                                   glob, micro, **common)
        else:
            handle = UpdateHandle(self.optimizer.optimizer)
            handle.update = self._apply_update
            ctx = DataParallelExecutor(self.model, handle, len(dl.dataset), glob, micro, user_loop=True,
                                       control_collectives=True,  # gather, reduce, wait_for_everyone
                                       **common)
        if self.event_log:
            ctx.log = EventLog(self.event_log, worker=ctx.worker_id, pid=os.getpid())
        if resume:
            self._apply_resume(ctx, resume)
            self.replay_steps = ctx.sampler.cursor
        self.train_loader = loader
        self.ctx = ctx
        ctx.on_reconfigured = self.after_reconfiguration
        ctx.start(self.joined)
        self.after_reconfiguration()
        return ctx

    @staticmethod
    def _apply_resume(ctx: DataParallelExecutor, resume: dict) -> None:
        ctx.sampler.load_state_dict(resume["sampler"])
        ctx.policy.load_state_dict(resume["engine"])
        ctx.policy.plan = None  # start over on whoever is here
        ctx.step = ctx.last_checkpoint_step = int(resume["step"])

    # ---------------------------------------------------------------- the step
    def enter_step(self, gen, n: int) -> None:
        self.gen, self.in_step, self.sync_attempted = gen, True, False
        self.coll.catch_up = False
        self._step_t0, self._compute = time.perf_counter(), 0.0

    def enter_microbatch(self, item: Optional[StepItem], last: bool, batch: Any = None) -> None:
        self.current, self.last, self.batch = item, last, batch
        self.acc.gradient_state._set_sync_gradients(last)
        self._mb_t0 = time.perf_counter()

    def after_microbatch(self) -> None:
        if self._mb_t0 is None:
            return
        dt = time.perf_counter() - self._mb_t0
        self._mb_t0 = None
        self._compute += dt
        if self.current is not None and self.ctx.faults:
            self.ctx.faults.at(self.ctx.step, "forward", phase_time=dt)  # slow faults pad the compute

    def leave_step(self) -> None:
        self.in_step, self.current, self.gen = False, None, None

    def backward(self, loss: torch.Tensor, num_items: Optional[int] = None, **kwargs: Any) -> None:
        """``accelerator.backward``; ``num_items``: the items (tokens) ``loss`` is the mean over,
        for a token-weighted global batch (``DataParallelExecutor.backward``)."""
        if self.skipping:
            return  # an item of a step the checkpoint already holds
        if not self.in_step:
            self._warn_once("backward", "accelerator.backward() outside the items of the prepared "
                            "training DataLoader: plain loss.backward(), not part of a global step")
            loss.backward(**kwargs)
            return
        if self.current is None:  # a ghost item: this member has nothing of this step to compute
            if self.sharding is not None:  # (but its pass runs FSDP's collectives for the others)
                self.ctx.backward(loss, None, **kwargs)
            return
        if num_items is None:
            num_items = self.items_of_next_backward
        self.replay.on_backward(loss, num_items)
        self.ctx.backward(loss * self.loss_scale, self.current, num_items, **kwargs)

    def defer(self, fn: Callable[[], Any], out: Optional[torch.Tensor] = None) -> None:
        """Run ``fn`` (gradient clipping) on the reduced gradients, just before the update; what
        it returns is copied into ``out`` (the total norm the loop was handed)."""
        self.clips.append((fn, out))

    def optimizer_step(self) -> None:
        """The user's ``optimizer.step()``: commits the step after the member's last item."""
        if self.skipping:
            return
        if not self.in_step:
            if self.ctx is None:
                raise RuntimeError("accelerate_ft: optimizer.step() before iterating the prepared "
                                   "training DataLoader (the runtime reduces gradients per global step)")
            self._warn_once("step", "optimizer.step() outside the items of the training DataLoader is ignored")
            return
        if self.last and not self.sync_attempted:
            self.finish_step()

    def finish_step(self) -> bool:
        """All-reduce and commit (or recover); True when a step was committed.

        A step that a failure interrupted is redone here, inside the user's
        ``optimizer.step()``: the micro-batches the recovery gave this member are recomputed
        with the loss recipe learnt from the loop (``LossReplay``) and the all-reduce runs
        again, until the step commits -- the user's loop sees one item per item and one
        ``optimizer.step()`` per step, as without a failure.  Without a recipe the redo runs
        through one more loop item (``redo_items``; sharded: as many items as a step has)."""
        ctx = self.ctx
        self.after_microbatch()
        if self.gen is not None:
            for _ in self.gen:
                raise RuntimeError("accelerate_ft: the training loader handed out fewer items "
                                   "than the step has")
            self.gen = None
        self.sync_attempted = True
        self.redo_items = False
        if not self.replay.ready and ctx.unspill():
            # A recipe restored from a checkpoint did not match this loop's first backward:
            # the surplus it was to compute takes one more item.
            self._warn_once("redo", "the loss recipe saved in the checkpoint does not match this loop: "
                            "this step's surplus micro-batches run as one more training item")
            self.redo_items = True
            self.acc.gradient_state._set_sync_gradients(False)
            return False
        self._compute_extra(ctx.spilled(), ctx.sampler.cursor)
        ts = time.perf_counter()
        first = True

        def attempt() -> bool:  # the loop computed the first; a redo is computed here
            nonlocal first
            if not first:
                self._redo_inside()
            first = False
            return ctx.sync_and_step()

        end = ctx.run_step(attempt, self._redo_here)
        committed = end is not StepEnd.REDO
        if end is StepEnd.ADOPTED:
            self.coll.catch_up = True  # peers are a step ahead until our next step
            # The norms the loop was handed are the committed step's, as its peers clipped it.
            outs = [out for _, out in self.clips if out is not None]
            for out, norm in zip(outs, ctx.last_grad_norms):
                out.fill_(norm)
        self.clips = []
        self.acc.gradient_state._set_sync_gradients(committed)
        if committed:
            end = time.perf_counter()
            self.last_step = {"step_s": end - self._step_t0, "compute_s": self._compute, "sync_s": end - ts}
            if ctx.recoveries != self.logged_recoveries:
                self.logged_recoveries = ctx.recoveries
                self.on_recovered()
        return committed

    def _redo_here(self) -> bool:
        """Whether a step nobody committed is redone inside ``optimizer.step()`` (with a loss
        recipe) or through more loop items (without one: said once; ``loop_items``)."""
        if self.replay.ready:
            return True
        more = "a whole step's items" if self.sharding is not None else "one more item"
        self._warn_once("redo", "a failure interrupted a step whose loss is computed outside the "
                        f"model (or from transformed inputs): the step is redone through {more} "
                        "of the training loader (return the loss from the model, e.g. "
                        "model(**batch).loss, to keep the loop's shape)")
        self.redo_items = True
        return False

    def loop_items(self) -> int:
        """How many items the training loader hands out for the next step: ``items_per_step``,
        or one for a step redone through the loop (``redo_items``) -- sharded, ``items_per_step``
        for that too (module doc: a sharded step's passes)."""
        return 1 if self.redo_items and self.sharding is None else self.items_per_step

    def spill_rule(self, n: int) -> Callable[[int], bool]:
        """Whether item ``i`` of a share larger than ``n`` items is one whole micro-batch, the
        surplus computed inside ``optimizer.step()`` (with a loss recipe).  Sharded: the items
        after the first all alike, from the recipe after the first item's backward -- the same
        answer on every member (module doc: a sharded step's passes); before the first backward
        of the run the first item is one micro-batch when more items follow (it teaches the
        recipe; merged, a surplus micro-batch would run with the first one's dropout seed)."""
        if self.sharding is not None:
            replay = self.replay
            return lambda i: replay.ready or (i == 0 and n > 1 and not replay.seen)
        return lambda i: self.replay.spill(i, n)

    def _redo_inside(self) -> None:
        """Compute this member's share of the interrupted step with the learnt loss recipe
        (sharded: the passes the loop runs for a step -- its items, then the spilled surplus --
        module doc)."""
        ctx = self.ctx
        if self.sharding is None:
            self._compute_extra(ctx.microbatches(), None)
            return
        self._compute_extra(ctx.items(self.items_per_step, spill=self.spill_rule(self.items_per_step)), None)
        self._compute_extra(ctx.spilled(), None)

    def _compute_extra(self, microbatches, step: Optional[int]) -> None:
        """Forward and backward of ``microbatches`` with the loss recipe (``LossReplay``):
        a share larger than the loop's items, or the redo of an interrupted step."""
        ctx, loader = self.ctx, self.train_loader
        for mb in microbatches:
            t0 = time.perf_counter()
            ghost = getattr(mb, "ghost", False)  # (sharded: a zero-weight pass on a real sample)
            batch = loader.load_item(ctx.sampler.microbatches(ctx.sampler.cursor)[0] if ghost else mb, step)
            items = self.replay.items(batch)
            ctx.backward(self.replay.loss(self.model, batch, items) * self.loss_scale, None if ghost else mb,
                         None if ghost else items)
            self._compute += time.perf_counter() - t0

    def _apply_update(self) -> None:
        norms = []
        for fn, out in self.clips:
            r = fn()
            if out is not None:
                out.copy_(r)
                norms.append(float(r))
        self.ctx.last_grad_norms = norms
        self.optimizer.optimizer.step()

    def after_reconfiguration(self) -> None:
        was_main = self.acc.state.process_index == 0
        self.publish()
        self.coll.reset()
        if self.is_main() and not was_main:
            self.ensure_trackers()

    # ---------------------------------------------------------------- evaluation
    def begin_eval(self) -> None:
        self.eval_runs += 1
        self.in_eval, self.eval_position, self.eval_seen, self.eval_restart = True, 0, 0, None
        # A member whose collectives stay local for now (it adopted a step its peers committed,
        # or a collective mismatched) evaluates every sample itself, as one that finishes an
        # evaluation alone after a failure does: its gathers return its own rows, all of them.
        self.eval_alone = self.eval_goes_local()
        self.eval_alone_next = False
        self.eval_complete = True
        if self.eval_alone:
            self.coll.local_reason = ("while it evaluates every sample on its own (its collectives "
                                      "rejoin its peers' at the next training step)")
        if self.ctx is not None:
            self.ctx.activity = self.eval_runs  # what recovering members compare
            self.coll.reraise = True  # a failed collective recovers the job (eval_failed)
            if self.sharding is not None and not self.eval_alone:  # it runs the unsharded model object
                gathered(self, self.ctx.refresh_model, self.eval_runs)

    def eval_goes_local(self) -> bool:
        """True while this member's collectives would return its local value (or the next
        evaluation was asked to run alone)."""
        return self.eval_alone_next or (self.coll.world_size > 1 and self.coll.stays_local)

    def end_eval(self) -> None:
        if self.coll.realigning and not self.eval_alone:  # a gather gave way: it returned a shard
            self.eval_complete = False
        self.in_eval, self.eval_valid = False, None
        self.coll.reraise, self.coll.local_reason = False, None
        if self.ctx is not None:
            self.ctx.activity = 0

    def eval_batch(self, n_valid: int, lo: int, hi: int) -> None:
        self.eval_valid, self.eval_span = n_valid, (lo, hi)

    def eval_received(self, out: Any, drop: Callable[[Any, int], Any]) -> Any:
        """A gather of the current round succeeded: advance this member's position and drop
        the rows it already had before a recovery restarted the evaluation earlier."""
        lo, hi = self.eval_span
        self.eval_position = max(self.eval_position, hi)
        n = min(max(0, self.eval_seen - lo), hi - lo)
        return drop(out, n) if n else out

    def eval_failed(self, failure: CollectiveFailure) -> None:
        """A collective of an evaluation failed: recover the job now; the evaluation goes on
        from the first sample not every survivor gathered (re-split over them), or -- when
        some survivor was not in this evaluation -- this member finishes it alone."""
        self.eval_failures += 1
        ctx = self.ctx
        if ctx is None:  # evaluating before training started: no state to agree on
            self.coll.degraded, self.eval_complete = True, False
            self.coll.reraise = False
            return
        same = ctx.recover_off_step(failure, ctx.activity)
        self.eval_seen = max(self.eval_seen, self.eval_position)
        start = self.eval_position
        if same:
            try:
                start = int(self.coll.allreduce(torch.tensor([start], dtype=torch.int64), "min").item())
            except CollectiveFailure as again:
                return self.eval_failed(again)
        else:
            self.coll.local_reason = "while it finishes an evaluation alone (its peers were not in it when a failure hit)"
        self.eval_restart = (start, not same)
        self.eval_position = start

    # ---------------------------------------------------------------- checkpoints
    def barrier_or_redo(self) -> bool:
        """The barrier that closes a ``save_state``.  True: every member got past it (or it ran
        locally).  False: a member died, the job recovered at once and every survivor was in
        this same save -- write it again."""
        ctx = self.ctx
        if ctx is None:
            self.coll.barrier()
            return True
        self.saves += 1
        self.coll.reraise = True
        try:
            self.coll.barrier()
            return True
        except CollectiveFailure as failure:
            again = ctx.recover_off_step(failure, _SAVE_TAG + self.saves)
            if again:
                self.saves -= 1  # the same save, written again: peers count it once too
            return not again
        finally:
            self.coll.reraise = self.in_eval

    # ---------------------------------------------------------------- trackers
    def ensure_trackers(self) -> None:
        """The live rank 0 runs the trackers; one that took over starts them now."""
        if self.is_main() and self.tracker_args is not None and not self.trackers_ready:
            Accelerator.init_trackers(self.acc, *self.tracker_args)
            self.trackers_ready = True

    def metrics(self, recovered: bool = False) -> dict:
        if self.ctx is None or self.ctx.view is None:
            return {}
        m = ft_metrics(self.ctx, self.last_step, recovered)
        if self.eval_complete is not None:
            m["ft/eval_complete"] = float(self.eval_complete)
        return m

    def log_values(self, values: dict) -> dict:
        """The user's logged ``values`` plus the ``ft/*`` metrics, on the user's own step axis;
        a recovery's MTTR and decision ride with the first ``log()`` after it."""
        out = {**values, **self.metrics(self.recovery_to_log)}
        self.recovery_to_log = False
        return out

    def on_recovered(self) -> None:
        """After the first committed step of a recovery: one console line (live rank 0) and
        the recovery's metrics for the next ``log()``."""
        self.recovery_to_log = True
        if self.is_main():
            log.warning("%s", recovery_line(self.ctx, "accelerate_ft"))

    # ---------------------------------------------------------------- checkpoints
    def ft_state(self) -> Optional[dict]:
        ctx = self.ctx
        if ctx is None:
            return dict(self.resume) if self.resume else None
        return {"version": _STATE_VERSION, "global_batch": ctx.sampler.global_batch,
                "micro_batch": ctx.sampler.micro_batch, "step": ctx.step,
                "sampler": ctx.sampler.state_dict(), "engine": ctx.policy.state_dict(),
                "loss_recipe": self.replay.state_dict()}

    def save_ft_state(self, folder: str) -> None:
        st = self.ft_state()
        if st is not None:
            run_state.save_checkpoint(os.path.join(folder, FT_STATE_FILE), st)

    def load_ft_state(self, folder: str) -> None:
        path = os.path.join(folder, FT_STATE_FILE)
        if not os.path.exists(path):
            return
        st = run_state.load_checkpoint(path)
        if st.get("version") != _STATE_VERSION:
            raise CheckpointError(f"{path}: state version {st.get('version')!r} is not {_STATE_VERSION}")
        self.replay.load_state_dict(st.get("loss_recipe"))
        if self.ctx is None:
            self.resume = st
        else:  # every member loads the same files at the same point of its loop
            self._apply_resume(self.ctx, st)
            self.replay_steps = self.ctx.sampler.cursor
            self.ctx.policy.start(self.ctx.members)
            alloc = self.ctx.policy.allocation
            self.ctx.sampler.set_allocation(list(alloc), list(alloc.values()))

    # ---------------------------------------------------------------- misc
    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("accelerate_ft: %s", msg)

    def end_training(self) -> None:
        """The user's loop is over: wait until every member has committed its last step
        (``RecoveryCore.end_training``)."""
        if self.ctx is not None:
            self.ctx.end_training()

    def close(self) -> None:
        if self.ctx is not None:
            self.ctx.close(redone_steps=self.ctx.redone_steps, adopted_steps=self.ctx.adopted_steps)
            self.ctx = None
        elif self.joined is not None:
            self.joined.membership.close()
            self.joined.gm.close()
        self.joined = None
