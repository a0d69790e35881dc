"""``ShardedExecutor``: FSDP2 / HSDP training on the shared recovery core, surviving failures.

The model is sharded with ``torch.distributed.fsdp.fully_shard`` on a device mesh: over all
members (``replicas=1``), or HSDP (``replicas=R``: R replica groups, each sharding the model
over ``world / R`` members).  Every step each member runs its whole share of the global batch
as one forward/backward (a member with no samples runs a zero-weight one: FSDP's collectives
need every member), then the core's one small all-reduce commits the step (``recovery.py``).

**Collectives that fail fast.**  FSDP's all-gathers and reduce-scatters run through our
generation's gloo group (``set_custom_all_gather`` / ``set_custom_reduce_scatter``), so a dead
or hung peer ends them within the abort poll like every other collective of the runtime.  The
device mesh itself is built on a *fake* default process group (no communication; it gives FSDP
its ranks), re-created for every generation.  The reduce-scatter is an all-reduce over all
members followed by a slice (gloo's own reduce-scatter never reports completion to a polling
waiter, and measured no faster: 25.9 vs 23.7 ms for 4 x 64 kB on 4 processes); it sums over the
replica groups too (HSDP's all-reduce over the fake group is then a no-op).

**Flat rows.**  FSDP2 shards every parameter on dim 0 in ``S = world / R`` chunks; chunk ``k``
of every parameter (and of every optimizer tensor of that parameter's shape) makes *row* ``k``.
Members with rank ``r`` hold row ``r % S``.  A re-shard streams the new layout's rows one at a
time: one SUM all-reduce per new row, to which exactly one member contributes each element
(its source rows' overlap with that row, ``_overlaps``); every member keeps its own.  In
memory, never via disk, and no member holds more than its sources and one row besides its own
(an unsharded checkpoint and ``full_parameters`` assemble the whole, by definition).

**Snapshots.**  Every ``K`` committed steps each member copies its row (parameters and
optimizer tensors) and sends the copy to its *buddy* (the next rank) while the next step runs;
each keeps its last two own snapshots and the last two it holds for its predecessor.  ``K`` is
Young/Daly's optimum from the measured snapshot cost and the engine's failure rate unless given.

**After a failure** the survivors agree on the step (the commit protocol: a member that missed
the last commit applies its held gradients), the source prices heal / recompute / rehabilitate /
restart (``shard_recovery.choose_recovery``) and every member carries the choice out:

* heal: rows come from their surviving replicas (HSDP); exact.
* recompute: every row from its snapshot at the common step ``t_c``; the sampler, scheduler,
  RNG and counters roll back with it; the steps since are redone; exact.
* rehabilitate: lost rows from their buddy's stale snapshot (``rehab.RehabRecipe``: optionally
  extrapolated, first moments reset, second moments kept; their updates then get a restarted
  bias correction and a linear learning-rate warm-up, ``_repair_update``); everything else
  stays current; no rollback.  The predicted
  steps to close the loss gap are logged.
* restart: the launcher restarts from the last disk checkpoint (the fallback).

**A framework that owns the module** (``lightning_ft``'s ``ModelParallelStrategy``) uses the
seams: ``_make_template`` / ``_make_mesh`` / ``_make_module`` (how a generation's sharded module
is made: there, the user's LightningModule with its children re-made and its own FSDP units
re-sharded), ``_adopt_live`` (the module the framework sharded before start: every member holds
its row, nothing moves), the step in two halves (``begin_step``, its forward/backward passes,
``interrupted`` for an exception of theirs, ``commit(update=...)`` with the framework's own
optimizer update) and ``full_state`` / ``load_full_state`` (whole checkpoints in torch's format).

Limits, honestly: one FSDP unit per top-level child with parameters plus the root; parameters
of one dtype; optimizers whose per-parameter state is tensors of the parameter's shape plus
scalars (SGD, Adam, AdamW, ...); the repair of restored elements scales their updates (torch's
optimizers keep one step counter and learning rate per parameter); a second failure before the post-recovery snapshot leaves no
snapshot (heal or the disk checkpoint then); buffers are taken from one member.
"""

from __future__ import annotations

from chameleon_ft._compat import renamed_getattr

import collections
import copy
import math
import sys
import time
import zlib
from typing import Callable, Optional

import torch
import torch.distributed as dist

from chameleon_ft.engine import shard_recovery as sr
from chameleon_ft.engine.rehab import RehabRecipe
from chameleon_ft.runtime import codec as run_state
from chameleon_ft.runtime.errors import ConfigError
from chameleon_ft.runtime.groups import CollectiveFailure
from chameleon_ft.runtime.recovery import ElasticConfig, RecoveryCore, seed_generators
from chameleon_ft.runtime.sampler import StepItem, step_items

__all__ = ["ShardedExecutor", "SHARDED_POLICIES"]

# The engine's data policies a sharded job can carry out (any membership: a re-shard).
SHARDED_POLICIES = frozenset({"reroute", "restart", "keep", "rebalance", "heal", "grow"})
_DEFAULT_K = 10  # snapshot interval before the cost and the step time are measured
_KEEP = 2  # snapshots kept (own and held)
_SNAP_TAG = 1 << 20


def _fsdp():
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
    except ImportError as exc:  # pragma: no cover - torch builds without distributed
        raise ConfigError(f"sharded training needs torch's FSDP2 (torch>=2.6): {exc}") from None
    return init_device_mesh, fully_shard, AllGather, ReduceScatter


