"""Per-generation gloo process groups that fail fast, for in-place recovery.

``GroupManager`` builds a fresh ``ProcessGroupGloo`` over the members of every agreed
membership generation (``MembershipView``), on a ``PrefixStore`` keyed by the view's unique
token, without ``init_process_group`` (the default group cannot be re-formed after a death).
``collective(fn, timeout_s)`` runs one collective and turns a peer error, a timeout, or an
abort declared by another member into ``CollectiveFailure``.

How survivors learn about a death (measured on torch 2.13, gloo/TCP, loopback):

* A SIGKILLed peer's ring neighbours get "Connection reset/closed by peer" within ~10 ms.
  Every other rank blocked in the same collective waits for gloo's timeout: no error reaches
  it while the neighbours stay alive.
* ``ProcessGroupGloo.abort()`` and ``shutdown()`` return at once but do not close the
  sockets and do not wake a thread blocked in a gloo op, so they cannot be used to cascade.
* Therefore: a member that sees an error writes the generation's *abort key* in the
  coordinator's TCPStore; every member waits on its work in a helper thread (``_await``: the
  blocking wait releases the GIL and wakes the member the moment the op completes) and,
  every few milliseconds, reads the abort key.  The first error thus reaches all members
  within one poll interval plus a store round trip.
* A hung peer (SIGSTOP) produces no error anywhere; ``timeout_s`` (the watchdog) bounds it.

Collective headers.  Gloo pairs the ops of a group by their order only: a barrier on one member
meets whatever its peer runs next, and two ops of different sizes abort the process in gloo's
size check (``EnforceNotMet``, SIGABRT, uncatchable).  So the step's gradient all-reduce (where
control collectives can run between steps: ``control_allowed``) and the adapters' control
collectives run ``checked(kind, tensor)`` first: one all-gather of a
fixed-size int64 header (``HEADER_LEN`` on every member, whatever the op) carrying the op kind
and the facts that must agree (label, dtype, reduce op or broadcast source, size, shape).  Data
moves only when every member's header agrees.  Otherwise every member sees the same headers
and resolves the same way, without consensus of its own and without touching the data:

* a *runtime* kind (``step``: the gradient all-reduce; ``sync``: a recovery all-reduce) whose
  differing peers are all in control collectives exchanges its header again: those peers give
  up their call and come to their own sync next;
* a *control* kind (reduce, all_gather, gather_object, broadcast, barrier) gives up without
  moving data (``CollectiveMismatch``; the caller returns its local value) and skips its
  control collectives, without a header, until its next runtime header matches
  (``realigning``), so that both sides meet again at the sync;
* runtime kinds that differ from each other cannot be reconciled here: the generation is
  aborted (``CollectiveFailure`` of kind ``"mismatch"``, no suspects) and the recovery
  protocol realigns the members, as after any failed collective.

Limits, honestly:

* An abandoned op keeps one gloo worker thread blocked until the group's own op timeout
  (``op_timeout_s``) expires.  The old group object is parked until its work completes;
  dropping it earlier would make its destructor join that thread while holding the GIL.
  A process that exits while a parked op is blocked should use ``os._exit``.
* An abandoned op might still write into its tensors until it times out, so ``collective``
  works on the caller's tensors only when the caller asks for it (``allreduce`` copies by
  default); after a ``CollectiveFailure`` the step must be redone from unreduced inputs.
* ``CollectiveFailure.suspects`` holds worker ids only when someone knew them (a launcher
  that saw a process exit, a timeout attributed by the membership layer); gloo's error
  text names a socket address, not a rank.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from chameleon_ft.runtime.errors import CollectiveFailure, CollectiveMismatch, ConfigError
from chameleon_ft.runtime.waits import Waits
from chameleon_ft.runtime.membership import MembershipView, abort_key
from chameleon_ft.runtime.headers import (  # noqa: F401  (HEADER_LEN ... re-exported)
    AGREED, CONTROL_KINDS, FREE_DIMS, GATHERS, HEADER_LEN, RUNTIME_KINDS, code_of, describe_header, encode_header,
    header_kind, op_name)

log = logging.getLogger(__name__)

__all__ = ["CollectiveFailure", "CollectiveMismatch", "GroupManager", "HEADER_LEN"]

class GroupManager(Waits):
    """Owns the current generation's gloo group for one worker.

    Args:
        store: the coordinator's TCPStore (client side), shared with ``Membership``.
        store_factory: returns a *new* TCPStore client; each rebuild gets its own, because a
            TCPStore client serialises its requests and an abandoned group construction may
            sit in a blocking ``get`` on it until the connect timeout.
        worker_id: this worker's stable id (for abort records).
        op_timeout_s: gloo's own per-op timeout for the group (seconds, not gloo's 30 min).
        connect_timeout_s: limit for forming a group (all members must construct it).
        abort_poll_s: how often a waiting member checks the generation's abort key.
        paused: True while the coordinator (or etcd) does not answer (``Membership.paused``):
            no collective starts then -- nothing is committed without a working membership --
            and a wait does not count that time toward its timeout.
        pause_limit_s: the longest such pause; past it the collective fails with a
            ``MembershipError`` naming the coordinator, whether or not the membership's own
            guard thread is alive (None: no limit).
        abort_seen: ``Membership.abort_seen``: a collective's start reads this flag instead of
            asking the store (None, or a None answer: it asks the store).
    """

    def __init__(self, store: dist.Store, worker_id: int,
                 store_factory: Callable[[], dist.Store], *, op_timeout_s: float = 10.0,
                 connect_timeout_s: float = 5.0, abort_poll_s: float = 0.005,
                 paused: Optional[Callable[[], bool]] = None, nccl=None,
                 abort_seen: Optional[Callable[[str], Optional[bool]]] = None,
                 pause_limit_s: Optional[float] = None, coordinator: str = "the coordinator"):
        self.paused = paused or (lambda: False)
        self.pause_limit_s, self.coordinator = pause_limit_s, coordinator
        self.abort_seen = abort_seen  # Membership.abort_seen: the watcher's flag, no store request
        self.nccl = nccl  # runtime/nccl.py's NcclData: CUDA tensors' all-reduce (None: gloo only)
        self._store = store
        self._store_factory = store_factory
        self.worker_id = worker_id
        self.op_timeout_s = float(op_timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.abort_poll_s = float(abort_poll_s)
        self._view: Optional[MembershipView] = None
        self._pg: Optional[dist.ProcessGroup] = None
        self._stores: list = []  # the stores of the newest groups (kept alive: see rebuild)
        self._data_stores: list = []  # (their data groups' own clients)
        # Group set-ups given up while still blocked in gloo's connect (see rebuild, close).
        self._abandoned: list[tuple[threading.Thread, float]] = []
        # A set-up started ahead of ``rebuild`` (``prebuild``): (token, thread, result, deadline).
        self._pre: Optional[tuple] = None
        self._pre_lock = threading.RLock()  # (also guards ``_abandoned``: two threads touch both)
        # (group, work or None) pairs whose op may still be blocked; see module docstring.
        self._parked: list[tuple[object, object]] = []
        self._parked_lock = threading.Lock()
        # Why control collectives are skipped until the next runtime header matches (module doc).
        self.realigning: Optional[str] = None
        self._wait_pool = None  # the waits' helper thread (waits.py), made on first use
        # This generation's subgroups (``subgroup``) and the last op started on each.
        self._subs: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._sub_work: dict[tuple[int, ...], object] = {}
        # False when the executor's step all-reduce runs without a header: a control
        # collective could then meet it and abort the process in gloo's size check.
        self.control_allowed = True
        # Gradient buckets on a gloo group of their own (``data_group``): set where control
        # collectives share the generation, so that a bucket can never meet one of them.
        self.separate_data = False
        # The token of the generation whose step header last agreed everywhere (``step_aligned``).
        self._aligned_token: Optional[str] = None
        self._data: Optional[dist.ProcessGroup] = None
        self._data_work = None  # the newest bucket op started (see start_reduce)
        self._sum_opts = dist.AllreduceOptions()  # a bucket's (made once: start_reduce is per bucket)
        self._sum_opts.reduceOp = dist.ReduceOp.SUM

    # ------------------------------------------------------------------ groups
    @property
    def view(self) -> Optional[MembershipView]:
        return self._view

    def formed_for(self, view: MembershipView) -> bool:
        """Whether the current group is the healthy one of ``view`` (no rebuild needed)."""
        return (self._pg is not None and self._view is not None
                and self._view.token == view.token and self.abort_record() is None)

    def group(self) -> dist.ProcessGroup:
        if self._pg is None:
            if self._view is not None:  # parked after a failure of this generation: it is over
                raise self._failure("the generation's group was given up after a failure", "aborted",
                                    self.abort_record())
            raise RuntimeError("no process group yet: call rebuild(view) first")
        return self._pg

    def rebuild(self, view: MembershipView) -> dist.ProcessGroup:
        """Form a fresh gloo group over ``view.members``; retire the previous one.

        Construction connects every pair, so it blocks until all members have called
        ``rebuild`` for the same view.  It runs in a helper thread while this thread watches
        the abort key, so a member dying during the rebuild leads to ``CollectiveFailure``
        (and another reconfiguration) within ``connect_timeout_s`` or sooner.
        """
        self._retire(None)
        self._view = view
        self.realigning = None  # a new generation's members all start in the recovery protocol
        with self._pre_lock:
            pre, self._pre = self._pre, None
        if pre is not None and pre[0] == view.token:  # set up meanwhile (``prebuild``)
            _, builder, result, deadline = pre
        else:
            if pre is not None:
                self._abandon(pre[1], pre[3])
            builder, result, deadline = self._start_build(view)
        self._await_build(builder, result, deadline, "rebuild")
        self._pg, self._data = result["pg"], result.get("data")
        if "nccl" in result:  # installed here, by this thread, for the view it waited for
            self.nccl.install(result["nccl"])
        # A store written in Python (etcd's) must outlive the group that may call into it:
        # the C++ side holds no reference to the Python object.
        self._stores = (self._stores + [result["store"]])[-4:]
        self._data_stores = (self._data_stores + [result.get("data_store")])[-4:]
        return self._pg

    def prebuild(self, view: MembershipView) -> None:
        """Start setting up ``view``'s group now, in the background; ``rebuild(view)`` then
        takes it (the membership's abort watcher calls this when the next view is agreed while
        the main thread still computes: a kill between steps cost ~30 ms of rebuild after the
        compute).  Not with NCCL (its communicator set-up stays on the main thread)."""
        if self.nccl is not None:
            return
        with self._pre_lock:
            if self._pre is not None:
                if self._pre[0] == view.token:
                    return
                self._abandon(self._pre[1], self._pre[3])
            self._pre = (view.token, *self._start_build(view))

    def _start_build(self, view: MembershipView, ranks: Optional[tuple[int, ...]] = None,
                     data: bool = False) -> tuple[threading.Thread, dict, float]:
        """A thread that sets up ``view``'s group (or, with ``ranks``, its subgroup of those
        ranks, on the generation's store client) into the returned dict ("pg" and "store"; with
        ``separate_data`` also "data", set up beside "pg" in a thread and on a store client
        ("data_store") of its own; with ``data``, only "data"; or "error"), and the time by which
        it must have ended."""
        result: dict = {}

        def gloo(prefix: dist.Store, rank: int, size: int) -> dist.ProcessGroup:
            pg = dist.ProcessGroupGloo(prefix, rank, size, timedelta(seconds=self.connect_timeout_s))
            pg.set_timeout(timedelta(seconds=self.op_timeout_s))  # set-up and ops: separate limits
            return pg

        def build_data(store: dist.Store, into: dict) -> None:  # the buckets' own group (data_group)
            try:
                into["data"] = gloo(dist.PrefixStore(f"cft/pg/{view.token}/data", store), view.rank, view.world_size)
                into["data_store"] = store
            except Exception as exc:
                into["error"] = exc

        def build() -> None:
            try:
                if data:  # (on the generation's client, kept already)
                    build_data(self._stores[-1], result)
                    return
                side, beside = {}, None
                if ranks is None:
                    store = self._store_factory()
                    prefix = dist.PrefixStore(f"cft/pg/{view.token}", store)
                    rank, size = view.rank, view.world_size
                    if self.separate_data:  # set up beside the generation's group, on a client of its own
                        beside = threading.Thread(target=build_data, args=(self._store_factory(), side),
                                                  name=f"cft-pg-data-{view.token}", daemon=True)
                        beside.start()
                else:
                    store = self._stores[-1]
                    prefix = dist.PrefixStore(f"cft/pg/{view.token}/sub/{'.'.join(map(str, ranks))}", store)
                    rank, size = ranks.index(view.rank), len(ranks)
                try:
                    pg = gloo(prefix, rank, size)
                except Exception:
                    if beside is not None:  # not waited for: ``close`` waits for it, as for a given-up set-up
                        self._abandon(beside, time.monotonic() + self.connect_timeout_s + 1.0)
                    raise
                if beside is not None:  # (gloo's connect timeout bounds it)
                    beside.join()
                if "error" in side:
                    raise side["error"]
                result.update(side)
                if self.nccl is not None and ranks is None:  # built here, installed by the waiter
                    result["nccl"] = self.nccl.build(dist.PrefixStore(f"cft/nccl/{view.token}", store),
                                                     view.rank, view.world_size)
                result["pg"], result["store"] = pg, store
            except Exception as exc:  # gloo raises RuntimeError / DistError subclasses
                result["error"] = exc

        builder = threading.Thread(target=build, name=f"cft-pg-build-{view.token}", daemon=True)
        builder.start()
        return builder, result, time.monotonic() + self.connect_timeout_s + 1.0

    def _await_build(self, builder: threading.Thread, result: dict, deadline: float, what: str) -> None:
        """Wait for a set-up from ``_start_build`` while watching the abort key and the deadline;
        a failure ends the generation (``CollectiveFailure``)."""
        next_check = 0.0
        while builder.is_alive():
            builder.join(0.002)
            now = time.monotonic()
            if builder.is_alive() and now >= next_check:
                next_check = now + self.abort_poll_s
                record = self.abort_record()
                if record is not None:  # the builder stays blocked until gloo's connect timeout
                    self._abandon(builder, deadline)
                    raise self._failure(f"aborted during {what}", "rebuild", record)
                if now > deadline:
                    self._abandon(builder, deadline)
                    raise self._local_failure(f"{what} timed out", "rebuild")
        if "error" in result:  # usually a member died or never arrived: end the generation
            raise self._local_failure(f"group formation failed: {result['error']}", "rebuild")

    def subgroup(self, ranks) -> dist.ProcessGroup:
        """The gloo group of ``ranks`` (ranks of this generation, this member among them), set
        up on first use by exactly those members and kept until the next generation: a
        pipeline job reduces each block's gradient among its replicas only.  Members in
        several subgroups must set them up in one order (they block until all arrive)."""
        ranks = tuple(sorted(int(r) for r in ranks))
        if self._view is None or self._view.rank not in ranks:
            raise ValueError(f"rank {self._view.rank if self._view else None} is not in subgroup {ranks}")
        if ranks == tuple(range(self._view.world_size)):
            return self.group()
        pg = self._subs.get(ranks)
        if pg is None:
            self.group()  # the generation's group (and store client) exist
            builder, result, deadline = self._start_build(self._view, ranks)
            self._await_build(builder, result, deadline, f"subgroup {ranks} set-up")
            pg = self._subs[ranks] = result["pg"]
        return pg

    def data_group(self) -> dist.ProcessGroup:
        """Where a data-parallel step's gradient buckets are reduced: the generation's group, or
        with ``separate_data`` a second gloo group over its members (set up with the generation,
        or on first use by the first generation) -- no control collective can meet a bucket."""
        if not self.separate_data:
            return self.group()
        if self._data is None:
            self.group()
            builder, result, deadline = self._start_build(self._view, data=True)
            self._await_build(builder, result, deadline, "data group set-up")
            self._data = result["data"]
        return self._data

    def start_reduce(self, buf: torch.Tensor) -> tuple:
        """Start a SUM all-reduce of ``buf``, in place, on the data group (NCCL for CUDA
        tensors), with no header and no store request; ``wait_reduce`` the returned handle."""
        opts = self._sum_opts
        if buf.is_cuda and self.nccl is not None and self.nccl.pg is not None:
            nccl = self.nccl.pg  # a failure aborts its communicator; its completion is polled
            return self.start(lambda pg: nccl.allreduce([buf], opts)), self.nccl.abort, True
        data = self.data_group()
        work = self.start(lambda pg: data.allreduce([buf], opts))
        # Parked with the newest op started on it: a step's later buckets block as long as this one.
        self._data_work = work
        return work, lambda: self._park(data, self._data_work), False

    def wait_reduce(self, handle: tuple, timeout_s: Optional[float] = None) -> None:
        """Wait for a ``start_reduce``, failing fast (``wait``)."""
        work, abandon, poll = handle
        self.wait(work, timeout_s, abandon=abandon, poll=poll)

    # ------------------------------------------------------------- collectives
    def collective(self, fn: Callable[[dist.ProcessGroup], object],
                   timeout_s: Optional[float] = None):
        """Run ``fn(group) -> Work`` and wait for it, failing fast.

        Returns nothing (ops write into their tensors).  Raises ``CollectiveFailure`` when
        the op errors, when ``timeout_s`` (default ``op_timeout_s``) passes, or when the
        generation is aborted.
        On a local error the abort key is written first, so every other member stops too.
        """
        self.wait(self.start(fn), timeout_s)

    def start(self, fn: Callable[[dist.ProcessGroup], object], check_abort: bool = True):
        """Enqueue ``fn(group) -> Work`` without waiting (a point-to-point send that the
        pipeline executor waits for later); ``wait`` it, or the generation's failure ends it.
        ``check_abort=False`` skips the store look-up (point-to-point ops: their wait checks)."""
        since = time.monotonic()
        paused = self.paused
        while True:
            while paused():  # the membership's guard ends the process if this lasts too long
                self.pause_over(since)
                time.sleep(0.05)
            # Someone may already have ended this generation (e.g. a joiner is waiting); checked
            # first, since a watchdog expiry leaves the generation aborted and its group parked.
            record = self._ended() if check_abort else None
            if record is not None:
                raise self._failure("generation aborted", "aborted", record)
            # The look-up may have blocked on a store that stopped answering (etcd without a
            # quorum) and reported "no abort": look at the pause again, so that no collective
            # (a step's commit) starts without a working membership.
            if not check_abort or not paused():
                break
        pg = self.group()
        try:
            return fn(pg)
        except Exception as exc:  # enqueueing can fail on an already-broken pair
            raise self._local_failure(f"collective failed to start: {exc}", "peer_error")

    # ------------------------------------------------------------ point-to-point
    def send(self, tensor: torch.Tensor, dst_rank: int, tag: int):
        """Start sending ``tensor`` to ``dst_rank`` (rank in this generation); ``wait_p2p`` it."""
        return self.start(lambda pg: pg.send([tensor], dst_rank, tag), check_abort=False)

    def recv(self, tensor: torch.Tensor, src_rank: int, tag: int):
        """Start receiving into ``tensor`` from ``src_rank``; ``wait_p2p`` it."""
        return self.start(lambda pg: pg.recv([tensor], src_rank, tag), check_abort=False)

    def checked(self, kind: str, tensor: Optional[torch.Tensor] = None, *, label: str = "",
                arg: int = 0, timeout_s: Optional[float] = None) -> torch.Tensor:
        """Exchange headers for a ``kind`` collective over ``tensor``; return every member's
        header (rows in rank order) once they all agree, so the data may move.

        Resolution when they differ (module doc): a runtime kind whose differing peers are all
        in control collectives exchanges again; a control kind raises ``CollectiveMismatch``
        and skips further control collectives until the next runtime header matches;
        differing runtime kinds abort the generation (``CollectiveFailure``, ``"mismatch"``).
        """
        return self.settle_header(self.post_header(kind, tensor, label=label, arg=arg), timeout_s)

    def step_aligned(self) -> bool:
        """Whether a data-parallel step of this generation may skip its ``step`` header: its
        buckets travel on a group of their own (``separate_data``) and a step header of this
        generation already agreed on every member.  Members diverge (one in a control
        collective, another in its step) only where a failure realigned them, and a failure ends
        the generation; so once a step of the generation met every member in its step, the
        members run the same program and their control collectives pair with each other.  Every
        member decides alike (the agreed rows, the generation's token).  Not where the step
        shares the control group: a stray control call meeting it there would abort the
        process in gloo's size check rather than wait for the watchdog."""
        return (self.separate_data and self._view is not None
                and self._aligned_token == self._view.token)

    def post_header(self, kind: str, tensor: Optional[torch.Tensor] = None, *, label: str = "",
                    arg: int = 0) -> tuple:
        """Start the header exchange of ``checked`` without waiting (a data-parallel step posts
        its ``step`` header beside its last bucket; the buckets travel on ``data_group``, so
        they need not wait for it); ``settle_header`` resolves it."""
        runtime = kind in RUNTIME_KINDS
        if not runtime and not self.control_allowed:
            raise ConfigError(f"a {kind} collective outside the training step: this executor's step "
                              "all-reduce carries no header, so a peer could meet it there; construct "
                              "the executor with control_collectives=True to run control collectives")
        mine = encode_header(kind, tensor, label, arg)
        if not runtime and self.realigning is not None:
            call = describe_header(mine)
            raise CollectiveMismatch(f"{call} skipped: {self.realigning}", call=call, skipped=True)
        n = self._view.world_size if self._view else 1
        rows = torch.zeros(n, HEADER_LEN, dtype=torch.int64)
        parts = list(rows.unbind(0))
        return kind, mine, rows, self.start(lambda pg: pg.allgather([parts], [mine]))

    def settle_header(self, posted: tuple, timeout_s: Optional[float] = None) -> torch.Tensor:
        """Wait for a ``post_header`` exchange and resolve it as ``checked`` does."""
        kind, mine, rows, work = posted
        runtime = kind in RUNTIME_KINDS
        n = rows.shape[0]
        me = self._view.rank if self._view else 0
        members = self._view.members if self._view else (self.worker_id,)
        # Each member gives up a control call at most once before it comes to its runtime
        # sync, so the second exchange agrees; more rounds mean a peer breaks the rule.
        for _ in range(n + 2):
            if work is None:
                rows = torch.zeros(n, HEADER_LEN, dtype=torch.int64)
                parts = list(rows.unbind(0))
                work = self.start(lambda pg: pg.allgather([parts], [mine]))
            self.wait(work, timeout_s)
            work = None
            differ = [i for i in range(n) if not torch.equal(rows[i, :AGREED], mine[:AGREED])]
            if not differ:
                if runtime:
                    self.realigning = None
                if kind == "step" and self._view is not None:
                    self._aligned_token = self._view.token
                return rows
            # Members differ: every one of them saw these rows, so each drops the generation's
            # alignment alike and the next step posts its header again (``step_aligned``).
            self._aligned_token = None
            call = describe_header(mine)
            peers = tuple((i, members[i], describe_header(rows[i])) for i in differ)
            met = "; ".join(f"rank {i} (worker {w}) in {c}" for i, w, c in peers)
            if not runtime:
                self.realigning = f"rank {me} gave up {call}, which met {met}"
                raise CollectiveMismatch(
                    f"{call} on rank {me} (worker {self.worker_id}) met {met}; no data moved: the "
                    "call returns this worker's local value and control collectives stay local "
                    "until the next training step", call=call, peers=peers)
            if any(header_kind(rows[i]) not in CONTROL_KINDS for i in differ):
                raise self._local_failure(f"collective mismatch: {call} on rank {me} met {met}",
                                          "mismatch")
            log.warning("%s on rank %d met %s; they give up their call, headers are exchanged again",
                        call, me, met)
        raise self._local_failure(f"collective mismatch: {describe_header(mine)} on rank {me} kept meeting "
                                  "control collectives", "mismatch")

    def allreduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM,
                  timeout_s: Optional[float] = None, copy: bool = True,
                  header: Optional[str] = None, label: str = "", ranks=None) -> torch.Tensor:
        """All-reduce ``tensor`` in place; with ``copy`` an abandoned op can't touch it later.

        ``header``: the collective's kind (``"step"``, ``"sync"``, ``"reduce"``...); its
        header exchange (``checked``) runs first.  None: no header (every member must be known
        to run this same op).  ``ranks``: over that ``subgroup`` only (gloo, no header)."""
        if header is not None:
            self.checked(header, tensor, label=label, arg=code_of(op_name(op)), timeout_s=timeout_s)
        buf = tensor.clone() if copy else tensor
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        if ranks is not None:
            key = tuple(sorted(int(r) for r in ranks))
            sub = self.subgroup(key)
            work = self._sub_work[key] = self.start(lambda pg: sub.allreduce([buf], opts))
            self.wait(work, timeout_s, abandon=lambda: self._park_sub(key))
        elif buf.is_cuda and self.nccl is not None and self.nccl.pg is not None:
            nccl = self.nccl.pg  # CUDA tensors over NCCL; a failure aborts its communicator
            self.wait(self.start(lambda pg: nccl.allreduce([buf], opts)), timeout_s, abandon=self.nccl.abort,
                      poll=True)
        else:
            self.collective(lambda pg: pg.allreduce([buf], opts), timeout_s)
        if copy:
            tensor.copy_(buf)
        return tensor

    def all_gather(self, tensor: torch.Tensor, timeout_s: Optional[float] = None,
                   kind: str = "all_gather", label: str = "") -> list[torch.Tensor]:
        """Every member's ``tensor`` (on CPU), in rank order; shapes may differ between members
        (same dtype and number of dimensions): the header carries each member's shape, the data
        travels flattened and padded.  ``kind``: ``"all_gather"`` or ``"gather_object"``."""
        if kind not in GATHERS:
            raise ValueError(f"all_gather kind must be one of {GATHERS}, got {kind!r}")
        t = tensor.detach().to("cpu").contiguous()
        rows = self.checked(kind, t, label=label, timeout_s=timeout_s)
        n = rows.shape[0]
        if t.ndim <= FREE_DIMS:
            shapes = rows[:, AGREED + 1:AGREED + 1 + t.ndim]
        else:  # every member has this many dims (checked), so the shapes have one size
            shapes = torch.zeros(n, t.ndim, dtype=torch.int64)
            parts = list(shapes.unbind(0))
            mine = torch.tensor(t.shape, dtype=torch.int64)
            self.collective(lambda pg: pg.allgather([parts], [mine]), timeout_s)
        numels = [int(x) for x in rows[:, AGREED].tolist()]
        flat = torch.zeros(max(1, max(numels)), dtype=t.dtype)
        flat[:t.numel()] = t.reshape(-1)
        out = [torch.empty_like(flat) for _ in range(n)]
        self.collective(lambda pg: pg.allgather([out], [flat]), timeout_s)
        return [o[:k].reshape([int(d) for d in shape.tolist()]).clone()
                for o, k, shape in zip(out, numels, shapes)]

    # ------------------------------------------------------------------ aborts
    def abort_record(self) -> Optional[dict]:
        """The abort record of the current generation, or None while it is healthy."""
        if self._view is None:
            return None
        key = abort_key(self._view.token)
        try:
            if not self._store.check([key]):
                return None
            return json.loads(self._store.get(key).decode())
        except (ValueError, UnicodeDecodeError):
            return {"reason": "unreadable abort record"}
        except dist.DistError:
            # The store does not answer now (etcd without a quorum, a partition): not an
            # abort.  The membership pauses collectives meanwhile and its guard ends this
            # worker if it lasts (``Membership.paused``, ``cut_off_s``).
            return None

    def _ended(self) -> Optional[dict]:
        """``abort_record()``, asked of the store only when the watcher's flag says the
        generation ended or no watcher runs (a collective's start: no round trip per op)."""
        seen = self.abort_seen(self._view.token) if self.abort_seen is not None and self._view else None
        return None if seen is False else self.abort_record()

    def raise_if_aborted(self) -> None:
        """Raise the generation's failure if a member ended it (a long local wait's check)."""
        record = self.abort_record()
        if record is not None:
            raise self._failure("generation aborted by peer", "aborted", record)

    def abort(self, reason: str, suspects: tuple[int, ...] = ()) -> None:
        """Declare the current generation over, for every member (first writer wins)."""
        if self._view is None:
            return
        record = json.dumps({"by": self.worker_id, "reason": reason,
                             "suspects": sorted(set(int(s) for s in suspects)),
                             "time": time.time()})
        self._store.compare_set(abort_key(self._view.token), "", record)

    def close(self) -> None:
        """Drop the current group; parked groups stay parked (see module docstring).  Waits
        for the group set-ups given up while blocked in gloo's connect (each until its connect
        timeout): a process whose script then ends normally would otherwise be aborted at exit
        ("terminate called without an active exception", SIGABRT after a finished run, when
        such a thread's store wait times out during the interpreter's finalization)."""
        self._retire(None)
        self._view = None
        self.realigning = None
        with self._pre_lock:
            if self._pre is not None:
                self._abandon(self._pre[1], self._pre[3])
                self._pre = None
        for builder, deadline in list(self._abandoned):
            builder.join(max(0.0, deadline - time.monotonic()))
        self._abandon()

    def _abandon(self, builder: Optional[threading.Thread] = None, deadline: float = 0.0) -> None:
        """Remember a group set-up given up while gloo's connect still waits (``close`` waits
        for it); forget the ones that have finished."""
        with self._pre_lock:
            self._abandoned = [(b, d) for b, d in self._abandoned if b.is_alive()]
            if builder is not None:
                self._abandoned.append((builder, deadline))

    # ---------------------------------------------------------------- helpers
    def _local_failure(self, message: str, kind: str) -> CollectiveFailure:
        """A failure this member saw: it ends the generation, unless another member ended it
        first -- then the failure is that member's abort (a peer that gives up an op breaks
        its connections, so a broken op here is the consequence, not the cause)."""
        self.abort(f"{kind}: {message[:200]}")
        record = self.abort_record()
        if record is not None and record.get("by") not in (None, self.worker_id):
            return self._failure(f"generation aborted by peer ({message})", "aborted", record)
        return self._failure(message, kind, record)

    def _failure(self, message: str, kind: str, record: Optional[dict]) -> CollectiveFailure:
        v = self._view
        suspects = tuple(record.get("suspects", ())) if record else ()
        reporter = record.get("by") if record else None
        return CollectiveFailure(message, kind=kind, token=v.token if v else "",
                                 generation=v.generation if v else -1,
                                 suspects=suspects, reporter=reporter)

    def _park(self, pg, work) -> None:
        with self._parked_lock:
            self._parked.append((pg, work))
        if self._pg is pg:
            self._pg = None
        if self._data is pg:
            self._data = None

    def _park_sub(self, ranks: tuple[int, ...]) -> None:
        """A subgroup whose op was abandoned: parked (see ``_park``), never used again."""
        if ranks in self._subs:
            self._park(self._subs.pop(ranks), self._sub_work.get(ranks))

    def _retire(self, work) -> None:
        last, self._data_work = self._data_work, None  # the newest bucket op (start_reduce)
        if self._data is not None:
            self._park(self._data, last)
            last = None
        if self._pg is not None:
            self._park(self._pg, work if work is not None else last)
        for key in list(self._subs):
            self._park_sub(key)
        self._sub_work = {}
        with self._parked_lock:
            # Release groups whose blocked op has finished (success, error or gloo timeout).
            done = [(g, w) for g, w in self._parked if w is None or w.is_completed()]
            self._parked = [(g, w) for g, w in self._parked if w is not None and not w.is_completed()]
        if done:
            # In a helper thread: a gloo group's destructor closes its connections and joins its
            # threads (14-24 ms seen), which a recovery would wait for.  ``close`` waits for it.
            dropper = threading.Thread(target=done.clear, daemon=True, name="cft-pg-drop")
            del done
            dropper.start()
            self._abandon(dropper, time.monotonic() + self.connect_timeout_s)
