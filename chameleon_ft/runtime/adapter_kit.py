"""What every framework adapter (``lightning_ft``, ``accelerate_ft``) needs from the runtime,
written once: data over the elastic sampler, evaluation shards over the live members,
collectives that follow the membership, the optimizer handle and the fault-tolerance metrics.

* ``MicroBatchSource``: loads this member's micro-batches of the ``ElasticSampler`` with the
  user's DataLoader settings (``collate_fn``, ``num_workers``, ``pin_memory``...), prefetching
  the member's plan to the end of the epoch; a micro-batch off the plan (one a failure moved to
  this member) is loaded in this process.
* ``training_order``: the (shuffle, seed) of a user's training DataLoader, or a clear refusal
  when its order cannot be kept exactly once under membership changes.
* ``shard_indices`` / ``ShardSampler``: rank ``r`` of ``n`` current members gets ``r, r+n, ...``
  (every sample once, no padding).  ``eval_batches``: the same, as batches with the *same
  count* on every member (for frameworks that run one collective per evaluation batch): the
  batches are the dataset's runs of ``b`` consecutive samples whatever the membership, round
  ``k`` gives member ``r`` batch ``k*n + r``, so gathering the rounds in rank order gives the
  dataset order; a member with nothing left in the last round gets one *ghost* sample whose
  results must be dropped (``n_valid == 0``).
* ``LiveCollectives``: reduce / all-gather (any shapes) / broadcast / barrier / object gather
  over the current generation's group with the runtime's watchdog.  Outside a training step a
  failed collective cannot be redone by the runtime (the framework's evaluation loop is the
  user's code), so it and the following ones return this worker's local value, with a
  warning, until the next training step recovers the job (``reset``) -- unless the adapter
  sets ``reraise`` because it can recover the job and rerun what the collective belonged to
  (lightning_ft does for its evaluation loops, see ``DataParallelExecutor.recover``).  Every one of
  them exchanges a fixed-size header first (``GroupManager.checked``): one that meets a
  different collective on a peer (another control call, or the step's gradient all-reduce)
  moves no data, returns the local value with a warning naming both calls, and the following
  ones stay local until the next training step's sync (``realigning``).
* ``UpdateHandle``: what ``DataParallelExecutor`` sees as the optimizer, so the adapter decides how
  the update is applied once the gradients are reduced (hooks, clipping, precision plugins).
* ``ft_metrics``: the ``ft/*`` metrics the adapters give to the framework's loggers.

Limits: map-style datasets only; tensors of evaluation collectives travel through CPU; objects
gathered with ``gather_objects`` must be JSON-able (nothing received is unpickled).
"""

from __future__ import annotations

import json
import logging
import warnings
from collections import deque
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler, SequentialSampler

from chameleon_ft.runtime.errors import ConfigError
from chameleon_ft.runtime import codec as run_state
from chameleon_ft.runtime.groups import CollectiveFailure, CollectiveMismatch
from chameleon_ft.engine.selector import BATCH_CHANGING
from chameleon_ft.runtime.executors.dp import DataParallelExecutor
from chameleon_ft.runtime.config import GRAD_COMPRESSIONS
from chameleon_ft.runtime.recovery import ElasticConfig
from chameleon_ft.runtime.sampler import MicroBatch, StepItem, step_items

log = logging.getLogger(__name__)

__all__ = ["MicroBatchSource", "MicroBatchFeed", "training_order", "shard_indices", "ShardSampler",
           "eval_batches", "LiveCollectives", "UpdateHandle", "ft_metrics", "recovery_line", "ddp_reduction"]


# ---------------------------------------------------------------------------- training data
class MicroBatchFeed:
    """This member's planned items (``sampler.step_items``) from one step to the end of the
    epoch, loaded in order by a DataLoader with the user's settings."""

    def __init__(self, source: "MicroBatchSource", start: int, n_items: Optional[int] = None) -> None:
        s = source.sampler
        self.signature = source.signature(n_items)
        self.epoch = s.epoch
        wid = source.worker_id
        self.plan = deque((t, item.indices) for t in range(start, s.steps_per_epoch)
                          for item in step_items(s.local_microbatches(wid, t), n_items) if not item.ghost)
        self.planned = set(self.plan)
        self.stash: dict = {}
        self.it = iter(source.make_dataloader([list(ids) for _, ids in self.plan]))

    def has(self, step: int, indices: tuple) -> bool:
        return (step, indices) in self.planned

    def get(self, step: int, indices: tuple) -> Any:
        key = (step, indices)
        while key not in self.stash:
            self.stash[self.plan.popleft()] = next(self.it)
        self.planned.discard(key)
        # A framework may read one step ahead, so the previous step's items may still be asked for.
        for old in [k for k in self.stash if k[0] < step - 1]:
            del self.stash[old]
        return self.stash.pop(key)


