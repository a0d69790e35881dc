"""The recovery core shared by every executor (``executors/``): one worker's membership, group,
commit protocol, engine bridge and state agreement; executors add how a step is computed and
committed and how a Decision's layout is carried out (``carry_out``).

**Commit protocol.** Every member holds a committed step counter. A step ends with its reduction
over the generation's group -- the gradients (data parallel: in buckets during backward,
``executors/buckets.py``) and a small tail (loss, tokens, per-member timings) -- then the optimizer
step and ``sampler.commit()``. Gloo may let some members finish a reduction in which a peer died
while others fail, so after every reconfiguration the members all-reduce their committed steps
(``_sync``); the lowest-ranked member at the maximum (the *source*) broadcasts the engine state
and its Decisions, and sends the run state point to point to every member that is behind or
new.  A step nobody finished is redone with the new allocation, one somebody finished adopted
by everyone: no half steps, bitwise-equal replicas, each global batch's samples consumed once
(the sampler's cursor moves only on commit). Every loop ends its steps through ``run_step``.

**Decisions.** On a membership change the source asks the engine (``engine_bridge.py``); on a
straggler every member asks it from the same reduced timings. ``restart`` makes the worker exit with
``RESTART_EXIT_CODE`` for the launcher.

Executor hooks: ``recovery_fields``, ``source_payload``, ``carry_out``, ``reset_step``,
``state_dict``/``load_state_dict`` (``executors/protocol.py``). Limits: all trainable parameters
share one dtype; the embedded coordinator is a single point of failure (``MembershipError`` at the
next collective when it is gone); an abandoned gloo op keeps a thread until ``hang_timeout_s``, so
end the process with ``os._exit`` (``elastic_main``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from enum import Enum
from typing import Callable, Optional

import torch
import torch.distributed as dist

from chameleon_ft.runtime.config import ElasticConfig
from chameleon_ft.runtime.coordination import first_to_record, reported_dead_among
from chameleon_ft.runtime.errors import (ConfigError, LeftBehind, NothingToHeal, Preempted, RestartRequested,
                                         WorldTooSmall)
from chameleon_ft.runtime.preemption import PreemptionNotice
from chameleon_ft.runtime.env import LOG_SAMPLES, WorkerEnv, startup_s
from chameleon_ft.runtime.eventlog import EventLog, RecoveryTimer
from chameleon_ft.runtime.faults import FaultInjector
from chameleon_ft.runtime.groups import CollectiveFailure, GroupManager
from chameleon_ft.runtime.join import Joined, join_job
from chameleon_ft.runtime.membership import Membership, MembershipError, MembershipView
from chameleon_ft.runtime.engine_bridge import EngineBridge, layer_params
from chameleon_ft.runtime.predictions import PredictionTracker
from chameleon_ft.runtime.sampler import ElasticSampler, seed_generators
from chameleon_ft.runtime.steering import Steering
from chameleon_ft.runtime.waits import poller
from chameleon_ft.runtime import codec as run_state

__all__ = ["ElasticConfig", "RecoveryCore", "StepEnd", "WorldTooSmall", "NothingToHeal", "layer_params",
           "Joined", "join_job", "seed_generators"]

log = logging.getLogger(__name__)

_LEAVE_MARK_S = 5.0  # how long the peers of an announced leave wait for the leavers' mark (_announced_leave)
_TAIL = 7  # per member in the commit's tail: four timings, the leave notice, a non-finite loss, steering (_tail_row)
_PREDICT_STEPS = 5  # steps measured after a Decision to check its predicted step time
_CALIBRATION_EVERY = 10  # steps between the event log's calibration records
_JOIN_S = 2.0  # a replacement's admission into a running job: the next view and a heal (prior)


class StepEnd(str, Enum):
    """How an attempted step ended on this member (``RecoveryCore.end_of_step``)."""

    COMMITTED = "committed"  # this member's all-reduce succeeded and it applied the update
    ADOPTED = "adopted"  # a failure interrupted it here, but a peer had committed it: its state is ours
    REDO = "redo"  # nobody committed it: the job reconfigured and the step runs again


class RecoveryCore:
    """One worker's membership, group, commit protocol and engine bridge (see module doc).

    ``stages``: depth of the first plan's pipelines (1: data parallel)."""

    # The step all-reduce's header kind: its exchange lets a peer's stray control collective (an
    # adapter's metric gather) give way, at one more collective per step.  None: no header, for
    # executors whose members run only the same collectives in the same order between two syncs.
    step_header: Optional[str] = "step"
    # SIGTERM leaves at the next step boundary (runtime/preemption.py); False where the framework
    # handles SIGTERM itself (Lightning stops its loop).
    takes_sigterm: bool = True
    # Gradients reduced in buckets on ``GroupManager.data_group`` (data parallel): with a step
    # header, that is a group of its own, so no control collective can meet a bucket.
    reduces_in_buckets = False
    # The engine's policies this executor carries out: each executor declares its own
    # (executors/protocol.py); the engine is offered only these.
    POLICIES: frozenset = frozenset()

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, dataset_len: int,
                 global_batch: int, micro_batch: int, *, scheduler=None, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False,
                 config: Optional[ElasticConfig] = None, env: Optional[WorkerEnv] = None,
                 stages: int = 1, user_loop: bool = False):
        self.env = env or WorkerEnv.from_env()
        self.user_loop = user_loop  # an adapter's loop, which cannot skip steps (``_leave``)
        self.cfg = config or ElasticConfig()
        if self.cfg.log_samples is None:
            self.cfg = dataclasses.replace(self.cfg, log_samples=os.environ.get(LOG_SAMPLES) == "1")
        self.hang_timeout_s = float(self.cfg.hang_timeout_s or self.env.hang_timeout_s)
        if not self.POLICIES:
            raise TypeError(f"{type(self).__name__} declares no POLICIES (executors/protocol.py)")
        self.allowed = self.POLICIES & frozenset(self.cfg.allowed_policies or self.POLICIES)
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.seed = seed
        self.worker_id = self.env.worker_id
        try:
            self.sampler = ElasticSampler(dataset_len, global_batch, micro_batch, seed=seed,
                                          shuffle=shuffle, drop_last=drop_last)
        except ValueError as exc:  # the user's sizes: a configuration error in every worker
            raise ConfigError(str(exc)) from None
        self.params = [p for p in model.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ConfigError(f"trainable parameters must share one dtype, got {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()
        self.policy = EngineBridge(
            layer_params(model), global_batch, micro_batch, per_node=self.env.local_world_size,
            warmup_steps=self.cfg.warmup_steps, mttf_s=self.env.mttf_s or self.cfg.mttf_s,
            replacement_eta_s=self.cfg.replacement_eta_s if self.env.max_replacements > 0 else None,
            max_replacements=self.env.max_replacements,
            restart_s=self.cfg.restart_s, stragglers=self.cfg.stragglers,
            allowed=self.allowed, allow_batch_change=self.cfg.allow_batch_change,
            straggler_options=self.cfg.straggler_options, items_per_step=self.cfg.items_per_step,
            stages=stages, memory_bytes=self.cfg.device_memory_bytes,
            one_each=self.cfg.one_microbatch_each)
        self._startup_s = startup_s()  # this worker's start-up so far (before joining)
        self.recoveries = 0
        self.predictions: list[dict] = []  # predicted vs measured, per failure/join Decision
        self._tracker = PredictionTracker(_PREDICT_STEPS)
        self.last_recovery: Optional[dict] = None  # on every member: mttr breakdown + info
        self.last_decisions: list[dict] = []  # JSON of the last Decisions taken or received
        self.step = 0  # committed global steps, across epochs
        self.lr_scale = 1.0  # learning-rate factor applied for a changed global batch
        self.fresh = True  # holds no agreed state yet (first start, replacement)
        self.last_checkpoint_step = 0
        # Committed steps the run is meant to reach (None: unknown): bounds the sharded snapshot
        # interval and what rehabilitation may leave to heal.
        self.planned_steps: Optional[int] = None
        self.checkpoint_path: Optional[str] = None  # set by the trainer that writes checkpoints
        self.view: Optional[MembershipView] = None
        self.membership: Optional[Membership] = None
        self.gm: Optional[GroupManager] = None
        self.log: Optional[EventLog] = None
        if self.env.run_dir:
            self.log = EventLog(os.path.join(self.env.run_dir, "events.jsonl"),
                                worker=self.worker_id, pid=os.getpid())
        # A replacement must not re-fire its predecessor's faults.
        self.faults = FaultInjector(self.env.faults if self.env.replacement == 0 else None,
                                    self.worker_id, self.env.local_rank, self.env.node_rank)
        self._step_start: Optional[float] = None
        self._compute_s, self._n_mb, self._ids = 0.0, 0, []
        self._prev_comm, self._prev_step = 0.0, 0.0
        self._pending: Optional[tuple[RecoveryTimer, dict]] = None
        self.notice = PreemptionNotice(self.worker_id)  # SIGTERM: leave after the step (start)
        self._leavers: tuple[int, ...] = ()
        # Called on every member when every member of the generation announced its leave in
        # the same commit (the whole job preempted: nobody carries on), before they go: where
        # the run's state is kept for a requeued job (``ElasticTrainer``: its checkpoint).
        self.on_whole_job_leave: Optional[Callable[[], None]] = None
        self._nonfinite: tuple[int, ...] = ()  # members whose loss of the step was not finite
        self._nonfinite_run = 0  # such steps in a row
        self.steering = Steering()  # stop/save decisions an adapter could not agree at once
        self._steer_words: dict = {}  # every member's steering word of the last commit
        self._is_source = False
        self._engine_undo: Optional[dict] = None  # the engine before a reconfiguration attempt (_sync)
        # What this member does outside a step (an adapter's tag, 0: nothing in particular),
        # shared by every reconfiguration's agreement (``recover_off_step``).
        self.activity = 0
        self.peer_activity: list[int] = []
        # After every reconfiguration (in a step or outside one): the adapter's translation.
        self.on_reconfigured: Optional[Callable[[], None]] = None
        self.redone_steps = 0  # attempts no member committed (run again)
        self.rollbacks = 0  # in-place rollbacks of this generation (its steps' attempts then differ)
        self.adopted_steps = 0  # attempts interrupted here that a peer committed

    # ---------------------------------------------------------------- properties
    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @property
    def rank(self) -> int:
        return self.view.rank if self.view else -1

    @property
    def members(self) -> tuple[int, ...]:
        return self.view.members if self.view else ()

    @property
    def reconfigured(self) -> bool:
        """A reconfiguration happened since the last committed step (every member of the
        current view agrees on this: they all took part in it and commit together)."""
        return self._pending is not None

    # ---------------------------------------------------------------- lifecycle
    def start(self, joined: Optional["Joined"] = None) -> MembershipView:
        """Join the job, form the group, and receive the agreed state from a peer.

        ``joined``: the result of an earlier ``join_job`` (adapters whose framework needs
        collectives before the training state exists join early and hand it over here)."""
        timer = RecoveryTimer()
        if self.takes_sigterm:
            self.notice.install()
        if joined is None:
            joined = join_job(self.env, self.cfg, self.hang_timeout_s)
        self.membership, self.gm = joined.membership, joined.gm
        self.membership.volunteers = lambda: not self.notice.reason
        # Without a step header a control collective could meet the step's all-reduce: refused.
        self.gm.control_allowed = self.step_header is not None
        self.gm.separate_data = self.reduces_in_buckets and self.step_header is not None
        view = joined.view
        timer.mark("membership")
        if self.log:
            self.log.run_start(replacement=self.env.replacement, node_rank=self.env.node_rank,
                               local_rank=self.env.local_rank, generation=view.generation,
                               members=list(view.members))
        self._establish(view, timer, None)
        # A replacement takes about as long to start as this worker took to get here (imports,
        # the model), plus joining a running job: measured, not the configured prior.
        if self._startup_s is not None and self.policy.replacement_eta_s is not None and not self.env.replacement:
            self.policy.replacement_eta_s = self._startup_s + _JOIN_S
        self._measure_agreement(timer.breakdown())  # until a recovery measures it
        if self.env.replacement:
            self._pending = (timer, {"reason": "replacement joined"})
        return self.view

    def depart(self) -> bool:
        """The end of training on this member, before it leaves: True once every member of the
        generation has committed the step this one ends at.  A commit can complete on some
        members and fail on another (gloo's partial completion, the ``drop`` fault): that one
        must adopt the step from a peer, which it cannot once its peers have left -- it would
        redo the step alone and end on other weights.  So each member marks its step in the
        store (``cft/done/<token>/<worker>``) and waits until every member's mark is there (a
        member reported dead is not waited for).  Meanwhile a peer that failed ends the
        generation: this member then recovers with it and returns False (the caller checks
        whether training is still over -- a member behind adopted the step -- and departs
        again).  Waits at most ``view_timeout_s``; a coordinator that no longer answers (or that
        deadline) ends the wait with a warning: this member has committed everything."""
        if self.membership is None or self.gm is None or self.view is None or self.view.world_size < 2:
            return True
        view, store = self.view, self.membership.store
        keys = {w: f"cft/done/{view.token}/{w}" for w in view.members}
        pending = [w for w in view.members if w != self.worker_id]
        dead_read = [0.0]

        def all_marked() -> bool:  # (raises the generation's failure once a member ended it)
            self.gm.raise_if_aborted()
            if store.check([keys[w] for w in pending]):
                return True
            if time.monotonic() - dead_read[0] > 0.25:
                dead_read[0] = time.monotonic()
                dead = reported_dead_among(store, pending)
                pending[:] = [w for w in pending if w not in dead]
            return not pending

        try:
            store.set(keys[self.worker_id], str(self.step))
            if not poller(all_marked, 0.02)(self.cfg.view_timeout_s):
                log.warning("worker %d: leaves without the end-of-training marks of worker(s) %s after %.0f s",
                            self.worker_id, pending, self.cfg.view_timeout_s)
        except CollectiveFailure as failure:
            self.recover_off_step(failure)
            return False
        except (dist.DistError, MembershipError) as exc:
            log.warning("worker %d: the coordinator did not answer at the end of training (%s); it leaves, "
                        "having committed step %d", self.worker_id, exc, self.step)
        return True

    def end_training(self) -> None:
        """``depart`` for an adapter whose user's loop has ended (Accelerate's ``end_training``,
        Lightning's ``on_train_end``, the ``Trainer``'s ``train``): recover with any member still
        finishing the last step until every member is done.  Never raises: a failure here is
        logged and the member goes on (its peers see a lost member if it then dies)."""
        try:
            for _ in range(8):  # (each round is a recovery: a member failing its last commit again and again)
                if self.depart():
                    return
            log.warning("worker %d: leaves after 8 recoveries at the end of training", self.worker_id)
        except Exception as exc:  # (at exit: nothing is left to run; the peers see a lost member)
            log.warning("worker %d: a recovery at the end of training failed (%s: %s); it leaves",
                        self.worker_id, type(exc).__name__, exc)

    def close(self, **fields) -> None:
        self.notice.uninstall()
        if self.log:
            self.log.run_end(step=self.step, epoch=self.epoch, members=list(self.members), **fields)
        for part in (self.membership, self.gm):
            if part:
                part.close()

    # ---------------------------------------------------------------- commit
    def _reduce_step(self, parts: list[torch.Tensor], compute_s: float):
        """The step's one all-reduce: this member's ``parts`` (flat, ``self.dtype``) followed
        by every member's timings (``_tail_row``).  Returns (the reduced ``parts`` as one
        buffer, timings per member, all-reduce seconds), or None when a failure interrupted it:
        the job has then reconfigured and the caller redoes the step."""
        n, r = self.view.world_size, self.view.rank
        device = parts[0].device if parts else torch.device("cpu")  # the gradients' device
        tail = torch.zeros(_TAIL * n, dtype=self.dtype)
        tail[_TAIL * r:_TAIL * (r + 1)] = torch.tensor(self._tail_row(compute_s), dtype=self.dtype)
        # A fresh buffer each step, so an abandoned op can't touch anything we keep.
        buf = torch.cat([p.to(self.dtype) for p in parts] + [tail.to(device)])
        comm = self._commit_attempt(lambda: self._commit_reduce(buf))
        if comm is None:
            return None
        at = buf.numel() - _TAIL * n
        return buf[:at], self._read_tail(buf[at:])[1], comm

    def _tail_row(self, compute_s: float) -> list[float]:
        """This member's timings -- compute s, micro-batches, the previous reduction's and
        step's s -- 1 when it leaves after this step (``runtime/preemption.py``), and its held
        loop-steering decisions (``runtime/steering.py``)."""
        # The sixth, a non-finite loss (not 0), is written on the tensor side by an executor that
        # checks it (``DataParallelExecutor.sync_and_step``: no host read).
        return [compute_s, self._n_mb, self._prev_comm, self._prev_step, 1.0 if self.notice.reason else 0.0, 0.0,
                self.steering.word()]

    def _read_tail(self, tail, lead: int = 0) -> tuple[list, dict]:
        """The reduced tail's first ``lead`` numbers, and every member's timings by worker id
        after them -- (compute s, micro-batches, the previous reduction's s, the previous step's
        s) -- (the step's one host read, after its commit point; ``tail`` a tensor or a numpy
        view of one, read with one ``tolist``); the members that
        announced their leave in it go to ``_leavers``, those whose loss was not finite to
        ``_nonfinite``, the steering words to ``_steer_words``."""
        words = tail.tolist()
        members = self.view.members
        end = lead + _TAIL * len(members)
        # Column k of the rows: words[lead + k:end:_TAIL], one number per member.
        self._leavers = tuple(w for w, v in zip(members, words[lead + 4:end:_TAIL]) if v > 0)
        self._nonfinite = tuple(w for w, v in zip(members, words[lead + 5:end:_TAIL]) if v != 0)  # (1, or NaN)
        self._steer_words = {w: v for w, v in zip(members, words[lead + 6:end:_TAIL]) if v > 0}
        return words[:lead], {w: (words[i], int(words[i + 1]), words[i + 2], words[i + 3])
                              for w, i in zip(members, range(lead, end, _TAIL))}

    def _commit_attempt(self, reduce, logged: bool = False) -> Optional[float]:
        """Run the step's reduction (the commit point; ``logged``: it writes ``_log_attempt``
        itself); its seconds, or None after a failure (recovered)."""
        if not logged:
            self._log_attempt()
        t0 = time.perf_counter()
        try:
            self._store_op(reduce)
            if self.faults.fires(self.step, "commit", "drop"):  # tests: a partial completion
                raise self.gm._local_failure("injected drop: the commit all-reduce, completed by the peers, "
                                             "failed here", "peer_error")
        except CollectiveFailure as failure:  # what it computed is kept (the redone step's share)
            self._step_start = None
            self._recover(failure, t0)
            return None
        return time.perf_counter() - t0

    def _log_attempt(self) -> None:
        if self.log:
            token = self.view.token + (f"/{self.rollbacks}" if self.rollbacks else "")
            if self.cfg.log_samples:
                self.log.step(self.step, self.view.world_size, len(self._ids), self._compute_s, epoch=self.epoch,
                              token=token, ids=self._ids)
            else:
                self.log.attempt(self.step, self.view.world_size, len(self._ids), self._compute_s, self.epoch, token)

    def _commit_reduce(self, buf: torch.Tensor) -> None:
        """The step's all-reduce in place (its header makes a peer's stray control call give way)."""
        self.gm.allreduce(buf, dist.ReduceOp.SUM, timeout_s=self.hang_timeout_s, copy=False, header=self.step_header)

    def _finish_step(self, timings: dict, comm: float) -> None:  # the update was applied
        self._commit()
        if self._steer_words:
            self._agree_steering()
        self._after_commit(timings)
        self._prev_comm = comm
        self._prev_step = time.perf_counter() - self._step_start
        self._step_start = None
        if self._leavers:
            self._announced_leave(self._leavers)

    def _agree_steering(self) -> None:
        """Some member held a loop-steering decision; the commit just made told every member
        the same (``runtime/steering.py``)."""
        words, self._steer_words = self._steer_words, {}
        self.steering.agree(words, self.step)
        if self.log and self.rank == 0:
            self.log.write("steering", step=self.step, held_by=sorted(words), stop_voters=list(self.steering.voters),
                           stop=bool(self.steering.voters))

    def _before_leave(self, leavers: tuple[int, ...]) -> None:
        """Executor hook, run by every member after the commit that announced ``leavers``
        and before they go: hand over what only the leavers hold (the sharded executor
        snapshots every row at this step, so that the leavers' rows come back without a step
        redone).  Nothing to do where every member holds the whole state."""

    def _announced_leave(self, leavers: tuple[int, ...]) -> None:
        """Members announced in the commit just made that they leave (SIGTERM): the leavers
        mark themselves gone and raise ``Preempted``; the others reconfigure now, between two
        steps -- every member read the same tail, so all act alike and nothing is redone."""
        self._leavers = ()
        everyone = set(leavers) >= set(self.view.members)
        if everyone and self.on_whole_job_leave is not None:
            self.on_whole_job_leave()  # all of them here, at this boundary: collectives may run
        else:
            self._before_leave(leavers)
        if self.worker_id in leavers:
            self._store_op(lambda: self.membership.leave())
            if self.log:
                self.log.run_end(step=self.step, epoch=self.epoch, members=list(self.members), left="preempted",
                                 whole_job=everyone)
            raise Preempted(f"worker {self.worker_id} left the job after step {self.step} "
                            f"({self.notice.reason}: preempted); its peers carry on")
        # The leavers mark themselves gone only after their own side of this commit succeeded;
        # ending the generation before that could fail it and bring them back for a second leave.
        wait_s = min(self.hang_timeout_s, _LEAVE_MARK_S)
        late = self._store_op(lambda: self.membership.await_left(leavers, wait_s))
        if late:
            log.warning("worker(s) %s announced their leave but did not mark it within %.1f s: their side of "
                        "the commit may have failed (they come back, then leave again)", list(late), wait_s)
        failure = CollectiveFailure(f"worker(s) {list(leavers)} announced their leave (a preemption notice)",
                                    kind="leave", token=self.view.token, generation=self.view.generation,
                                    suspects=leavers, reporter=self.worker_id)
        self._recover(failure, time.perf_counter())

    def _commit(self) -> None:  # the sampler's cursor moves only here
        self.sampler.commit()
        self.step += 1
        if self.sampler.epoch_done:
            self.sampler.set_epoch(self.sampler.epoch + 1)

    def _after_commit(self, timings: dict) -> None:
        decision = self.policy.observe_step(timings, self.step, self.step - self.last_checkpoint_step)
        if decision is not None:
            self.apply_allocation()
            self.last_decisions = [decision.to_json()]
            if self.log and self.rank == 0:
                self.log.decision(decision.to_json(), step=self.step)
        if self._pending is not None:
            timer, info = self._pending
            self._pending = None
            timer.mark("first_step")
            self.recoveries += 1
            self.last_recovery = {"mttr": timer.breakdown(), "step": self.step,
                                  "members": list(self.members), **info}
            if self.log and self._is_source:
                self.log.recovery(timer, step=self.step, members=list(self.members), **info)
            mttr = self.last_recovery["mttr"]
            self._measure_agreement(mttr)
            self._tracker.start(self.step, self.last_decisions, mttr, time.perf_counter())
        rec = self._tracker.commit(self.step, time.perf_counter())
        if rec is not None:
            self.predictions.append(rec)
            if self.log and self.rank == 0:
                self.log.write("prediction", step=self.step, **rec)
        if self.step % _CALIBRATION_EVERY == 0 and self.log and self.rank == 0 and self.policy.fit is not None:
            self.log.write("calibration", step=self.step, **self.policy.calibration_json())

    def _measure_agreement(self, mttr: dict) -> None:
        """For the next Decision: a reconfiguration's fixed part beyond the rebuild (state transfer
        less migration and the source's engine work, ``engine_s``)."""
        migration_s = (getattr(self, "last_migration", None) or {}).get("seconds") or 0.0
        self.policy.agree_s = max(0.0, (mttr.get("state_transfer") or 0.0) - migration_s
                                  - getattr(self, "_engine_s", 0.0))

    def _discard(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self._step_start = None
        self._compute_s, self._n_mb, self._ids = 0.0, 0, []
        self.reset_step()

    def reset_step(self) -> None:
        """Forget the executor's bookkeeping of a discarded step."""

    def weigh(self, loss: torch.Tensor, mb, tokens=None) -> torch.Tensor:
        """``loss`` weighted for the step, for an adapter that runs the backward itself
        (Lightning's precision plugin): the ``backward`` fault hook and ``_token_weight``."""
        self.faults.at(self.step, "backward")
        return loss * self._token_weight(mb, tokens)

    def _token_weight(self, mb, tokens=None):
        """The factor of a micro-batch's (or item's) mean loss: its sample share, or with
        ``tokens`` (a number, or a 0-dim tensor: never read here) its token count, counted into
        the step's (``self._tokens``, the executor's); the reduced total divides the gradients
        and the loss after the commit: the global batch's token mean, whoever computed which
        micro-batch, with no collective of its own."""
        if tokens is None:
            return mb.weight
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().reshape(()).to(self.dtype)
        elif tokens <= 0:
            raise ValueError(f"a token-weighted micro-batch needs a positive item count, got {tokens}")
        self._tokens = self._tokens + tokens
        return tokens

    def _before_item(self, item) -> None:
        """Before a step's item runs: the ``forward`` fault hook and, with ``seed_microbatches``,
        the per-(step, slot) seed of its first micro-batch (the same whichever member runs it)."""
        self.faults.at(self.step, "forward")
        if self.cfg.seed_microbatches and not item.ghost:
            seed_generators((self.seed * 1_000_003 + self.step) * 65_537 + item.seed_slot)
    # ---------------------------------------------------------------- recovery
    def recover(self, failure: CollectiveFailure) -> None:
        """Reconfigure after ``failure`` of a collective outside a step, as after a failed one
        (nothing is redone; ``peer_activity`` then tells what every member was doing)."""
        self._recover(failure, time.perf_counter())

    def run_step(self, attempt: Callable[[], bool], again: Optional[Callable[[], bool]] = None) -> StepEnd:
        """The end of a step, once for every loop: ``attempt()`` computes this member's share
        (after a failure: what the recovery gave it) and commits it, True when it committed
        here.  A step nobody committed is attempted again (here unless ``again()`` says no: the
        caller's loop redoes it) until committed or adopted from a peer; returns how it ended."""
        before = self.step
        end = self.end_of_step(attempt(), before)
        while end is StepEnd.REDO and (again is None or again()):
            end = self.end_of_step(attempt(), before)
        return end

    def end_of_step(self, committed: bool, step_before: int) -> StepEnd:
        """Classify and count an attempt's end (``committed``: what the commit returned;
        ``step_before``: the step counter before it): ``redone_steps`` / ``adopted_steps``."""
        if committed:
            return StepEnd.COMMITTED
        if self.step > step_before:
            self.adopted_steps += 1
            return StepEnd.ADOPTED
        self.redone_steps += 1
        return StepEnd.REDO

    def recover_off_step(self, failure: CollectiveFailure, activity: int = 0) -> bool:
        """The one recovery outside a step (an evaluation, barrier, save, epoch-end sync): recover
        now, tagged with ``activity`` (the adapter's integer for what this member did; 0:
        nothing in particular); True when every member recovered from the same activity (they
        may run it again together), else this member finishes it alone."""
        before, self.activity = self.activity, activity
        try:
            self.recover(failure)
        finally:
            self.activity = before
        return bool(activity) and all(a == activity for a in self.peer_activity)

    def _store_op(self, fn):
        """Run ``fn``; a failing coordinator store becomes a clear ``MembershipError``."""
        try:
            return fn()
        except (CollectiveFailure, MembershipError):
            raise
        except dist.DistError as exc:
            where = ("" if self.env.store.startswith("etcd://") else " (it is hosted by the launcher "
                     "of node 0, the job's single point of failure)")
            raise MembershipError(f"worker {self.worker_id}: lost the coordinator at {self.env.store}{where}: "
                                  f"{exc}") from exc

    def _recover(self, failure: CollectiveFailure, t_start: float) -> None:
        self._tracker.cancel()  # a Decision interrupted before its steps were measured
        timer = RecoveryTimer(start=t_start, clock=time.perf_counter)
        timer.mark("detect")
        record = self._store_op(self.gm.abort_record) or {}
        reason = str(record.get("reason", ""))
        hang = failure.kind == "timeout" or reason.startswith("timeout")
        info = {"kind": failure.kind, "hang": hang, "failed_generation": failure.generation,
                "reporter": failure.reporter, "reason": reason[:300]}
        token = failure.token or None
        self._store_op(lambda: self.membership.report_failure(
            failure.suspects, f"{failure.kind}: {str(failure)[:200]}", token=token))
        view = self._store_op(lambda: self.membership.next_view(self.cfg.view_timeout_s, after=token))
        timer.mark("membership")
        self._establish(view, timer, info)
        self._pending = (timer, info)
        if self.on_reconfigured is not None:
            self.on_reconfigured()

    def _establish(self, view: MembershipView, timer: RecoveryTimer, info: Optional[dict]) -> None:
        """Form the group for ``view`` and agree on the state; on another failure (a kill
        during recovery), report it and go again with the next view -- never wait forever."""
        while True:
            try:
                if view.world_size < self.cfg.min_world_size:
                    raise WorldTooSmall(
                        f"{view.world_size} worker(s) left, fewer than min_world_size="
                        f"{self.cfg.min_world_size}")
                t0 = time.perf_counter()
                if not self.gm.formed_for(view):
                    self._store_op(lambda: self.gm.rebuild(view))
                    self.policy.rebuild_s = time.perf_counter() - t0
                timer.mark("rebuild")
                self.view = view
                self._sync(view, info)
                timer.mark("state_transfer")
                return
            except CollectiveFailure as again:
                failure = again  # the lambda runs now, but keep the name alive past the except
                failed = view
                if self._engine_undo is not None:  # (see _sync)
                    self.policy.load_state_dict(self._engine_undo)
                    self._engine_undo = None
                self._store_op(lambda: self.membership.report_failure(
                    failure.suspects, f"{failure.kind} during recovery: {str(failure)[:200]}",
                    token=failed.token))
                view = self._store_op(lambda: self.membership.next_view(self.cfg.view_timeout_s,
                                                                        after=failed.token))
                timer.mark("membership")

    def _sync(self, view: MembershipView, info: Optional[dict]) -> None:
        n, r = view.world_size, view.rank
        batch_before = self.sampler.global_batch
        mine = self.recovery_fields()
        k = len(mine)
        shared = None if self.fresh else self.replicated_state()  # (what holders send together)
        v = torch.zeros((4 + k) * n, dtype=torch.int64)
        v[r], v[n + r], v[2 * n + r] = self.step, int(self.fresh), int(self.activity)
        v[3 * n + r] = run_state.layout_digest(shared) if shared is not None else 0
        if k:
            v[4 * n + r * k:4 * n + (r + 1) * k] = torch.tensor(mine, dtype=torch.int64)
        self._store_op(lambda: self.gm.allreduce(v, dist.ReduceOp.SUM, timeout_s=self.hang_timeout_s,
                                                 header="sync"))
        steps, fresh = v[:n].tolist(), v[n:2 * n].tolist()
        self.peer_activity = v[2 * n:3 * n].tolist()
        layouts = v[3 * n:4 * n].tolist()
        # What every member reported, for an executor's source_payload / carry_out.
        self.peer_steps, self.peer_fresh = steps, fresh
        self.peer_fields = [v[4 * n + i * k:4 * n + (i + 1) * k].tolist() for i in range(n)]
        top = max(steps)
        if self.user_loop and not self.env.replacement and top - self.step > (0 if self.fresh else 1):
            self._leave(view, top)
        if self.env.replacement and all(fresh):
            # Everyone here is new: the job finished, or every worker with state is gone.
            raise NothingToHeal(f"replacement worker {self.worker_id} found no peer with state "
                                "to heal from (the job finished or all its workers are gone)")
        source = next((i for i in range(n) if steps[i] == top and not fresh[i]), 0)
        needers = [i for i in range(n) if i != source and (steps[i] < top or fresh[i])]  # get the state
        # The members at the top step holding the replicated part as the source does send it
        # together, each its share of the messages (the source first: it sends the skeleton).
        holders = [i for i in range(n) if steps[i] == top and not fresh[i] and layouts[source]
                   and layouts[i] == layouts[source]] or [source]
        was_behind = self.fresh or self.step < top
        self._is_source = r == source
        # Every member but the source needs the state (a job's start): it rides in the broadcast,
        # the same bytes as sending it to each.  Sent point to point over a rate-limited link
        # instead, every later step of the job ran ~4 % slower there, cause not found
        # (docs/benchmarks-step.md, "The link case again").
        in_broadcast = n > 1 and len(needers) == n - 1
        payload, state = None, None
        if self._is_source:
            t_engine = time.perf_counter()
            # The engine decides in ``source_payload``; should this attempt fail before its
            # Decisions are logged, ``_establish`` puts the engine back (``_engine_undo``), so that
            # the next attempt -- this member its source again -- decides them again instead of
            # finding nobody lost.
            self._engine_undo = self.policy.state_dict()
            payload = self.source_payload(view, info)
            if self.log:  # before the broadcast: after it, a next source's engine no longer counts them
                self.log.deaths(payload.get("dead", []), info, payload["decisions"], worker_id=self.worker_id, step=self.step,
                                claim=lambda w: self.membership is None or first_to_record(self.membership.store, w))
            payload["engine_s"] = time.perf_counter() - t_engine  # not agreement (_measure_agreement)
            state = self.state_dict() if needers else None
            if in_broadcast:
                payload["state"] = state
        self.faults.at(top, "reconfigure")  # (tests: a death between the Decisions and their broadcast)
        payload = run_state.broadcast_tree(
            lambda fn: self._store_op(lambda: self.gm.collective(fn, self.hang_timeout_s)),
            source, r, payload)
        # The state goes only to the members behind, point to point: its replicated part from
        # every holder (a share each), the rest from the source.
        state_bytes = 0
        send = lambda tree, **kw: self._store_op(lambda: run_state.send_tree(  # noqa: E731
            self.gm.send, lambda works: self.gm.wait_p2p(works, self.hang_timeout_s), tree, needers, **kw))
        recv = lambda **kw: self._store_op(lambda: run_state.recv_tree(  # noqa: E731
            self.gm.recv, lambda works: self.gm.wait_p2p(works, self.hang_timeout_s), source, **kw))
        if in_broadcast:
            if r in needers:
                self.load_state_dict(payload.pop("state"))
            else:
                payload.pop("state", None)
                state_bytes = len(needers) * sum(t.numel() * t.element_size()
                                                 for t in run_state.encode(state, host=False)[1])
        elif r in holders and needers:
            rest = run_state.split_tree(state, shared) if self._is_source and shared is not None else state
            sent = send(rest) if self._is_source else 0
            if shared is not None and layouts[source]:
                sent += send(shared, tag=run_state.SHARED_TAG, share=(holders.index(r), len(holders)))
            state_bytes = len(needers) * sent
        elif r in needers:
            state = recv()
            if layouts[source]:
                state = run_state.merge_tree(state, recv(tag=run_state.SHARED_TAG, holders=holders))
            self.load_state_dict(state)
        if not self._is_source:
            self.sampler.load_state_dict(payload["sampler"])
        # The source too: every member takes straggler Decisions on its own, so the engine state
        # (hysteresis counters, cached predictions too) must be identical everywhere.
        self.policy.load_state_dict(payload["engine"])
        if was_behind or self.sampler.global_batch != batch_before:
            self._discard()  # nothing of ours belongs to the step everyone is at (or its batch changed)
        self._apply_lr_scale()
        self.fresh = False
        self.last_decisions, self._engine_s = list(payload["decisions"]), float(payload.get("engine_s", 0.0))
        if self._is_source and self.log:
            self._log_reconfiguration(view, info, payload, [view.members[i] for i in needers], state_bytes,
                                      [view.members[i] for i in holders] if needers else [])
        self._engine_undo = None
        if payload["restart"]:
            raise RestartRequested(payload["decisions"][-1] if payload["decisions"] else None)
        self.carry_out(payload, top, n, r)

    def _leave(self, view: MembershipView, top: int) -> None:
        """Peers committed more than the one step a user's loop may adopt: end the generation
        naming this member and raise ``LeftBehind`` (it exits as a lost one; peers carry on)."""
        msg = (f"worker {self.worker_id} was left out of the job "
               f"{'before its first step' if self.fresh else f'at step {self.step}'} while its peers "
               f"committed up to step {top} (it stopped or was cut off for longer than the hang "
               f"timeout); its training loop cannot skip steps: it leaves the job, its peers carry on")
        self._store_op(lambda: self.membership.report_failure([self.worker_id], msg, token=view.token))
        self.membership.close()
        if self.log:
            self.log.run_end(step=self.step, left_behind=True, peers_step=top, generation=view.generation)
        raise LeftBehind(msg)

    def recovery_fields(self) -> list[int]:
        """Integers (as many on every member) it reports in the recovery all-reduce."""
        return []

    def carry_out(self, payload: dict, top: int, n: int, r: int) -> None:
        """Carry out what the agreed state asks before training resumes (the executor's)."""
        self._discard()

    def source_payload(self, view: MembershipView, info: Optional[dict]) -> dict:
        restart, decisions = False, []
        before = set(self.policy.alive)
        try:
            if self.policy.plan is None:
                self.policy.start(view.members)
            else:
                decisions = self.policy.on_membership(
                    view.members, bool(info and info.get("hang")), self.step,
                    self.step - self.last_checkpoint_step)
        except RestartRequested as req:
            restart, decisions = True, decisions + [req.decision]
        if not restart:
            self.apply_allocation()
        return {"engine": self.policy.state_dict(), "sampler": self.sampler.state_dict(),
                "decisions": [d.to_json() for d in decisions], "restart": restart,
                "dead": sorted(before - set(view.members))}

    def apply_allocation(self) -> None:
        if self.sampler.global_batch != self.policy.current_batch:  # shrink, or growing back
            self.sampler.set_global_batch(self.policy.current_batch)
        alloc = self.policy.allocation
        self.sampler.set_allocation(list(alloc), list(alloc.values()))

    def _apply_lr_scale(self) -> None:
        """The learning rate follows the global batch (linear scaling rule), on every member."""
        factor = self.policy.lr_scale / self.lr_scale
        if factor == 1.0:
            return
        for group in self.optimizer.param_groups:
            group["lr"] *= factor
            if "initial_lr" in group:
                group["initial_lr"] *= factor
        if self.scheduler is not None and hasattr(self.scheduler, "base_lrs"):
            self.scheduler.base_lrs = [b * factor for b in self.scheduler.base_lrs]
        self.lr_scale = self.policy.lr_scale

    def _log_reconfiguration(self, view: MembershipView, info: Optional[dict], payload: dict,
                             state_to: list[int], state_bytes: int, state_from: list[int]) -> None:
        dead = payload.get("dead", [])  # (their failure record: ``EventLog.deaths``, before the broadcast)
        self.log.membership(view.generation, view.members, reason="failure" if dead else "join",
                            token=view.token, step=self.step, state_sent=bool(state_bytes),
                            state_to=state_to, state_bytes=state_bytes, state_from=state_from)
        for d in payload["decisions"]:
            self.log.decision(d, step=self.step)

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """The whole run state: model, optimizer, scheduler, sampler, engine, step, RNG."""
        return {**self._run_state(), "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(), "engine": self.policy.state_dict()}

    def replicated_state(self) -> Optional[dict]:
        """The part of ``state_dict()`` that every member at the same step holds bit for bit,
        as a sub-tree of it (``codec.split_tree``), or None (the default: the source sends the
        whole state).  Those members share sending it to the members behind (``_sync``)."""
        return None

    def load_state_dict(self, s: dict) -> None:
        self.model.load_state_dict(s["model"])
        self.optimizer.load_state_dict(s["optimizer"])
        self._load_run(s)
        self.policy.load_state_dict(s["engine"])

    def _run_state(self) -> dict:
        """The run state besides the model, optimizer and engine: counters, scheduler,
        sampler, RNG (what a rollback to a snapshot restores too)."""
        return {"step": self.step, "last_checkpoint_step": self.last_checkpoint_step, "lr_scale": self.lr_scale,
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "sampler": self.sampler.state_dict(), "steering": self.steering.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()}}

    def _load_run(self, s: dict) -> None:
        if self.scheduler is not None and s["scheduler"] is not None:
            self.scheduler.load_state_dict(s["scheduler"])
        self.sampler.load_state_dict(s["sampler"])
        torch.set_rng_state(s["rng"]["torch"])
        random.setstate(s["rng"]["python"])
        self.step = int(s["step"])
        self.last_checkpoint_step = int(s["last_checkpoint_step"])
        self.lr_scale = float(s.get("lr_scale", 1.0))
        self.steering.load_state_dict(s.get("steering"))

    def plan_run(self, max_steps: Optional[int] = None, epochs: Optional[int] = None) -> None:
        """``planned_steps`` from where the run will stop: ``max_steps`` committed steps or
        ``epochs`` epochs, whichever comes first (None for a bound not set; neither: unknown)."""
        ends = ([max_steps] if max_steps is not None else []) + (
            [epochs * self.sampler.steps_per_epoch] if epochs is not None else [])
        self.planned_steps = min(ends) if ends else None

    def save_checkpoint(self, path: str) -> None:
        """Call on every member at the same step: the lowest-ranked one writes the run state
        and, beside it, the model's plain ``state_dict`` (``codec.model_file``); all of them
        remember the step (the engine weighs restart by steps since it)."""
        self.last_checkpoint_step = self.step
        if self.rank == 0:
            run_state.save_checkpoint(path, self.state_dict(), midway=lambda: self.faults.at(self.step, "save"))
            run_state.save_model(run_state.model_file(path), self.model.state_dict())

    def save_final(self, path: str) -> None:
        """The end of training's checkpoint, confirmed: every member calls it at the same point;
        the lowest-ranked one writes it (``save_checkpoint``), then all meet once.  A member lost
        before that meeting -- the writer killed inside its write -- makes the others recover
        and write it again (the new lowest-ranked one), so that no job ends with exit 0 on a
        final checkpoint that was never written."""
        while True:
            self.save_checkpoint(path)
            if self.view.world_size < 2:
                return
            try:
                self._meet()
                return
            except CollectiveFailure as failure:
                self.recover_off_step(failure)

    def _meet(self) -> None:
        """Every member of the generation meets once (a one-number all-reduce under the step's
        header): each knows the others got this far.  ``CollectiveFailure`` when one did not."""
        self.gm.allreduce(torch.zeros(1), dist.ReduceOp.SUM, timeout_s=self.hang_timeout_s, copy=False,
                          header=self.step_header)

    def load_checkpoint(self, path: str) -> None:
        """Resume from ``path`` before ``start()``; the plan starts over on whoever is there."""
        self.load_state_dict(run_state.load_checkpoint(path))
        self.policy.plan = None