def _fake_world(rank: int, world: int) -> None:
    """A default process group that never communicates: FSDP's device mesh takes its ranks
    from it; our comms carry the data."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world, store=dist.HashStore())


class _Layout:
    """Rows of the flat state for a sharding over ``shards`` (FSDP2's dim-0 chunks)."""

    def __init__(self, shapes: list[torch.Size], world: int, replicas: int):
        self.world, self.replicas = world, replicas
        self.shards = world // replicas
        self.shapes = shapes
        self.numels = [math.prod(s) for s in shapes]
        self.offsets = [0]
        for k in self.numels:
            self.offsets.append(self.offsets[-1] + k)
        self.total = self.offsets[-1]

    def row_of(self, rank: int) -> int:
        return rank % self.shards

    def segments(self, row: int) -> list[tuple[int, int]]:
        """Flat ranges ``[start, stop)`` of ``row``, one per parameter (empty where a parameter
        has fewer dim-0 slices than rows), in the order of the parameters' local shards."""
        out = []
        for shape, off in zip(self.shapes, self.offsets):
            d0 = shape[0] if len(shape) else 1
            rest = math.prod(shape[1:]) if len(shape) > 1 else 1
            c = -(-d0 // self.shards)
            lo, hi = min(row * c, d0), min((row + 1) * c, d0)
            out.append((off + lo * rest, off + hi * rest))
        return out

    def numel(self, row: int) -> int:
        return sum(b - a for a, b in self.segments(row))

    def to_json(self) -> list[int]:
        return [self.world, self.replicas]


class FsdpComms:
    """FSDP2's all-gather and reduce-scatter over one generation's gloo group, failing fast
    like every collective of the runtime (a dead or hung peer ends them within the abort
    poll).  ``install`` sets them on every ``FSDPModule`` of a module, with sum reduction and
    no division (the step's weights make the mean).  ``failure``: the last one that failed
    (FSDP may wrap the exception it raised)."""

    def __init__(self, gm, world: int, shards: int, rank: int, timeout_s: float):
        self.gm, self.world, self.shards, self.rank = gm, world, shards, rank
        self.row = rank % shards
        self.timeout_s = timeout_s
        self.failure: Optional[CollectiveFailure] = None
        _, _, all_gather_cls, reduce_scatter_cls = _fsdp()
        comms = self

        class _AG(all_gather_cls):
            def allocate(self, size, *, dtype, device):
                return torch.empty(*size, dtype=dtype, device=device)

            def __call__(self, output_tensor, input_tensor, group, async_op=False):
                comms.all_gather(output_tensor, input_tensor)

        class _RS(reduce_scatter_cls):
            def allocate(self, size, *, dtype, device):
                return torch.empty(*size, dtype=dtype, device=device)

            def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
                comms.reduce_scatter(output_tensor, input_tensor)

        self._ag, self._rs = _AG(), _RS()

    def install(self, module: torch.nn.Module) -> list:
        """Our collectives on every FSDP unit of ``module``; returns the units."""
        from torch.distributed.fsdp import FSDPModule
        units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            unit.set_custom_all_gather(self._ag)
            unit.set_custom_reduce_scatter(self._rs)
            unit.set_force_sum_reduction_for_comms(True)
            unit.set_gradient_divide_factor(1.0)
        return units

    def _run(self, fn) -> None:
        try:
            self.gm.collective(fn, self.timeout_s)
        except CollectiveFailure as exc:
            self.failure = exc
            raise

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        n, s = self.world, self.shards
        if n == s:  # one shard group: gather straight into FSDP's buffer
            self._run(lambda pg: pg._allgather_base(out, inp.contiguous()))
            return
        parts = [torch.empty_like(inp) for _ in range(n)]
        self._run(lambda pg: pg.allgather([parts], [inp.contiguous()]))
        base = (self.rank // s) * s
        for i, chunk in enumerate(out.chunk(s)):
            chunk.copy_(parts[base + i])

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        buf = inp.detach().clone()
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self._run(lambda pg: pg.allreduce([buf], opts))
        out.copy_(buf.chunk(self.shards)[self.row])


class ShardedExecutor(RecoveryCore):
    """FSDP2 (``replicas=1``) or HSDP (``replicas=R``) training that survives failures (module doc).

    Args:
        model: the unsharded model (CPU); it is the template of every generation's sharded copy
            and is left as given.
        optimizer: built over ``model``'s parameters; every generation rebinds it, the same
            object, to its sharded parameters (``self.optimizer is optimizer``).
        snapshot_every: steps between snapshots (K); None: Young/Daly's optimum.
        recipe: how rehabilitated rows are repaired.
    """

    # Between two syncs every member runs FSDP's collectives and the commit, in one order
    # (no adapter's control collectives): the commit needs no header exchange.
    _step_header = None

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset_len: int,
                 global_batch: int, micro_batch: int, *, replicas: int = 1,
                 snapshot_every: Optional[int] = None, recipe: Optional[RehabRecipe] = None,
                 scheduler=None, seed: int = 0, shuffle: bool = True, drop_last: bool = False,
                 config: Optional[ElasticConfig] = None, env=None):
        cfg = copy.copy(config) if config is not None else ElasticConfig()
        cfg.allowed_policies = SHARDED_POLICIES & frozenset(cfg.allowed_policies or SHARDED_POLICIES)
        super().__init__(model, optimizer, dataset_len, global_batch, micro_batch, scheduler=scheduler,
                         seed=seed, shuffle=shuffle, drop_last=drop_last, config=cfg, env=env)
        if replicas < 1:
            raise ConfigError(f"replicas must be >= 1, got {replicas}")
        if snapshot_every is not None and snapshot_every < 0:
            raise ConfigError(f"snapshot_every must be >= 0 (0: no snapshots), got {snapshot_every}")
        self.replicas = int(replicas)
        self.snapshot_every = snapshot_every
        self.recipe = recipe or RehabRecipe()
        self.paths = frozenset(cfg.shard_recovery or sr.PATHS)
        self._template = self._make_template(model)
        self._names = [n for n, p in model.named_parameters() if p.requires_grad]
        self._shapes = [p.shape for n, p in model.named_parameters() if p.requires_grad]
        self._total = sum(math.prod(s) for s in self._shapes)  # elements of one flat part
        self._wrap = [n for n, child in model.named_children() if any(True for _ in child.parameters())]
        where = {id(p): i for i, p in enumerate(self.params)}
        self._opt_groups = [[where[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        self.module: Optional[torch.nn.Module] = None  # this generation's sharded model
        self.layout: Optional[_Layout] = None
        self.comms: Optional[FsdpComms] = None  # this generation's FSDP collectives
        self._keys: list[str] = []  # optimizer tensor states sharded like the parameters
        self._own: list[dict] = []  # this member's last snapshots (oldest first)
        self._held: list[dict] = []  # the predecessor's, held for it
        self._inflight: Optional[dict] = None
        self._grads_ready = False
        self._update: Optional[Callable[[], None]] = None  # the step's optimizer update (commit)
        self._live_start = False  # a framework sharded the model before start (every row held)
        self.loss_history: list[tuple[int, float]] = []
        self.snapshot_cost_s: Optional[float] = None
        # Steps between snapshots (0: none -- then only heal and the disk checkpoint remain).
        self.k = _DEFAULT_K if snapshot_every is None else snapshot_every
        self.last_shard_decision: Optional[dict] = None
        self._warm: Optional[dict] = None  # rehabilitation's repair of the restored elements' updates
        self._repair_info: Optional[dict] = None  # this member's part of the last repair (logged)
        self._step_times: list[float] = []
        self._transfer_s = 0.05
        self._init_mesh, self._fully_shard = _fsdp()[:2]

    # ---------------------------------------------------------------- the model
    def _replicas_for(self, n: int) -> int:
        return max(r for r in range(1, min(self.replicas, n) + 1) if n % r == 0)

    def _build(self, n: int, rank: int) -> None:
        """This generation's sharded model (uninitialised storage) and optimizer."""
        self._set_layout(n, rank)
        _fake_world(rank, n)
        module = self._make_module(self._make_mesh(n))
        self.comms.install(module)
        self.module = module
        self._bind(module)

    def _set_layout(self, n: int, rank: int) -> None:
        """This generation's layout, this member's row and the comms over its group."""
        self.layout = _Layout(self._shapes, n, self._replicas_for(n))
        self.row = self.layout.row_of(rank)  # kept: after a failure the view has new ranks
        self.comms = FsdpComms(self.gm, n, self.layout.shards, rank, self.hang_timeout_s)

    def _bind(self, module: torch.nn.Module) -> None:
        named = dict(module.named_parameters())
        self.shard_params = [named[n] for n in self._names]
        # The same optimizer object, rebound: whoever holds it (the user, an LR scheduler, a
        # framework) sees this generation's parameters; its state is loaded by _load_rows.
        for g, idx in zip(self.optimizer.param_groups, self._opt_groups):
            g["params"] = [self.shard_params[i] for i in idx]
        self.optimizer.state = collections.defaultdict(dict)

    # Seams for a framework that owns the module (lightning_ft): the template, the mesh, how a
    # generation's sharded module is made from them, and the module it sharded before start.
    def _adopt_live(self, n: int, rank: int) -> None:
        raise NotImplementedError("a live start needs the framework's sharded module")

    def _make_template(self, model: torch.nn.Module):
        return copy.deepcopy(model).to("meta")

    def _make_mesh(self, n: int):
        if self.layout.replicas == 1:
            return self._init_mesh("cpu", (n,), mesh_dim_names=("shard",))
        return self._init_mesh("cpu", (self.layout.replicas, self.layout.shards),
                               mesh_dim_names=("replicate", "shard"))

    def _make_module(self, mesh) -> torch.nn.Module:
        """A fresh sharded copy of the template: one FSDP unit per top-level child with
        parameters, plus the root; storage uninitialised (``_load_rows`` fills it)."""
        module = copy.deepcopy(self._template)
        for unit in [module.get_submodule(name) for name in self._wrap] + [module]:
            self._fully_shard(unit, mesh=mesh)
        module.to_empty(device="cpu")
        return module

    def _locals(self) -> list[torch.Tensor]:
        return [p.to_local() for p in self.shard_params]

    def _state_local(self, i: int, key: str) -> Optional[torch.Tensor]:
        v = self.optimizer.state.get(self.shard_params[i], {}).get(key)
        return None if v is None else _local(v)

    def _row_vector(self) -> torch.Tensor:
        """This member's row: its parameter shards, then each optimizer tensor state's."""
        return _flatten(self._locals(), self._state_local, self._keys, self.dtype)

    def _current_keys(self) -> list[str]:
        """The optimizer's states sharded like the parameters: found once they exist (an
        optimizer has none before its first step), then kept."""
        if not self._keys:
            self._keys = self._tensor_keys()
        return self._keys

    def _scalars(self) -> dict:
        return _scalars(self.optimizer, self.shard_params, self._current_keys())

    def _groups_json(self) -> list[dict]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def _buffers(self) -> dict:
        src = self.module if self.module is not None else self.model
        return {n: b.detach().clone() for n, b in src.named_buffers()}

    def _tensor_keys(self) -> list[str]:
        return _state_keys(self.optimizer, self.shard_params)

    # ---------------------------------------------------------------- training
    def share(self) -> StepItem:
        """This member's share of the current step as one item (a ghost when it has none)."""
        return step_items(self.sampler.local_microbatches(self.worker_id), 1)[0]

    def train_step(self, loss_of: Callable[[torch.nn.Module, tuple], torch.Tensor],
                   ghost_indices: tuple = (0,)) -> bool:
        """One global step: forward/backward of this member's share (``loss_of(module,
        indices)`` is the mean loss of those samples), then commit.  True when committed;
        False when a failure interrupted it (the job reconfigured; run it again)."""
        t0 = self.begin_step()
        item = self.share()
        weight = item.weight
        indices = item.indices if not item.ghost else ghost_indices
        if self.cfg.seed_microbatches:
            seed_generators(hash((self.seed, self.step, item.seed_slot if not item.ghost else -1)) % (2**63))
        try:
            self.faults.at(self.step, "forward")
            loss = loss_of(self.module, indices)
            (loss * weight).backward()
        except Exception as exc:
            return self.interrupted(exc, t0)
        return self.commit(float(loss.detach()) * weight, t0, len(item.parts), list(item.indices))

    # The step in two halves, for a framework that runs the forward/backward itself
    # (lightning_ft): ``begin_step``, its passes (any exception through ``interrupted``),
    # then ``commit``.
    def begin_step(self) -> float:
        t0 = time.perf_counter()
        self._step_start = t0
        return t0

    def interrupted(self, exc: BaseException, t0: float) -> bool:
        """An exception of the step's forward/backward: a failed collective (FSDP may wrap the
        one our comms raised) recovers the job and returns False (redo the step); anything
        else is re-raised."""
        failure = exc if isinstance(exc, CollectiveFailure) else (self.comms.failure if self.comms else None)
        if failure is None:
            raise exc
        if self.comms is not None:
            self.comms.failure = None
        self._grads_ready = False
        self._step_start = None
        self._recover(failure, t0)
        return False

    def commit(self, weighted_loss: float, t0: float, n_mb: int, ids: list,
               update: Optional[Callable[[], None]] = None) -> bool:
        """Commit the step whose gradients this member computed (its ``weighted_loss``: its
        samples' share of the global mean loss): the snapshot in flight completes, the
        all-reduce agrees, then ``update`` (default ``optimizer.step()``) runs.  True when
        committed; False when a failure interrupted it (the job reconfigured; redo)."""
        self._grads_ready = True
        self._update = update
        try:
            self._complete_snapshot()
        except CollectiveFailure as failure:
            return self.interrupted(failure, t0)
        self._compute_s = time.perf_counter() - t0
        self._n_mb, self._ids = n_mb, ids
        self.faults.at(self.step, "allreduce")
        if not math.isfinite(weighted_loss):
            raise FloatingPointError(f"worker {self.worker_id}: the loss is {weighted_loss} at step {self.step}; "
                                     "nothing was committed (the last snapshot and checkpoint are intact)")
        parts = torch.tensor([weighted_loss, self.snapshot_cost_s or 0.0], dtype=self.dtype)
        reduced = self._reduce_step([parts], self._compute_s)
        if reduced is None:
            self._grads_ready = False
            return False
        buf, timings, comm = reduced
        self._apply_update()
        self._finish_step(timings, comm)
        self._after_commit_sharded(float(buf[0]), float(buf[1]) / max(1, self.view.world_size))
        return True

    def _apply_update(self) -> None:
        self.faults.at(self.step, "optimizer")
        before = self._restored_values()
        if self._update is not None:
            self._update()
        else:
            self.optimizer.step()
        if before is not None:
            self._repair_update(before)
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._grads_ready = False
        self._update = None

    # ---------------------------------------------------------------- rehabilitation's repair
    def _start_repair(self, plan: dict) -> None:
        """After a rehabilitation: the elements of this member's row that were restored from a
        stale snapshot get the recipe's repair on their updates (``_repair_update``)."""
        beta = self._momentum()
        restart = self.recipe.restart_bias_correction and beta > 0
        w = max(0, int(self.recipe.warmup_steps))
        if not w and not restart:
            self._repair_info = {"warmup_steps": 0, "restart_bias_correction": False}
            return
        mask = torch.zeros(self.layout.numel(self.row), dtype=torch.bool)
        for at, n in _restored(plan, self.layout, self.row):
            mask[at:at + n] = True
        if bool(mask.any()):
            self._warm = {"from": self.step, "mask": mask, "beta": beta, "restart": restart, "w": w}
        self._repair_info = {"warmup_steps": w, "restart_bias_correction": restart,
                             "restored_elements": int(mask.sum())}

    def _restored_values(self) -> Optional[torch.Tensor]:
        if self._warm is None:
            return None
        return _flatten(self._locals(), self._state_local, [], self.dtype)[self._warm["mask"]]

    def _repair_update(self, before: torch.Tensor) -> None:
        """Scale the restored elements' update of the ``k``-th step since the repair by
        ``min(1, k / W)`` (the learning-rate warm-up) times ``(1 - b**t) / (1 - b**k)`` (the
        first moment's bias correction restarted: Adam's ``t`` keeps counting from the run's
        start, the reset moment only has ``k`` steps; SGD: ``t`` infinite).  Per element, so
        only the restored part of the row is touched; the whole update of those elements
        (AdamW's decoupled decay included) is scaled."""
        rp = self._warm
        k = self.step - rp["from"] + 1
        scale = min(1.0, k / rp["w"]) if rp["w"] else 1.0
        corr = 1.0
        if rp["restart"]:
            t = self.optimizer.state.get(self.shard_params[0], {}).get("step")
            b = rp["beta"]
            corr = (1.0 - b ** float(t) if t is not None else 1.0) / (1.0 - b ** k)
        locs = self._locals()
        flat = _flatten(locs, self._state_local, [], self.dtype)
        flat[rp["mask"]] = before + (scale * corr) * (flat[rp["mask"]] - before)
        with torch.no_grad():
            _unflatten_into(flat, locs)
        if k >= rp["w"] and abs(corr - 1.0) < 1e-3:
            self._warm = None

    def _after_commit_sharded(self, loss: float, snap_cost: float) -> None:
        self.loss_history.append((self.step, loss))
        del self.loss_history[:-400]
        if self._prev_step > 0:
            self._step_times.append(self._prev_step)
            del self._step_times[:-20]
        if snap_cost > 0:
            self.snapshot_cost_s = snap_cost
        if self.snapshot_every is None and self.snapshot_cost_s and self._step_times:
            self.k = sr.snapshot_interval(self.snapshot_cost_s, self.policy.mttf(), self._median_step())
        if self.k and self.step % self.k == 0:
            self._take_snapshot(wait=False)

    def _median_step(self) -> float:
        s = sorted(self._step_times) or [0.1]
        return s[len(s) // 2]

    # ---------------------------------------------------------------- snapshots
    def _take_snapshot(self, wait: bool) -> None:
        """Copy this member's row and send it to its buddy (the next rank); the transfer runs
        while the next step computes (``_complete_snapshot``), or at once with ``wait``."""
        self._complete_snapshot()
        t0 = time.perf_counter()
        n, r = self.view.world_size, self.view.rank
        self._current_keys()
        own = {"step": self.step, "row": self._row_vector().clone(), "k": self.layout.row_of(r),
               "layout": self.layout.to_json(), "keys": list(self._keys), "scalars": self._scalars(),
               "groups": self._groups_json(), "buffers": self._buffers(), "run": self._run_state()}
        if n < 2:
            self._push(self._own, own)
            self.snapshot_cost_s = time.perf_counter() - t0
            return
        prev = (r - 1) % n
        prev_row = self.layout.row_of(prev)
        size = (1 + len(self._keys)) * self.layout.numel(prev_row)
        incoming = torch.empty(size, dtype=self.dtype)
        tag = _SNAP_TAG + 2 * (self.step % (_SNAP_TAG // 2))
        out_crc = torch.tensor([_crc(own["row"])], dtype=torch.int64)
        sent = own["row"]
        if self.faults.corrupt(self.step):  # test-only: damaged in flight, after its checksum
            sent = sent.clone()
            sent.view(-1)[: max(1, sent.numel() // 10)] += 1.0
        in_crc = torch.zeros(1, dtype=torch.int64)
        works = [self.gm.send(sent, (r + 1) % n, tag), self.gm.send(out_crc, (r + 1) % n, tag + 1),
                 self.gm.recv(incoming, prev, tag), self.gm.recv(in_crc, prev, tag + 1)]
        self._inflight = {"own": own, "held": {"step": self.step, "row": incoming, "k": prev_row,
                                               "layout": self.layout.to_json(), "from": self.view.members[prev]},
                          "crc": in_crc, "works": works, "t": time.perf_counter() - t0}
        if wait:
            self._complete_snapshot()

    def _complete_snapshot(self) -> None:
        fl, self._inflight = self._inflight, None
        if fl is None:
            return
        t0 = time.perf_counter()
        self.gm.wait_p2p(fl["works"], self.hang_timeout_s)
        self._push(self._own, fl["own"])
        held = fl["held"]
        if _crc(held["row"]) == int(fl["crc"][0]):
            self._push(self._held, held)
        else:  # keep the last good one; say so: a later failure may have to fall back further
            msg = (f"worker {self.worker_id}: the snapshot of row {held['k']} from worker {held['from']} "
                   f"at step {held['step']} is corrupt (checksum mismatch): discarded, the previous one is kept")
            print(f"chameleon-ft: {msg}", file=sys.stderr, flush=True)
            if self.log:
                self.log.write("snapshot", step=held["step"], ok=False, row=held["k"],
                               sender=held["from"], message=msg)
        self.snapshot_cost_s = fl["t"] + time.perf_counter() - t0

    @staticmethod
    def _push(lst: list, snap: dict) -> None:
        lst.append(snap)
        del lst[:-_KEEP]

    def _valid(self, snaps: list[dict]) -> list[dict]:
        return [s for s in snaps if self.layout is not None and s["layout"] == self.layout.to_json()]

    # ---------------------------------------------------------------- recovery hooks
    def _sync_fields(self) -> list[int]:
        """[row, own steps x2, held row, held steps x2, world, replicas] of the layout held."""
        if self.module is None or self.fresh:
            return [-1] * 8
        own = [s["step"] for s in self._valid(self._own)][-_KEEP:]
        held = self._valid(self._held)[-_KEEP:]
        hrow = held[-1]["k"] if held else -1
        pad = lambda xs: ([-1] * _KEEP + list(xs))[-_KEEP:]  # noqa: E731
        return ([self.row] + pad(own) + [hrow] + pad([h["step"] for h in held])
                + [self.layout.world, self.layout.replicas])

    def state_dict(self) -> dict:
        """The run state a peer that is behind needs (the model and optimizer move by rows)."""
        s = self._run_state()
        s["engine"] = self.policy.state_dict()
        return s

    def load_state_dict(self, s: dict) -> None:
        if self._grads_ready and int(s["step"]) == self.step + 1 and self.module is not None:
            # A peer committed the step this member's gradients are for: apply them (the
            # commit protocol's adoption, without moving any state).
            self._apply_update()
        self._load_run(s)
        self.policy.load_state_dict(s["engine"])

    def _discard(self) -> None:
        if self.module is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self._grads_ready = False
        self._step_start = None
        self._compute_s, self._n_mb, self._ids = 0.0, 0, []

    def _decide(self, view, info) -> dict:
        payload = super()._decide(view, info)
        if not payload["restart"]:
            payload["shard"] = self._shard_plan(view)
            if payload["shard"]["mode"] == "restart":
                d = payload["shard"]["decision"]
                why = "; ".join(f"{k}: {c['reason']}" for k, c in d["candidates"].items() if k != "restart")
                print(f"chameleon-ft: worker {self.worker_id}: rows {d['lost_rows']} cannot be recovered in "
                      f"memory ({why}); restarting from the disk checkpoint "
                      f"({d['candidates']['restart']['reason']})", file=sys.stderr, flush=True)
                if self.log:
                    self.log.write("shard_recovery", step=self.step, **d)
                payload["restart"] = True
                payload["decisions"].append({"event": {"kind": "shard_loss", "devices": payload["dead"]},
                                             "chosen": "restart", "candidates": [],
                                             "shard": payload["shard"]["decision"]})
        return payload

    def _shard_plan(self, view) -> dict:
        """The source's plan for the rows (first start, heal, recompute, rehabilitate)."""
        members = list(view.members)
        if self._live_start:  # a framework sharded the model over these members: rows in place
            return {"mode": "live"}
        if self.module is None:  # nobody holds sharded state: the source's unsharded model
            keys = _state_keys(self.optimizer, self.params)
            return {"mode": "init", "from": self.worker_id, "keys": keys,
                    "scalars": _scalars(self.optimizer, self.params, keys), "groups": self._groups_json(), "buffers": self._buffers(), "run": None}
        fields = dict(zip(members, self.peer_fields))
        rows = self.layout.shards
        holders: dict[int, list[int]] = {}
        snaps: dict[int, set] = {}
        snap_at: dict[tuple[int, int], tuple[int, str]] = {}
        for w in members:
            f = fields[w]
            if f[0] < 0 or [f[6], f[7]] != self.layout.to_json():
                continue
            holders.setdefault(f[0], []).append(w)
            for st in f[1:3]:
                if st >= 0:
                    snaps.setdefault(f[0], set()).add(st)
                    snap_at.setdefault((f[0], st), (w, "own"))
            for st in f[4:6]:
                if st >= 0 and f[3] >= 0:
                    snaps.setdefault(f[3], set()).add(st)
                    snap_at.setdefault((f[3], st), (w, "held"))
        lost = [k for k in range(rows) if k not in holders]
        lost_numel = sum(self.layout.numel(k) for k in lost)
        snap_step = sr.stale_snapshot(lost, snaps, self.step)
        facts = sr.ShardFacts(
            step=self.step, rows=rows, current=frozenset(holders), snapshots={k: sorted(v) for k, v in snaps.items()},
            step_s=self._median_step(), transfer_s=self._transfer_s,
            lost_fraction=lost_numel / max(1, self.layout.total),
            trend=sr.loss_trend(self.loss_history, at_snapshot=snap_step),
            checkpoint_step=self.last_checkpoint_step if self._has_checkpoint() else None,
            restart_s=self.policy.restart_s, allowed=self.paths, momentum=self._momentum(),
            warmup_steps=self.recipe.warmup_steps,
            restart_bias_correction=self.recipe.restart_bias_correction)
        d = sr.choose_recovery(facts)
        plan = {"mode": d.chosen, "decision": d.to_json(), "keys": list(self._current_keys()),
                "old": self.layout.to_json()}
        if d.chosen == "heal":
            plan["rows"] = [[k, min(holders[k]), "live", self.step] for k in range(rows)]
        elif d.chosen == "recompute":
            t = d.rollback_to
            plan["rows"] = [[k, *snap_at[(k, t)], t] for k in range(rows)]
            own = next((s for s in self._valid(self._own) if s["step"] == t), None)
            if own is None:  # the source's row was snapshotted at t by a replica only
                raise RuntimeError(f"worker {self.worker_id}: no own snapshot at step {t} to roll back to")
            plan.update(keys=list(own["keys"]), scalars=own["scalars"], groups=own["groups"],
                        buffers=own["buffers"], run=own["run"])
        elif d.chosen == "rehabilitate":
            plan["rows"] = []
            for k in range(rows):
                if k in holders:
                    plan["rows"].append([k, min(holders[k]), "live", self.step])
                else:
                    t = max(s for s in snaps[k] if s <= self.step)
                    plan["rows"].append([k, *snap_at[(k, t)], t])
        if d.chosen in ("heal", "rehabilitate"):
            plan.update(scalars=self._scalars(), groups=self._groups_json(), buffers=self._buffers(), run=None)
        return plan

    def _momentum(self) -> float:
        """The first-moment decay that rehabilitation's reset throws away (0 when kept)."""
        if not self.recipe.reset_first_moment:
            return 0.0
        g = self.optimizer.param_groups[0]
        if "betas" in g:
            return float(g["betas"][0])
        return float(g.get("momentum", 0.0) or 0.0)

    def _has_checkpoint(self) -> bool:
        return bool(self.checkpoint_path) and self.last_checkpoint_step > 0

    def _after_sync(self, payload: dict, top: int, n: int, r: int) -> None:
        self._discard()
        plan = payload.get("shard")
        if plan is None:
            return
        self._warm = None  # a repair in progress ends with the layout it was computed for
        self._repair_info = None
        if plan["mode"] == "live":
            self._live_start = False
            self._adopt_live(n, r)
            self._current_keys()
            if self.k:
                self._take_snapshot(wait=True)
            return
        t0 = time.perf_counter()
        new = _Layout(self._shapes, n, self._replicas_for(n))
        row = new.row_of(r)
        mine = self._assemble_row(plan, new, row)
        if plan["mode"] == "rehabilitate":
            self._repair(mine, plan, new, row)
        self._build(n, r)
        self._keys = list(plan["keys"])
        self._load_rows(mine, plan)
        if plan["mode"] == "rehabilitate":
            self._start_repair(plan)
        if plan["mode"] == "recompute":
            self._load_run(plan["run"])
            self._apply_allocation()  # the snapshot's sampler had the old members
            self.loss_history = [(s, v) for s, v in self.loss_history if s <= self.step]
        self._own, self._held, self._inflight = [], [], None
        self._transfer_s = time.perf_counter() - t0
        if self.k:
            self._take_snapshot(wait=True)  # the old snapshots are rows of the old layout
        d = plan.get("decision")
        if d is not None:
            self.last_shard_decision = {**d, "step": self.step, "transfer_s": self._transfer_s}
            if self._repair_info is not None:  # this member's part of the repair
                self.last_shard_decision["repair"] = self._repair_info
            if self.log and self._is_source:
                self.log.write("shard_recovery", **self.last_shard_decision)

    def _gather_rows(self, plan: dict, dst: _Layout, sink: Callable[[int, torch.Tensor], None]) -> None:
        """Every row of ``dst`` (parameters, then each tensor state), one at a time: one SUM
        all-reduce per row, to which exactly one member contributes each element (its source
        rows' overlap with it); ``sink(row, buffer)`` on every member.  At most one row's
        buffer is alive at a time, besides the member's own sources."""
        keys = plan["keys"]
        parts = 1 + len(keys)
        if plan["mode"] == "init":  # the source's unsharded model as one row
            src, sources = _Layout(self._shapes, 1, 1), []
            if self.worker_id == plan["from"]:
                state = lambda i, key: self.optimizer.state.get(self.params[i], {}).get(key)  # noqa: E731
                sources.append((0, _flatten(self.params, state, keys, self.dtype)))
        else:
            src = _Layout(self._shapes, *plan["old"])
            sources = [(k, self._row_source(kind, step, k, plan))
                       for k, w, kind, step in plan["rows"] if w == self.worker_id]
        for r in range(dst.shards):
            segs, m = dst.segments(r), dst.numel(r)
            buf = torch.zeros(parts * m, dtype=self.dtype)
            for k, vec in sources:
                _copy_overlaps(buf, m, segs, vec, src.numel(k), src.segments(k), parts)
            self._store_op(lambda b=buf: self.gm.allreduce(b, dist.ReduceOp.SUM, timeout_s=self.hang_timeout_s))
            sink(r, buf)

    def _assemble_row(self, plan: dict, dst: _Layout, row: int) -> torch.Tensor:
        """This member's ``row`` of the ``dst`` layout (every member calls it: a collective)."""
        kept: dict[int, torch.Tensor] = {}
        self._gather_rows(plan, dst, lambda r, buf: kept.__setitem__(r, buf) if r == row else None)
        return kept[row]

    def _assemble_full(self, plan: dict) -> torch.Tensor:
        """The whole flat state (parameters, then each tensor state) on every member: for an
        unsharded checkpoint and ``full_parameters``, which are whole by definition."""
        lay = _Layout(self._shapes, *plan["old"])
        parts, total = 1 + len(plan["keys"]), lay.total
        full = torch.zeros(parts * total, dtype=self.dtype)

        def put(r: int, buf: torch.Tensor) -> None:
            m, d = lay.numel(r), 0
            for a, b in lay.segments(r):
                for j in range(parts):
                    full[j * total + a:j * total + b] = buf[j * m + d:j * m + d + b - a]
                d += b - a
        self._gather_rows(plan, lay, put)
        return full

    def _row_source(self, kind: str, step: int, k: int, plan: dict) -> torch.Tensor:
        if kind == "live":
            return self._row_vector()
        pool = self._own if kind == "own" else self._held
        snap = [s for s in pool if s["step"] == step and s["k"] == k]
        if not snap:
            raise RuntimeError(f"worker {self.worker_id}: no {kind} snapshot of row {k} at step {step}")
        vec = snap[-1]["row"]
        if (kind == "held" and plan["mode"] == "rehabilitate" and self.recipe.extrapolate_snapshots >= 2):
            older = [s for s in pool if s["k"] == k and s["step"] < step]
            if older:
                prev = older[-1]
                m = _Layout(self._shapes, *plan["old"]).numel(k)
                frac = min(1.0, (self.step - step) / max(1, step - prev["step"]))
                vec = vec.clone()
                vec[:m] += self.recipe.damping * frac * (vec[:m] - prev["row"][:m])
        return vec

    def _repair(self, mine: torch.Tensor, plan: dict, new: _Layout, row: int) -> None:
        """Rehabilitation's optimizer repair on the lost rows' elements of this member's new
        ``row``: first moments (and other momentum-like states) reset, second moments
        (``*sq*``) kept."""
        m = new.numel(row)
        for at, n in _restored(plan, new, row):
            for j, key in enumerate(plan["keys"], start=1):
                second = "sq" in key
                if (second and not self.recipe.keep_second_moment) or (not second and self.recipe.reset_first_moment):
                    mine[j * m + at:j * m + at + n] = 0.0

    def _load_rows(self, mine: torch.Tensor, plan: dict) -> None:
        """This member's row (parameters, then each tensor state) into its sharded model and
        optimizer, with the plan's scalars, hyper-parameters and buffers."""
        m = self.layout.numel(self.row)
        with torch.no_grad():
            _unflatten_into(mine[:m], self._locals())
            if plan["keys"]:
                # Materialise the optimizer's state through its own code path, then overwrite.
                self._init_optimizer_state()
                for j, key in enumerate(plan["keys"], start=1):
                    _unflatten_into(mine[j * m:(j + 1) * m],
                                    [self._state_local(i, key) for i in range(len(self.shard_params))])
                for i, sc in (plan.get("scalars") or {}).items():
                    st = self.optimizer.state[self.shard_params[int(i)]]
                    for key, v in sc.items():
                        st[key] = v.clone() if isinstance(v, torch.Tensor) else v
            for g, saved in zip(self.optimizer.param_groups, plan.get("groups") or []):
                g.update({k: v for k, v in saved.items()})
            bufs = dict(self.module.named_buffers())
            for name, b in (plan.get("buffers") or {}).items():
                if name in bufs:
                    bufs[name].copy_(b)

    def _init_optimizer_state(self) -> None:
        """Let the optimizer create its per-parameter state (one step with zero gradients and
        zero learning rate), so that its tensors exist with the right placement."""
        saved = [g["lr"] for g in self.optimizer.param_groups]
        params = [p.detach().clone() for p in self._locals()]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        for p in self.shard_params:
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for g, lr in zip(self.optimizer.param_groups, saved):
            g["lr"] = lr
        with torch.no_grad():
            for t, v in zip(self._locals(), params):
                t.copy_(v)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The whole parameters by name, gathered from the shards (a collective: every member
        calls it at the same point)."""
        return self._split(self._assemble_full(self._live_plan([])), 0)

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The whole parameters by name and the optimizer's whole state in torch's
        ``state_dict`` format (state by parameter index, ``param_groups``), gathered from the
        rows (a collective: every member calls it at the same point; a framework's unsharded
        checkpoint)."""
        keys = self._current_keys()
        full = self._assemble_full(self._live_plan(keys))
        params = self._split(full, 0)
        per_key = {key: self._split(full, j) for j, key in enumerate(keys, start=1)}
        scalars = self._scalars()
        state = {}
        for at, i in enumerate(self._torch_order()):
            if not self.optimizer.state.get(self.shard_params[i]):
                continue
            st = {key: per_key[key][self._names[i]] for key in keys}
            st.update(scalars.get(i, {}))
            state[at] = st
        return params, {"state": state, "param_groups": self.optimizer.state_dict()["param_groups"]}

    def load_full_state(self, params: dict[str, torch.Tensor], optim: Optional[dict]) -> None:
        """Load a ``full_state`` (whole tensors) into this member's rows of the layout it holds
        now (no collective: each member keeps its own slices)."""
        keys = sorted({k for st in (optim or {}).get("state", {}).values() for k, v in st.items()
                       if isinstance(v, torch.Tensor) and v.dim() > 0})
        order = self._torch_order()
        by_param = {order[int(at)]: st for at, st in (optim or {}).get("state", {}).items()}
        state = lambda i, key: by_param.get(i, {}).get(key)  # noqa: E731
        whole = _Layout(self._shapes, 1, 1)
        tensors = [params[n].to(self.dtype) if n in params else torch.zeros(shape, dtype=self.dtype)
                   for n, shape in zip(self._names, self._shapes)]
        full = _flatten(tensors, state, keys, self.dtype)
        m = self.layout.numel(self.row)
        row = torch.zeros((1 + len(keys)) * m, dtype=self.dtype)
        _copy_overlaps(row, m, self.layout.segments(self.row), full, whole.total, whole.segments(0), 1 + len(keys))
        scalars = {i: {k: v for k, v in st.items() if k not in keys} for i, st in by_param.items()}
        groups = (optim or {}).get("param_groups") or []
        self._keys = keys
        self._load_rows(row, {"keys": keys, "scalars": scalars,
                              "groups": [{k: v for k, v in g.items() if k != "params"} for g in groups],
                              "buffers": None})

    def _torch_order(self) -> list[int]:
        """Our parameter index of each of torch's (its ``state_dict`` numbers parameters
        across the param groups, in order)."""
        return [i for g in self._opt_groups for i in g]

    def _live_plan(self, keys: list[str]) -> dict:
        """Every row from its holder in replica group 0 (ranks 0..S-1), as it is now."""
        members = list(self.view.members)
        return {"mode": "heal", "keys": list(keys), "old": self.layout.to_json(),
                "rows": [[k, members[k], "live", self.step] for k in range(self.layout.shards)]}

    def _split(self, full: torch.Tensor, j: int) -> dict[str, torch.Tensor]:
        """Part ``j`` of an assembled flat state (0: parameters, then each state) by name."""
        at = j * self.layout.total
        return {n: full[at + o:at + o + k].view(shape).clone() for n, o, k, shape in
                zip(self._names, self.layout.offsets, self.layout.numels, self._shapes)}

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: str) -> None:
        """Call on every member at the same step: the rows are gathered (one all-reduce) and
        the lowest-ranked member writes the whole, unsharded run state (loadable with
        ``weights_only=True``; any world size resumes from it).  A failure during the gather
        recovers like a failed step and leaves the previous checkpoint in place."""
        self._current_keys()
        t0 = time.perf_counter()
        try:
            full = self._assemble_full(self._live_plan(self._keys))
        except CollectiveFailure as failure:
            self._recover(failure, t0)
            return
        self.last_checkpoint_step = self.step
        if self.rank != 0:
            return
        run_state.save_checkpoint(path, {
            "sharded": True, "names": list(self._names), "params": self._split(full, 0),
            "state": {key: self._split(full, j) for j, key in enumerate(self._keys, start=1)},
            "scalars": self._scalars(), "groups": self._groups_json(), "buffers": self._buffers(),
            "run": self._run_state(), "engine": self.policy.state_dict()})

    def load_checkpoint(self, path: str) -> None:
        """Resume from ``path`` before ``start()`` (a ``CheckpointError`` names what is wrong
        with the file); the first generation shards it over whoever is there."""
        s = run_state.load_checkpoint(path)
        if not s.get("sharded") or list(s.get("names", [])) != self._names:
            raise run_state.CheckpointError(f"{path}: not a checkpoint of this sharded model")
        with torch.no_grad():
            for name, p in zip(self._names, self.params):
                p.copy_(s["params"][name])
            bufs = dict(self.model.named_buffers())
            for name, b in s["buffers"].items():
                if name in bufs:
                    bufs[name].copy_(b)
        for i, (name, p) in enumerate(zip(self._names, self.params)):
            st = {key: s["state"][key][name].clone() for key in s["state"]}
            st.update(s["scalars"].get(i, {}))
            self.optimizer.state[p] = st
        for g, saved in zip(self.optimizer.param_groups, s["groups"]):
            g.update(saved)
        self._load_run(s["run"])
        self.policy.load_state_dict(s["engine"])
        self.policy.plan = None


def _overlaps(src: list[tuple[int, int]], dst: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(offset in the source row, offset in the destination row, length) of every flat range
    two rows share; both are segment lists of the same parameters (``_Layout.segments``)."""
    out, so, do = [], 0, 0
    for (a1, b1), (a2, b2) in zip(src, dst):
        lo, hi = max(a1, a2), min(b1, b2)
        if lo < hi:
            out.append((so + lo - a1, do + lo - a2, hi - lo))
        so, do = so + b1 - a1, do + b2 - a2
    return out


def _copy_overlaps(dst: torch.Tensor, m: int, dst_segs, src: torch.Tensor, mk: int, src_segs,
                   parts: int) -> None:
    """Copy into ``dst`` (``parts`` blocks of ``m``: parameters, then each state) what the
    source row ``src`` (blocks of ``mk``) shares with it.  A snapshot taken before the
    optimizer had state carries the parameters only: its missing blocks are left alone."""
    avail = min(parts, src.numel() // mk) if mk else 0
    for so, do, n in _overlaps(src_segs, dst_segs):
        for j in range(avail):
            dst[j * m + do:j * m + do + n] = src[j * mk + so:j * mk + so + n]


def _restored(plan: dict, new: _Layout, row: int) -> list[tuple[int, int]]:
    """(offset, length) in ``new``'s ``row`` of the elements a rehabilitation restored from a
    stale snapshot (the plan's lost rows of the old layout)."""
    old = _Layout(new.shapes, *plan["old"])
    return [(at, n) for k in plan["decision"]["lost_rows"]
            for _, at, n in _overlaps(old.segments(k), new.segments(row))]


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().contiguous().view(torch.uint8).numpy().tobytes())


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _state_keys(optimizer: torch.optim.Optimizer, params) -> list[str]:
    """The optimizer's per-parameter states shaped like their parameter (sharded like it)."""
    keys = set()
    for p in params:
        for k, v in optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and _local(v).shape == _local(p).shape:
                keys.add(k)
    return sorted(keys)


def _scalars(optimizer: torch.optim.Optimizer, params, keys) -> dict:
    """Per-parameter optimizer state that is not sharded (e.g. Adam's step), by index."""
    return {i: {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                for k, v in optimizer.state.get(p, {}).items() if k not in keys}
            for i, p in enumerate(params)}


def _flatten(tensors, state: Callable[[int, str], Optional[torch.Tensor]], keys, dtype) -> torch.Tensor:
    """``tensors`` flattened, then for each key every tensor's state (zeros where it has none)."""
    parts = [t.detach().reshape(-1) for t in tensors]
    for key in keys:
        for i, t in enumerate(tensors):
            v = state(i, key)
            parts.append(_local(v).detach().reshape(-1) if v is not None else torch.zeros(t.numel(), dtype=dtype))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)


def _unflatten_into(flat: torch.Tensor, tensors) -> None:
    """Copy consecutive pieces of ``flat`` into ``tensors`` (in place)."""
    at = 0
    for t in tensors:
        t.copy_(flat[at:at + t.numel()].view_as(t))
        at += t.numel()


# The old name, kept working with a deprecation warning.
__getattr__ = renamed_getattr(__name__, {"ShardedContext": "ShardedExecutor"})
