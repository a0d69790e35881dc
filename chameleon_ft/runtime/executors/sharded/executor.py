"""``ShardedExecutor``: FSDP2 / HSDP training on the shared recovery core, surviving failures.

The model is sharded with ``torch.distributed.fsdp.fully_shard`` on a device mesh: over all
members (``replicas=1``), or HSDP (``replicas=R``: R replica groups, each sharding the model
over ``world / R`` members).  Every step each member runs its whole share of the global batch
as one forward/backward (a member with no samples runs a zero-weight one: FSDP's collectives
need every member), then the core's one small all-reduce commits the step (``recovery.py``).

The package, one concept a module: ``comms`` (FSDP's collectives on our gloo group, failing
fast, and the no-communication world the device mesh is built on, re-created per generation),
``layout`` (the flat *rows* of the state: chunk ``k`` of every parameter and optimizer tensor,
held by the members with ``rank % S == k``), ``snapshots`` (every ``K`` committed steps each
member sends a copy of its row to its buddy, the next rank; ``K`` is Young/Daly's optimum from
the measured snapshot cost and the engine's failure rate unless given), ``rows`` (the re-shard:
one SUM all-reduce per new row, in memory), ``repair`` (rehabilitation's repair), ``whole``
(unsharded checkpoints and ``full_state``) and this module (the executor: the model, the step,
the recovery hooks).

**After a failure** the survivors agree on the step (the commit protocol: a member that missed
the last commit applies its held gradients), the source prices heal / recompute / rehabilitate /
restart (``shard_recovery.choose_recovery``) and every member carries the choice out:

* heal: rows come from their surviving replicas (HSDP); exact.
* recompute: every row from its snapshot at the common step ``t_c``; the sampler, scheduler,
  RNG and counters roll back with it; the steps since are redone; exact.
* rehabilitate: lost rows from their buddy's stale snapshot (``rehab.RehabRecipe``: optionally
  extrapolated, first moments reset, second moments kept; their updates then get a restarted
  bias correction and a linear learning-rate warm-up, ``_repair_update``); everything else
  stays current; no rollback.  The predicted steps to close the loss gap are logged.
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
optimizers keep one step counter and learning rate per parameter); a second failure before the
post-recovery snapshot leaves no snapshot (heal or the disk checkpoint then); buffers are taken
from one member.
"""

from __future__ import annotations


import collections
import copy
import math
import sys
import time
from typing import Callable, Optional

import torch

from chameleon_ft.engine import shard_recovery as sr
from chameleon_ft.engine.rehab import RehabRecipe
from chameleon_ft.runtime.errors import ConfigError
from chameleon_ft.runtime.executors.sharded.comms import FsdpComms, _fsdp, no_comm_world
from chameleon_ft.runtime.executors.sharded.layout import _Layout, _flatten, _local, _scalars, _state_keys
from chameleon_ft.runtime.executors.sharded.repair import _RehabRepair
from chameleon_ft.runtime.executors.sharded.rows import _Reshard
from chameleon_ft.runtime.executors.sharded.snapshots import _KEEP, _BuddySnapshots
from chameleon_ft.runtime.executors.sharded.whole import _WholeState
from chameleon_ft.runtime.groups import CollectiveFailure
from chameleon_ft.runtime.recovery import ElasticConfig, RecoveryCore, seed_generators
from chameleon_ft.runtime.sampler import StepItem, step_items

__all__ = ["ShardedExecutor", "SHARDED_POLICIES"]

# The engine's data policies a sharded job can carry out (any membership: a re-shard).
SHARDED_POLICIES = frozenset({"reroute", "restart", "keep", "rebalance", "heal", "grow"})
_DEFAULT_K = 10  # snapshot interval before the cost and the step time are measured
# The first trained snapshot, whatever K: a failure before step K then restores lost rows from a
# trained step, not from the initial state (which the engine never rehabilitates from).
_FIRST_SNAPSHOT = 2


