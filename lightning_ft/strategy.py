"""``FaultTolerantDDPStrategy`` (``strategy="ddp_ft"``): Lightning's data-parallel strategy on
the chameleon-ft runtime, so that the survivors keep training in place when a worker dies,
hangs or slows down.

What it changes against ``DDPStrategy`` and why:

* **No default process group, no DDP wrapper.**  ``setup_environment`` joins the job's
  membership (``join_job``) and forms a gloo group per membership generation; gradients are
  reduced by ``DataParallelExecutor.sync_and_step`` (one fail-fast all-reduce per step) instead of
  DDP's hooks, because a default group cannot be re-formed after a death.
* **One Lightning batch per global step.**  The training DataLoader becomes a ``StepLoader``
  over the exactly-once ``ElasticSampler`` (global batch = workers at launch x ``batch_size``
  x ``accumulate_grad_batches``, kept through failures); ``trainer.accumulate_grad_batches``
  is set to 1 and the strategy runs the member's micro-batches of the step inside
  ``optimizer_step``: the first through Lightning's closure, the others through
  ``training_step``/``backward`` hooks, each loss weighted by its share of the global batch.
  So ``global_step``, ``batch_idx`` (= step in the epoch) and ``current_epoch`` are identical
  on every worker whatever the membership.
* **The step is atomic.**  ``optimizer_step`` hands the update (precision plugin: hooks,
  gradient clipping, ``optimizer.step``) to ``sync_and_step``, which applies it only after the
  all-reduce succeeded; on a failure the runtime recovers (membership, new group, engine
  decision, state agreement) and the strategy redoes the step's missing micro-batches, or
  adopts the step when a peer committed it.  Lightning sees one completed optimizer step.
* **Collectives follow the membership.**  ``reduce``/``all_gather``/``broadcast``/``barrier``
  and every torchmetrics ``Metric``'s sync run over the current generation's group, with the
  runtime's watchdog; ``global_rank``/``world_size``/``is_global_zero`` are the live view's.
  Evaluation loaders get a ``ShardSampler`` (every sample once, re-sharded after a change).

* **Evaluation survives too.**  The validation/test loops are wrapped (``_run_evaluation``):
  a failed collective inside one unwinds it, the job recovers at once and, when every member
  was in the same evaluation, it runs again over the survivors; otherwise its metrics are
  flagged partial (``ft/eval_complete`` = 0).

* **Between steps too.**  Other collectives outside a training step (the epoch-end sync of
  training metrics, checkpoint barriers, ``on_train_batch_end``) recover the job at the
  first failure (``_recover_off_step``), so that the new rank 0 writes the epoch's checkpoint
  and logs; that collective and the following ones return this worker's local value until
  its next training step (the members may have met the failure in different collectives).
  The same holds for a worker that adopted a step its peers committed, until its next step.
* The wrappers around Lightning's evaluation loops and epoch reset live in
  ``lightning_ft/loops.py`` (``LoopWrappers``, a mixin of this strategy).
* **Lightning's warnings that are wrong here** -- the one-device advice for
  ``validate()``/``test()`` and the "unreliable results" of a mid-epoch resume -- are filtered
  in the code that emits them and replaced by true lines.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any, Callable, Optional

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult
from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from torch.utils.data import DataLoader, DistributedSampler

from chameleon_ft.runtime.errors import ConfigError, LauncherError
from chameleon_ft.runtime.relaunch import launched
from lightning_ft.launch import relaunch_lightning
from chameleon_ft.runtime.adapter_kit import (LiveCollectives, UpdateHandle, ddp_reduction, refuse_grad_scaler,
                                          training_order)
from chameleon_ft.runtime.env import EnvError, WorkerEnv
from chameleon_ft.runtime.eventlog import EventLog
from chameleon_ft.runtime.groups import CollectiveFailure
from chameleon_ft.runtime.recovery import ElasticConfig, Joined, StepEnd, join_job
from chameleon_ft.runtime.executors.dp import DataParallelExecutor
from lightning_ft.data import ShardSampler, StepLoader
from lightning_ft.hooks import StrategyHooks
from lightning_ft.loops import LoopWrappers
from typing_extensions import override

log = logging.getLogger(__name__)

__all__ = ["FaultTolerantDDPStrategy", "LauncherError"]

_NOT_LAUNCHED = (
    "fault-tolerant training needs the chameleon-ft launcher (CHAMELEON_FT_NO_RELAUNCH=1 kept "
    "this process from becoming it): start the script with "
    "`chameleon-ft run --nproc-per-node N train.py` (or `python -m chameleon_ft.cli.launch ...`). "
    "Lightning's own launcher runs rank 0 inside your `python train.py` process and torchrun "
    "restarts every worker on a failure, so neither can keep the survivors training in place. "
    "Without it, train with strategy='ddp' and a ModelCheckpoint, and after a failure rerun with "
    "`trainer.fit(model, ckpt_path='last')` (checkpoint-restart).")


_UNEVEN = ("inside training_step while the members run different numbers of micro-batches in "
           "this step (after a failure or a rebalance), so their collectives cannot pair up")


# Why collectives are local after a recovery between steps (see _recover_off_step).
_OFF_STEP = "until its next training step (a worker was lost between training steps)"


def check_precision(plugin) -> None:
    """A precision plugin with a ``GradScaler`` (``precision="16-mixed"`` on a GPU; Lightning
    turns it into bf16 on the CPU) is refused clearly (``refuse_grad_scaler``)."""
    if getattr(plugin, "scaler", None) is not None:
        refuse_grad_scaler("lightning_ft", f"precision={getattr(plugin, 'precision', '16-mixed')!r}")


class _SchedulerState:
    """What ``DataParallelExecutor`` sees as the scheduler.  Lightning steps the LR schedulers itself
    (after the step, by interval and frequency); the runtime only needs their state *at the
    commit* so that a worker that adopts a step its peers committed ends up where they are
    once its own Lightning loop has stepped the schedulers for that step (the optimizers'
    hyperparameters at the commit travel too: ``runtime/hyperparams.py``, in the executor)."""

    def __init__(self, strategy: "FaultTolerantDDPStrategy") -> None:
        self.strategy = strategy
        self.step()

    def _schedulers(self):
        return [c.scheduler for c in self.strategy.lr_scheduler_configs]

    def step(self) -> None:  # called by sync_and_step right after the optimizer update
        self.snapshot = [copy.deepcopy(s.state_dict()) for s in self._schedulers()]

    def state_dict(self) -> dict:
        return {"schedulers": self.snapshot}

    def load_state_dict(self, state: dict) -> None:
        for sched, s in zip(self._schedulers(), state["schedulers"]):
            sched.load_state_dict(s)
        self.snapshot = copy.deepcopy(state["schedulers"])


def _drop_lightnings_sigterm(trainer) -> None:
    """Take SIGTERM from Lightning's ``SignalConnector`` (main thread, before the runtime's
    notice is installed): its handler makes ``fit`` raise at the next batch end, so a
    preemption notice would end the worker like a crash found later.  Without it the runtime's
    notice makes the worker leave after the step it is in, announced
    (``runtime/preemption.py``).  Handlers of the user's that Lightning composed are kept."""
    if threading.current_thread() is not threading.main_thread():
        return
    handler = signal.getsignal(signal.SIGTERM)
    if not isinstance(handler, _HandlersCompose):
        return
    mine = trainer._signal_connector
    keep = [h for h in handler.signal_handlers if getattr(h, "__self__", None) is not mine]
    signal.signal(signal.SIGTERM, _HandlersCompose(keep) if keep else signal.SIG_DFL)


