"""``FaultTolerantAccelerator``: ``accelerate.Accelerator`` whose data-parallel workers keep
training in place when one of them dies, hangs or slows down; ``wrap(accelerator)`` turns an
existing one into it.  Start the script with ``chameleon-ft run --nproc-per-node N train.py``.

What changes against ``Accelerator`` (and why) -- the contract is in docs/accelerate.md:

* **No default process group, no DDP wrapper.**  Accelerate is set up as a single process on
  CPU (``_env.py`` hides torchrun's variables); the runtime joins the job's membership and
  reduces the gradients once per global step over a gloo group that is re-formed after a failure.
* **The training loader yields micro-batches** of the runtime's exactly-once sampler; the user's
  ``optimizer.step()`` after the member's last micro-batch commits the global step, and only a
  committed step updates the weights and steps the LR schedulers (``step_protocol.py``).
* **Evaluation loaders are re-split over the current members** at each pass; ``gather``,
  ``gather_for_metrics``, ``reduce``, ``wait_for_everyone`` run over the live group, and
  ``num_processes``/``process_index``/``is_main_process`` are the live membership's.
* ``save_state``/``load_state`` write and read Accelerate's folder (rank 0 writes) plus the
  runtime's sampler cursor and engine state, so a checkpoint resumes on any number of workers.

Under ``accelerate launch``/torchrun (no ``chameleon-ft run`` environment) it is a plain
``Accelerator`` and says so once: a failure there restarts every worker (checkpoint-restart).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import warnings
from typing import Any, Iterable, Optional

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DistributedType

from chameleon_ft.runtime.errors import ConfigError, LauncherError
from chameleon_ft.runtime.groups import CollectiveFailure
from accelerate_ft._env import launch_env, other_launcher
from accelerate_ft.data import ElasticEvalLoader, ElasticTrainLoader, SkipFirst
from accelerate_ft.results import drop_rows, map_tensors, tensors_only, trim_rows
from accelerate_ft.setups import fsdp_env_hidden, fsdp_setup, place_on_device, refuse_sharding
from accelerate_ft.sharded import ShardedModel, gathered
from accelerate_ft.step_protocol import StepProtocol
from chameleon_ft.runtime.adapter_kit import adapter_config
from chameleon_ft.runtime.recovery import ElasticConfig
from chameleon_ft.runtime.relaunch import relaunch_local_rank_zero
from typing_extensions import override

__all__ = ["FaultTolerantAccelerator", "wrap", "LauncherError", "NOT_LAUNCHED"]

NOT_LAUNCHED = (
    "accelerate_ft: this process was not started by `chameleon-ft run`, so it trains as a plain "
    "Accelerator without in-place recovery.  Under `accelerate launch` (torchrun) a worker failure "
    "restarts every worker: call accelerator.save_state() every few steps, accelerator.load_state() "
    "at start when a checkpoint exists, and launch with `accelerate launch --max_restarts N` "
    "(checkpoint-restart).  For survivors that keep training in place run "
    "`chameleon-ft run --nproc-per-node N train.py`.")


def relaunch_torchrun(env=None, extra: tuple = ()) -> None:
    """Under ``accelerate launch`` (torchrun: one process per worker, its agent restarts them
    all when one dies), hand the job to ``chameleon-ft run``: the node's local rank 0 becomes
    its launcher for every local worker, the others leave (``runtime/relaunch.py``; ``extra``:
    more launcher flags).  Returns only when relaunching is turned off
    (``CHAMELEON_FT_NO_RELAUNCH=1``)."""
    env = os.environ if env is None else env
    try:
        world, local = int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"])
        local_rank, node = int(env["LOCAL_RANK"]), int(env.get("GROUP_RANK", "0"))
    except (KeyError, ValueError):
        return
    relaunch_local_rank_zero(local_rank, local, max(1, world // max(1, local)), node,
                             env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500")),
                             extra, why="started by accelerate launch (torchrun)")


def not_launched_message(env=None) -> str:
    """``NOT_LAUNCHED``, ending with the exact command that would recover this job: under
    ``accelerate launch`` (torchrun's variables set) its own flags, with ``chameleon-ft run``
    in place of ``accelerate launch``."""
    env = os.environ if env is None else env
    world, local = env.get("WORLD_SIZE"), env.get("LOCAL_WORLD_SIZE")
    if not world or not local:
        return NOT_LAUNCHED
    machines = max(1, int(world) // max(1, int(local)))
    cmd = ["chameleon-ft run", f"--num_processes {world}"]
    if machines > 1:
        cmd += [f"--num_machines {machines}", f"--machine_rank {env.get('GROUP_RANK', '0')}",
                f"--main_process_ip {env.get('MASTER_ADDR', '<node 0>')}", f"--main_process_port {env.get('MASTER_PORT', '29500')}"]
    script = " ".join([os.path.basename(sys.argv[0] or "train.py"), *sys.argv[1:]])
    return (f"{NOT_LAUNCHED}  This job, recoverable: {' '.join(cmd)} {script} "
            "(the same flags as `accelerate launch`, the command name swapped)")


def _config(allowed_policies, hang_timeout_s, stragglers, allow_batch_change=False) -> ElasticConfig:
    return adapter_config("accelerate_ft", allowed_policies, hang_timeout_s, allow_batch_change,
                          stragglers=stragglers)


class _FTOptimizer(AcceleratedOptimizer):
    """The prepared optimizer: ``step()`` commits the global step after the member's last
    micro-batch (a no-op otherwise); the runtime zeroes the gradients after each commit."""

    _ft_rt: StepProtocol

    @override
    def state_dict(self):
        """Sharded (FSDP2): the whole state in torch's format, as gathered for the checkpoint
        being written (``save_state`` gathers it on every member first)."""
        rt = self._ft_rt
        if rt.sharded_ctx is not None:
            return gathered(rt, rt.sharded_ctx.whole_state, 0)[1]
        return super().state_dict()

    @override
    def load_state_dict(self, state_dict):
        ctx = self._ft_rt.sharded_ctx
        if ctx is not None:  # load_state loaded the model object first: both into the rows
            ctx.load_whole(state_dict)
            return
        super().load_state_dict(state_dict)

    @override
    def step(self, closure=None):
        if closure is not None:
            raise ConfigError("accelerate_ft: optimizer closures (LBFGS) are not supported")
        self._ft_rt.optimizer_step()

    @override
    def zero_grad(self, set_to_none=None):
        if self._ft_rt.ctx is None:
            super().zero_grad(set_to_none=set_to_none)
        # Otherwise a no-op: the gradients a member holds when a failure interrupts a step are
        # kept for the redone step, and the runtime zeroes them after every commit.

    @property
    @override
    def step_was_skipped(self) -> bool:
        return False


class _FTScheduler(AcceleratedScheduler):
    """The prepared scheduler: stepped by the runtime once per committed step when it steps
    with the optimizer (the default), so the user's ``scheduler.step()`` is a no-op."""

    @override
    def step(self, *args, **kwargs):
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)