class ShardedExecutor(_BuddySnapshots, _Reshard, _RehabRepair, _WholeState, RecoveryCore):
    """FSDP2 (``replicas=1``) or HSDP (``replicas=R``) training that survives failures (module doc).

    Args:
        model: the unsharded model (CPU); it is the template of every generation's sharded copy
            and is left as given.
        optimizer: built over ``model``'s parameters; every generation rebinds it, the same
            object, to its sharded parameters (``self.optimizer is optimizer``).
        snapshot_every: steps between snapshots (K); None: Young/Daly's optimum from the measured
            snapshot cost and the engine's failure rate, bounded by the run (at least
            ``shard_recovery.SNAPSHOTS_PER_RUN`` snapshots over ``planned_steps``).
        recipe: how rehabilitated rows are repaired.
    """

    # Between two syncs every member runs FSDP's collectives and the commit, in one order
    # (no adapter's control collectives): the commit needs no header exchange.
    step_header = None
    POLICIES = SHARDED_POLICIES

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset_len: int,
                 global_batch: int, micro_batch: int, *, replicas: int = 1,
                 snapshot_every: Optional[int] = None, recipe: Optional[RehabRecipe] = None,
                 scheduler=None, seed: int = 0, shuffle: bool = True, drop_last: bool = False,
                 config: Optional[ElasticConfig] = None, env=None, user_loop: bool = False):
        cfg = copy.copy(config) if config is not None else ElasticConfig()
        cfg.allowed_policies = SHARDED_POLICIES & frozenset(cfg.allowed_policies or SHARDED_POLICIES)
        super().__init__(model, optimizer, dataset_len, global_batch, micro_batch, scheduler=scheduler,
                         seed=seed, shuffle=shuffle, drop_last=drop_last, config=cfg, env=env,
                         user_loop=user_loop)
        if replicas < 1:
            raise ConfigError(f"replicas must be >= 1, got {replicas}")
        if snapshot_every is not None and snapshot_every < 0:
            raise ConfigError(f"snapshot_every must be >= 0 (0: no snapshots), got {snapshot_every}")
        self.replicas = int(replicas)
        self.snapshot_every = snapshot_every
        self.recipe = recipe or RehabRecipe()
        self.paths = frozenset(cfg.shard_recovery or sr.PATHS)
        # The model's device: every generation's shards live there; snapshots and the rows a
        # re-shard streams stay in host memory (what gloo carries).
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
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
        self._heal = None  # the HealCheck of the last rehabilitation, while it is watched
        self._fallback: Optional[dict] = None  # the recompute still possible while it is watched
        self.heal_scale = 1.0  # measured / predicted heal steps of the last one (the next prediction's)
        self.heal_checks: list[dict] = []  # every heal_check record of this run
        self.commit_sums: list[float] = []  # the last commit's reduced token count and extras
        self._init_mesh, self._fully_shard = _fsdp()[:2]

    # ---------------------------------------------------------------- the model
    def _replicas_for(self, n: int) -> int:
        return max(r for r in range(1, min(self.replicas, n) + 1) if n % r == 0)

    def _build(self, n: int, rank: int) -> None:
        """This generation's sharded model (uninitialised storage) and optimizer."""
        self._set_layout(n, rank)
        no_comm_world(rank, n)
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
        """``model`` on the meta device, its tied parameters (one object under several names:
        an LM's embedding and output layer) tied again (the conversion unties them)."""
        template = copy.deepcopy(model).to("meta")
        first: dict[int, tuple[str, str]] = {}
        for mod_name, mod in model.named_modules():
            for p_name, p in mod.named_parameters(recurse=False):
                if id(p) not in first:
                    first[id(p)] = (mod_name, p_name)
                    continue
                owner, attr = first[id(p)]
                setattr(template.get_submodule(mod_name), p_name,
                        getattr(template.get_submodule(owner), attr))
        return template

    def _make_mesh(self, n: int):
        if self.layout.replicas == 1:
            return self._init_mesh(self.device.type, (n,), mesh_dim_names=("shard",))
        return self._init_mesh(self.device.type, (self.layout.replicas, self.layout.shards),
                               mesh_dim_names=("replicate", "shard"))

    def _make_module(self, mesh) -> torch.nn.Module:
        """A fresh sharded copy of the template: one FSDP unit per top-level child with
        parameters, plus the root; storage uninitialised (``_load_rows`` fills it)."""
        module = copy.deepcopy(self._template)
        for unit in [module.get_submodule(name) for name in self._wrap] + [module]:
            self._fully_shard(unit, mesh=mesh)
        module.to_empty(device=self.device)
        return module

    def _locals(self) -> list[torch.Tensor]:
        return [p.to_local() for p in self.shard_params]

    def _state_local(self, i: int, key: str) -> Optional[torch.Tensor]:
        v = self.optimizer.state.get(self.shard_params[i], {}).get(key)
        return None if v is None else _local(v)

    def _row_vector(self) -> torch.Tensor:
        """This member's row: its parameter shards, then each optimizer tensor state's."""
        return _flatten(self._locals(), self._state_local, self._current_keys(), self.dtype)

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
        indices)`` is the mean loss of those samples, or ``(sum, count)`` over their items: a
        token-weighted step, divided by the global batch's count), then commit.  True when
        committed; False when a failure interrupted it (the job reconfigured; run it again)."""
        t0 = self.begin_step()
        item = self.share()
        weight = item.weight
        indices = item.indices if not item.ghost else ghost_indices
        if self.cfg.seed_microbatches:
            seed_generators(hash((self.seed, self.step, item.seed_slot if not item.ghost else -1)) % (2**63))
        try:
            self.faults.at(self.step, "forward")
            loss, tokens = loss_of(self.module, indices), 0.0
            if isinstance(loss, tuple):  # (sum over the items, their count)
                loss, weight, tokens = loss[0], float(not item.ghost), float(loss[1]) * (not item.ghost)
            (loss * weight).backward()
        except Exception as exc:
            return self.interrupted(exc, t0)
        return self.commit(float(loss.detach()) * weight, t0, len(item.parts), list(item.indices), tokens=tokens)

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
               update: Optional[Callable[[], None]] = None, tokens: float = 0.0, extra=()) -> bool:
        """Commit the step whose gradients this member computed (its ``weighted_loss``: its
        samples' share of the global mean loss): the snapshot in flight completes, the
        all-reduce agrees, then ``update`` (default ``optimizer.step()``) runs.  True when
        committed; False when a failure interrupted it (the job reconfigured; redo).

        ``tokens``: this member's item count of a token-weighted step (its losses weighted by
        their counts): the reduced count divides the gradients and the loss before the update.
        ``extra``: more numbers summed over the members in the same all-reduce (the same
        count on every member), read back as ``commit_sums[1:]`` (``commit_sums[0]`` is the
        token count)."""
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
        parts = torch.tensor([weighted_loss, self.snapshot_cost_s or 0.0, tokens, *extra], dtype=self.dtype)
        reduced = self._reduce_step([parts], self._compute_s)
        if reduced is None:
            self._grads_ready = False
            return False
        buf, timings, comm = reduced
        self.commit_sums = buf[2:].tolist()
        self._apply_update()
        self._finish_step(timings, comm)
        loss = float(buf[0]) / (self.commit_sums[0] if self.commit_sums[0] > 0 else 1.0)
        self._after_commit_sharded(loss, float(buf[1]) / max(1, self.view.world_size))
        return True

    def _apply_update(self) -> None:
        tokens = self.commit_sums[0] if self.commit_sums else 0.0
        if tokens > 0:  # a token-weighted step: the global batch's token mean
            with torch.no_grad():
                for p in self.shard_params:
                    if p.grad is not None:
                        p.grad.div_(tokens)
        before = self._restored_values()
        with self.faults.phase(self.step, "optimizer"):  # a ``slow`` fault can pad the update
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

    def _after_commit_sharded(self, loss: float, snap_cost: float) -> None:
        self.loss_history.append((self.step, loss))
        del self.loss_history[:-400]
        if self._heal is not None:
            for rec in self._heal.observe(self.step, loss):
                self._report_heal(rec)
        if self._prev_step > 0:
            self._step_times.append(self._prev_step)
            del self._step_times[:-20]
        if snap_cost > 0:
            self.snapshot_cost_s = snap_cost
        if self.snapshot_every is None:
            if self.snapshot_cost_s and self._step_times:
                self.k = sr.snapshot_interval(self.snapshot_cost_s, self.policy.mttf(), self._median_step(),
                                              run_steps=self.planned_steps)
            elif self.planned_steps:  # not measured yet: the prior, bounded by the run as well
                self.k = max(1, min(_DEFAULT_K, self.planned_steps // sr.SNAPSHOTS_PER_RUN))
        if self.k and (self.step % self.k == 0 or self.step == min(self.k, _FIRST_SNAPSHOT)):
            try:
                self._take_snapshot(wait=False)
            except CollectiveFailure as failure:  # the buddy died after the step committed:
                self._inflight = None             # the step stands; the job recovers from here
                self.recover(failure)
                return
        if self._fallback is not None and self._fallback.get("due"):
            self._fall_back()

    def _before_leave(self, leavers: tuple[int, ...]) -> None:
        """A leave announced in the commit just made: every member snapshots its row at this
        step (each to its buddy), so that the recovery after the leave finds the leavers' rows
        at this step (a recompute from here redoes nothing; HSDP heals from the replica
        anyway).  An all-reduce after it tells every member that every transfer arrived: the
        leaver's exit must not cut one short (a process that exits with unread data on a socket
        resets it).  A failure here leaves the older snapshots to decide from."""
        if self.module is None or self.view.world_size < 2:
            return
        try:
            self._take_snapshot(wait=True)
            self._meet()
        except CollectiveFailure:
            self._inflight = None

    def _report_heal(self, rec: dict) -> None:
        """A heal check's record: every member keeps it (the loss is the global one, so all
        agree: they fall back together, at the same step) and calibrates the next prediction
        with it; the lowest rank says it."""
        self.heal_checks.append(rec)
        can_fall_back = self._fallback is not None
        if rec["fallback"] and can_fall_back:
            self._fallback["due"] = rec
        if rec["kind"] == "end" or rec["fallback"]:
            if rec.get("ratio") is not None:
                self.heal_scale = min(20.0, max(0.25, rec["ratio"]))
            self._heal = None
            if not rec["fallback"]:
                self._fallback = None  # the heal is over: the old layout's snapshots go
        if self.view.rank != 0:
            return
        lo, hi = rec["lag_interval"]
        lag = (f"{rec['lag']:.1f} steps behind the failure-free trend (95 % interval {lo:.1f}..{hi:.1f}"
               f"{'' if rec['informative'] else ', too noisy to calibrate on'})")
        if rec["kind"] == "check":
            state = "on track" if rec["on_track"] else "NOT on track"
            msg = (f"heal {state} at step {rec['step']}: {lag}; predicted {rec['predicted_heal_steps']:.1f}, "
                   f"at most {rec['bound']:.1f} expected")
        else:
            msg = (f"heal {'done' if rec['healed'] else 'NOT done'} at step {rec['step']}: {lag}; predicted "
                   f"{rec['predicted_heal_steps']:.1f}; the next rehabilitation's estimate is scaled by {self.heal_scale:.2f}")
        if rec["fallback"]:
            msg += (f"; rolling back to the snapshots of step {rec['fallback_step']} and recomputing (fewer steps "
                    f"than the lag)" if can_fall_back else "; no snapshot to roll back to is left: training goes on")
        elif not rec["on_track"]:
            msg += "; rolling back would lose more than the lag: training goes on"
        print(f"chameleon-ft: worker {self.worker_id}: {msg}", file=sys.stderr, flush=True)
        if self.log:
            self.log.write("heal_check", **rec)

    def _fall_back(self) -> None:
        """The heal is not closing and a recompute still costs less: every member, at the
        same committed step, rolls back to the fallback snapshots (the old layout's, kept since
        the rehabilitation) into the current layout, and the steps since are redone.  A
        failure meanwhile is recovered as any other (from the rehabilitated state)."""
        fb, self._fallback = self._fallback, None
        plan, rec = fb["plan"], fb["due"]
        t0, at = time.perf_counter(), self.step
        try:
            self._complete_snapshot()
            mine = self._assemble_row(plan, self.layout, self.row, fb["sources"])
            self._load_rows(mine, plan)
            self._warm = None
            self._roll_back(plan)
            self.rollbacks += 1  # the redone steps are new attempts of this generation
            self._own, self._held, self._inflight = [], [], None
            if self.k:
                self._take_snapshot(wait=True)
        except CollectiveFailure as failure:
            self.recover(failure)
            return
        d = {**(self.last_shard_decision or {}), "chosen": "recompute", "fallback": True,
             "rollback_to": plan["t"], "failed_heal": rec, "step": at, "transfer_s": time.perf_counter() - t0}
        self.last_shard_decision = d
        if self.view.rank == 0 and self.log:
            self.log.write("shard_recovery", **d)

    def _roll_back(self, plan: dict) -> None:
        """A recompute's run state: sampler, scheduler, RNG and counters of the snapshot."""
        self._load_run(plan["run"])
        self.apply_allocation()  # the snapshot's sampler may have had other members
        self.loss_history = [(s, v) for s, v in self.loss_history if s <= self.step]

    def _median_step(self) -> float:
        s = sorted(self._step_times) or [0.1]
        return s[len(s) // 2]

    # ---------------------------------------------------------------- recovery hooks
    def recovery_fields(self) -> list[int]:
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
        s["heal_scale"] = self.heal_scale  # the gap model's calibration on this job
        s["commit_sums"] = list(self.commit_sums)  # an adopting member's update needs them
        return s

    def load_state_dict(self, s: dict) -> None:
        if self._grads_ready and int(s["step"]) == self.step + 1 and self.module is not None:
            self.commit_sums = [float(v) for v in s.get("commit_sums") or []]
            # A peer committed the step this member's gradients are for: apply them (the
            # commit protocol's adoption, without moving any state).
            self._apply_update()
        self._load_run(s)
        self.policy.load_state_dict(s["engine"])
        self.heal_scale = float(s.get("heal_scale", self.heal_scale))

    def _discard(self) -> None:
        if self.module is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self._grads_ready = False
        self._step_start = None
        self._compute_s, self._n_mb, self._ids = 0.0, 0, []

    def source_payload(self, view, info) -> dict:
        payload = super().source_payload(view, info)
        if not payload["restart"]:
            payload["shard"] = self._shard_plan(view)
            if payload["shard"]["mode"] == "rehabilitate":
                # Every member watches the heal on the same trend: the source's losses (a member
                # that was a step behind, or adopted one, had another history and another check -- seen).
                payload["shard"]["heal_history"] = [[int(k), float(v)]
                                                    for k, v in sr.heal_points(self.loss_history, self.step)]
            if payload["shard"]["mode"] == "restart":
                d = payload["shard"]["decision"]
                why = "; ".join(f"{k}: {c['reason']}" for k, c in d["candidates"].items() if k != "restart")
                how = (f"restarting from the disk checkpoint ({d['candidates']['restart']['reason']})"
                       if self._has_checkpoint() else "and there is no disk checkpoint: the job stops to be "
                       "started again from the beginning (the launcher's --max-restarts does it)")
                print(f"chameleon-ft: worker {self.worker_id}: rows {d['lost_rows']} cannot be recovered in "
                      f"memory ({why}); {how}", file=sys.stderr, flush=True)
                if self.log:
                    self.log.write("shard_recovery", step=self.step, **d)
                payload["restart"] = True
                payload["decisions"].append({"event": {"kind": "shard_loss", "devices": payload["dead"]},
                                             "chosen": "restart", "candidates": [],
                                             "shard": payload["shard"]["decision"]})
        return payload

    def _has_checkpoint(self) -> bool:
        return bool(self.checkpoint_path) and self.last_checkpoint_step > 0

    def carry_out(self, payload: dict, top: int, n: int, r: int) -> None:
        self._discard()
        plan = payload.get("shard")
        if plan is None:
            return
        self._warm = None  # a repair in progress ends with the layout it was computed for
        self._repair_info = None
        self._fallback = None  # and so does a heal's fallback (its rows are of an older layout)
        if plan["mode"] == "live":
            self._live_start = False
            self._adopt_live(n, r)
            self._current_keys()
            if self.k:
                self._take_snapshot(wait=True)
            return
        t0, at = time.perf_counter(), self.step  # the failure's step (a recompute rolls back from it)
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
        decided = plan.get("decision") or {}
        heal = decided.get("predicted_heal_steps")
        fallback = plan.get("fallback") if plan["mode"] == "rehabilitate" else None
        trend = [(int(k), float(v)) for k, v in plan.get("heal_history", ())] or self.loss_history
        self._heal = (sr.heal_check(trend, self.step, heal,
                                    fallback_step=None if fallback is None else fallback["t"],
                                    path=decided.get("heal_path") or ())
                      if plan["mode"] == "rehabilitate" and heal is not None else None)
        # The old layout's snapshots this member contributes to that recompute, kept (and only
        # they) while the heal is watched.
        self._fallback = ({"plan": fallback, "sources": self._plan_sources(fallback)}
                          if fallback is not None and self._heal is not None else None)
        if plan["mode"] == "recompute":
            self._roll_back(plan)
        self._own, self._held, self._inflight = [], [], None
        self._transfer_s = time.perf_counter() - t0
        if self.k:
            self._take_snapshot(wait=True)  # the old snapshots are rows of the old layout
        d = plan.get("decision")
        if d is not None:
            self.last_shard_decision = {**d, "step": at, "transfer_s": self._transfer_s}
            if self._repair_info is not None:  # this member's part of the repair
                self.last_shard_decision["repair"] = self._repair_info
            if self._is_source:
                unchecked = ("; the heal is not checked: the loss has no decreasing trend to measure a lag against"
                             if plan["mode"] == "rehabilitate" and heal and self._heal is None else "")
                print(f"chameleon-ft: worker {self.worker_id}: {sr.describe(d)}{unchecked}", file=sys.stderr, flush=True)
                if self.log:
                    self.log.write("shard_recovery", **self.last_shard_decision)