class FaultTolerantDDPStrategy(DDPStrategy, LoopWrappers):
    """Data-parallel training that survives worker failures in place (see module doc).

    Args:
        ft_config: runtime knobs; default: taken from the trainer's ``FaultToleranceCallback``.
        event_log: path of the JSONL event log (default: the launcher's run dir).
    """

    strategy_name = "ddp_ft"

    def __init__(self, *args: Any, ft_config: Optional[ElasticConfig] = None,
                 event_log: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ft_config = ft_config
        self.event_log = event_log
        self.ctx: Optional[DataParallelExecutor] = None
        self.env: Optional[WorkerEnv] = None
        self._joined: Optional[Joined] = None
        self._loader: Optional[StepLoader] = None
        self._coll = LiveCollectives(self._gm, self._view, self._op_timeout, lambda: self.ctx,
                                     who="lightning_ft")
        self._batch_key: Optional[tuple] = None
        self._mb = None
        self._in_step = False  # inside optimizer_step (the step's micro-batches and all-reduce)
        self._handle: Optional[UpdateHandle] = None
        self.user_accumulate = 1
        self.last_step: dict = {}  # phase timings of the last committed step
        self._eval_runs = 0  # evaluations run with a training context (their activity tag)
        self.eval_reruns = 0  # evaluations rerun over the survivors after a failure
        self.eval_partial = 0  # evaluations whose metrics cover only this worker's shard

    @classmethod
    def adopt(cls, strategy: DDPStrategy) -> "FaultTolerantDDPStrategy":
        """Turn a ``DDPStrategy`` the Trainer already holds (``strategy=DDPStrategy(...)``) into
        this class, in place, before it forms any process group: its DDP settings
        (``bucket_cap_mb``, ``gradient_as_bucket_view``, the communication hook, ...) and the
        accelerator, devices, cluster environment, precision and checkpoint IO Lightning set."""
        lightning_set = dict(vars(strategy))
        strategy.__class__ = cls
        strategy.__dict__.clear()
        cls.__init__(strategy)
        for k, v in lightning_set.items():
            setattr(strategy, k, v)
        return strategy

    # ---------------------------------------------------------------- ranks
    def _view(self):
        if self.ctx is not None and self.ctx.view is not None:
            return self.ctx.view
        return self._joined.view if self._joined is not None else None

    @property
    @override
    def global_rank(self) -> int:
        v = self._view()
        return v.rank if v is not None else super().global_rank

    @property
    @override
    def world_size(self) -> int:
        v = self._view()
        return v.world_size if v is not None else super().world_size

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        if self.parallel_devices[0].type == "cpu":
            return torch.device("cpu")
        return self.parallel_devices[self.local_rank % len(self.parallel_devices)]

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        self._publish_rank()

    def _publish_rank(self) -> None:
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank

    # ---------------------------------------------------------------- set-up
    @override
    def _configure_launcher(self) -> None:
        if not launched():
            # Started Lightning's way (``python train.py``, ``srun``, torchrun): hand the job to
            # our launcher, which returns only when relaunching is turned off.
            relaunch_lightning(self.cluster_environment, len(self.parallel_devices or [None]), self.num_nodes)
            raise LauncherError(_NOT_LAUNCHED)
        self._launcher = None

    @override
    def setup_environment(self) -> None:
        assert self.accelerator is not None
        self.accelerator.setup_device(self.root_device)
        try:
            self.env = WorkerEnv.from_env()
        except EnvError as exc:
            raise LauncherError(f"{_NOT_LAUNCHED} ({exc})") from None
        if self.env.replacement:
            raise LauncherError(
                "lightning_ft does not heal replacement workers yet (a replacement would have to "
                "replay Lightning's loop state): run `chameleon-ft run` without --max-replacements")
        if self.ft_config is None:
            cb = self._callback()
            self.ft_config = cb.elastic_config() if cb is not None else ElasticConfig()
            self.event_log = self.event_log or (cb.event_log if cb is not None else None)
        if self._joined is None:
            # Once per process: a later stage (trainer.test/validate after fit) runs on the
            # live membership; joining again would wait for workers that may be gone.
            self._joined = join_job(self.env, self.ft_config)
            atexit.register(self.close)
        self._publish_rank()
        self._agree_logger_versions()
        cb = self._callback()
        if cb is not None:
            cb.before_stage(self.lightning_module.trainer)

    def _callback(self) -> Optional[StrategyHooks]:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        for cb in (trainer.callbacks if trainer is not None else []):
            if isinstance(cb, StrategyHooks):
                return cb
        return None

    def _agree_logger_versions(self) -> None:
        """Any member may become rank 0 and take over logging: all must write to the same
        logger version (rank 0's choice)."""
        trainer = self.lightning_module.trainer
        for logger in trainer.loggers:
            if hasattr(logger, "_version"):
                version = logger.version if self.is_global_zero else None
                logger._version = self.broadcast(version, 0)

    @override
    def setup(self, trainer) -> None:
        # Strategy.setup: no DDP wrapper -- the runtime reduces the gradients.
        Strategy.setup(self, trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            if not self.lightning_module.automatic_optimization:
                raise ConfigError("lightning_ft supports automatic optimization only "
                                 "(manual_backward/optimizer.step in training_step is not redone)")
            if len(self.optimizers) != 1:
                raise ConfigError("lightning_ft supports exactly one optimizer")
            check_precision(self.precision_plugin)
        self._route_metrics()
        self._wrap_loops(trainer)

    @override
    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # no DistributedDataParallel: the runtime reduces the gradients

    def _route_metrics(self) -> None:
        try:
            from torchmetrics import Metric
        except ImportError:
            return
        for m in self.lightning_module.modules():
            if isinstance(m, Metric):
                m.dist_sync_fn = self._metric_gather
                m.distributed_available_fn = self._metric_sync_available

    # ---------------------------------------------------------------- evaluation
    # ---------------------------------------------------------------- data
    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        if trainer.state.stage == RunningStage.TRAINING:
            return self._training_loader(dataloader)
        if isinstance(dataloader, DataLoader) and isinstance(dataloader.sampler, DistributedSampler):
            from lightning.pytorch.utilities.data import _update_dataloader
            if trainer.state.fn in (TrainerFn.VALIDATING, TrainerFn.TESTING):
                # In place of Lightning's advice to use one device (see _run_evaluation).
                rank_zero_info(f"lightning_ft: trainer.{trainer.state.fn.value}() evaluates each of the "
                               f"{len(dataloader.dataset)} samples exactly once over the {self.world_size} "
                               "live workers (no DistributedSampler padding)")
            return _update_dataloader(dataloader, ShardSampler(len(dataloader.dataset), self),
                                      mode=trainer.state.stage)
        return dataloader

    def _training_loader(self, dl: object) -> StepLoader:
        shuffle, seed = training_order(dl, int(os.environ.get("PL_GLOBAL_SEED", 0)), "lightning_ft")
        if self.ctx is None:
            self._start_context(dl, shuffle, seed)
        self._loader = StepLoader(self, dl)
        return self._loader

    def _start_context(self, dl: DataLoader, shuffle: bool, seed: int) -> None:
        trainer = self.lightning_module.trainer
        cb = self._callback()
        resume = cb.resume_state if cb is not None else None
        self.user_accumulate = int(trainer.accumulate_grad_batches)
        trainer.accumulate_grad_batches = 1  # one Lightning batch is one global step
        mb = int(dl.batch_size)
        global_batch = (int(resume["global_batch"]) if resume
                        else self.env.world_size * mb * self.user_accumulate)
        if resume and int(resume["micro_batch"]) != mb:
            raise ConfigError(f"lightning_ft: the checkpoint was trained with batch_size "
                             f"{resume['micro_batch']}, this run uses {mb}")
        ctx = self._new_context(len(dl.dataset), global_batch, mb, seed=seed, shuffle=shuffle,
                                drop_last=dl.drop_last)
        ctx.on_reconfigured = self._after_reconfiguration
        if self.event_log:
            ctx.log = EventLog(self.event_log, worker=ctx.worker_id, pid=os.getpid())
        if resume:
            ctx.sampler.load_state_dict(resume["sampler"])
            ctx.policy.load_state_dict(resume["engine"])
            ctx.policy.plan = None  # start over on whoever is here
            ctx.step = int(resume["step"])
            ctx.last_checkpoint_step = int(resume["step"])
        trainer = self.lightning_module.trainer
        # The run's length, as Lightning will stop (its -1 / None: no bound).
        ctx.plan_run(trainer.max_steps if (trainer.max_steps or -1) >= 0 else None,
                     trainer.max_epochs if (trainer.max_epochs or -1) >= 0 else None)
        self.ctx = ctx
        _drop_lightnings_sigterm(trainer)
        ctx.start(self._joined)
        self._after_reconfiguration(initial=True)

    def _new_context(self, dataset_len: int, global_batch: int, micro_batch: int, **kw) -> DataParallelExecutor:
        self._handle = UpdateHandle(self.optimizers[0])
        # At least one micro-batch per member and step (ElasticConfig.one_microbatch_each).
        config = self.ft_config or ElasticConfig()
        config = dataclasses.replace(config, one_microbatch_each=True, **ddp_reduction(
            self._ddp_kwargs, config, hook=self._ddp_comm_hook, wrapper=self._ddp_comm_wrapper))
        return DataParallelExecutor(self.lightning_module, self._handle, dataset_len, global_batch, micro_batch,
                                    scheduler=_SchedulerState(self), config=config, env=self.env,
                                    control_collectives=True, user_loop=True, **kw)  # metric syncs, barriers

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None,
                        dataloader_idx: int = 0) -> Any:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if (trainer is not None and self._loader is not None and trainer.training
                and trainer.state.stage == RunningStage.TRAINING):
            self._batch_key, batch = self._loader.resolve(batch, self._prepare)
        return super().batch_to_device(batch, device, dataloader_idx)

    def step_microbatches(self) -> list:
        """The micro-batches this member computes in the current step, in order (after a
        recovery that kept peers' gradients: only the part it was given to redo)."""
        return self.ctx.pending_microbatches()

    def _prepare(self, batch: Any) -> Any:
        trainer = self.lightning_module.trainer
        batch = trainer.precision_plugin.convert_input(batch)
        return self.lightning_module._on_before_batch_transfer(batch, dataloader_idx=0)

    # ---------------------------------------------------------------- the step
    @override
    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._mb is not None:
            # The micro-batch's share of the global batch: summed over members, the gradient
            # is the global-batch mean whoever computed which micro-batch.
            closure_loss = self.ctx.weigh(closure_loss, self._mb)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        ctx = self.ctx
        if ctx is None:
            raise RuntimeError("lightning_ft: optimizer_step before the training data was set up")
        model = model or self.lightning_module
        self._in_step = True
        try:
            result = self._run_step(ctx, optimizer, closure, model, kwargs)
        finally:
            self._in_step = False
        if ctx.steering.stop_at is not None or ctx.steering.adopt:
            self._steer(model.trainer)
        return result

    def _steer(self, trainer) -> None:
        """Loop-steering decisions held while collectives returned local values, agreed on
        the commit just made (``runtime/steering.py``): a stop ends the loop after this step on
        every member; a save/best decision made locally anywhere makes every member take rank
        0's ``ModelCheckpoint``/``EarlyStopping`` bookkeeping (rank 0 wrote the files)."""
        steering = self.ctx.steering
        if steering.stops_now(self.ctx.step):
            trainer.should_stop = True
            for cb in trainer.early_stopping_callbacks:
                cb.stopped_epoch = trainer.current_epoch
        if not steering.adopt:
            return
        steering.adopt = False
        callbacks = [cb for cb in trainer.callbacks if isinstance(cb, (ModelCheckpoint, EarlyStopping))]
        if not callbacks or self.world_size <= 1:
            return
        got = self.broadcast({str(i): cb.state_dict() for i, cb in enumerate(callbacks)}, 0)
        if self._coll.stays_local:  # not agreed now: held again, for the next commit
            steering.decided_locally()
            return
        for i, cb in enumerate(callbacks):
            cb.load_state_dict(got[str(i)])

    def _run_step(self, ctx, optimizer, closure, model, kwargs: dict) -> Any:
        trainer = model.trainer
        batch_idx = trainer.fit_loop.epoch_loop.batch_idx
        self._coll.catch_up = False
        ran_closure, result = False, None
        t0 = ts = time.perf_counter()
        compute = data_wait = 0.0

        def attempt() -> bool:
            nonlocal ran_closure, result, compute, data_wait, ts
            step = ctx.step
            cursor = ctx.sampler.cursor  # the step within the epoch: what the loader's items are keyed by
            self._coll.local_reason = None if self._step_collectives_line_up() else _UNEVEN
            # Lightning's closure zeroes the gradients before its backward: only the step's first
            # micro-batch on this member runs through it (none computed before it, none kept).
            first = not ran_closure and not ctx.holds_gradients
            for mb in ctx.microbatches():
                self._mb = mb
                tc = time.perf_counter()
                wait = 0.0
                if first and self._batch_key == (cursor, mb.index):
                    result = closure()  # training_step on Lightning's batch, zero_grad, backward
                    ran_closure = True
                else:
                    td = time.perf_counter()
                    batch = self._prepare(self._loader.fetch(cursor, mb))
                    batch = Strategy.batch_to_device(self, batch)
                    wait = time.perf_counter() - td
                    self._extra_microbatch(trainer, batch, batch_idx, optimizer)
                # ``slow`` faults (--faults slow:...) pad the micro-batch by (factor - 1) x its
                # forward+backward time, as ElasticTrainer does.  Inside the loop body, so the
                # padding counts in the compute time that ``microbatches()`` measures and the
                # straggler detector sees.
                ctx.faults.at(step, "forward", time.perf_counter() - tc - wait)
                first = False
                data_wait += wait
                compute += time.perf_counter() - tc
            self._mb = None
            self._coll.local_reason = None
            self._handle.update = lambda: self._apply_update(optimizer, model, result, kwargs)
            ts = time.perf_counter()
            return ctx.sync_and_step()

        self._step_ended(ctx.run_step(attempt))
        self._close_step(closure, ran_closure)
        end = time.perf_counter()
        self.last_step = {"step_s": end - t0, "compute_s": compute - data_wait, "data_wait_s": data_wait,
                          "sync_s": end - ts}
        return result

    def _step_ended(self, end: StepEnd) -> None:
        """A step adopted from a peer that committed it (its state is ours): our collectives
        stay local until our next step."""
        if end is StepEnd.ADOPTED:
            self._coll.catch_up = True

    @property
    def redone_steps(self) -> int:
        return self.ctx.redone_steps if self.ctx is not None else 0

    @property
    def adopted_steps(self) -> int:
        return self.ctx.adopted_steps if self.ctx is not None else 0

    def _close_step(self, closure, ran_closure: bool) -> None:
        if not ran_closure and isinstance(closure, Closure):
            closure._result = ClosureResult(None)  # nothing of this step ran through Lightning's batch
        self._batch_key = None

    def _step_collectives_line_up(self) -> bool:
        """Whether collectives inside ``training_step`` (``self.log(..., sync_dist=True)`` on
        step, ``self.all_gather``) pair up across members in this pass: they run once per
        micro-batch, so only when every member runs as many micro-batches as the others -- an
        even allocation and no reconfiguration since the last commit (a redone step gives each
        member a different share).  Every member decides this from agreed state alone.
        Otherwise gloo would pair different collectives, and a size mismatch aborts the
        process."""
        ctx = self.ctx
        if ctx.reconfigured:
            return False
        counts = {len(mbs) for mbs in ctx.sampler.step_plan().values()}
        return len(counts) == 1

    def _extra_microbatch(self, trainer, batch: Any, batch_idx: int, optimizer) -> torch.Tensor:
        """One more micro-batch of this step: ``training_step`` and ``backward`` through
        Lightning's hooks (logging, on_before/after_backward), as its closure would."""
        trainer._logger_connector.on_batch_start(batch)
        kwargs = trainer.fit_loop.epoch_loop._build_kwargs(OrderedDict(), batch, batch_idx)
        out = call._call_strategy_hook(trainer, "training_step", *kwargs.values())
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if loss is None:
            raise RuntimeError("lightning_ft: training_step returned no loss; skipping a micro-batch "
                               "is not supported in fault-tolerant training")
        call._call_strategy_hook(trainer, "backward", loss, optimizer)
        return loss

    def _apply_update(self, optimizer, model, result, kwargs) -> None:
        # Gradients are reduced by now: hooks, clipping and the update see the global gradient.
        self.precision_plugin.optimizer_step(optimizer, model=model, closure=lambda: result, **kwargs)

    def _after_reconfiguration(self, initial: bool = False) -> None:
        was_zero = rank_zero_only.rank == 0
        self._publish_rank()
        self._coll.reset()
        trainer = self.lightning_module.trainer
        if not initial:
            # Evaluation loaders are re-sharded over the new members at their next run.
            for loop in (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop):
                loop._combined_loader = None
        if self.is_global_zero and not was_zero:
            cb = self._callback()
            if cb is not None:
                cb.take_over_logging(trainer)

    # ---------------------------------------------------------------- collectives
    def _gm(self):
        if self.ctx is not None and self.ctx.gm is not None:
            return self.ctx.gm
        return self._joined.gm if self._joined is not None else None

    def _op_timeout(self) -> float:
        return self.ctx.hang_timeout_s if self.ctx is not None else float(
            self.ft_config.hang_timeout_s or self.env.hang_timeout_s)

    def _collective(self, run: Callable[[], Any], local: Callable[[], Any]) -> Any:
        """Run a collective that Lightning or the user calls.  Inside a training step (or an
        evaluation, which reruns itself) the runtime's rules hold.  Anywhere else (epoch-end
        hooks and metric syncs, checkpoint barriers, ``on_train_batch_end``), a failure
        recovers the job at once (``_recover_off_step``) and the collective returns this
        worker's local value."""
        if self.ctx is None or self._in_step or self._coll.reraise:
            return run()
        self._coll.reraise = True
        try:
            return run()
        except CollectiveFailure as failure:
            self._recover_off_step(failure)
            return local()
        finally:
            self._coll.reraise = False

    def _recover_off_step(self, failure: CollectiveFailure) -> None:
        """A worker was lost while this member was between training steps: agree on the
        survivors, form their group and agree on the state now (``DataParallelExecutor.recover``), so
        that the new rank 0 writes what the lost one would have (a checkpoint, the epoch's
        logs).  The members may have met the failure in different collectives of this window,
        so until its next training step this member's collectives return its local value
        (``catch_up``); the step's all-reduce is the first that pairs up again."""
        ctx = self.ctx
        ctx.recover_off_step(failure, 0)
        self._coll.catch_up = True
        self._coll.local_reason = _OFF_STEP
        if self.is_global_zero:
            log.warning("lightning_ft: a worker was lost outside a training step; the %d survivors "
                        "recovered at once", ctx.view.world_size)

    @override
    def reduce(self, tensor, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean"):
        if not isinstance(tensor, torch.Tensor):
            return tensor
        return self._collective(lambda: self._coll.allreduce(tensor, reduce_op or "mean"), lambda: tensor)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Lightning's decisions that steer the loop, the same on every member: reduced now
        over live collectives; while they return local values an ``EarlyStopping`` stop is
        deferred to the next commit, and other decisions (``ModelCheckpoint``'s) keep their local
        value until rank 0's bookkeeping is adopted after that commit (``_steer``)."""
        if self.ctx is None or self._gm() is None or self.world_size <= 1:
            return bool(decision)
        stop = isinstance(sys._getframe(1).f_locals.get("self"), EarlyStopping)  # its caller
        return self._coll.decide(decision, any_=not all, stop=stop,
                                 reduce=lambda t: self.reduce(t, reduce_op="sum"))

    @override
    def all_gather(self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False):
        return torch.stack(self._collective(lambda: self._coll.all_gather(tensor), lambda: [tensor]))

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self._gm() is None or self.world_size <= 1:
            return obj
        is_path = isinstance(obj, PurePath)
        out = self._collective(lambda: self._coll.broadcast({"path": str(obj)} if is_path else obj, src),
                               lambda: {"path": str(obj)} if is_path else obj)
        return type(obj)(out["path"]) if is_path else out

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        self._collective(self._coll.barrier, lambda: None)

    def _metric_sync_available(self) -> bool:
        return self._gm() is not None and self.world_size > 1

    def _metric_gather(self, tensor: torch.Tensor, group: Optional[Any] = None) -> list:
        return self._collective(lambda: self._coll.all_gather(tensor, what="metric sync"), lambda: [tensor])

    # ---------------------------------------------------------------- teardown
    @override
    def on_train_end(self) -> None:
        """The fit loop ended (after the callbacks' and the module's ``on_train_end``): no member
        goes on before every member has committed the last step -- one whose last commit failed
        after its peers' succeeded adopts it from them (``RecoveryCore.depart``)."""
        super().on_train_end()
        if self.ctx is not None:
            self.ctx.end_training()

    @override
    def teardown(self) -> None:
        # The membership and group stay for later stages (validate/test after fit); they end
        # with the process.
        super().teardown()

    def close(self) -> None:
        if self.ctx is not None:
            self.ctx.close(redone_steps=self.ctx.redone_steps, adopted_steps=self.ctx.adopted_steps)
        elif self._joined is not None:
            self._joined.membership.close()
            self._joined.gm.close()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register("ddp_ft", cls, description="fault-tolerant DDP (chameleon-ft)",
                                   override=True)
