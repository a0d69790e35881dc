"""``PipelineExecutor``: one worker of a DP x PP job that survives failures in place.

The user gives the model as an ordered list of blocks (an ``nn.Sequential``: embedding, N
transformer blocks, head); the engine's plan decides the layout -- pipelines of stages holding
contiguous blocks, possibly of different depths and splits, and how many micro-batches each
pipeline runs.  A worker materialises only the blocks of its slot (``blocks.py``: per-block
factories or a model on the ``meta`` device; a built model is released to ``meta`` after the
first plan), so a block a worker newly holds really arrives from a peer.

A step (``train_step``): the schedule's routes (``schedule.py``) and this worker's 1F1B task
order run in ``executor.run_step``; then each block's gradient is summed among its replicas
only (``reduce.py``: one all-reduce per set of holders, over a subgroup) -- each pipeline holds
each block once, so the sum is the block's gradient over the whole global batch; then one small
all-reduce over every member (loss, calibration, timings) commits the step, and each held
block's own optimizer steps.  The commit is atomic as in data parallelism
(``runtime/recovery.py``): a member that a failure left one step behind holds its blocks'
reduced gradients of that step and applies them (roll-forward), so no step is half applied.

Recovery is the shared protocol (membership, group rebuild, step agreement, the engine's
Decision shipped by the source).  The recovery all-reduce carries which blocks each member holds;
the source turns the new plan into transfers: the engine's own migration plan for a re-plan
(optimal assignment, colouring rounds) when the holdings are those of the old plan, otherwise
``engine.migration.transfers_to`` (a replacement, or a migration a second failure interrupted).  Every
member then runs the rounds (``migration.py``: weights, optimizer and scheduler state of whole
blocks, point to point, only what is missing) and drops the blocks its slot no longer has.
Reroute needs no transfer: the dead stage's micro-batches get a same-stage peer in the routes.

With ``ElasticConfig.overlap_migration`` the job trains on, rerouted, while the state moves, and
switches at a step boundary (``overlap.py``).

Limits, honestly: shrink is off; a straggler rebalance moves micro-batches between the running
pipelines, no state (docs/runtime-pipeline.md); no gradient clipping over the whole model (each
block's optimizer is its own).
"""

from __future__ import annotations


import inspect
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from chameleon_ft.engine.plan import Plan
from chameleon_ft.engine.migration import critical_path, held_state, transfers_to
from chameleon_ft.runtime.errors import ConfigError
from chameleon_ft.runtime.groups import CollectiveFailure
from chameleon_ft.runtime import codec as run_state
from chameleon_ft.runtime.executors.pipeline import checkpoint as ckpt, migration, overlap
from chameleon_ft.runtime.executors.pipeline.blocks import Blocks
from chameleon_ft.runtime.executors.pipeline.holdings import covers, held_ranges
from chameleon_ft.runtime.executors.pipeline.calibration import calibration_row, read_rows
from chameleon_ft.runtime.executors.pipeline.reduce import CommitPosts, holder_sets, reduce_sets
from chameleon_ft.runtime.executors.pipeline.step import PROBE_STEP, link_pairs, probe_links, probe_size, run_step
from chameleon_ft.engine.schedule import routes, worker_orders
from chameleon_ft.runtime.recovery import ElasticConfig, RecoveryCore, seed_generators

__all__ = ["PipelineExecutor"]

class _HeldOptimizers:
    """The per-block optimizers of the blocks a worker holds, seen as one optimizer by the
    shared recovery code (``zero_grad`` after a discarded step)."""

    def __init__(self, ctx: "PipelineExecutor"):
        self.ctx = ctx

    def zero_grad(self, set_to_none: bool = True) -> None:
        for b in self.ctx.held:
            for p in self.ctx.blocks[b].parameters():
                p.grad = None

    @property
    def param_groups(self) -> list:
        return [g for o in self.ctx.block_opt.values() for g in o.param_groups]


