"""Membership for in-place recovery: who is alive now, and which generation this is.

The engine is torchft's Lighthouse (``torchft._torchft.LighthouseServer`` / ``LighthouseClient``,
a Rust gRPC service), not a home-made consensus.  Every worker heartbeats to it; after a
failure every survivor asks it for a *quorum*; all workers in one quorum round receive the
same participant list and ``quorum_id``, which become the next ``MembershipView``.  See
docs/runtime-membership.md for why it was chosen over torch.distributed.elastic's rendezvous
and for measured timings.

Pieces:

* ``CoordinatorServer`` runs in the launcher/agent process (never in a worker, so any worker
  may die): a ``TCPStore`` (abort keys, published views, group set-up) and the Lighthouse,
  both bound to 127.0.0.1 by default.  It is the single point of failure of the job.
* ``Membership`` runs in each worker: ``join()``, ``view()``, ``report_failure()``,
  ``next_view()`` (the quorum client: the Lighthouse, or etcd) and a heartbeat thread.  Its
  other parts own their threads and store clients: the liveness monitor
  (``runtime/liveness.py``) and the abort watcher with the coordinator guard
  (``runtime/abort_watch.py``).

How a quorum forms (Lighthouse rules): at once when every member of the previous quorum asks
again ("fast quorum"); otherwise when every heartbeating worker has asked, or ``join_timeout_ms``
after the first request, provided more than half of the heartbeating workers asked.  A dead
worker never asks and looks healthy until ``heartbeat_timeout_ms``, so after a SIGKILL the
survivors waited ``join_timeout_ms``.  Now the launcher that saw the worker exit asks in its
name (``stand_in_for_the_dead``, marked in the member data, dropped from every member's view):
the quorum is complete as soon as every survivor asked.  A death nobody saw (a lost node, a
partition, a hang) still takes the join window; if two of four die before their heartbeats
expire, agreement waits for ``heartbeat_timeout_ms`` (split-brain guard).  A quorum that left
out live members (not scheduled within the join window) is not acted on until they are known
dead, silent for ``heartbeat_timeout_s``, or have ended it by asking (``_left_out_came_back``).

Limits, honestly:

* Nothing here is Byzantine-safe or authenticated: anything that can reach the coordinator's
  ports can join or abort a generation.  Default binds are loopback only.
* ``report_failure`` is advisory: the Lighthouse has no eviction call, so a worker reported
  dead but still alive and asking joins the next quorum.  Liveness is decided by who asks
  and who heartbeats.
* A live worker asks for the next quorum as soon as its generation is aborted, even while it
  computes (``runtime/abort_watch.py`` polls the abort key every 20 ms; ``abort_seen`` is its flag).  A
  worker busy beyond the group set-up (``connect_timeout_s``) after that, or stopped, misses
  the quorum, aborts the new generation and is re-admitted one round later.
* Peer data is never unpickled: Lighthouse member data is JSON, store values are JSON text.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist  # noqa: E402

from chameleon_ft.runtime import _quiet_rust  # noqa: F401,E402  (before torchft: its logger's level)
from torchft._torchft import LighthouseClient  # noqa: E402

from chameleon_ft.runtime.coordination import (  # noqa: E402  (the keys; the coordinator side)
    _FAILURES_KEY, _FIRST_KEY, _LATEST_KEY, _REGISTRY_KEY, STORE_REQUEST_TIMEOUT_S, CoordinatorServer,
    _incarnation_key, _stood_in, abort_key, connect_store, dead_workers, mark_dead, read_latest, read_stop,
    read_value, report_dead, reported_dead_among, TOKEN_ENV, stand_in_for_the_dead, stop_job, join_proof, registry)
from chameleon_ft.runtime.coordination import proven as _proven  # noqa: E402
from chameleon_ft.runtime.errors import MembershipError, NothingToHeal  # noqa: E402  (defined with the other outcomes)
from chameleon_ft.runtime.abort_watch import AbortWatcher  # noqa: E402
from chameleon_ft.runtime.etcd import EtcdQuorum, EtcdStore, LeftOut, is_etcd  # noqa: E402
from chameleon_ft.runtime.presence import (PRESENCE_KEY, PRESENCE_NODE_ENV, PresenceClient,  # noqa: E402
                                           presence_node_key)
from chameleon_ft.runtime.liveness import (JUDGED_KEY, LIVENESS_KEY, LivenessMonitor, beat_key,  # noqa: E402
                                           silent_reason, await_the_missing as _await_the_missing)
from chameleon_ft.runtime.waits import poller  # noqa: E402

log = logging.getLogger(__name__)

_REGISTERED_KEY = "cft/registered"  # how many registrations (a counter)
_ENOUGH_KEY = "cft/registered/enough"  # set by the registration that made min_world_size

# A worker asking to be admitted again within ADMISSION_BACKOFF_RESET_S of its last admission
# waits first: ADMISSION_BACKOFF_S, doubling each time, at most ADMISSION_BACKOFF_MAX_S
# (``Membership._request_admission``).
ADMISSION_BACKOFF_S = 0.25
ADMISSION_BACKOFF_MAX_S = 8.0
ADMISSION_BACKOFF_RESET_S = 30.0

__all__ = ["MembershipView", "MembershipError", "Membership", "CoordinatorServer", "abort_key",
           "read_latest", "report_dead", "stop_job", "read_stop", "connect_store", "stand_in_for_the_dead"]


_PROOFS_KEY = "cft/proofs/"  # + a generation's token: its members' join proofs (``_publish``)


def _listens(store_addr: str) -> bool:
    """Whether something accepts TCP connections at ``host:port`` (within half a second)."""
    host, _, port = store_addr.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=0.5).close()
        return True
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class MembershipView:
    """One agreed generation, as seen by one member.  ``generation`` is the Lighthouse
    ``quorum_id`` (it only grows; the same for a new quorum of the same members); ``token`` is
    unique per agreed quorum even then, and names the generation's group and abort key."""

    generation: int
    members: tuple[int, ...]
    rank: int
    world_size: int
    token: str

    def to_json(self) -> str:
        return json.dumps({"generation": self.generation, "members": list(self.members),
                           "token": self.token})