class FaultTolerantAccelerator(Accelerator):
    """Drop-in ``Accelerator`` whose workers survive failures in place (see module doc).

    Args (besides Accelerator's own):
        allowed_policies: what the engine may choose on a failure, among
            ``reroute, replan, wait, restart, keep, rebalance, heal, grow`` (default: all).
        hang_timeout_s: watchdog on every collective (default: ``chameleon-ft run --hang-timeout``).
        stragglers: rebalance micro-batches away from a persistently slow worker.
        event_log: JSONL event log (default: ``events.jsonl`` in the launcher's run dir).
        require_launcher: raise ``LauncherError`` instead of running as a plain Accelerator
            when the process was not started by ``chameleon-ft run``.
    """

    #: Set by a wrapper that builds loaders (the ``Trainer``): whether the next one prepared
    #: is the training loader; None: the first one is.
    next_loader_trains: Optional[bool] = None

    def __init__(self, *args: Any, allowed_policies: Optional[Iterable[str]] = None,
                 hang_timeout_s: Optional[float] = None, stragglers: bool = True,
                 allow_batch_change: bool = False, event_log: Optional[str] = None,
                 require_launcher: bool = False, **kwargs: Any) -> None:
        cfg = _config(allowed_policies, hang_timeout_s, stragglers, allow_batch_change)
        self._ft: Optional[StepProtocol] = None
        self._ft_trigger_taken: Optional[int] = None  # the agreed trigger check_trigger answered
        env = launch_env()
        if env is None:
            if other_launcher():  # accelerate launch / torchrun: its local rank 0 becomes our launcher
                relaunch_torchrun()
            if require_launcher:
                raise LauncherError(not_launched_message())
            if other_launcher():
                warnings.warn(not_launched_message(), stacklevel=2)
            super().__init__(*args, **kwargs)
            return
        place_on_device(bool(args[4]) if len(args) > 4 else bool(kwargs.get("cpu", False)), env,
                         args[2] if len(args) > 2 else kwargs.get("mixed_precision"))
        refuse_sharding(kwargs)
        sharding = fsdp_setup(kwargs)  # FSDP2: the runtime shards, Accelerate sees one process
        with fsdp_env_hidden():
            super().__init__(*args, **kwargs)
        self._ft = StepProtocol(self, env, cfg, event_log)
        self._ft.sharding = sharding

    # ---------------------------------------------------------------- introspection
    @property
    def ft_context(self):
        """The worker's ``DataParallelExecutor`` (None before the training loader is first iterated)."""
        return self._ft.ctx if self._ft is not None else None

    @property
    def ft_metrics(self) -> dict:
        """The ``ft/*`` metrics of the last committed step (what the trackers receive)."""
        return self._ft.metrics() if self._ft is not None else {}

    @property
    @override
    def is_local_main_process(self) -> bool:
        return self._ft.is_local_main() if self._ft is not None else super().is_local_main_process

    @override
    def print(self, *args, **kwargs):
        if self.is_local_main_process:
            print(*args, **kwargs)

    # ---------------------------------------------------------------- prepare
    @override
    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None,
                            training: Optional[bool] = None):
        """``training``: whether this is the training loader (default: ``next_loader_trains``
        when a wrapper set it, else the first DataLoader prepared is, the others are evaluation
        loaders)."""
        if self._ft is None or not isinstance(data_loader, torch.utils.data.DataLoader):
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        placement = self.device_placement if device_placement is None else device_placement
        rt = self._ft
        if training is None:
            training = self.next_loader_trains
        if training is None:
            training = not getattr(rt, "_train_prepared", False)
        if training:
            if getattr(rt, "_train_prepared", False):
                raise ConfigError("accelerate_ft: one training DataLoader per Accelerator; prepare the "
                                 "others with prepare_data_loader(dl, training=False)")
            rt._train_prepared = True
            return ElasticTrainLoader(rt, data_loader, placement)
        return ElasticEvalLoader(rt, data_loader, placement)

    @override
    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        """Sharded (an FSDP2 plugin): returns a ``ShardedModel`` over ``model`` (accelerate_ft/sharded.py)."""
        if self._ft is not None and self._ft.sharding is not None and not evaluation_mode:
            if isinstance(model, ShardedModel):
                return model
            model = ShardedModel(self._ft, super().prepare_model(model, device_placement=device_placement))
            self._ft.add_model(model)
            return model
        model = super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if self._ft is not None and not evaluation_mode:
            self._ft.add_model(model)
        return model

    @override
    def prepare_optimizer(self, optimizer, device_placement=None):
        opt = super().prepare_optimizer(optimizer, device_placement=device_placement)
        if self._ft is not None and not isinstance(opt, _FTOptimizer):
            if self._ft.optimizer is not None:
                raise ConfigError("accelerate_ft supports one optimizer per Accelerator")
            opt.__class__ = _FTOptimizer
            opt._ft_rt = self._ft
            self._ft.optimizer = opt
        return opt

    @override
    def prepare_scheduler(self, scheduler):
        sched = super().prepare_scheduler(scheduler)
        if self._ft is not None and not isinstance(sched, _FTScheduler):
            sched.__class__ = _FTScheduler
            self._ft.schedulers.append(sched)
        return sched

    @override
    def skip_first_batches(self, dataloader, num_batches: int = 0):
        """The training loader without its first ``num_batches`` items: after ``load_state``
        those are the checkpoint's steps of the epoch, handed out again without training."""
        if self._ft is not None and isinstance(dataloader, ElasticTrainLoader):
            return SkipFirst(dataloader, num_batches) if num_batches else dataloader
        if self._ft is not None and isinstance(dataloader, ElasticEvalLoader):
            return dataloader
        return super().skip_first_batches(dataloader, num_batches)

    # ---------------------------------------------------------------- the step
    @override
    def backward(self, loss, num_items=None, **kwargs):
        """``Accelerator.backward``; ``num_items``: the number of items (tokens) ``loss`` is the
        mean over.  Given for every micro-batch, the update is the global batch's token mean,
        whoever computes which micro-batch (docs/accelerate.md, "Token-weighted losses");
        without the runtime it is ignored (the plain loss is back-propagated)."""
        if self._ft is None:
            return super().backward(loss, **kwargs)
        self._ft.backward(loss, num_items=num_items, **kwargs)

    @override
    def _do_sync(self):
        if self._ft is None:
            return super()._do_sync()
        # The training loader sets sync_gradients: True on the member's last item of a step.

    @contextlib.contextmanager
    @override
    def accumulate(self, *models):
        if self._ft is None:
            with super().accumulate(*models):
                yield
            return
        yield  # the step boundaries come from the training loader; there is no DDP to silence

    @contextlib.contextmanager
    @override
    def no_sync(self, model):
        if self._ft is None:
            with super().no_sync(model):
                yield
            return
        yield

    @override
    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """Inside a training step the clipping is applied to the *reduced* gradients just before
        the update; the returned tensor is filled with the total norm when the step commits.
        Sharded: the 2-norm of every trained parameter (``parameters`` is not read)."""
        if self._ft is None or not self._ft.in_step:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        if self._ft.sharding is not None:
            if float(norm_type) != 2.0:
                raise ConfigError(f"accelerate_ft: sharded training clips by the 2-norm only (got norm_type={norm_type})")
            out = torch.zeros(())
            self._ft.defer(lambda: self._ft.ctx.clip_grad_norm(max_norm), out)
            return out
        params = list(parameters)
        out = torch.zeros((), device=params[0].device if params else None)
        self._ft.defer(lambda: torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type), out)
        return out

    # ---------------------------------------------------------------- the sharded model, whole
    @override
    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile=None):
        """Sharded: the user's model object holding the committed weights (a gather outside a
        step: every process calls it, as ``get_state_dict``)."""
        if isinstance(model, ShardedModel):
            rt = self._ft
            if rt.sharded_ctx is not None and not rt.in_step:
                gathered(rt, rt.sharded_ctx.refresh_model, 0)
            return model._original
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    @override
    def get_state_dict(self, model, unwrap: bool = True):
        """Sharded: the whole ``state_dict`` of the user's model (a gather: every process calls it)."""
        if self._ft is not None and self._ft.sharding is not None:
            if isinstance(model, ShardedModel) or model is getattr(self._ft.model, "_original", None):
                rt = self._ft
                if rt.sharded_ctx is not None:
                    gathered(rt, rt.sharded_ctx.refresh_model, 0)
                return getattr(model, "_original", model).state_dict()
        return super().get_state_dict(model, unwrap)

    @override
    def clip_grad_value_(self, parameters, clip_value):
        if self._ft is None or not self._ft.in_step:
            return super().clip_grad_value_(parameters, clip_value)
        params = list(parameters)
        self._ft.defer(lambda: torch.nn.utils.clip_grad_value_(params, clip_value))

    @override
    def unscale_gradients(self, optimizer=None):
        if self._ft is None:
            return super().unscale_gradients(optimizer)

    # ---------------------------------------------------------------- collectives
    def _gather_one(self, t: torch.Tensor) -> torch.Tensor:
        parts = self._ft.coll.all_gather(t.unsqueeze(0) if t.ndim == 0 else t, what="gather")
        return torch.cat(parts, dim=0)

    @override
    def gather(self, tensor):
        """Every current member's tensor(s), concatenated in rank order (shapes may differ in
        the first dimension)."""
        if self._ft is None:
            return super().gather(tensor)
        return self._in_eval(lambda: map_tensors(self._gather_one, tensor), lambda: tensor)

    def _in_eval(self, fn, local):
        """Run a collective; one that fails inside an evaluation recovers the job at once and
        returns this member's local value, and the evaluation is flagged incomplete
        (``ft/eval_complete`` = 0) -- its result mixes values from before and after."""
        try:
            return fn()
        except CollectiveFailure as failure:  # only raised inside an evaluation (coll.reraise)
            self._ft.eval_failed(failure)
            self._ft.eval_complete = False
            return local()

    @override
    def gather_for_metrics(self, input_data, use_gather_object=False):
        """Like ``gather``, over the current members; inside an evaluation loader every sample
        comes back exactly once, in dataset order (the ghost a member may get is dropped).  When
        a member dies during the evaluation, this call recovers the job and returns no rows
        (zero-length tensors / an empty list); the loader then goes on over the survivors from
        the first sample not all of them have, so the rows returned over the whole evaluation
        still cover every sample once."""
        if self._ft is None:
            return super().gather_for_metrics(input_data, use_gather_object)
        rt = self._ft
        n_valid = rt.eval_valid
        if n_valid is not None:
            input_data = trim_rows(input_data, n_valid)
        objects = use_gather_object or not tensors_only(input_data)
        try:
            if objects:
                items = input_data if isinstance(input_data, list) else [input_data]
                out = [x for part in rt.coll.gather_objects(items) for x in part]
            else:
                out = map_tensors(self._gather_one, input_data)
        except CollectiveFailure as failure:  # only raised inside an evaluation (coll.reraise)
            rt.eval_failed(failure)
            return [] if objects else trim_rows(input_data, 0)
        if rt.in_eval:
            out = rt.eval_received(out, drop_rows)
        return out

    @override
    def reduce(self, tensor, reduction="sum", scale=1.0):
        if self._ft is None:
            return super().reduce(tensor, reduction, scale)
        if reduction == "none":
            return tensor
        return self._in_eval(lambda: map_tensors(lambda t: self._ft.coll.allreduce(t, reduction) * scale if scale != 1.0
                                          else self._ft.coll.allreduce(t, reduction), tensor),
                             lambda: tensor)

    @override
    def check_trigger(self):
        """Whether any member called ``set_trigger()`` (the trigger is then reset), the same
        on every member: while collectives return local values (after a failure outside a
        step) the check is deferred -- False now, this member's trigger rides the next step's
        commit, and the first check after that commit is True everywhere when any member's was
        set (``runtime/steering.py``)."""
        rt = self._ft
        ctx = rt.ctx if rt is not None else None
        if ctx is None:
            return super().check_trigger()
        steering = ctx.steering
        if steering.stop_at is not None and steering.stop_at != self._ft_trigger_taken:
            self._ft_trigger_taken = steering.stop_at  # an agreed trigger, answered once
            self.flag_tensor = None
            return True
        mine = self.flag_tensor is not None and bool(self.flag_tensor.item())
        fired = rt.coll.decide(mine, any_=True, stop=True, reduce=lambda t: self.reduce(t, "sum"))
        if fired or rt.coll.stays_local:
            self.flag_tensor = None  # answered, or its vote rides the next commit
        return fired

    @override
    def wait_for_everyone(self):
        if self._ft is None:
            return super().wait_for_everyone()
        if not getattr(self._ft, "_barrier_off", False):
            self._in_eval(self._ft.coll.barrier, lambda: None)

    @contextlib.contextmanager
    @override
    def main_process_first(self):
        if self._ft is None:
            with super().main_process_first():
                yield
            return
        if not self.is_main_process:
            self.wait_for_everyone()
        yield
        if self.is_main_process:
            self.wait_for_everyone()

    @contextlib.contextmanager
    @override
    def local_main_process_first(self):
        with self.main_process_first():
            yield

    # ---------------------------------------------------------------- trackers
    @override
    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None):
        """Started on the live rank 0; a worker that becomes rank 0 after a failure starts them."""
        if self._ft is None:
            return super().init_trackers(project_name, config, init_kwargs)
        self._ft.tracker_args = (project_name, config, init_kwargs)
        self._ft.ensure_trackers()

    @override
    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None):
        """Logged by the live rank 0, with the ``ft/*`` metrics added on the same ``step``
        (after a recovery also its ``ft/mttr_s`` and ``ft/policy/<chosen>``)."""
        if self._ft is None:
            return super().log(values, step, log_kwargs)
        if not self.is_main_process:
            return
        self._ft.ensure_trackers()
        super().log(self._ft.log_values(values), step, log_kwargs)

    @override
    def end_training(self):
        """Accelerate's end of a script (the trackers finish), and here also the point where no
        member goes on before every member has committed the last step: one whose last commit
        failed after its peers' succeeded adopts the step from them (``RecoveryCore.depart``)."""
        if self._ft is not None:
            self._ft.end_training()
        if self._ft is None or self.is_main_process:
            super().end_training()

    # ---------------------------------------------------------------- checkpoints
    @override
    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs):
        """Call on every member at the same point: the main process writes Accelerate's folder
        plus the runtime's state (sampler cursor, engine, loss recipe); returns the folder.

        When a member dies during the save (the main process in the middle of writing, or any
        member before the closing barrier), the barrier's failure recovers the job at once and,
        if every survivor was in this save, the (new) main process writes the folder again, so
        it is complete and holds the same step as without the failure."""
        if self._ft is None:
            return super().save_state(output_dir, safe_serialization, **kwargs)
        rt = self._ft
        auto = self.project_configuration.automatic_checkpoint_naming
        folder = (os.path.join(self.project_dir, "checkpoints", f"checkpoint_{self.save_iteration}")
                  if auto else output_dir)
        counted = False  # this member advanced Accelerate's checkpoint iteration already
        if rt.sharded_ctx is not None:
            gathered(rt, rt.sharded_ctx.whole_state, 0)  # every member: the main one writes it
        while True:
            if self.is_main_process:
                if auto and counted:
                    self.project_configuration.iteration -= 1  # write the same folder again
                rt._barrier_off = True  # Accelerate's own barrier would wait for members that don't save
                try:
                    folder = super().save_state(output_dir, safe_serialization, **kwargs)
                finally:
                    rt._barrier_off = False
                rt.save_ft_state(folder)
            elif not counted:
                self.project_configuration.iteration += 1
            counted = True
            if rt.ctx is not None:
                rt.ctx.last_checkpoint_step = rt.ctx.step
            if rt.barrier_or_redo():
                return folder

    @override
    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs):
        """Every member loads the same folder; training resumes at the saved sampler cursor, on
        however many workers are running now."""
        if self._ft is None:
            return super().load_state(input_dir, load_kwargs, **kwargs)
        folder = input_dir
        if folder is None and self.project_configuration.automatic_checkpoint_naming:
            root = os.path.join(self.project_dir, "checkpoints")
            folders = sorted(os.listdir(root), key=lambda f: int(re.findall(r"(\d+)$", f)[0]))
            folder = os.path.join(root, folders[-1])
        out = super().load_state(folder, load_kwargs, **kwargs)
        self._ft.load_ft_state(folder)
        return out


