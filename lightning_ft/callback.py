"""``FaultToleranceCallback``: the one line a Lightning user adds to survive worker failures.

    trainer = Trainer(accelerator="cpu", devices=4, strategy="ddp",
                      callbacks=[FaultToleranceCallback()])
    # run with:  chameleon-ft run --nproc-per-node 4 train.py

**Why the callback installs the strategy when it is constructed.**  Every callback hook runs
after ``Strategy.setup_environment``, and ``DDPStrategy.setup_environment`` creates the default
process group -- a fixed world that cannot survive a death, and that under
``chameleon-ft run`` (no ``MASTER_PORT``) would wait for its peers for 30 minutes.  The only
moment before the Trainer resolves ``strategy="ddp"`` is the construction of the callback
itself (Python builds ``callbacks=[...]`` before calling ``Trainer``), so the constructor
points Lightning's ``StrategyRegistry`` entry ``"ddp"`` at ``FaultTolerantDDPStrategy``.
``strategy="ddp_ft"`` is the same strategy by name, for code that builds the Trainer first.
A ``DDPStrategy`` given as an object (``strategy=DDPStrategy(bucket_cap_mb=4)``: built before the
callback) is turned into ``FaultTolerantDDPStrategy`` in place when its launcher is configured
or its set-up starts, before any process group, keeping its settings (as a
``ModelParallelStrategy`` object becomes ``FaultTolerantModelParallelStrategy``); a subclass of
either is refused there with a clear error (its own code would run on the wrong class).
``setup`` checks that the trainer really runs the fault-tolerant strategy and stops with a
clear error otherwise.

Hooks: ``setup`` (checks), ``on_train_batch_end`` (one console line per recovery, the
fault-tolerance metrics to the loggers at Lightning's step),
``on_save_checkpoint`` (the engine counts steps since the last checkpoint),
``state_dict``/``load_state_dict`` (sampler cursor, engine state, global batch: a checkpoint
resumes on the same or another number of workers), ``on_exception`` (exit codes that
``chameleon-ft run`` understands).
"""

from __future__ import annotations

import csv
import logging
import os
import time
from dataclasses import replace
from typing import Iterable, Optional

from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.strategies import (DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy,
                                          StrategyRegistry)

from chameleon_ft.runtime.adapter_kit import adapter_config, ft_metrics, recovery_line
from chameleon_ft.runtime.env import RESTART_EXIT_CODE
from chameleon_ft.runtime.errors import ConfigError, exit_code_for, exit_worker
from chameleon_ft.runtime.relaunch import launched
from lightning_ft.launch import relaunch_lightning
from chameleon_ft.runtime.recovery import ElasticConfig
from lightning_ft.hooks import StrategyHooks
from lightning_ft.sharded import FaultTolerantModelParallelStrategy
from lightning_ft.strategy import _NOT_LAUNCHED, FaultTolerantDDPStrategy, LauncherError
from typing_extensions import override

__all__ = ["FaultToleranceCallback"]

log = logging.getLogger(__name__)

_STATE_VERSION = 1


_UNADOPTED = ("FaultToleranceCallback could not carry this {}: the callback turns a {base} "
              "object into {ours} when its set-up starts, and does not turn "
              "subclasses (their own code would run on the wrong class); pass "
              "strategy=lightning_ft.{ours}(...) instead")


def install_as_ddp() -> None:
    """Make ``strategy="ddp"`` (and ``"ddp_ft"``) build ``FaultTolerantDDPStrategy``, and a
    ``DDPStrategy`` or ``ModelParallelStrategy`` object of a Trainer with this callback become
    ``FaultTolerantDDPStrategy`` / ``FaultTolerantModelParallelStrategy`` before it forms a
    process group."""
    for name in ("ddp", "ddp_ft"):
        StrategyRegistry.register(name, FaultTolerantDDPStrategy, override=True,
                                  description="fault-tolerant DDP (chameleon-ft)")
    for base, ours in ((ModelParallelStrategy, FaultTolerantModelParallelStrategy),
                       (DDPStrategy, FaultTolerantDDPStrategy)):
        _adopt_objects(base, ours)