def _token_of(quorum) -> str:
    """The generation token of a quorum round: its id and creation time (every member of the
    round computes the same one)."""
    created = quorum.created
    return f"{quorum.quorum_id}.{created.seconds}{created.nanos:09d}"


class Membership:
    """This worker's handle on the job's membership.

    Args:
        worker_id: stable id of this worker (survives restarts of its slot).
        store_addr: ``host:port`` of the coordinator's TCPStore.
        lighthouse_addr: ``http://host:port`` of the coordinator's Lighthouse.
        heartbeat_interval_s: heartbeat period (well under ``heartbeat_timeout_ms``).
        connect_timeout_s: limit for reaching the coordinator.
        retry_s: how long one quorum request waits before re-checking whether the others moved on.
        watch_aborts: run the abort watcher (``runtime/abort_watch.py``): ask for the next quorum as soon
            as the generation ends, even while the main thread is busy (and ``abort_seen``).
        heartbeat_timeout_s: a member whose liveness beats (every ``heartbeat_interval_s``: on
            its presence connection when the embedded coordinator judges, else a counter in the
            store) have stopped for this long is
            reported lost (a dead node, a partition, a stopped process), so the survivors'
            collectives end within about this long instead of at the watchdog.  None: off.
        cut_off_s: this worker stops (exit 3, ``MEMBERSHIP_EXIT_CODE``) when the coordinator has
            not answered for this long: it is on the wrong side of a partition, or the
            coordinator is gone; it commits nothing more.  None: off.
        quorum_wait_s: with etcd, how long the job stays paused while an etcd member answers
            but the cluster has no quorum (nothing is committed meanwhile; ``paused``); it goes
            on when the quorum is back, and stops (exit 3) after this long.
    """

    def __init__(self, worker_id: int, store_addr: str, lighthouse_addr: str, *,
                 heartbeat_interval_s: float = 0.1, connect_timeout_s: float = 5.0,
                 retry_s: float = 1.0, watch_aborts: bool = True,
                 heartbeat_timeout_s: Optional[float] = 1.0, cut_off_s: Optional[float] = 3.0,
                 quorum_wait_s: float = 60.0):
        self.worker_id = int(worker_id)
        self.store_addr = store_addr
        self.lighthouse_addr = lighthouse_addr
        self.heartbeat_interval_s = heartbeat_interval_s
        self.connect_timeout_s = connect_timeout_s
        self.retry_s = retry_s
        self.watch_aborts = watch_aborts
        self.store = self._first_store()
        try:
            if is_etcd(store_addr):  # the quorum over etcd (lighthouse_addr: "etcd?join_ms=N")
                join_ms = float(lighthouse_addr.partition("join_ms=")[2] or 50)
                self._client = EtcdQuorum(self.store, join_timeout_s=join_ms / 1000.0,
                                          heartbeat_timeout_s=heartbeat_timeout_s or 1.0,
                                          gone=lambda: dead_workers(self.store))
            else:
                self._client = LighthouseClient(lighthouse_addr, timedelta(seconds=connect_timeout_s))
        except Exception as exc:
            raise MembershipError(
                f"lighthouse at {lighthouse_addr} unreachable after {connect_timeout_s:.1f} s: {exc}"
            ) from exc
        self._view: Optional[MembershipView] = None
        self._stop = threading.Event()
        self._hb_thread: Optional[threading.Thread] = None
        self.heartbeat_errors = 0
        # One quorum request at a time: the main thread's, or the abort watcher's on its behalf.
        self._agree_lock = threading.Lock()
        self._early: Optional[str] = None  # token of a view the watcher agreed on, not yet taken
        self._left_out_of = -1  # (etcd) the last round decided without this worker that it ended
        self._fatal: Optional[NothingToHeal] = None  # the job went on without this worker (_agree)
        # Called by the watcher with each view it agreed on (``GroupManager.prebuild``: the
        # group's set-up overlaps the main thread's compute).
        self.on_early_view: Optional[Callable[[MembershipView], None]] = None
        # False while this worker is on its way out (a preemption notice it will announce at
        # the next commit): the watcher does not put it in its peers' next quorum then -- they
        # would form a generation it is about to leave.  Its main thread still asks itself
        # where a step fails before it could leave.
        self.volunteers: Callable[[], bool] = lambda: True
        self.early_joins = 0
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.cut_off_s = cut_off_s
        self.quorum_wait_s = quorum_wait_s
        # The abort watcher and the coordinator guard (``runtime/abort_watch.py``): their own
        # thread and store client, started by ``join`` when ``watch_aborts``.
        self.watcher = AbortWatcher(self.worker_id, store_addr, connect_timeout_s, view=lambda: self._view,
                                    on_ended=self._generation_ended, stop=self._stop, cut_off_s=cut_off_s,
                                    quorum_wait_s=quorum_wait_s, presence=lambda: getattr(self, "_presence", None))
        self.lost_reports = 0  # members this worker reported for a silent heartbeat
        self.judged_by_coordinator = False  # the embedded coordinator judges liveness (``join``)
        self.incarnation = 0  # (the store's, from ``join``)
        self._proofs: dict[int, list] = {}  # the last quorum's members' join proofs (``_to_view``)
        self._refused_said: set[int] = set()  # workers left out for a bad join proof (said once)
        self._admitted_at: Optional[float] = None  # when this worker last ended a generation to join
        self._admission_tries = 0  # its admissions since, each within the reset time of the one before

    def _first_store(self) -> dist.Store:
        """The worker's first client of the coordinator's store.  A coordinator that accepts TCP
        connections but does not serve this one within the connect timeout (a job's start on a
        loaded machine: without a retry the worker stops and its peers wait for its
        registration) is tried twice more; one that refuses (nothing listens, another job
        token) or an etcd that does not answer fails at once."""
        for _ in range(2):
            try:
                return connect_store(self.store_addr, self.connect_timeout_s)
            except MembershipError as exc:
                if exc.__cause__ is None or is_etcd(self.store_addr) or not _listens(self.store_addr):
                    raise
                log.warning("worker %d: %s; trying again (the coordinator accepts connections)", self.worker_id, exc)
        return connect_store(self.store_addr, self.connect_timeout_s)

    def connect_store(self) -> dist.Store:
        """A fresh client to the coordinator store (for a process group's set-up).  Over etcd a
        clone of this worker's client (its own connections; the job token already checked):
        a new client's health and token requests cost two etcd round trips in every recovery."""
        if isinstance(self.store, EtcdStore):
            return self.store.clone()
        return connect_store(self.store_addr, self.connect_timeout_s)

    # ---------------------------------------------------------------- lifecycle
    def join(self, min_world_size: int = 1, timeout_s: float = 60.0) -> MembershipView:
        """Register, start heartbeating, and wait for a generation with enough members.

        A worker that joins a running job (a replacement) first ends the running generation,
        so that the members come to the Lighthouse and admit it.
        """
        # A replacement reusing this id gets a new incarnation, so the launcher's death
        # report about its predecessor does not apply to it.
        self.incarnation = self.store.add(_incarnation_key(self.worker_id), 1)
        self.store.append(_REGISTRY_KEY, f"{self.worker_id}:{self.incarnation}:"
                                         f"{join_proof(self.worker_id, self.incarnation)},")
        if self.store.add(_REGISTERED_KEY, 1) == min_world_size:  # the last of the launch: say so once
            self.store.set(_ENOUGH_KEY, "1")
        self._register_presence()
        self.judged_by_coordinator = self.store.check([JUDGED_KEY])
        self._first_heartbeat()
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                           name=f"cft-heartbeat-{self.worker_id}")
        self._hb_thread.start()
        self.store.add(beat_key(self.worker_id), 0)  # the counters the judge reads exist
        self.store.compare_set(LIVENESS_KEY, "", "{}")  # before any generation names this worker
        liveness_request_s = (self.heartbeat_timeout_s or 4.0) / 2  # a liveness client's request limit
        self._monitor = LivenessMonitor(
            self.worker_id, lambda: connect_store(self.store_addr, min(1.0, self.connect_timeout_s),
                                                  request_timeout_s=liveness_request_s),
            timeout_s=self.heartbeat_timeout_s, grace_s=STORE_REQUEST_TIMEOUT_S,
            election_grace_s=liveness_request_s + 3 * self.heartbeat_interval_s,  # (its reconnect and beat)
            beat_every_s=self.heartbeat_interval_s, view=lambda: self._view, report=self._silent,
            answered=self.watcher.answered, judge=self.watch_aborts,
            beat=lambda: self._presence is not None and self._presence.beat())
        self._monitor.start()
        deadline = time.monotonic() + timeout_s
        view = self._first_generation(min_world_size, deadline)
        while view is None:
            with self._agree_lock:
                view = self._agree(deadline, previous_token=self._view.token if self._view else None)
            if view.world_size < min_world_size:  # (a late joiner's quorum can be as small)
                view = None
                time.sleep(0.25)
        if self._presence is None:  # (etcd: the next node's launcher may have published its socket since)
            self._register_presence()
        if self.watch_aborts:
            self.watcher.start()
        return view

    def view(self) -> Optional[MembershipView]:
        return self._view

    def _first_generation(self, min_world_size: int, deadline: float) -> Optional[MembershipView]:
        """A job's first generation: every worker that registered once ``min_world_size`` did,
        agreed by one compare-and-set in the store (the first proposal wins, linearizably), not
        by a Lighthouse round.  The Lighthouse forms a quorum ``join_timeout_ms`` after its first
        request once more than half of the live workers asked, so workers that start spread out
        (a loaded machine, a slow network) got quorums too small to start, asked again, and
        could miss each other over and over (a job that never starts).  None for a worker
        that joins a running job, or one the agreed first generation does not hold: it asks
        the Lighthouse (``_agree``) and is admitted as a late joiner.

        A member of the agreed first generation that gets here after its peers published it
        (it registered, then its process was slow: a loaded machine) takes it as it is, rather
        than take it for a running job's and end it to be admitted (``_request_admission``),
        which would leave its peers training without it for the steps that takes -- the first
        generation of every job holds every worker that made it."""
        if min_world_size <= 1:
            return None
        latest = self._latest()
        if latest is not None:
            first = self._first()
            if first is None or first.get("token") != latest.get("token") or self.worker_id not in first["members"]:
                return None  # the job moved past its first generation, or this worker is not in it
            return self._take_first(first)
        # One blocking wait (the store answers when the last launch worker registered), not a
        # poll of the growing registry by every worker: O(N) requests for N workers.
        try:
            self.store.wait([_ENOUGH_KEY], timedelta(seconds=max(0.1, deadline - time.monotonic())))
        except Exception:
            if len(self._registered()) < min_world_size:
                raise MembershipError(f"worker {self.worker_id}: only {len(self._registered())} of "
                                      f"{min_world_size} workers registered in time") from None
        proofs = self._registered()
        proposal = {"generation": 0, "members": sorted(proofs), "token": f"0.{time.time_ns()}",
                    "proofs": {str(w): r for w, r in proofs.items()}}
        first = json.loads(self.store.compare_set(_FIRST_KEY, "", json.dumps(proposal)).decode())
        if self.worker_id not in first["members"]:
            return None
        return self._take_first(first)

    def _first(self) -> Optional[dict]:
        """The job's agreed first generation (``_first_generation``), or None."""
        return self._json_key(_FIRST_KEY)

    def _take_first(self, first: dict) -> MembershipView:
        """The agreed first generation, without any worker it names whose join proof it does
        not carry (a proposal forged in the store: every member leaves out the same ones)."""
        proofs = first.get("proofs") or {}
        members = tuple(self._with_proofs(first["members"], proofs))
        if self.worker_id not in members:
            raise MembershipError(f"worker {self.worker_id}: the job's first generation in the store does not "
                                  "hold this worker's join proof (was it written by a process of another job?)")
        self._proofs = {int(w): r for w, r in proofs.items() if int(w) in members}
        view = MembershipView(generation=0, members=members, rank=members.index(self.worker_id),
                              world_size=len(members), token=first["token"])
        self._view = view
        self._publish(view)
        self.watcher.answered()
        return view

    def report_failure(self, worker_ids=(), reason: str = "", token: Optional[str] = None) -> None:
        """End generation ``token`` (default: the current one) for every member, recording who
        is suspected.

        Idempotent: the first report of a generation wins the abort key; every report is
        appended to the coordinator's failure log (JSON lines).  Pass the token of the failed
        generation: the watcher may have agreed on the next one, which must not be ended.
        """
        record = {"by": self.worker_id, "reason": reason,
                  "suspects": sorted(set(int(w) for w in worker_ids)), "time": time.time()}
        if token is None and self._view is not None:
            token = self._view.token
        if token is not None:
            if self._view is not None and self._view.token == token:
                record["generation"] = self._view.generation
            self.store.compare_set(abort_key(token), "", json.dumps(record))
            self.watcher.aborted_token = token
        self.store.append(_FAILURES_KEY, json.dumps(record) + "\n")

    def next_view(self, timeout_s: float = 30.0, after: Optional[str] = None) -> MembershipView:
        """Block until the survivors agree on the generation after ``after`` (a token; default:
        the current one), and return it.

        Every worker that receives a view from the same quorum round gets the same members
        and generation.  When the abort watcher already agreed on it (this worker was busy
        when the generation ended), that view is returned at once.  Raises MembershipError
        after ``timeout_s``.
        """
        with self._agree_lock:
            if self._fatal is not None:  # (found by the abort watcher, asking on its behalf)
                raise self._fatal
            current = self._view.token if self._view else None
            if after is not None and current is not None and current != after:
                self._early = None
                return self._view  # agreed by the watcher while this worker was busy
            self._early = None
            return self._agree(time.monotonic() + timeout_s, previous_token=current)

    def _register_presence(self) -> None:
        """Open this worker's presence connection (``runtime/presence.py``) -- to the embedded
        coordinator, or in an etcd job to the next node's launcher -- whose end without a
        goodbye reports it dead at once, also when its launcher is lost with it.  Without one
        (a single-node etcd job, a socket not published yet, a refusal) heartbeats find the loss."""
        self._presence: Optional[PresenceClient] = None
        node = os.environ.get(PRESENCE_NODE_ENV)
        key = (presence_node_key(int(node)) if node else None) if is_etcd(self.store_addr) else PRESENCE_KEY
        if key is None or not self.store.check([key]):
            return
        host, _, port = self.store.get(key).decode().rpartition(":")
        if host.strip("[]") in ("", "0.0.0.0", "::"):  # a wildcard bind: where this worker reached the store
            host = self.store_addr.rpartition(":")[0]
        client = PresenceClient()
        try:
            client.connect(f"{host}:{port}", os.environ.get(TOKEN_ENV, ""), self.worker_id,
                           self.incarnation, timeout_s=self.connect_timeout_s)
        except (OSError, ValueError) as exc:
            client.close()
            log.warning("worker %d: no presence connection to the coordinator (%s): if its node is lost "
                        "with its launcher, the loss is found by the heartbeat timeout", self.worker_id, exc)
            return
        self._presence = client

    def leave(self) -> None:
        """Leave the job, announced (``runtime/preemption.py``): mark this incarnation gone, so
        that peers acting on a quorum without it need not wait for its silence, then ``close``.
        Its generation is ended by its peers, who read the announcement in the same commit."""
        mark_dead(self.store, self.worker_id, self.incarnation)
        self.close()

    def await_left(self, workers, timeout_s: float) -> tuple[int, ...]:
        """Wait up to ``timeout_s`` until each of ``workers`` marked its incarnation gone
        (``leave``: it does so only after its own side of the commit that announced it
        succeeded); the ones that did not, by then.  Its peers call this before they end the
        generation, so that ending it cannot fail the leaver's last collective."""
        pending = set(workers)

        def marked() -> bool:
            pending.difference_update(self._reported_dead(tuple(pending)))
            return not pending
        poller(marked, 0.05)(timeout_s)
        return tuple(sorted(pending))

    def close(self) -> None:
        """Stop heartbeating; the Lighthouse drops this worker after its heartbeat timeout."""
        if getattr(self, "_presence", None) is not None:
            self._presence.close()  # a goodbye: this is no death
        self._stop.set()
        if getattr(self, "_monitor", None) is not None:
            self._monitor.stop(2 * self.heartbeat_interval_s + 1.0)
        if self._hb_thread is not None and self._hb_thread is not threading.current_thread():
            self._hb_thread.join(timeout=2 * self.heartbeat_interval_s + 1.0)
        self.watcher.join(2 * self.heartbeat_interval_s + 1.0)

    # ---------------------------------------------------------------- the abort watcher's side
    def _generation_ended(self, view: MembershipView) -> bool:
        """The abort watcher saw ``view`` ended (``runtime/abort_watch.py``): ask for the next
        quorum now, on behalf of a main thread that may still be computing, once per
        generation; not for a generation it agreed on that the main thread has not taken yet (a
        main thread busy for longer than a group set-up gets excluded, as before, instead of
        holding every peer in a loop of failed set-ups).  False: not now (ask again later)."""
        if self._early is not None:
            return False
        if not self.volunteers():
            return True
        if not self._agree_lock.acquire(blocking=False):
            return True  # the main thread is asking itself
        try:
            if self._view is view:
                new = self._agree(time.monotonic() + self.retry_s * 10, previous_token=view.token)
                self._early = new.token
                self.early_joins += 1
                if self.on_early_view is not None:
                    self.on_early_view(new)
        except Exception as exc:  # closed, or no quorum: the main thread will ask itself
            log.debug("abort watcher of worker %d: %s", self.worker_id, exc)  # (NothingToHeal: _fatal)
        finally:
            self._agree_lock.release()
        return True

    def _silent(self, worker: int, silent_s: float, token: str) -> None:
        """The liveness monitor found ``worker`` silent (``heartbeat_timeout_s``): report it."""
        self.lost_reports += 1
        self.report_failure([worker], silent_reason(worker, silent_s), token=token)

    def abort_seen(self, token: str) -> Optional[bool]:
        """``AbortWatcher.abort_seen``: the watcher's flag, no store request (None: ask the store)."""
        return self.watcher.abort_seen(token)

    def paused(self) -> bool:
        """True while the coordinator has not answered for half a second (``GroupManager``
        starts no collective then, so nothing is committed without a working membership)."""
        return self.watch_aborts and self.watcher.paused()

    def pause_limit_s(self) -> float:
        return self.watcher.pause_limit_s()

    # ---------------------------------------------------------------- internals
    def _agree(self, deadline: float, previous_token: Optional[str]) -> MembershipView:
        before = self._view
        while True:
            latest = self._latest()
            view = self._missed_quorum(previous_token, latest)
            if view is None:
                self._request_admission(previous_token, latest)
                self.watcher.answered()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise MembershipError(
                        f"worker {self.worker_id}: no quorum formed in time "
                        f"(coordinator {self.lighthouse_addr})")
                try:
                    # (etcd) a round decided without this worker after its last generation, not yet
                    # ended by it, is ended at once (``LeftOut``), not waited out in the next round
                    more = {"after": max(self._view.generation, self._left_out_of)} \
                        if self._view is not None and isinstance(self._client, EtcdQuorum) else {}
                    quorum = self._client.quorum(
                        replica_id=str(self.worker_id),
                        timeout=timedelta(seconds=min(remaining, self.retry_s)),
                        data=self._ask_data(previous_token), **more)
                except LeftOut as out:  # (etcd) decided without this worker: end it to be admitted
                    self._left_out_of = int(out.quorum.quorum_id)
                    self._request_admission(previous_token, {"token": _token_of(out.quorum),
                                                             "generation": int(out.quorum.quorum_id)})
                    continue
                except Exception as exc:  # timeout, or the coordinator is gone
                    if self._stop.is_set():
                        raise MembershipError("membership closed") from exc
                    log.debug("quorum request of worker %d: %s", self.worker_id, exc)
                    if not self._coordinator_alive():
                        raise MembershipError(f"coordinator unreachable: {exc}") from exc
                    continue
                view = self._to_view(quorum)
                if view is None:
                    continue
            # Left out of a newer generation none of whose members is in this quorum: they went on
            # without this worker, which must not train on alone from its older state.
            went_on = (before is not None and latest is not None and latest.get("generation", -1) > before.generation
                       and self.worker_id not in latest["members"] and not set(view.members) & set(latest["members"]))
            # (Published before it is acted on: a live member it left out, asking meanwhile,
            # sees it as the newest generation and ends it; this worker's own view only once
            # every check below passed -- the abort watcher may be the one asking.)
            self._publish(view)
            missing = set(latest["members"]) if went_on else set(before.members) - set(view.members) if before else set()
            marked = set(self._reported_dead(set(view.members) | missing))  # (one read for both)
            dead = tuple(sorted(marked & set(view.members)))
            if dead:
                # A member asked and then died (the launcher saw it exit): this quorum can
                # never form a group; end it now rather than after the connect timeout.
                self.report_failure(dead, "member reported dead by the launcher", token=view.token)
                continue
            if self._left_out_came_back(missing - marked, view):
                previous_token = view.token  # a live member it left out ended it: ask again
                continue
            if went_on:  # and they are gone (silent or dead for the heartbeat timeout)
                # Ended, so that no later request takes the published view for a quorum it missed.
                self.report_failure((), f"worker {self.worker_id} was left out: the job went on without it",
                                    token=view.token)
                self._fatal = NothingToHeal(
                    f"worker {self.worker_id} was left out of generation {latest['generation']} {latest['members']}, "
                    f"and none of them is in its quorum {list(view.members)}: the job went on without it and "
                    "they are gone (finished, or lost); it stops rather than train on alone from its older state")
                raise self._fatal
            self._view = view
            return view

    def _missed_quorum(self, previous_token: Optional[str], latest: Optional[dict]) -> Optional[MembershipView]:
        """A quorum formed with this worker that it did not receive: a request that timed out
        (``retry_s``) stays a participant at the Lighthouse until its next quorum, which holds
        this worker but reaches only the requests then waiting (measured, torchft 0.2); its
        members published it and wait for this one in its group (docs/runtime-membership.md).
        Only after a generation of this incarnation; not when that generation was ended.
        ``latest``: the published generation (``_latest``), read once by the caller."""
        mine = self._view
        if (latest is None or mine is None or latest.get("token") == previous_token
                or self.worker_id not in latest.get("members", ())
                or (latest.get("generation", -1), latest.get("token", "")) <= (mine.generation, mine.token)
                or self.store.check([abort_key(latest["token"])])):
            return None
        members = tuple(int(w) for w in latest["members"])
        if not isinstance(self._client, EtcdQuorum):  # over the Lighthouse: its members' proofs
            proofs = self._json_key(_PROOFS_KEY + str(latest["token"])) or {}
            if self._with_proofs(members, proofs) != list(members):
                return None
        return MembershipView(generation=int(latest["generation"]), members=members,
                              rank=members.index(self.worker_id), world_size=len(members), token=latest["token"])

    def _left_out_came_back(self, missing, view: MembershipView) -> bool:
        """``liveness.await_the_missing`` for the ``missing`` members (left out of ``view``)."""
        if not missing or not self.heartbeat_timeout_s:
            return False
        lv = getattr(self, "_monitor", None)
        lv = lv.clock if lv is not None else None
        if lv is not None and self.judged_by_coordinator:  # its record: who has been quiet, how long
            lv.heard_record(self._json_key(LIVENESS_KEY) or {})
        return _await_the_missing(
            missing, self.heartbeat_timeout_s, beat=lambda w: self.store.add(beat_key(w), 0),
            ended=lambda: self.store.check([abort_key(view.token)]), dead=self._reported_dead,
            last_moved=lv.last_moved if lv is not None else (lambda w: None))

    def _to_view(self, quorum) -> Optional[MembershipView]:
        """The view of ``quorum`` without the dead workers a launcher stood in for
        (``stand_in_for_the_dead``) and, over the Lighthouse, without any participant whose
        request does not carry a valid join proof (``join_proof``: it does not hold the job
        token; every member leaves out the same ones); None when this worker's own request was
        overwritten by such a stand-in (a replacement that reuses a dead worker's id: it asks
        again).  The proofs of the members are kept for ``_publish``."""
        members, proofs = [], {}
        for p in quorum.participants:
            if _stood_in(p):
                continue
            w, data = int(p.replica_id), getattr(p, "data", None)
            if isinstance(data, dict):  # (the Lighthouse; etcd's members carry no data: etcd's auth)
                record = [data.get("incarnation"), data.get("proof")]
                if not _proven(w, record):
                    self._refused(w)
                    continue
                proofs[w] = record
            members.append(w)
        members = tuple(sorted(members))
        self._proofs = proofs
        if self.worker_id not in members:
            return None
        return MembershipView(generation=int(quorum.quorum_id), members=members,
                              rank=members.index(self.worker_id), world_size=len(members),
                              token=_token_of(quorum))

    def _with_proofs(self, workers, proofs: dict) -> list[int]:
        """The ``workers`` whose join proof ``proofs`` (by id as a string) holds, in order;
        the others are left out (``_refused``)."""
        out = []
        for w in workers:
            if _proven(int(w), proofs.get(str(w))):
                out.append(int(w))
            else:
                self._refused(int(w))
        return out

    def _refused(self, worker: int) -> None:
        if worker not in self._refused_said:
            self._refused_said.add(worker)
            log.warning("worker %d: a quorum request as worker %d without a valid join proof was left out "
                        "(a process without this job's token, or of another job at the same coordinator)",
                        self.worker_id, worker)

    def _ask_data(self, token: Optional[str]) -> dict:
        """This worker's quorum request data; over etcd also who the report that ended generation
        ``token`` suspects (``EtcdQuorum`` does not wait for them although their leases may
        outlast the report; the Lighthouse has its stand-ins, so no read for it)."""
        data: dict = {"worker_id": self.worker_id, "incarnation": self.incarnation,
                      "proof": join_proof(self.worker_id, self.incarnation)}
        if token and isinstance(self._client, EtcdQuorum):
            record = self._json_key(abort_key(token)) or {}
            data["suspects"] = [int(w) for w in record.get("suspects", ())]
        return data

    def _reported_dead(self, members) -> tuple[int, ...]:
        return tuple(sorted(reported_dead_among(self.store, [w for w in members if w != self.worker_id])))

    def _registered(self) -> dict[int, list]:
        """The workers that registered with a valid join proof: id -> [incarnation, proof]."""
        records = registry(self.store)
        return {w: records[w] for w in self._with_proofs(records, {str(w): r for w, r in records.items()})}

    def _latest(self) -> Optional[dict]:
        return self._json_key(_LATEST_KEY)

    def _json_key(self, key: str) -> Optional[dict]:
        """The JSON object the store holds at ``key``, or None (absent or unreadable)."""
        raw = read_value(self.store, key)
        if raw is None:
            return None
        try:
            return json.loads(raw.decode())
        except (ValueError, UnicodeDecodeError):
            return None

    def _request_admission(self, previous_token: Optional[str], latest: Optional[dict]) -> None:
        """If a generation is running without us, end it so its members come and admit us.
        Asked again soon after our last admission, first wait, longer each time, unless the
        generation ends meanwhile (``ADMISSION_BACKOFF_S``; why: docs/runtime-membership.md).
        ``latest``: the published generation, as the caller just read it."""
        if latest is None or latest.get("token") == previous_token:
            return
        now = time.monotonic()
        recent = self._admitted_at is not None and now - self._admitted_at < ADMISSION_BACKOFF_RESET_S
        self._admission_tries = self._admission_tries + 1 if recent else 0
        self._admitted_at = now
        wait = min(ADMISSION_BACKOFF_S * 2.0 ** min(self._admission_tries - 1, 16), ADMISSION_BACKOFF_MAX_S) \
            if self._admission_tries else 0.0
        while time.monotonic() < now + wait and not self.store.check([abort_key(latest["token"])]):
            time.sleep(min(0.02, wait))
        if wait:
            latest = self._latest() or latest
        if latest.get("token") == previous_token:
            return
        record = {"by": self.worker_id, "reason": "admission", "suspects": [],
                  "time": time.time(), "generation": latest.get("generation")}
        self.store.compare_set(abort_key(latest["token"]), "", json.dumps(record))

    def _publish(self, view: MembershipView) -> None:
        # Only move "latest" forward; quorum ids are monotonic, tokens break ties by time.
        latest = self._latest()
        mine = (view.generation, view.token)
        if latest is None or (latest.get("generation", -1), latest.get("token", "")) < mine:
            if self._proofs:  # (before the view: who adopts it from the store checks them)
                self.store.set(_PROOFS_KEY + view.token, json.dumps({str(w): r for w, r in self._proofs.items()}))
            self.store.set(_LATEST_KEY, view.to_json())

    def _coordinator_alive(self) -> bool:
        try:
            return self.store.check([_LATEST_KEY]) or True
        except Exception:
            return False

    def _first_heartbeat(self) -> None:
        """The join's first heartbeat, retried for ``connect_timeout_s``: a coordinator (or etcd)
        slow to answer one request under a job's start is not unreachable."""
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            try:
                return self._heartbeat_once(raise_errors=True)
            except MembershipError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.1)

    def _heartbeat_once(self, raise_errors: bool = False) -> None:
        try:
            self._client.heartbeat(str(self.worker_id),
                                   timedelta(seconds=max(1.0, 5 * self.heartbeat_interval_s)))
        except Exception as exc:
            self.heartbeat_errors += 1
            if raise_errors:
                raise MembershipError(
                    f"lighthouse at {self.lighthouse_addr} unreachable: {exc}") from exc
            log.debug("heartbeat of worker %d failed: %s", self.worker_id, exc)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_interval_s):
            self._heartbeat_once()