def _optimizer_factory(optimizer) -> Callable:
    if isinstance(optimizer, torch.optim.Optimizer):
        if len(optimizer.param_groups) != 1:
            raise ConfigError("a pipeline job rebuilds the optimizer per block from its class and "
                              "defaults: give one parameter group, or a factory fn(params)")
        cls = type(optimizer)
        # Only what the constructor takes (``defaults`` may hold derived entries, e.g. AdamW's
        # ``decoupled_weight_decay``).
        accepted = inspect.signature(cls.__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        return lambda params: cls(params, **defaults)
    if callable(optimizer):
        return optimizer
    raise ConfigError(f"optimizer must be a torch optimizer or fn(params), got {type(optimizer).__name__}")


class PipelineExecutor(RecoveryCore):
    """One worker of an elastic DP x PP job (see module doc).

    Args:
        blocks: the model's ordered blocks: a list of per-block factories ``fn() -> module``
            (each holder builds its blocks under the block's seed; nothing else is
            materialised), an ``nn.Sequential`` built on the ``meta`` device (held blocks are
            ``reset_parameters()``-initialised), or a built ``nn.Sequential`` / list of modules
            (the lowest worker's blocks are sent to every other holder once at start).  See
            ``blocks.py``.
        optimizer: an optimizer over the model (its class and defaults are reused per block)
            or ``fn(params) -> optimizer`` (e.g. ``functools.partial(torch.optim.AdamW, lr=...)``).
        dataset, collate_fn: micro-batch ``i`` is ``collate_fn([dataset[k] for k in ids])``.
        input_fn: the first block's input from a batch (default ``batch[0]``).
        loss_fn: ``loss_fn(last block's output, batch)``, the micro-batch's mean loss.
        stages: depth of the first plan's pipelines.
        scheduler: optional ``fn(optimizer) -> LR scheduler`` (one per block, stepped together).
        device: where held blocks live (default: a built model's device; for factories and
            meta models the local CUDA device when there is one, else the CPU).
    """

    # No shrink (the global batch is kept); a rebalance moves micro-batches only (module doc).
    # ``restart`` is a choice only once checkpoints are written (``allow_restart``); without
    # them it would start the job over (it stays the fallback when nothing in place is feasible).
    POLICIES = frozenset({"reroute", "replan", "wait", "heal", "grow", "keep", "rebalance"})

    # The commit all-reduce carries no header: a pipeline job's members run nothing but the same
    # collectives in the same order between two syncs (no adapter offers control collectives).
    step_header = None

    def __init__(self, blocks, optimizer, dataset, loss_fn: Callable, global_batch: int,
                 micro_batch: int, stages: int, *, input_fn: Optional[Callable] = None,
                 collate_fn: Callable = default_collate, scheduler: Optional[Callable] = None,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False,
                 config: Optional[ElasticConfig] = None, env=None, device=None):
        self.blockset = Blocks(blocks, seed=seed, device=device)
        model = self.blockset.model
        self.blocks = self.blockset.modules  # the same list: a block made later replaces its entry
        cfg = config or ElasticConfig()
        self.make_optimizer = _optimizer_factory(optimizer)
        self.make_scheduler = scheduler
        super().__init__(model, _HeldOptimizers(self), len(dataset), global_batch, micro_batch,
                         seed=seed, shuffle=shuffle, drop_last=drop_last, config=cfg, env=env,
                         stages=stages)
        self.dataset, self.collate_fn, self.loss_fn = dataset, collate_fn, loss_fn
        self.input_fn = input_fn or (lambda batch: batch[0])
        self.device = self.blockset.device
        sizes = [sum(p.numel() for p in b.parameters()) for b in self.blocks]
        self.block_numel = sizes
        self.policy.layer_params = [max(1, n) for n in sizes]
        self.policy.min_replicas = max(1, int(cfg.min_replicas))
        # A built model: all held until the first sync; lazy blocks: made by their holders then.
        self.held: set[int] = set() if self.blockset.lazy else set(range(len(self.blocks)))
        # Blocks whose state is the job's (received, or kept through a completed migration);
        # a block only built here is not, until the first migration agrees on one copy.
        self.agreed: set[int] = set()
        self.block_opt: dict[int, torch.optim.Optimizer] = {}
        self.block_sched: dict = {}
        for b in self.held:
            self._new_optimizer(b)
        self.last_loss: Optional[float] = None
        self.last_migration: Optional[dict] = None  # measured, on every member that moved state
        # This member's blocks' reduced gradients of the step being committed (``reduce.py``):
        # what it rolls forward with when a failure leaves it one step behind its peers.
        self._staged: Optional[dict[int, torch.Tensor]] = None
        self._resume: Optional[tuple] = None  # (blocks folder, step, digests) of a loaded checkpoint
        self._measured = False
        self._schedule_key = None
        self._wire: tuple = (None, {})  # (generation token, the message sizes of its pairs)
        self._commit_posts = CommitPosts()  # rank 0's receives of the commit, posted early
        self._routes, self._orders, self._sets = [], {}, []
        self._measured_step = None  # the executor's StepResult of the step being committed
        self._optimizer_s = (0.0, 0.0)  # the last optimizer step: seconds, parameters
        self._last_commit: Optional[float] = None
        self._overlap: Optional[overlap.Overlap] = None  # a migration running while the job trains
        self.policy.overlap_migration = bool(cfg.overlap_migration)
        link = self.cfg.emulate_link
        if link is not None:
            lat, bw = float(link[0]), float(link[1])
            if lat < 0 or bw <= 0:
                raise ConfigError(f"emulate_link must be (latency_s >= 0, bandwidth_Bps > 0), got {link}")
            self._link_delay = lambda nbytes: lat + nbytes / bw
        else:
            self._link_delay = None

    # ---------------------------------------------------------------- blocks and state
    def _new_optimizer(self, b: int) -> None:
        params = list(self.blocks[b].parameters())
        self.block_opt[b] = self.make_optimizer(params)
        if self.make_scheduler is not None:
            self.block_sched[b] = self.make_scheduler(self.block_opt[b])

    def slot_blocks(self, plan: Optional[Plan] = None) -> set[int]:
        """The blocks this worker's slot in ``plan`` (default: the running one) holds."""
        plan = plan or self.policy.plan
        # (a member the running layout waits for -- an overlapped heal's replacement -- holds no slot yet)
        where = plan.locate(self.worker_id) if plan and self.worker_id in self.policy.alive else None
        if where is None:
            return set()
        lo, hi = plan.pipelines[where[0]].layers_of_stage(where[1])
        return set(range(lo, hi))

    def block_state(self, b: int) -> dict:
        """Weights, optimizer and scheduler state of held block ``b`` (what a migration moves)."""
        return {"params": self.blocks[b].state_dict(), "optim": self.block_opt[b].state_dict(),
                "sched": self.block_sched[b].state_dict() if b in self.block_sched else None}

    def state_bytes(self, b: int) -> int:
        """Bytes of block ``b``'s parameters and of its optimizer state shaped like them (the
        migration plan's weights + optimizer state; scalar counters are left out)."""
        total = 0
        opt = self.block_opt[b]
        for p in self.blocks[b].parameters():
            total += p.numel() * p.element_size()
            for t in opt.state.get(p, {}).values():
                if isinstance(t, torch.Tensor) and t.shape == p.shape:
                    total += t.numel() * t.element_size()
        return total

    def put_block(self, b: int, state: dict) -> None:
        """Hold block ``b`` with ``state`` (from a peer)."""
        block = self.blocks[b] if b in self.held else self.blockset.make(b)
        block.load_state_dict(state["params"])
        self._new_optimizer(b)
        self.block_opt[b].load_state_dict(state["optim"])
        if state.get("sched") is not None and b in self.block_sched:
            self.block_sched[b].load_state_dict(state["sched"])
        self.held.add(b)
        self.agreed.add(b)

    def build_block(self, b: int) -> None:
        """Hold block ``b`` as its initialisation (lazy blocks, before the first committed step:
        every holder makes the same one under the block's seed)."""
        self.blockset.make(b)
        self._new_optimizer(b)
        self.held.add(b)
        self.agreed.add(b)

    def drop_block(self, b: int) -> None:
        self.blockset.release(b)
        self.held.discard(b)
        self.agreed.discard(b)
        self.block_opt.pop(b, None)
        self.block_sched.pop(b, None)

    def block_states(self) -> dict[int, dict]:
        """Every held block's state (tests compare replicas with it)."""
        return {b: self.block_state(b) for b in sorted(self.held)}

    def state_dict(self) -> dict:
        """The run state without the blocks (they move by migration)."""
        return {"step": self.step, "last_checkpoint_step": self.last_checkpoint_step,
                "lr_scale": self.lr_scale, "sampler": self.sampler.state_dict(),
                "engine": self.policy.state_dict(), "rng": {"torch": torch.get_rng_state()}}

    def load_state_dict(self, s: dict) -> None:
        if not self.fresh and self.step == int(s["step"]) - 1:
            # Peers committed the step this member was committing: roll forward with its own
            # blocks' reduced gradients (``reduce.py`` says why it has them).
            if self._staged is None:
                raise RuntimeError(f"worker {self.worker_id} is one step behind without that step's "
                                   "reduced gradients; cannot roll forward")
            self._apply_update(self._staged)
            if self.log:
                self.log.write("roll_forward", step=self.step + 1, blocks=sorted(self._staged))
        self.sampler.load_state_dict(s["sampler"])
        self.policy.load_state_dict(s["engine"])
        torch.set_rng_state(s["rng"]["torch"])
        self.step = int(s["step"])
        self.last_checkpoint_step = int(s["last_checkpoint_step"])

    def save_checkpoint(self, path: str) -> None:
        """Call on every member at the same step (``checkpoint.py``): each block is written by
        its lowest alive holder, then rank 0 writes the run state naming them.  A failure
        meanwhile recovers as after a step and leaves the previous checkpoint in force."""
        step, folder = self.step, ckpt.blocks_dir(path, self.step)
        digests = torch.zeros(len(self.blocks), dtype=torch.int64)
        for holders, blocks in holder_sets(self.policy.plan, self.policy.alive, len(self.blocks)):
            if holders and holders[0] == self.worker_id:
                for b in blocks:
                    digests[b] = ckpt.write_block(folder, b, self.block_state(b))
        try:
            self._store_op(lambda: self.gm.allreduce(digests, dist.ReduceOp.SUM, copy=False,
                                                     timeout_s=self.hang_timeout_s))
        except CollectiveFailure as failure:
            self.recover(failure)
            return
        self.last_checkpoint_step = step
        if self.rank == 0:
            run_state.save_checkpoint(path, {**self.state_dict(), "blocks": digests.tolist()})
            ckpt.prune(path, step)

    def load_checkpoint(self, path: str) -> None:
        """Resume from ``path`` before ``start()``: the run state now, each worker's blocks once
        the first layout over whoever is there is agreed (``carry_out``)."""
        tree = ckpt.read_run(path, len(self.blocks))
        self.load_state_dict(tree)
        self.policy.plan = None
        self._resume = (ckpt.blocks_dir(path, tree["step"]), int(tree["step"]), list(tree["blocks"]))

    def close(self, **fields) -> None:
        if self._overlap is not None:  # the job ended before the switch: the old layout holds all
            self._overlap.end(self.hang_timeout_s)
            self._overlap = None
        super().close(**fields)

    def allow_restart(self) -> None:
        """Checkpoints are written: checkpoint-restart becomes one of the engine's choices
        (unless the user's ``allowed_policies`` leaves it out)."""
        if "restart" in (self.cfg.allowed_policies or {"restart"}):
            self.allowed = self.allowed | {"restart"}
            self.policy.allowed = self.allowed

    # ---------------------------------------------------------------- recovery hooks
    def recovery_fields(self) -> list[int]:
        """Per block: 2 = this member holds the job's state of it, 1 = only built here, 0 = no."""
        return [2 if b in self.agreed else int(b in self.held) for b in range(len(self.blocks))]

    def source_payload(self, view, info) -> dict:
        members = view.members
        holdings = held_ranges(self.peer_fields, self.peer_steps, members, len(self.blocks))
        if self.policy.migrating_from is not None:  # a failure interrupted the last migration
            if covers(self.policy.plan, holdings):
                self.policy.migrating_from = None  # every block already where the new plan wants it
            else:
                self.policy.undo_migration()
        before, old_plan = self.policy.layout(), self.policy.plan
        payload = super().source_payload(view, info)
        if payload["restart"]:
            return payload
        resume = self._resume
        if resume is not None and max(self.peer_steps) == resume[1] and not any(2 in f for f in self.peer_fields):
            # Resumed from a checkpoint, nobody holds the job's state of a block yet: every
            # member loads its slot's blocks from the checkpoint (``carry_out``).
            self.policy.last_migration = self.policy.migrating_from = None
            payload["migration"] = {"rounds": [], "load": True}
            return payload
        if self.blockset.lazy and max(self.peer_steps) == 0:
            # No step committed: every block's state is its initialisation, which each holder
            # makes itself under the block's seed (``carry_out``) -- nothing moves.
            self.policy.last_migration = self.policy.migrating_from = None
            payload["migration"] = {"rounds": [], "build": True}
            return payload
        workload, cluster = self.policy.workload(), self.policy.cluster(members)
        mig = self.policy.last_migration
        expected = None
        if mig is not None and old_plan is not None:
            expected = {d: [(a, b)] for d, (a, b, _, _) in held_state(old_plan, set(members)).items()}
            expected.update({w: [] for w in members if w not in expected})
        if mig is None or holdings != expected:
            mig = transfers_to(self.policy.plan, holdings, workload, cluster)
        if mig.lost:
            lost = ", ".join(f"blocks {a}-{b}" for a, b, _, _ in mig.lost)
            payload["restart"] = True
            payload["decisions"].append({"chosen": "restart", "reason": f"no survivor holds {lost}"})
            return payload
        self.policy.last_migration = None
        payload["migration"] = {"rounds": [[[t.src, t.dst, t.layers[0], t.layers[1]] for t in r]
                                           for r in mig.rounds],
                                "predicted_bytes": mig.total_bytes, "predicted_s": mig.seconds}
        if mig.transfers and old_plan is not None:
            if self.cfg.overlap_migration and overlap.plan(self, payload, old_plan, members, holdings):
                payload["engine"] = self.policy.state_dict()
            elif self.policy.plan != old_plan:
                self.policy.begin_migration(before)
                payload["engine"] = self.policy.state_dict()
        return payload

    def carry_out(self, payload: dict, top: int, n: int, r: int) -> None:
        self._discard()  # a pipeline step is redone whole (its partial sums are spread out)
        self._last_commit = None  # the next commit interval would include this recovery
        if self._overlap is not None:  # a recovery ends an overlapped migration (overlap.py)
            self._overlap.cancel()
            self._overlap = None
        plan = payload.get("migration") or {"rounds": []}
        want = self.slot_blocks()
        t0 = time.perf_counter()
        if plan["rounds"] and self._is_source and self.log:
            self.log.write("migration", step=self.step, phase="start", rounds=plan["rounds"],
                           predicted_bytes=plan.get("predicted_bytes"), overlapped=bool(plan.get("overlap")))
        if plan.get("overlap"):  # snapshot now, move in the background, switch later
            self._overlap, plan = overlap.Overlap(self, plan), {"rounds": []}
        moved = migration.run(self, plan["rounds"], self.hang_timeout_s)
        timed = migration.confirm(self, plan["rounds"], moved, self.hang_timeout_s) if plan["rounds"] else []
        self.policy.migrating_from = None
        if plan.get("build"):
            for b in sorted(want - self.held):
                self.build_block(b)
        if plan.get("load"):
            if self._resume is None:
                raise ConfigError(f"worker {self.worker_id} was asked to load its blocks from a checkpoint "
                                  "it did not resume from")
            folder, _, digests = self._resume
            for b in sorted(want):
                self.put_block(b, ckpt.read_block(folder, b, digests[b]))
        for b in sorted(self.held - want):
            self.drop_block(b)
        self.agreed = set(self.held)
        self._schedule_key = None
        if plan["rounds"] or "predicted_bytes" in plan:
            self.last_migration = {"bytes": moved["state_bytes"], "wire_bytes": moved["wire_bytes"],
                                   "seconds": time.perf_counter() - t0,
                                   "transfers": moved["transfers"], "rounds": len(plan["rounds"]),
                                   "predicted_bytes": plan.get("predicted_bytes"),
                                   "predicted_s": plan.get("predicted_s")}
            if timed:
                self.policy.observe_migration(*self._timed_path(timed))
            # Every member reports its own share; the test sums them across members.
            if self.log:
                self.log.write("migration", step=self.step, phase="end", **self.last_migration)
        if self.fresh is False and not self.held and want:
            raise ConfigError(f"worker {self.worker_id} holds no blocks after the migration")

    def _timed_path(self, timed) -> tuple[int, float, float]:
        """The migration's critical path (``engine.migration.critical_path``) over each transfer's
        measured seconds (``migration.confirm``): its transfers, their bytes as they were sent,
        and its seconds -- what the calibration fits the migration link to.
        The optimizer's state travels only once it exists (the start-up migration, before the
        first step, carries weights alone: counting the state there made the calibrated
        migration bandwidth 3x too high and a re-plan's transition ~2.7x too short).  Every
        member decides from the same facts (every block optimizer steps at every step)."""
        stateful = any(self.block_opt[b].state for b in self.held)
        per = self.policy.weight_bytes + (self.policy.optim_bytes if stateful else 0)

        def nbytes(t) -> float:
            return float(sum(self.block_numel[t[2]:t[3]]) * per)
        seconds, path = critical_path(timed, lambda t: (t[0], t[1], t[4]))
        return len(path), sum(nbytes(t) for t in path), seconds

    def reset_step(self) -> None:
        self._measured_step = None
        self._staged = None

    def apply_allocation(self) -> None:
        # The sampler's per-member allocation is data parallel's; routes come from the plan.
        if self.sampler.global_batch != self.policy.current_batch:
            self.sampler.set_global_batch(self.policy.current_batch)

    # ---------------------------------------------------------------- one step
    def _schedule(self):
        plan = self.policy.plan
        key = (repr(plan.to_json()), tuple(sorted(self.policy.alive)), id(self._overlap))
        if key != self._schedule_key:
            self._routes = routes(plan, self.policy.alive)
            self._orders = worker_orders(self._routes)
            self._sets = holder_sets(plan, self.policy.alive, len(self.blocks),  # who reduces what
                                     self._overlap.shadows if self._overlap else None)
            self._schedule_key = key
        return self._routes, self._orders.get(self.worker_id, [])

    def train_step(self) -> bool:
        """Run this worker's part of the current step and commit it.  False: a failure
        interrupted it; the job reconfigured and the caller runs the step again."""
        t_start = time.perf_counter()
        self._step_start = t_start
        self._compute_s, self._n_mb, self._ids = 0.0, 0, []
        self.faults.at(self.step, "step_start")
        mbs = {mb.index: mb for mb in self.sampler.microbatches(self.sampler.cursor)}
        rs, order = self._schedule()
        rank_of = {w: i for i, w in enumerate(self.view.members)}
        base = (self.seed * 1_000_003 + self.step) * 65_537

        def on_task(task) -> None:
            self.faults.at(self.step, "forward" if task.kind == "F" else "backward")

        if self._wire[0] != self.view.token:  # message sizes are agreed per generation (step.py)
            self._wire = (self.view.token, {})
        try:
            self._commit_posts.post(self.gm, self.view.token, self.dtype)
            probes = probe_links(self.gm, rank_of, self.worker_id, link_pairs(rs), probe_size(self.block_numel),
                                 self.hang_timeout_s, self._link_delay) if self.step == PROBE_STEP else []
            res = run_step(
                self.gm, rank_of, self.worker_id, self.blocks, rs, order,
                batch_of=lambda slot: self.collate_fn([self.dataset[i] for i in mbs[slot].indices]),
                input_fn=self.input_fn, loss_fn=self.loss_fn, weight_of=lambda slot: mbs[slot].weight,
                seed_of=lambda slot, b: (base + slot) * 1_009 + b,
                seed_fn=seed_generators if self.cfg.seed_microbatches else (lambda s: None),
                timeout_s=self.hang_timeout_s, device=self.device, on_task=on_task,
                link_delay=self._link_delay, wire=self._wire[1])
        except CollectiveFailure as failure:
            self._step_start = None
            self._recover(failure, t_start)
            return False
        self._compute_s, self._n_mb, res.probes = res.compute_s, res.microbatches, probes
        self._measured_step = res
        self._ids = [i for r in rs if r.hops[0].worker == self.worker_id for i in mbs[r.slot].indices]
        return self.sync_and_step(res.loss)

    def sync_and_step(self, loss: float = 0.0) -> bool:
        self.faults.at(self.step, "allreduce")
        ov = self._overlap
        if ov is not None:
            if ov.error:  # the background transfers broke off: end the generation, decide again
                self._recover(self.gm._local_failure(f"overlapped migration: {ov.error}", "peer_error"),
                              time.perf_counter())
                return False
            ov.install(self)
        held_numel = sum(self.block_numel[b] for b in self.held - (ov.mine if ov else set()))
        frac = held_numel / max(1, sum(self.block_numel))
        t0 = time.perf_counter()
        try:
            self._staged = self._reduce_blocks()
        except CollectiveFailure as failure:
            self._step_start = None
            self._recover(failure, t0)
            return False
        sets_s = time.perf_counter() - t0
        # Compute is reported per whole-model micro-batch (the engine's unit): this worker's
        # seconds scaled by the share of the model it runs.  The commit point (reduce.py).
        # [loss, blocks not yet caught up (overlap.py), calibration row]
        parts = [torch.tensor([loss, ov.pending() if ov else 0], dtype=self.dtype), self._calibration_row()]
        reduced = self._reduce_step(parts, self._compute_s / frac if frac else 0.0)
        if reduced is None:
            return False
        buf, timings, comm = reduced
        self.faults.at(self.step, "optimizer")
        t_opt = time.perf_counter()
        self._apply_update(self._staged)
        if ov is not None:
            ov.keep(self._staged)
        self._staged = None
        # Shared with the next step's calibration row: (seconds, parameters updated).
        self._optimizer_s = (time.perf_counter() - t_opt, float(held_numel))
        if not self._measured and self.held:
            self._measure_state_bytes()
        self.last_loss = float(buf[0])
        self._observe_calibration(buf[2:])
        self._finish_step(timings, sets_s + comm)
        if ov is not None and ov is self._overlap:  # the job is not at the Decision's layout yet
            self._tracker.cancel()
            if float(buf[1]) == 0:  # every member caught up: the new layout from the next step
                overlap.switch(self)
        # Pipeline jobs report commit-to-commit seconds (what the engine's step time is checked
        # against); the step's own seconds when a recovery came between.
        now = time.perf_counter()
        if self._last_commit is not None:
            self._prev_step = now - self._last_commit
        self._last_commit = now
        return True

    def _commit_reduce(self, buf: torch.Tensor) -> None:  # the commit point (reduce.py)
        self._commit_posts.reduce(self.gm, self.view.token, buf, self.hang_timeout_s)

    def _reduce_blocks(self) -> dict[int, torch.Tensor]:
        """Every held block's gradient summed over its replicas (``reduce.py``)."""
        # ``self._sets``: the reduction sets that train_step's ``_schedule`` set for this step.
        rank_of = {w: i for i, w in enumerate(self.view.members)}

        def grads_of(b: int) -> list[torch.Tensor]:
            if b not in self.held:  # a shadow holder (overlap.py) adds nothing
                return [torch.zeros(self.block_numel[b], dtype=self.dtype)]
            return [p.grad.detach().reshape(-1).to("cpu", self.dtype) if p.grad is not None
                    else torch.zeros(p.numel(), dtype=self.dtype) for p in self.blocks[b].parameters()]
        return self._store_op(lambda: reduce_sets(self.gm, self._sets, self.worker_id, rank_of, grads_of,
                                                  self.dtype, self.hang_timeout_s))

    # ---------------------------------------------------------------- calibration
    def _calibration_row(self) -> torch.Tensor:
        row = calibration_row(self._measured_step, len(self.blocks), self.view.world_size, self.view.rank,
                              self._optimizer_s)
        return row.to(self.dtype)

    def _observe_calibration(self, flat: torch.Tensor) -> None:
        self.policy.observe_pipeline(*read_rows(flat, self.view.members, len(self.blocks)))
        self._measured_step = None

    def _apply_update(self, reduced: dict[int, torch.Tensor]) -> None:
        """Set each held block's gradients from its reduced gradient and step its optimizer."""
        for b in sorted(self.held):
            self.step_block(b, reduced[b])

    def step_block(self, b: int, flat: torch.Tensor) -> None:
        """One optimizer (and scheduler) step of held block ``b`` with ``flat``, its reduced gradient."""
        params, at = list(self.blocks[b].parameters()), 0
        for p in params:
            # A view of the reduced buffer where it already is (no copy on the CPU).
            p.grad = flat[at:at + p.numel()].view_as(p).to(p.device, p.dtype)
            at += p.numel()
        self.block_opt[b].step()
        if b in self.block_sched:
            self.block_sched[b].step()
        for p in params:
            p.grad = None

    def _measure_state_bytes(self) -> None:
        """Bytes per parameter of weights and of optimizer state, as the engine's workload
        (the migration planner then predicts the bytes a migration really moves).  Every holder measures
        the same numbers: the optimizer is the same class everywhere."""
        b = min(self.held)
        numel = max(1, self.block_numel[b])
        p0 = next(self.blocks[b].parameters(), None)
        wb = p0.element_size() if p0 is not None else 4
        ob = (self.state_bytes(b) - numel * wb) / numel
        self.policy.weight_bytes, self.policy.optim_bytes = int(wb), int(round(ob))
        self.policy._predicted = None
        self._measured = True