class MicroBatchSource:
    """Items of the runtime's sampler (micro-batches, or merged/cut ones: ``StepItem``), loaded
    like the user's ``dataloader`` would load a batch of the same samples.

    ``ctx_fn`` returns the worker's ``DataParallelExecutor`` (adapters create it late)."""

    def __init__(self, ctx_fn: Callable[[], Any], dataloader: DataLoader) -> None:
        self._ctx_fn = ctx_fn
        self.dataloader = dataloader
        self.dataset = dataloader.dataset
        self._feed: Optional[MicroBatchFeed] = None

    @property
    def sampler(self):
        return self._ctx_fn().sampler

    @property
    def worker_id(self) -> int:
        return self._ctx_fn().worker_id

    def signature(self, n_items: Optional[int] = None) -> tuple:
        s = self.sampler
        return (s.epoch, tuple(s.members), tuple(s.allocation), n_items)

    def make_dataloader(self, index_lists: list[list[int]]) -> DataLoader:
        dl = self.dataloader
        kwargs = {}
        if dl.num_workers > 0:
            kwargs = {"prefetch_factor": dl.prefetch_factor, "persistent_workers": False,
                      "multiprocessing_context": dl.multiprocessing_context}
        return DataLoader(self.dataset, batch_sampler=index_lists, collate_fn=dl.collate_fn,
                          num_workers=dl.num_workers, pin_memory=dl.pin_memory,
                          worker_init_fn=dl.worker_init_fn, timeout=dl.timeout,
                          generator=dl.generator, **kwargs)

    def load_now(self, indices) -> Any:
        """Load the samples ``indices`` in this process (an item off this member's plan)."""
        return self.dataloader.collate_fn([self.dataset[i] for i in indices])

    def fetch(self, step: int, item: "MicroBatch | StepItem", n_items: Optional[int] = None) -> Any:
        """The collated data of ``item`` of ``step`` (this epoch); ``n_items``: how the plan
        the feed prefetches is cut (as in ``_feed_from``)."""
        feed = self._feed
        indices = tuple(item.indices)
        if feed is not None and feed.signature == self.signature(n_items) and feed.has(step, indices):
            return feed.get(step, indices)
        return self.load_now(indices)

    def _feed_from(self, step: int, n_items: Optional[int] = None) -> MicroBatchFeed:
        if self._feed is None or self._feed.signature != self.signature(n_items):
            self._feed = MicroBatchFeed(self, step, n_items)
        return self._feed


def refuse_grad_scaler(who: str, how: str) -> None:
    """fp16 mixed precision's ``GradScaler`` skips and rescales updates outside the step that
    the runtime commits atomically (a skipped step on one member would be committed on the
    others), and its scale is not part of the transferred state: refuse it with what to use
    instead.  ``how``: what the user set (``mixed_precision='fp16'``, ``precision='16-mixed'``)."""
    raise ConfigError(f"{who}: {how} needs a GradScaler, which skips and rescales updates outside "
                      "the fault-tolerant step; use bf16 mixed precision (no scaler) or full precision")