def _adopt_objects(base, ours) -> None:
    """Patch ``base``'s launcher configuration and set-up (once) so that an object of exactly
    ``base`` in a Trainer with this callback is carried by ``ours`` (``ours.adopt``); ``ours``
    overrides both, so its own objects never come here."""
    if not getattr(base._configure_launcher, "_cft", False):
        configure_launcher = base._configure_launcher

        def _configure_launcher(strategy) -> None:
            # A FaultToleranceCallback exists (it called this): started Lightning's way, the
            # job goes to our launcher instead (lightning_ft/launch.py).
            if not launched():
                relaunch_lightning(strategy.cluster_environment, len(strategy.parallel_devices or [None]),
                                   strategy.num_nodes)
            elif type(strategy) is DDPStrategy:  # its workers are ours: no launcher of Lightning's
                strategy._launcher = None  # (as FaultTolerantDDPStrategy under chameleon-ft run)
                return
            configure_launcher(strategy)

        _configure_launcher._cft = True
        base._configure_launcher = _configure_launcher
    if not getattr(base.setup_environment, "_cft", False):
        original = base.setup_environment

        def setup_environment(strategy) -> None:
            # The strategy object was built before the callback (``strategy=`` comes first in
            # the Trainer's arguments); the first hook that sees the trainer's callbacks and
            # runs before any process group is this one.
            trainer = strategy.lightning_module.trainer if strategy.lightning_module is not None else None
            if trainer is not None and any(isinstance(cb, FaultToleranceCallback) for cb in trainer.callbacks):
                if type(strategy) is not base:
                    raise ConfigError(_UNADOPTED.format(type(strategy).__name__, base=base.__name__,
                                                        ours=ours.__name__))
                if strategy._launcher is not None:
                    raise LauncherError(_NOT_LAUNCHED)
                ours.adopt(strategy).setup_environment()
                return
            original(strategy)

        setup_environment._cft = True
        base.setup_environment = setup_environment


_PER_BATCH_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
                    "on_before_zero_grad", "on_train_batch_end", "on_validation_batch_start",
                    "on_validation_batch_end", "on_test_batch_start", "on_test_batch_end", "on_predict_batch_start",
                    "on_predict_batch_end")