def wrap(accelerator: Accelerator, **options: Any) -> Accelerator:
    """Make an existing ``Accelerator`` fault-tolerant (before anything was prepared); the
    options are ``FaultTolerantAccelerator``'s.  Build it after ``import accelerate_ft`` (the
    import keeps Accelerate from creating a fixed-world process group under ``chameleon-ft run``).
    Outside ``chameleon-ft run`` it is returned unchanged (plain, with the same warning)."""
    if isinstance(accelerator, FaultTolerantAccelerator) and accelerator._ft is not None:
        return accelerator
    require = options.pop("require_launcher", False)
    event_log = options.pop("event_log", None)
    cfg = _config(options.pop("allowed_policies", None), options.pop("hang_timeout_s", None),
                  options.pop("stragglers", True), options.pop("allow_batch_change", False))
    if options:
        raise TypeError(f"wrap(): unknown options {sorted(options)}")
    env = launch_env()
    if env is None:
        if require:
            raise LauncherError(not_launched_message())
        if other_launcher():
            warnings.warn(not_launched_message(), stacklevel=2)
        return accelerator
    if fsdp_setup({}) is not None:  # accelerate launch --use_fsdp: the Accelerator dropped its plugin
        raise ConfigError("wrap() cannot carry FSDP: the Accelerator was built without its plugin on a single "
                          "process; build FaultTolerantAccelerator(...) instead (it reads the same FSDP2 setup)")
    if accelerator.distributed_type != DistributedType.NO or torch.distributed.is_initialized():
        raise LauncherError(
            f"wrap(): this Accelerator already set up {accelerator.distributed_type} with a fixed-world "
            "process group; import accelerate_ft before building it, or build FaultTolerantAccelerator")
    if accelerator.device.type not in ("cpu", "cuda"):
        raise LauncherError(f"wrap(): accelerate_ft runs on CUDA GPUs or the CPU ({accelerator.device.type} "
                            "is not supported yet); build the Accelerator with cpu=True")
    place_on_device(accelerator.device.type == "cpu", env, accelerator.mixed_precision)
    if accelerator._models or accelerator._optimizers or accelerator._dataloaders or accelerator._schedulers:
        raise ConfigError("wrap() must come before accelerator.prepare(...)")
    accelerator.__class__ = FaultTolerantAccelerator
    accelerator._ft = StepProtocol(accelerator, env, cfg, event_log)
    return accelerator