def ddp_reduction(handler, config: ElasticConfig, hook=None, wrapper=None) -> dict:
    """The gradient buckets' settings from a user's DDP settings: ``handler`` holds
    ``bucket_cap_mb`` and ``gradient_as_bucket_view`` as DDP reads them (Accelerate's
    ``DistributedDataParallelKwargs``, the HF Trainer's ``ddp_bucket_cap_mb`` through it,
    Lightning's ``DDPStrategy`` keyword arguments as a dict) and, for Accelerate,
    ``comm_hook`` / ``comm_wrapper``; ``hook`` / ``wrapper``: Lightning's ``ddp_comm_hook`` /
    ``ddp_comm_wrapper``.  DDP's fp16 and bf16 compression hooks (Accelerate's
    ``DDPCommunicationHookType.FP16`` / ``BF16``, torch's ``fp16_compress_hook`` /
    ``bf16_compress_hook``) become ``"fp16"`` / ``"bf16"`` (``executors/buckets.py`` carries
    them out); any other hook or wrapper (PowerSGD, a custom one) is refused rather than
    silently dropped.  ``find_unused_parameters`` and ``static_graph`` need nothing (unused
    parameters are reduced as zeros).  Returns the ``ElasticConfig`` fields ``bucket_cap_mb``,
    ``grad_compression`` and ``gradient_as_bucket_view``: the user's DDP settings where given,
    else ``config``'s."""
    get = ((lambda k, d=None: d) if handler is None else handler.get if isinstance(handler, dict)
           else (lambda k, d=None: getattr(handler, k, d)))
    compression = _compression(get("comm_hook", None) if hook is None else hook) or config.grad_compression
    wrap = get("comm_wrapper", None) if wrapper is None else wrapper
    if wrap is not None and _hook_name(wrap) not in ("no", "none"):
        raise ConfigError(f"DDP communication wrapper {wrap!r}: it wraps a hook chameleon-ft does not run "
                          "(PowerSGD); use comm_hook fp16 or bf16 alone, or full precision")
    cap = get("bucket_cap_mb", None)
    view = get("gradient_as_bucket_view", None)
    return {"bucket_cap_mb": float(cap) if cap is not None else config.bucket_cap_mb,
            "grad_compression": compression,
            "gradient_as_bucket_view": bool(view) if view is not None else config.gradient_as_bucket_view}


def _hook_name(hook) -> str:
    """A hook's name: an Accelerate enum's value, or a function's ``__name__``."""
    value = getattr(hook, "value", None)
    return str(value if value is not None else getattr(hook, "__name__", hook)).lower()


def _compression(hook) -> Optional[str]:
    if hook is None:
        return None
    name = _hook_name(hook)
    if name in ("no", "none"):
        return None
    if name in GRAD_COMPRESSIONS:  # Accelerate's DDPCommunicationHookType
        return name
    kind = name.removesuffix("_compress_hook")  # torch's default_hooks.<kind>_compress_hook
    if callable(hook) and kind in GRAD_COMPRESSIONS and \
            getattr(hook, "__module__", "").startswith("torch.distributed.algorithms.ddp_comm_hooks"):
        return kind
    raise ConfigError(f"DDP communication hook {hook!r}: chameleon-ft's gradient buckets run DDP's fp16 and "
                      "bf16 compression hooks only; use one of those or leave it unset (full precision)")


def adapter_config(who: str, allowed_policies, hang_timeout_s, allow_batch_change: bool, **kw) -> ElasticConfig:
    """The ``ElasticConfig`` an adapter runs with, its options checked.  Adapters map one
    framework batch to a fixed share of one global step, so they keep the global batch fixed:
    ``shrink`` is refused and ``allow_batch_change`` only warns."""
    offered = DataParallelExecutor.POLICIES - BATCH_CHANGING
    if allowed_policies is not None:
        allowed_policies = frozenset(allowed_policies)
        unknown = allowed_policies - offered
        if unknown:
            raise ConfigError(f"allowed_policies: {sorted(unknown)} cannot be carried out by {who}; "
                             f"choose among {sorted(offered)} ({who} keeps the global batch fixed: "
                             "shrink is not offered)")
    if hang_timeout_s is not None and hang_timeout_s <= 0:
        raise ConfigError("hang_timeout_s must be > 0")
    if allow_batch_change:
        warnings.warn(f"allow_batch_change=True: {who} keeps the global batch fixed (one framework "
                      "batch is a fixed share of one global step); the option has no effect", stacklevel=3)
    return ElasticConfig(hang_timeout_s=hang_timeout_s, allowed_policies=allowed_policies,
                         allow_batch_change=False, **kw)


def training_order(dl: DataLoader, default_seed: int, who: str) -> tuple[bool, int]:
    """(shuffle, seed) of a user's training DataLoader, for the runtime's ``ElasticSampler``."""
    if not isinstance(dl, DataLoader):
        raise TypeError(f"{who} needs a torch DataLoader for training, got {type(dl).__name__}")
    if dl.batch_size is None:
        raise ConfigError(f"{who}: the training DataLoader must use batch_size "
                         "(a custom batch_sampler cannot be re-planned exactly once)")
    sampler = dl.sampler
    if type(sampler) is DistributedSampler:
        return sampler.shuffle, sampler.seed
    if isinstance(sampler, (RandomSampler, SequentialSampler)):
        seed = default_seed
        gen = getattr(sampler, "generator", None) or dl.generator
        if gen is not None:
            seed = int(gen.initial_seed()) % (2 ** 31)
        return isinstance(sampler, RandomSampler), seed
    raise ConfigError(f"{who}: the training sampler {type(sampler).__name__} is not supported: use "
                     "shuffle=True/False (the elastic sampler keeps a seeded global order and hands "
                     "out every sample exactly once per epoch)")