class FaultToleranceCallback(Callback, StrategyHooks):
    """Keep training in place when a data-parallel worker dies, hangs or slows down.

    Args:
        allowed_policies: what the engine may choose on a failure, among
            ``reroute, replan, wait, restart, keep, rebalance, heal, grow`` (default: all).
            ``restart`` ends the run with exit code 75 for a checkpoint-restart.
        hang_timeout_s: watchdog on every collective: a worker silent for longer is treated as
            hung (default: ``chameleon-ft run --hang-timeout``, 10 s).
        allow_batch_change: let the engine shrink the global batch.  The runtime keeps the
            global batch fixed today (shrink is not offered), so this only warns.
        event_log: path of the JSONL event log (default: ``events.jsonl`` in the run dir of
            ``chameleon-ft run``); ``chameleon-ft report`` reads it.
        stragglers: rebalance micro-batches away from a persistently slow worker.
        log_every_n_steps: how often the fault-tolerance metrics go to the loggers (default:
            the Trainer's ``log_every_n_steps``); every recovery is logged at once.
        snapshot_every: sharded training (``ModelParallelStrategy``): steps between the buddy
            snapshots of each shard (default: Young/Daly's optimum; 0: none).
        rehab_recipe: sharded training: how a shard restored from its stale snapshot is
            repaired (``chameleon_ft.engine.rehab.RehabRecipe``).
    """

    def __init__(self, allowed_policies: Optional[Iterable[str]] = None,
                 hang_timeout_s: Optional[float] = None, allow_batch_change: bool = False,
                 event_log: Optional[str] = None, stragglers: bool = True,
                 log_every_n_steps: Optional[int] = None, snapshot_every: Optional[int] = None,
                 rehab_recipe=None) -> None:
        self._config = adapter_config("lightning_ft", allowed_policies, hang_timeout_s,
                                      allow_batch_change, stragglers=stragglers)
        self.allowed_policies = allowed_policies
        self.hang_timeout_s = hang_timeout_s
        self.allow_batch_change = allow_batch_change
        self.event_log = event_log
        self.stragglers = stragglers
        self.log_every_n_steps = log_every_n_steps
        self.snapshot_every = snapshot_every
        self.rehab_recipe = rehab_recipe
        self.resume_state: Optional[dict] = None
        self._strategy: Optional[FaultTolerantDDPStrategy] = None
        self._seen_recoveries = 0
        # Lightning calls every callback's every hook, each inside its profiler's context (about
        # fifteen Python calls); it skips an attribute that is not callable
        # (``trainer.call._call_callback_hooks``).  The per-batch hooks this class -- or a
        # subclass -- leaves empty are set to None here: five a training step.
        for name in _PER_BATCH_HOOKS:
            if getattr(type(self), name) is getattr(Callback, name):
                setattr(self, name, None)
        install_as_ddp()

    def elastic_config(self) -> ElasticConfig:
        return replace(self._config)

    # ---------------------------------------------------------------- hooks
    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        """Check that the trainer runs the fault-tolerant strategy and settings it supports."""
        if isinstance(trainer.strategy, FSDPStrategy):
            raise ConfigError(
                "FaultToleranceCallback does not carry FSDPStrategy (FSDP1; Lightning refuses it on CPU): "
                "use ModelParallelStrategy(data_parallel_size=<workers>, tensor_parallel_size=1) with "
                "fully_shard(...) in configure_model (FSDP2), which the callback carries")
        if isinstance(trainer.strategy, ModelParallelStrategy):
            raise ConfigError(_UNADOPTED.format(type(trainer.strategy).__name__, base="ModelParallelStrategy",
                                                ours="FaultTolerantModelParallelStrategy"))
        if not isinstance(trainer.strategy, FaultTolerantDDPStrategy):
            one = ""
            if isinstance(trainer.strategy, SingleDeviceStrategy) and int(os.environ.get("WORLD_SIZE", "1")) > 1:
                # Seen with Lightning's own transformer example: devices="auto" counts one CPU device.
                one = (f"; Lightning chose one device, but {os.environ['WORLD_SIZE']} workers were "
                       "started: pass devices=<workers per node> (devices='auto' counts 1 on a CPU), "
                       "as under torchrun")
            raise LauncherError(
                f"FaultToleranceCallback needs strategy='ddp' or 'ddp_ft' (or a DDPStrategy object) (got "
                f"{type(trainer.strategy).__name__}); build the callback before the Trainer, e.g. "
                f"Trainer(strategy='ddp', callbacks=[FaultToleranceCallback()]){one}")
        self._strategy = trainer.strategy
        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
            raise ConfigError("FaultToleranceCallback: GradientAccumulationScheduler changes the global "
                             "batch mid-run; use a fixed accumulate_grad_batches")
        if stage == "fit" and trainer.limit_train_batches not in (1.0, None):
            raise ConfigError("FaultToleranceCallback: limit_train_batches must be 1.0 (an epoch is "
                             "every sample exactly once)")

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """After each global step: one console line per recovery (live rank 0), and the
        fault-tolerance metrics to the loggers every ``log_every_n_steps`` steps and at once
        after a recovery.  They are logged at Lightning's step for this batch (the one its own
        ``self.log`` metrics of the batch get), so they share rows with them."""
        s = self._strategy
        if s is None or s.ctx is None:
            return
        ctx = s.ctx
        # Every member counts the recoveries, so that a member that becomes rank 0 later does
        # not report an earlier one again; ``ctx.recoveries`` grows at a recovery's first
        # committed step.
        recovered = ctx.recoveries != self._seen_recoveries
        self._seen_recoveries = ctx.recoveries
        if not trainer.is_global_zero:
            return
        if recovered:
            log.warning("%s", recovery_line(ctx, "lightning_ft"))
        every = self.log_every_n_steps or trainer.log_every_n_steps or 50
        if not trainer.loggers or (not recovered and trainer.global_step % every):
            return
        m = ft_metrics(ctx, s.last_step, recovered)
        m.update({"ft/eval_reruns": float(s.eval_reruns), "ft/eval_partial": float(s.eval_partial)})
        trainer._logger_connector.log_metrics(m)

    @override
    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if self._strategy is not None and self._strategy.ctx is not None:
            self._strategy.ctx.last_checkpoint_step = self._strategy.ctx.step

    @override
    def state_dict(self) -> dict:
        ctx = self._strategy.ctx if self._strategy is not None else None
        if ctx is None:
            return dict(self.resume_state or {})
        return {"version": _STATE_VERSION, "global_batch": ctx.sampler.global_batch,
                "micro_batch": ctx.sampler.micro_batch, "step": ctx.step,
                "sampler": ctx.sampler.state_dict(), "engine": ctx.policy.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict and state_dict.get("version") != _STATE_VERSION:
            raise ConfigError(f"FaultToleranceCallback: checkpoint state version "
                             f"{state_dict.get('version')!r} is not {_STATE_VERSION}")
        self.resume_state = dict(state_dict) or None

    @override
    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """End the worker with the code ``chameleon-ft run`` acts on (75: checkpoint-restart,
        3: coordinator lost, 78: configuration error; ``chameleon_ft.runtime.errors``)."""
        code = exit_code_for(exception)
        if code is None:
            return
        for logger in trainer.loggers:
            try:
                logger.finalize("failed")
            except Exception:  # exiting anyway
                pass
        exit_worker(exception, code, "resume with trainer.fit(model, ckpt_path=...) from the last checkpoint"
                    if code == RESTART_EXIT_CODE else "")

    # ---------------------------------------------------------------- logging take-over
    def take_over_logging(self, trainer) -> None:
        """This worker became rank 0 after a failure: continue the loggers' files.  A
        CSVLogger would delete its ``metrics.csv`` on first use; keep the rows the previous
        rank 0 wrote and append to them.  A ``TensorBoardLogger`` starts a new event file in the
        same directory (TensorBoard reads all of them), named with this worker's id and a
        nanosecond clock (``before_stage``), so that it cannot overwrite the previous rank 0's
        file, nor its own of an earlier stage (event file names carry whole seconds only)."""
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger) and logger._experiment is None:
                logger._cft_took_over = True
                _unique_event_file(logger)
            if isinstance(logger, CSVLogger) and logger._experiment is None:
                path = os.path.join(logger.log_dir, "metrics.csv")
                kept = None
                if os.path.isfile(path):
                    kept = path + ".takeover"
                    os.replace(path, kept)
                writer = logger.experiment
                if kept is not None:
                    os.replace(kept, path)
                    with open(path, newline="") as f:
                        header = next(csv.reader(f), [])
                    writer.metrics_keys = list(header)

    def before_stage(self, trainer) -> None:
        """The strategy calls this before the loggers of a stage (fit, validate, test) start:
        a TensorBoardLogger taken over earlier gets a new writer with a fresh event file name
        (its writer, closed at the end of the previous stage, would reopen its file under a
        name of whole seconds -- the same name within a second -- and truncate it)."""
        for logger in trainer.loggers:
            if getattr(logger, "_cft_took_over", False):
                if logger._experiment is not None:
                    logger._experiment.close()
                    logger._experiment = None
                _unique_event_file(logger)


def _unique_event_file(logger: TensorBoardLogger) -> None:
    wid = os.environ.get("CHAMELEON_FT_WORKER_ID", "x")
    logger._kwargs["filename_suffix"] = f".worker{wid}.{time.time_ns()}"
