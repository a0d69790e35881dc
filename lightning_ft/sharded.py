"""``FaultTolerantModelParallelStrategy``: Lightning's ``ModelParallelStrategy`` with FSDP2
(``fully_shard`` in the user's ``configure_model``) on the chameleon-ft runtime, so that the
survivors keep training in place when a worker dies and its shard has no other copy.

The user's script is Lightning's own FSDP2 recipe -- ``strategy=ModelParallelStrategy(
data_parallel_size=N, tensor_parallel_size=1)``, ``fully_shard(...)`` on submodules in
``configure_model`` -- plus ``callbacks=[FaultToleranceCallback()]``; the callback turns the
strategy object into this class before it forms any process group (``adopt``).

What it does, on the machinery of ``FaultTolerantDDPStrategy`` (membership, ``StepLoader``,
collectives over the live group, the loop wrappers):

* **The mesh.**  ``self.device_mesh`` (what ``configure_model`` reads) is a 2-D mesh
  (``data_parallel`` x ``tensor_parallel`` = N x 1) over a *fake* default process group that
  never communicates; FSDP's all-gathers and reduce-scatters run through the live gloo group
  (``FsdpComms``), so they fail fast like every collective of the runtime.
* **The module stays one object.**  The LightningModule's children with parameters are copied
  to the meta device before ``configure_model`` (the template); the FSDP units the user made
  are recorded by name.  After a failure each generation replaces those children with fresh
  copies of the template, applies ``fully_shard`` to the same units on the new mesh and loads
  this member's rows (``ShardedExecutor``); the optimizer is the same object, rebound in place,
  so Lightning's optimizers and LR schedulers need no rebuild.
* **The step.**  Every member runs as many forward/backward passes as the member with the most
  micro-batches (FSDP's collectives must pair up): its own micro-batches (the first through
  Lightning's closure), then zero-weight passes with logging off.  Then the runtime's commit
  (``ShardedExecutor.commit``), whose update is Lightning's own (precision plugin, hooks,
  ``optimizer.step``).  A failed FSDP collective redoes the step.
* **Recovery** is the engine's choice between *rehabilitate* (the lost rows from their
  buddy's stale snapshot, repaired; no rollback) and *restart* from the last checkpoint.
  *Recompute* is not offered here: rolling back would move Lightning's loop, its logged steps
  and its LR schedulers back by several steps; it runs through ``ElasticTrainer``.
* **Evaluation** unshards every unit once at its start (one collective per unit, over the live
  group) and runs the forwards without collectives, so that members with different numbers of
  evaluation batches (every sample once, no padding) do not mismatch FSDP's all-gathers.
* **Checkpoints** are whole (``ShardedExecutor.full_state``: parameters and the optimizer's
  state in torch's format), written by the live rank 0 and loadable with ``weights_only=True``
  on any number of workers; Lightning's own gather would run over the fake group.

Limits, honestly: data parallel sharding only (``tensor_parallel_size=1``, no HSDP); the
LightningModule itself must not be an FSDP unit, and ``configure_model`` must only shard (not
create or re-wrap) modules that exist after ``__init__``; FSDP options besides the mesh and
``reshard_after_forward`` (mixed precision, offload) are not carried; no gradient clipping
(the norm would need a collective over the fake group).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from collections import namedtuple
from typing import Any, Optional, Union

import torch
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from lightning.pytorch.utilities.model_helpers import is_overridden

from chameleon_ft.engine.rehab import RehabRecipe
from chameleon_ft.runtime.errors import ConfigError
from chameleon_ft.runtime.executors.sharded.comms import FsdpComms, no_comm_world
from chameleon_ft.runtime.executors.sharded.executor import ShardedExecutor
from lightning_ft.strategy import _UNEVEN, FaultTolerantDDPStrategy, _SchedulerState
from typing_extensions import override

__all__ = ["FaultTolerantModelParallelStrategy"]

# What the Lightning adapter carries out among the sharded recovery paths (see module doc).
LIGHTNING_SHARD_PATHS = frozenset({"rehabilitate", "restart"})

# A zero-weight pass: it runs FSDP's collectives for a member with fewer micro-batches.
_Ghost = namedtuple("_Ghost", "weight index")


class _LightningShardedContext(ShardedExecutor):
    """``ShardedExecutor`` over the user's LightningModule (module doc): the module is kept,
    its children are re-made from the template per generation and the user's units are
    sharded again; at start every member already holds its row (``_adopt_live``)."""

    # Lightning runs control collectives (metric syncs, barriers) between two steps: the
    # commit keeps its header so that a stray one gives way.
    step_header = "step"

    def __init__(self, module, template: dict, units: dict, mesh_fn, *args, device=None, **kwargs):
        self._children_template, self._units, self._mesh_fn = template, units, mesh_fn
        self.resume_full: Optional[tuple] = None  # whole state from a checkpoint, loaded at start
        super().__init__(module, *args, **kwargs)
        self.device = torch.device(device) if device is not None else self.device  # the strategy's root device
        self._live_start = True

    def _make_template(self, model):
        return None  # the children's templates were taken before configure_model

    def _make_mesh(self, n: int):
        return self._mesh_fn(n, self.row)  # one replica group: the row is the rank

    def _make_module(self, mesh):
        lm = self.model
        for name, child in self._children_template.items():
            setattr(lm, name, copy.deepcopy(child))
        dp = mesh["data_parallel"]
        for name, reshard in self._units.items():  # deepest first
            self._fully_shard(lm.get_submodule(name), mesh=dp, reshard_after_forward=reshard)
        for name in self._children_template:
            lm.get_submodule(name).to_empty(device=self.device)
        return lm

    def _adopt_live(self, n: int, rank: int) -> None:
        self._set_layout(n, rank)
        self.comms.install(self.model)
        self.module = self.model
        self._bind(self.model)  # the optimizer already holds these parameters and no state
        if self.resume_full is not None:
            self.load_full_state(*self.resume_full)
            self.resume_full = None


class FaultTolerantModelParallelStrategy(FaultTolerantDDPStrategy):
    """Sharded (FSDP2) training that survives worker failures in place (see module doc).

    Args: as ``ModelParallelStrategy`` (``tensor_parallel_size`` must be 1;
    ``save_distributed_checkpoint`` is ignored: checkpoints are whole), plus
        snapshot_every: steps between buddy snapshots (None: Young/Daly's optimum).
        recipe: how rehabilitated rows are repaired (``RehabRecipe``).
    """

    strategy_name = "model_parallel_ft"

    def __init__(self, data_parallel_size: Union[str, int] = "auto",
                 tensor_parallel_size: Union[str, int] = "auto", save_distributed_checkpoint: bool = True,
                 process_group_backend: Optional[str] = None, timeout: Any = None, *,
                 ft_config=None, event_log: Optional[str] = None, snapshot_every: Optional[int] = None,
                 recipe: Optional[RehabRecipe] = None) -> None:
        super().__init__(ft_config=ft_config, event_log=event_log)
        self._data_parallel_size = data_parallel_size
        self._tensor_parallel_size = tensor_parallel_size
        self.snapshot_every = snapshot_every
        self.recipe = recipe
        self._template: Optional[dict] = None
        self._units: dict = {}
        self._pre_comms: Optional[FsdpComms] = None
        self._resume_params: Optional[dict] = None  # a checkpoint's whole state, loaded at start
        self._resume_optim: Optional[dict] = None
        self._full_cache: tuple = (None, None)  # ((step, generation), whole state) of the last gather

    @classmethod
    def adopt(cls, strategy: ModelParallelStrategy) -> "FaultTolerantModelParallelStrategy":
        """Turn a ``ModelParallelStrategy`` the Trainer already holds into this class, in place
        (the Trainer keeps the object), before it forms any process group: its sizes, and the
        accelerator, devices, cluster environment, precision and checkpoint IO Lightning set."""
        lightning_set = dict(vars(strategy))
        strategy.__class__ = cls
        strategy.__dict__.clear()
        cls.__init__(strategy, data_parallel_size=lightning_set["_data_parallel_size"],
                     tensor_parallel_size=lightning_set["_tensor_parallel_size"])
        for k, v in lightning_set.items():
            if k in vars(strategy) and not k.startswith(("_data_", "_tensor_")):
                setattr(strategy, k, v)
        return strategy

    @property
    def device_mesh(self):
        return self.lightning_module._device_mesh if self.lightning_module is not None else None

    # ---------------------------------------------------------------- set-up
    @override
    def setup_environment(self) -> None:
        if self._tensor_parallel_size != 1:
            raise ConfigError(
                "lightning_ft carries sharded data parallelism only: use ModelParallelStrategy("
                f"data_parallel_size=<workers>, tensor_parallel_size=1) (got tensor_parallel_size="
                f"{self._tensor_parallel_size!r})")
        super().setup_environment()
        view = self._joined.view
        if self._data_parallel_size not in ("auto", view.world_size):
            raise ConfigError(f"lightning_ft: data_parallel_size={self._data_parallel_size} but the job has "
                              f"{view.world_size} workers (it follows the live membership: use 'auto' or the "
                              "number of workers at launch)")
        self._mesh(view.world_size, view.rank)

    def _mesh(self, n: int, rank: int):
        """A data_parallel x tensor_parallel (n x 1) mesh over a fake default group; also the
        LightningModule's ``device_mesh`` (what ``configure_model`` reads)."""
        from torch.distributed.device_mesh import init_device_mesh
        no_comm_world(rank, n)
        mesh = init_device_mesh(self.root_device.type, (n, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
        self.lightning_module._device_mesh = mesh
        return mesh

    @contextlib.contextmanager
    @override
    def model_sharded_context(self):
        # Entered by Lightning around configure_model: the children's templates, before the
        # user shards them (every generation re-makes them from these).
        lm = self.lightning_module
        if self._template is None and lm is not None:
            self._template = {name: copy.deepcopy(child).to("meta") for name, child in lm.named_children()
                              if any(True for _ in child.parameters())}
        yield

    @override
    def setup(self, trainer) -> None:
        from torch.distributed.fsdp import FSDPModule
        lm = self.lightning_module
        if not is_overridden("configure_model", lm):
            raise ConfigError("FaultTolerantModelParallelStrategy: override configure_model() in the "
                              "LightningModule and call fully_shard(...) on its submodules there")
        if isinstance(lm, FSDPModule):
            raise ConfigError("lightning_ft: fully_shard the LightningModule's submodules (e.g. self.model), "
                              "not the LightningModule itself (it is kept as one object through failures)")
        units = [(name, m) for name, m in lm.named_modules() if isinstance(m, FSDPModule)]
        if not units:
            raise ConfigError("lightning_ft: configure_model() sharded nothing; call fully_shard(module, "
                              "mesh=self.device_mesh['data_parallel']) on the submodules to shard")
        names = [n for n, p in lm.named_parameters() if p.requires_grad]
        tmpl = [f"{c}.{n}" for c, child in (self._template or {}).items()
                for n, p in child.named_parameters() if p.requires_grad]
        if sorted(names) != sorted(tmpl):
            raise ConfigError("lightning_ft: configure_model() changed the module's structure (created or "
                              "re-wrapped modules); only fully_shard(...) of modules made in __init__ is carried")
        from torch.distributed.tensor import DTensor, Shard
        for n, p in lm.named_parameters():
            if p.requires_grad and not (isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),)):
                raise ConfigError(f"lightning_ft: parameter {n} is not in any fully_shard unit (every trainable "
                                  "parameter must be sharded on the data_parallel mesh)")
        if trainer.gradient_clip_val:
            raise ConfigError("lightning_ft: gradient clipping is not supported with sharded training "
                              "(the norm needs a collective over the shards)")
        # deepest first, so that a re-made generation shards inner units before outer ones
        self._units = {name: _reshards(m) for name, m in sorted(units, key=lambda u: -u[0].count("."))}
        view = self._joined.view
        self._pre_comms = FsdpComms(self._joined.gm, view.world_size, view.world_size, view.rank,
                                    self._op_timeout())
        self._pre_comms.install(lm)
        super().setup(trainer)

    def _new_context(self, dataset_len: int, global_batch: int, micro_batch: int, **kw):
        cb = self._callback()
        if self.snapshot_every is None:
            self.snapshot_every = getattr(cb, "snapshot_every", None)
        self.recipe = self.recipe or getattr(cb, "rehab_recipe", None)
        cfg = copy.copy(self.ft_config)
        cfg.shard_recovery = LIGHTNING_SHARD_PATHS & frozenset(cfg.shard_recovery or LIGHTNING_SHARD_PATHS)
        cfg.one_microbatch_each = True  # as the DDP strategy (ElasticConfig.one_microbatch_each)
        ctx = _LightningShardedContext(
            self.lightning_module, self._template, self._units, self._mesh, self.optimizers[0], dataset_len,
            global_batch, micro_batch, snapshot_every=self.snapshot_every, recipe=self.recipe,
            scheduler=_SchedulerState(self), config=cfg, env=self.env, user_loop=True, device=self.root_device, **kw)
        if self._resume_params is not None:
            ctx.resume_full = (self._resume_params, self._resume_optim)
        return ctx

    # ---------------------------------------------------------------- the step
    def step_microbatches(self) -> list:
        """This member's share of the current step (a redo recomputes all of it)."""
        return self.ctx.sampler.local_microbatches(self.ctx.worker_id)

    def _run_step(self, ctx, optimizer, closure, model, kwargs: dict) -> Any:
        trainer = model.trainer
        batch_idx = trainer.fit_loop.epoch_loop.batch_idx
        self._coll.catch_up = False
        ran_closure, result = False, None
        t_first = time.perf_counter()

        def attempt() -> bool:
            nonlocal ran_closure, result
            step = ctx.step
            cursor = ctx.sampler.cursor  # the step within the epoch: what the loader's items are keyed by
            t0 = ctx.begin_step()
            self._coll.local_reason = None if self._step_collectives_line_up() else _UNEVEN
            plan = ctx.sampler.step_plan()
            mine = list(plan.get(ctx.worker_id, []))
            passes = max(len(v) for v in plan.values())
            loss_w = 0.0
            try:
                for i in range(passes):
                    ctx.faults.at(step, "forward")
                    mb = mine[i] if i < len(mine) else None
                    # (the closure zeroes the gradients: only as the attempt's first pass)
                    if mb is not None and i == 0 and not ran_closure and self._batch_key == (cursor, mb.index):
                        self._mb = mb
                        result = closure()  # training_step on Lightning's batch, zero_grad, backward
                        ran_closure, loss = True, result
                    else:
                        self._mb = mb if mb is not None else _Ghost(0.0, -1)
                        source = mb if mb is not None else (mine or [m for v in plan.values() for m in v])[0]
                        batch = self._prepare(self._loader.fetch(cursor, source))
                        batch = Strategy.batch_to_device(self, batch)
                        with _quiet(model, mb is None):
                            loss = self._extra_microbatch(trainer, batch, batch_idx, optimizer)
                    if mb is not None and loss is not None:
                        loss_w += float(loss.detach()) * mb.weight
            except Exception as exc:
                self._mb = None
                self._coll.local_reason = None
                ctx.interrupted(exc, t0)  # re-raises anything but a failed collective
                return False  # nobody committed a step still computing
            self._mb = None
            self._coll.local_reason = None
            update = functools.partial(self._apply_update, optimizer, model, result, kwargs)
            ids = [i for mb in mine for i in mb.indices]
            return ctx.commit(loss_w, t0, len(mine), ids, update=update)

        self._step_ended(ctx.run_step(attempt))
        self._close_step(closure, ran_closure)
        self.last_step = {"step_s": time.perf_counter() - t_first, "compute_s": ctx._compute_s,
                          "data_wait_s": 0.0, "sync_s": ctx._prev_comm}
        return result

    # ---------------------------------------------------------------- evaluation
    def _wrap_loops(self, trainer) -> None:
        super()._wrap_loops(trainer)
        for loop in (trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop):
            if "_cft_unsharded" not in vars(loop):
                loop._cft_unsharded = True
                loop._cft_run = functools.partial(self._evaluate_unsharded, loop._cft_run)

    def _evaluate_unsharded(self, run) -> Any:
        """Every unit unsharded once (one all-gather each, over the live group), the loop's
        forwards without collectives, then resharded (local) with its own setting back."""
        from torch.distributed.fsdp import FSDPModule
        units = [(n, m) for n, m in self.lightning_module.named_modules() if isinstance(m, FSDPModule)]
        try:
            for _, u in units:
                u.set_reshard_after_forward(False)
            with torch.no_grad():
                for _, u in units:
                    u.unshard()
            return run()
        finally:
            for name, u in units:
                u.reshard()
                u.set_reshard_after_forward(self._units.get(name, True))

    # ---------------------------------------------------------------- checkpoints
    def _full_state(self) -> tuple[dict, dict]:
        """Whole parameters and optimizer state, gathered once per step (Lightning asks for the
        module's and the optimizer's state separately)."""
        ctx = self.ctx
        key = (ctx.step, ctx.view.token)
        if self._full_cache[0] != key:
            self._full_cache = (key, self._collective(ctx.full_state, ctx.full_state))
        return self._full_cache[1]

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        lm = self.lightning_module
        if self.ctx is None or self.ctx.module is None:
            raise ConfigError("lightning_ft: a sharded model is saved once training has started")
        params, _ = self._full_state()
        out = {}
        for name, t in lm.state_dict().items():
            out[name] = params[name] if name in params else (t.full_tensor() if hasattr(t, "full_tensor") else t)
        return out

    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return self._full_state()[1]

    @override
    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        # Loaded into the rows once the runtime starts (every member keeps its own slices).
        self._resume_params = dict(checkpoint["state_dict"])
        lm = self.lightning_module
        bufs = dict(lm.named_buffers())
        with torch.no_grad():
            for name, t in checkpoint["state_dict"].items():
                if name in bufs:
                    bufs[name].copy_(t)

    @override
    def load_optimizer_state_dict(self, checkpoint) -> None:
        states = checkpoint.get("optimizer_states") or []
        self._resume_optim = states[0] if states else None

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return True


def _reshards(unit) -> bool:
    """The unit's ``reshard_after_forward`` (True: free the unsharded parameters after its forward)."""
    group = unit._get_fsdp_state()._fsdp_param_group
    return group is None or group.post_forward_mesh_info is not None


@contextlib.contextmanager
def _quiet(module, on: bool):
    """A zero-weight pass logs nothing (its ``self.log`` calls are dropped)."""
    if not on:
        yield
        return
    module.log = module.log_dict = lambda *a, **k: None
    try:
        yield
    finally:
        del module.log, module.log_dict