# ---------------------------------------------------------------------------- evaluation data
def shard_indices(dataset_len: int, rank: int, world_size: int) -> range:
    """Rank ``rank`` of ``world_size`` members: ``rank, rank+n, ...`` (no padding)."""
    return range(rank, dataset_len, max(1, world_size))


class ShardSampler(Sampler):
    """Evaluation sampler over the *current* members (``shard_indices``); ``position()``
    returns (rank, world size) and is asked at each ``iter()``."""

    def __init__(self, dataset_len: int, position: Callable[[], tuple[int, int]]) -> None:
        self.dataset_len = dataset_len
        self.position = position

    def _shard(self) -> range:
        return shard_indices(self.dataset_len, *self.position())

    def __iter__(self):
        return iter(self._shard())

    def __len__(self) -> int:
        return len(self._shard())


def eval_batches(dataset_len: int, batch_size: int, rank: int, world_size: int,
                 start: int = 0) -> list[tuple[list[int], int]]:
    """``(indices, n_valid)`` per evaluation batch of ``rank``; every member gets the same number
    of batches (see module doc).  ``n_valid`` is 0 for a ghost batch (one repeated sample).
    The batches are the dataset's consecutive runs of ``batch_size`` samples whatever the
    membership (a batch-mean loss over padded sequences, averaged per sample as the
    ``Trainer`` does, depends on which samples share a batch), dealt round-robin: round ``k``
    gives member ``r`` batch ``k*n + r``.  ``start``: the rounds cover samples
    ``[start, dataset_len)`` (an evaluation resumed over the survivors after a failure; a
    multiple of ``batch_size`` keeps the failure-free batches)."""
    n, b = max(1, world_size), max(1, batch_size)
    out = []
    for lo in range(start, dataset_len, n * b):
        first = lo + rank * b
        if first < dataset_len:
            last = min(first + b, dataset_len)
            out.append((list(range(first, last)), last - first))
        else:
            out.append(([lo], 0))
    return out


# ---------------------------------------------------------------------------- collectives
_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM,
        "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class LiveCollectives:
    """Collectives over the current generation (see module doc).

    Args:
        gm_fn: the worker's ``GroupManager`` (None before it joined).
        view_fn: the current ``MembershipView``.
        timeout_fn: the watchdog in seconds.
        ctx_fn: the worker's executor (None before training started): a failed collective is
            written to its event log, as deferred unless ``reraise`` is set.
        who: prefix of the warnings.
    """

    def __init__(self, gm_fn: Callable, view_fn: Callable, timeout_fn: Callable[[], float],
                 ctx_fn: Optional[Callable] = None, who: str = "chameleon-ft") -> None:
        self.gm_fn, self.view_fn, self.timeout_fn = gm_fn, view_fn, timeout_fn
        self.ctx_fn = ctx_fn
        self.who = who
        self.degraded = False  # the generation broke outside a step: local until recovered
        self.catch_up = False  # adopted a step peers committed: local until our next step
        # Set by an adapter that can redo what the collectives belong to (an evaluation it
        # can rerun after recovering the job): a failure is raised instead of going local.
        self.reraise = False
        # Set by an adapter while its members' collectives cannot line up (why, for the warning).
        self.local_reason: Optional[str] = None
        self._warned: set = set()

    def _log_failure(self, what: str, failure: CollectiveFailure) -> None:
        ctx = self.ctx_fn() if self.ctx_fn is not None else None
        if ctx is not None and ctx.log is not None:
            ctx.log.write("failure", workers=list(failure.suspects), kind="collective",
                          detected_by=f"worker {ctx.worker_id}", step=ctx.step,
                          collective=what, deferred=not self.reraise)

    def reset(self) -> None:
        """The job recovered (or a step committed): collectives are live again."""
        self.degraded = False

    @property
    def stays_local(self) -> bool:
        """This member's collectives return its local value for now (the job broke outside a
        step, it adopted a step, an adapter said why, or it realigns after a mismatch)."""
        return bool(self.degraded or self.catch_up or self.local_reason or self.realigning)

    @property
    def realigning(self) -> bool:
        """A collective met a different one on a peer: collectives stay local (no header is
        exchanged) until this member's next training step sync."""
        gm = self.gm_fn()
        return gm is not None and gm.realigning is not None

    @property
    def world_size(self) -> int:
        v = self.view_fn()
        return v.world_size if v is not None else 1

    @property
    def rank(self) -> int:
        v = self.view_fn()
        return v.rank if v is not None else 0

    def run(self, what: str, fn: Callable, local: Callable) -> Any:
        gm = self.gm_fn()
        if gm is None or self.world_size <= 1 or self.degraded or self.catch_up or self.local_reason:
            if self.local_reason:
                self._warn_local(what, reason=self.local_reason)
            elif self.degraded or self.catch_up:
                self._warn_local(what)
            return local()
        try:
            return fn(gm)
        except CollectiveMismatch as mismatch:  # nothing moved and nothing failed
            if mismatch.skipped:
                self._warn_local(what, reason="while it realigns with its peers after a collective "
                                 "mismatch (until the next training step)")
            else:
                log.warning("%s: %s", self.who, mismatch)
            return local()
        except CollectiveFailure as failure:
            self._log_failure(what, failure)
            if self.reraise:
                raise
            self.degraded = True
            self._warn_local(what, failure)
            return local()

    def _warn_local(self, what: str, failure: Optional[CollectiveFailure] = None,
                    reason: Optional[str] = None) -> None:
        if (what, reason) in self._warned:
            return
        self._warned.add((what, reason))
        if reason:
            log.warning("%s: %s returns this worker's local value %s", self.who, what, reason)
            return
        why = f"failed ({failure.kind}: {str(failure)[:300]})" if failure else "skipped while the job reconfigures"
        log.warning("%s: %s %s outside a training step; it returns this worker's local value "
                    "until the job recovers at the next training step", self.who, what, why)

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        op = str(getattr(op, "name", op) or "sum").lower()
        if op not in _OPS:
            raise ConfigError(f"{self.who}: unsupported reduce op {op!r}; use one of {sorted(_OPS)}")

        def fn(gm):
            buf = tensor.detach().to("cpu", copy=True)
            if op in ("mean", "avg") and not buf.is_floating_point():
                buf = buf.float()
            gm.allreduce(buf, _OPS[op], timeout_s=self.timeout_fn(), header="reduce", label=op)
            if op in ("mean", "avg"):
                buf = buf / self.world_size
            return buf.to(tensor.device)

        return self.run("reduce", fn, lambda: tensor)

    def all_gather(self, tensor: torch.Tensor, what: str = "all_gather") -> list[torch.Tensor]:
        """Every member's ``tensor`` in rank order (shapes may differ, same number of dims)."""
        kind = "gather_object" if what == "gather_object" else "all_gather"
        return self.run(what, lambda gm: [t.to(tensor.device) for t in
                                          gm.all_gather(tensor, self.timeout_fn(), kind=kind, label=what)],
                        lambda: [tensor])

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of rank ``src`` on every member (tensors, numbers, strings, lists, dicts)."""

        def fn(gm):
            gm.checked("broadcast", arg=src, timeout_s=self.timeout_fn())
            return run_state.broadcast_tree(lambda f: gm.collective(f, self.timeout_fn()), src,
                                            self.rank, obj if self.rank == src else None)

        return self.run("broadcast", fn, lambda: obj)

    def barrier(self) -> None:
        # The header exchange is an all-gather over every member: a barrier by itself.
        self.run("barrier", lambda gm: gm.checked("barrier", timeout_s=self.timeout_fn()), lambda: None)

    def decide(self, decision: bool, any_: bool, stop: bool = False,
               reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> bool:
        """A boolean decision that steers the loop, the same on every member (``any_``: true
        when one member's is; else when all are).  Over live collectives it is reduced now.
        When they return local values (or fail in this very reduction), a ``stop`` is deferred
        -- False now, the vote rides the next commit (``runtime/steering.py``) -- and any other
        decision keeps its local value, flagged so that the adapter adopts rank 0's bookkeeping
        after the next commit.  ``reduce``: the adapter's sum over members (default ``allreduce``)."""
        ctx = self.ctx_fn() if self.ctx_fn is not None else None
        if ctx is None or self.world_size <= 1:
            return bool(decision)
        if not self.stays_local:
            total = float((reduce or (lambda t: self.allreduce(t, "sum")))(torch.tensor(float(bool(decision)))))
            if not self.stays_local:
                return total >= 1 if any_ else total >= self.world_size
        if stop:
            ctx.steering.defer_stop(decision)
            self._warn_local("a stop decision", reason="deferred: it is agreed on the next commit, "
                             "the same on every member")
            return False
        ctx.steering.decided_locally()
        return bool(decision)

    def gather_objects(self, obj: Any) -> list:
        """Every member's JSON-able ``obj`` in rank order."""
        try:
            blob = json.dumps(obj).encode()
        except TypeError as exc:
            raise TypeError(f"{self.who}: gathering objects needs JSON-able values ({exc}); "
                            "gather tensors instead") from None
        t = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.zeros(0, dtype=torch.uint8)
        parts = self.all_gather(t, what="gather_object")
        return [json.loads(bytes(p.numpy()).decode()) for p in parts]


# ---------------------------------------------------------------------------- the update
class UpdateHandle:
    """What ``DataParallelExecutor`` sees as the optimizer: ``step()`` runs ``update`` (set by the
    adapter, called once the gradients are reduced) or the optimizer's own step."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.update: Optional[Callable[[], Any]] = None

    def step(self) -> None:
        if self.update is not None:
            self.update()
        else:
            self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


# ---------------------------------------------------------------------------- metrics
def ft_metrics(ctx, last_step: dict, recovered: bool) -> dict:
    """``ft/*`` metrics for the loggers: world size, recoveries, redone/adopted steps (the
    core's counters, ``RecoveryCore.end_of_step``), the last step's phase timings and
    throughput; after a recovery its MTTR and the chosen policy."""
    step_s = last_step.get("step_s") or 0.0
    m = {"ft/world_size": float(ctx.view.world_size), "ft/recoveries": float(ctx.recoveries),
         "ft/redone_steps": float(ctx.redone_steps), "ft/adopted_steps": float(ctx.adopted_steps)}
    if step_s > 0:
        m["ft/throughput_samples_per_s"] = ctx.sampler.global_batch / step_s
    m.update({f"ft/{k}": float(v) for k, v in last_step.items()})
    if recovered:
        rec = ctx.last_recovery or {}
        if "total" in rec.get("mttr", {}):
            m["ft/mttr_s"] = float(rec["mttr"]["total"])
        for d in ctx.last_decisions:
            if d.get("chosen"):
                m[f"ft/policy/{d['chosen']}"] = 1.0
    return m


def recovery_line(ctx, who: str) -> str:
    """One console line about the last recovery: who was lost, what the engine chose, MTTR."""
    rec = ctx.last_recovery or {}
    decisions = [d for d in ctx.last_decisions if d.get("event", {}).get("kind") != "straggler"]
    lost = sorted({int(w) for d in decisions for w in d["event"].get("devices", ())})
    kinds = sorted({d["event"]["kind"] for d in decisions})
    chosen = [d["chosen"] for d in decisions]
    mttr = rec.get("mttr", {}).get("total")
    what = f"lost worker(s) {lost} ({', '.join(kinds)})" if lost else str(rec.get("reason") or "reconfigured")
    line = (f"{who}: recovered at step {rec.get('step', ctx.step)}: {what}; engine chose "
            f"{' then '.join(chosen) or 'nothing new'}; {ctx.view.world_size} worker(s) train on")
    shard = getattr(ctx, "last_shard_decision", None)  # sharded jobs: how the lost rows came back
    at = rec.get("step", ctx.step)  # the first step committed after the recovery
    if shard is not None and shard.get("step", -2) in (at - 1, at) and shard.get("lost_rows"):
        line += f"; shards {shard['lost_rows']}: {shard['chosen']}"
        if shard.get("snapshot_step") is not None and shard["chosen"] != "heal":
            line += f" from step {shard['snapshot_step']}'s snapshot"
        if shard.get("predicted_heal_steps"):
            over = f" over the next {shard['heal_horizon']}" if shard.get("heal_horizon") else ""
            line += f" (predicted to lag {shard['predicted_heal_steps']:.1f} steps behind on average{over})"
    return line + (f"; MTTR {mttr:.3f} s" if mttr is not None else "")
