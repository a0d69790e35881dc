"""The coordinator's side of membership: the embedded coordinator (``CoordinatorServer``: a
TCPStore and torchft's Lighthouse, hosted by node 0's launcher) and the calls a launcher makes
on whatever store the job uses (``read_latest``, ``report_dead``, ``stop_job``, ``read_stop``),
with the key names both sides share.  Workers use ``membership.Membership``.

The embedded coordinator is the single point of failure of a job that uses it: lose node 0 and
the workers can no longer agree on a generation.  ``--rdzv-backend etcd`` keeps the same keys in
an etcd cluster instead (``runtime/etcd.py``).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from chameleon_ft.runtime import _quiet_rust  # noqa: F401  (before torchft: its logger's level)
from chameleon_ft.runtime.errors import ConfigError, MembershipError
from chameleon_ft.runtime.etcd import EtcdRefused, EtcdStore, is_etcd, parse_etcd
from chameleon_ft.runtime.liveness import JUDGED_KEY, JobJudge, silent_reason
from chameleon_ft.runtime.presence import PRESENCE_KEY, PresenceServer, proof
from torchft._torchft import LighthouseClient, LighthouseServer

log = logging.getLogger(__name__)

__all__ = ["CoordinatorServer", "abort_key", "read_latest", "read_value", "dead_workers", "mark_dead", "report_dead",
           "reported_dead_among", "stop_job",
           "read_stop", "stand_in_for_the_dead", "job_digest", "TOKEN_ENV", "JobTokenError", "check_token", "namespaced",
           "connect_store", "presence_ended", "GenerationEnds", "join_proof", "proven", "registry"]

TOKEN_ENV = "CHAMELEON_FT_JOB_TOKEN"
AUTH_KEY = "cft/auth"  # outside the job's namespace: the digest of the job token


class JobTokenError(RuntimeError):
    """This process's job token is not the one the job's coordinator was started with."""


def job_digest(token: Optional[str] = None) -> str:
    """The job's name in its store: a digest of the job token (``--job-token`` /
    ``CHAMELEON_FT_JOB_TOKEN``; none: the empty token), never the token itself."""
    import hashlib

    token = os.environ.get(TOKEN_ENV, "") if token is None else token
    return hashlib.sha256(b"chameleon-ft job token\0" + token.encode()).hexdigest()[:24]


def check_token(raw: dist.Store, digest: str, where: str) -> None:
    """Refuse a client whose job token differs from the coordinator's (``AUTH_KEY``)."""
    try:
        theirs = raw.get(AUTH_KEY).decode()
    except dist.DistError as exc:
        raise JobTokenError(f"{where} runs no chameleon-ft job (no job token recorded there): {exc}") from exc
    if theirs != digest:
        raise JobTokenError(f"refused by {where}: this process's job token is not the job's (set the same "
                            f"--job-token, or {TOKEN_ENV}, on every node)")


def namespaced(raw: dist.Store, digest: str) -> dist.Store:
    """The job's keys, under its token's digest: a client with another token sees none of them."""
    return dist.PrefixStore(f"cft-job-{digest}", raw)

_LATEST_KEY = "cft/latest"
_REGISTRY_KEY = "cft/registry"
_FAILURES_KEY = "cft/failures"
_FIRST_KEY = "cft/first"  # the job's first generation (membership.Membership._first_generation)
_STOP_KEY = "cft/stop"  # the job stops everywhere (a worker's code raised: a bug, not a failure)


def _incarnation_key(worker_id: int) -> str:
    return f"cft/incarnation/{worker_id}"


def _dead_key(worker_id: int) -> str:
    return f"cft/dead/{worker_id}"


_DEAD_LOG_KEY = "cft/dead-log"  # every dead mark once more, "worker:incarnation\n" appended


def mark_dead(store, worker_id: int, incarnation: int) -> None:
    """Record that ``worker_id``'s ``incarnation`` is gone: its own key (``reported_dead``) and a
    line of the one log that ``reported_dead_among`` and ``dead_workers`` read."""
    store.set(_dead_key(worker_id), str(incarnation))
    store.append(_DEAD_LOG_KEY, f"{worker_id}:{incarnation}\n")


def reported_dead_among(store, workers=None) -> set[int]:
    """Which of ``workers`` (registered workers; None: every worker with a mark) have their
    current incarnation reported dead, by the rule of ``reported_dead``, in one or two requests
    whatever their number: the log of dead marks, then -- only when some of them have a mark --
    their incarnation counters in one ``multi_get``."""
    raw = read_value(store, _DEAD_LOG_KEY)
    if not raw:
        return set()
    marks: dict[int, int] = {}
    for line in raw.decode().split():
        w, _, inc = line.partition(":")
        marks[int(w)] = max(marks.get(int(w), 0), int(inc))
    marked = list(marks) if workers is None else [int(w) for w in workers if int(w) in marks]
    if not marked:
        return set()
    incarnations = store.multi_get([_incarnation_key(w) for w in marked])
    return {w for w, inc in zip(marked, incarnations) if _marks_dead(str(marks[w]).encode(), int(inc or b"0"))}


def dead_workers(store) -> set[str]:
    """Every worker whose current incarnation a launcher (or a presence connection's end)
    reported dead (``report_dead``), as strings: what the quorum over etcd does instead of the
    Lighthouse's stand-in requests (``stand_in_for_the_dead``)."""
    return {str(w) for w in reported_dead_among(store)}


def _marks_dead(mark: Optional[bytes], incarnation: int) -> bool:
    """The rule every reader of a dead mark applies: a mark (the incarnation it was made for)
    counts for the worker's ``incarnation`` only if it is not older -- a replacement that took
    the id since is alive."""
    return mark is not None and int(mark or b"0") >= incarnation


def reported_dead(store, worker: int, incarnation: Optional[int] = None) -> bool:
    """Whether ``worker``'s current incarnation (or ``incarnation``) was reported dead
    (``report_dead``); the incarnation is read only when a mark exists."""
    if not store.check([_dead_key(worker)]):
        return False
    if incarnation is None:
        incarnation = store.add(_incarnation_key(worker), 0)
    return _marks_dead(store.get(_dead_key(worker)), incarnation)


def first_to_record(store: dist.Store, worker_id: int) -> bool:
    """Whether the caller is the first to record the failure of ``worker_id``'s current
    incarnation (``EventLog.deaths``, called by a recovery's source: each death once in the
    event log)."""
    try:
        incarnation = store.add(_incarnation_key(worker_id), 0)
        return store.add(f"cft/failure_recorded/{worker_id}/{incarnation}", 1) == 1
    except Exception:  # (the coordinator unreachable: a record twice rather than none)
        return True


def join_proof(worker: int, incarnation: int) -> str:
    """What a worker's registration and quorum requests carry to show it holds the job token
    (``TOKEN_ENV``): an HMAC under the token of its id and incarnation (``presence.proof``
    with the label ``join``).  The token itself is neither sent nor stored.  Limits: a copy of
    one worker's proof stands for that worker and incarnation only (it can be replayed as that
    worker, not as another or a new one)."""
    return proof(os.environ.get(TOKEN_ENV, ""), b"join", worker, incarnation)


def proven(worker: int, record) -> bool:
    """Whether ``record`` (``[incarnation, proof]``) is ``worker``'s join proof."""
    try:
        incarnation, given = int(record[0]), str(record[1])
    except (TypeError, ValueError, IndexError):
        return False
    return hmac.compare_digest(given, join_proof(worker, incarnation))


def registry(store: dist.Store) -> dict[int, list]:
    """Every worker that registered (``Membership.join``): id -> ``[incarnation, join proof]``
    of its newest registration (not checked here: ``proven``)."""
    raw = read_value(store, _REGISTRY_KEY)
    out: dict[int, list] = {}
    for entry in (raw or b"").decode().split(","):
        parts = entry.strip().split(":")
        if parts[0].isdigit():  # (anything else is not ours: left out)
            out[int(parts[0])] = [parts[1] if len(parts) > 1 else None, parts[2] if len(parts) > 2 else None]
    return out


def abort_key(token: str) -> str:
    """Store key that, once set, ends the generation ``token`` for every member."""
    return f"cft/abort/{token}"


class CoordinatorServer:
    """The job's coordination endpoint, run by the launcher (not by a worker).

    Hosts a TCPStore and a Lighthouse on ``host`` (127.0.0.1 by default).  It is the single
    point of failure of the job: if this process dies, workers finish their current
    generation but cannot agree on another one.

    Args:
        min_replicas: smallest quorum the Lighthouse will form.
        join_timeout_ms: how long a quorum waits for healthy stragglers after the first
            request; it is most of the membership-agreement time after a SIGKILL.
        heartbeat_timeout_ms: silence after which a worker is no longer counted as alive.
        quorum_tick_ms: how often the Lighthouse re-evaluates pending quorums.
        liveness_timeout_s: the workers' heartbeat timeout (``--heartbeat-timeout``): given,
            the coordinator judges which members went silent (``liveness.JobJudge``) and the
            workers beat on their presence connections; None: the members judge.
    """

    def __init__(self, host: str = "127.0.0.1", store_port: int = 0, lighthouse_port: int = 0,
                 *, min_replicas: int = 1, join_timeout_ms: int = 50,
                 heartbeat_timeout_ms: int = 1000, quorum_tick_ms: int = 10, token: Optional[str] = None,
                 liveness_timeout_s: Optional[float] = None):
        self.host = host
        # The store listens on a socket bound here, to ``host`` only: given a port, TCPStore's
        # server binds every interface (IPv6 dual-stack), whatever ``host`` says, and formats
        # each peer's address with a reverse DNS look-up in its one event-loop thread -- for a
        # v4-mapped ``::ffff:127.0.0.1`` that look-up goes to the DNS server, and where that
        # answers slowly (measured: 5 s) every client of the job waits, the workers' cut-off
        # (3 s) fires and the job stops.  Bound to 127.0.0.1 the peer is found in /etc/hosts.
        # The store owns the socket from here (it closes the fd when it goes): the Python object
        # lets go of it, or its own close would later close whatever fd took the same number.
        listen = _listen_socket(host, store_port)
        port = listen.getsockname()[1]
        self._raw = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                  timeout=timedelta(seconds=30), master_listen_fd=listen.detach())
        digest = job_digest(token)
        self._raw.set(AUTH_KEY, digest)
        self.store = namespaced(self._raw, digest)  # what the launcher reads and writes
        self._lighthouse = LighthouseServer(
            bind=f"{host}:{lighthouse_port}", min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms, quorum_tick_ms=quorum_tick_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms)
        # address() reports the machine's hostname, which need not resolve to the bound
        # interface; rebuild it from the bind host.
        lh_port = int(self._lighthouse.address().rsplit(":", 1)[1])
        self.store_addr = f"{host}:{self._raw.port}"
        self.lighthouse_addr = f"http://{host}:{lh_port}"
        # Each worker's one idle connection: its end without a goodbye reports it dead at once,
        # also when its launcher went with it (runtime/presence.py).  Its own store client.
        # (30 s, as the server's own: on a loaded machine its first connect can take over 5 s)
        self._presence_store = namespaced(dist.TCPStore(host, self._raw.port, is_master=False, wait_for_workers=False,
                                                        timeout=timedelta(seconds=30)), digest)
        # With a liveness timeout the workers beat on that connection and the coordinator
        # judges who went silent (``liveness.JobJudge``); a worker whose beats reach it neither
        # judges nor reads a counter.  The judge takes the newest generation the ends' tick
        # (every 20 ms, on the same thread) read last: no read of its own.
        ends = GenerationEnds(self._presence_store)
        self.judge = None if not liveness_timeout_s else JobJudge(
            self._presence_store, liveness_timeout_s, latest=lambda: ends.latest,
            report=lambda w, s, latest: report_silent(self._presence_store, latest, w, s))
        if self.judge is not None:
            self.store.set(JUDGED_KEY, "coordinator")
        self._presence = PresenceServer(host, os.environ.get(TOKEN_ENV, "") if token is None else token,
                                        self._connection_ended, ended=ends, judge=self.judge)
        self.store.set(PRESENCE_KEY, self._presence.address)

    def _connection_ended(self, worker: int, incarnation: int) -> None:
        """A worker's presence connection ended without a goodbye: report it dead and, as the
        launcher's agent does for a process it saw exit, stand in for it at the Lighthouse, so
        that the survivors agree as soon as they all asked, not a join window later (a whole
        node's loss: its launcher is gone with it)."""
        if presence_ended(self._presence_store, worker, incarnation):
            stand_in_for_the_dead(self.lighthouse_addr, worker)

    def latest_view(self) -> Optional[dict]:
        """The newest generation published by its members: generation, members, token."""
        return read_latest(self.store)

    def registered(self) -> set[int]:
        """Worker ids that ever joined."""
        return set(registry(self.store))

    def dead_workers(self) -> set[int]:
        """Workers that joined once but are not members of the newest generation."""
        latest = self.latest_view()
        members = set(latest["members"]) if latest else set()
        return self.registered() - members

    def report_dead(self, worker_id: int, reason: str = "process exited") -> None:
        """Launcher fast path; see the module-level ``report_dead``."""
        report_dead(self.store, worker_id, reason)

    def shutdown(self) -> None:
        self._presence.close()
        self._lighthouse.shutdown()


class GenerationEnds:
    """The coordinator's side of the abort fan-out (``runtime/presence.py``): each call reads
    the newest generation and the abort keys of the last few generations it saw newest, and
    returns the tokens of those that ended since the last call -- a handful of requests per
    call whatever the number of members, where every member polling its own key was N.

    Limits: a generation newest for less than one call's interval is not watched (its members
    read their own key, ``abort_watch.READ_EVERY_S``)."""

    KEEP = 4  # generations watched: the newest ones, not yet seen ended

    def __init__(self, store: dist.Store):
        self.store = store
        self.seen: list[str] = []  # the last KEEP generations seen newest, oldest first
        self.watched: list[str] = []  # those of them not seen ended
        self.latest: Optional[dict] = None  # the newest generation, as the last call read it

    def __call__(self) -> list[str]:
        self.latest = latest = read_latest(self.store)
        if latest is not None and latest["token"] not in self.seen:
            self.seen = (self.seen + [latest["token"]])[-self.KEEP:]
            self.watched = [t for t in self.watched if t in self.seen] + [latest["token"]]
        ended = [t for t in self.watched if self.store.check([abort_key(t)])]
        self.watched = [t for t in self.watched if t not in ended]
        return ended


def presence_ended(store, worker: int, incarnation: int, where: str = "the coordinator") -> bool:
    """A registered worker's presence connection (``runtime/presence.py``) ended without a
    goodbye: its process is gone.  Reported as its launcher would (``report_dead``), unless a
    replacement took the id or the launcher already did; True when reported here."""
    if store.add(_incarnation_key(worker), 0) != incarnation:
        return False
    if reported_dead(store, worker, incarnation):
        return False
    log.info("worker %d's connection to %s ended: reported dead", worker, where)
    report_dead(store, worker, f"its connection to {where} ended (the process is gone)")
    return True


def _listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to ``host:port`` (port 0: any free one) for the store."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host in ("::", ""):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


STAND_IN = "stand_in_for_dead"  # quorum member data of a request made for a dead worker


def _stood_in(member) -> bool:
    """A quorum participant that ``stand_in_for_the_dead`` put there (the Lighthouse hands
    member data back as a dict; etcd's members carry none)."""
    data = getattr(member, "data", None)
    return isinstance(data, dict) and bool(data.get(STAND_IN))


def stand_in_for_the_dead(lighthouse_addr: str, worker_id: int, timeout_s: float = 5.0) -> threading.Thread:
    """Ask the Lighthouse for the next quorum in the name of ``worker_id``, which its launcher
    saw exit, so that the survivors agree as soon as all of them asked.

    The Lighthouse forms a quorum at once only when every member of the previous one asked;
    a dead worker never asks and keeps looking healthy until its heartbeat times out, so the
    survivors waited ``join_timeout_ms`` (most of a recovery's agreement).  This request
    completes the set; its member data marks it, and every member drops it from the view
    (``Membership._to_view``), alike since they all receive the same quorum.  The request runs
    in a daemon thread and gives up after ``timeout_s`` (nobody asked: nothing happens)."""
    def ask() -> None:
        try:
            client = LighthouseClient(lighthouse_addr, timedelta(seconds=2))
            client.quorum(replica_id=str(worker_id), timeout=timedelta(seconds=timeout_s),
                          data={"worker_id": int(worker_id), STAND_IN: True})
        except Exception as exc:  # timed out (no round), or the coordinator is gone
            log.debug("stand-in request for worker %d: %s", worker_id, exc)

    t = threading.Thread(target=ask, name=f"cft-stand-in-{worker_id}", daemon=True)
    t.start()
    return t


def read_value(store: dist.Store, key: str) -> Optional[bytes]:
    """``key``'s value, or None when it is absent: one request where the store can (etcd's
    ``get_or_none``), else ``check`` then ``get``."""
    get_or_none = getattr(store, "get_or_none", None)
    if get_or_none is not None:
        return get_or_none(key)
    return store.get(key) if store.check([key]) else None


def read_latest(store: dist.Store) -> Optional[dict]:
    """The newest generation published in ``store``: generation, members, token (or None)."""
    raw = read_value(store, _LATEST_KEY)
    return None if raw is None else json.loads(raw.decode())


def report_dead(store: dist.Store, worker_id: int, reason: str = "process exited") -> None:
    """Launcher fast path: it saw a worker process exit, so end the newest generation now
    instead of waiting for a collective error or a heartbeat timeout.  The death is also
    recorded, so a quorum that the worker joined just before dying is ended as soon as it
    forms (otherwise its group construction would wait for the connect timeout).  Works from
    any launcher that holds a client of the coordinator's store, not only the one hosting it."""
    mark_dead(store, worker_id, store.add(_incarnation_key(worker_id), 0))
    latest = read_latest(store)
    if latest is not None:
        _end_for(store, latest, worker_id, reason)


def report_silent(store: dist.Store, latest: dict, worker: int, silent_s: float) -> None:
    """The coordinator's liveness judge found ``worker`` silent in generation ``latest``: end
    it, naming the worker (what a member judge's ``Membership.report_failure`` writes)."""
    log.info("worker %d silent for %.1f s: generation %s ended", worker, silent_s, latest["generation"])
    _end_for(store, latest, worker, silent_reason(worker, silent_s))


def _end_for(store: dist.Store, latest: dict, worker: int, reason: str) -> None:
    """End generation ``latest`` in the coordinator's name, suspecting ``worker`` (the first
    record of a generation wins its abort key), and log the record with the job's failures."""
    record = {"by": "coordinator", "reason": reason, "suspects": [int(worker)],
              "time": time.time(), "generation": latest["generation"]}
    store.compare_set(abort_key(latest["token"]), "", json.dumps(record))
    store.append(_FAILURES_KEY, json.dumps(record) + "\n")


def stop_job(store: dist.Store, record: dict) -> None:
    """Stop the job on every node (``record``: who raised what): the first stop wins, and the
    newest generation is ended so that no member waits in a collective for the stopped ones.
    Every launcher polls ``read_stop`` and ends its workers."""
    store.compare_set(_STOP_KEY, "", json.dumps(record))
    latest = read_latest(store)
    if latest is not None:
        store.compare_set(abort_key(latest["token"]), "", json.dumps(
            {"by": "launcher", "reason": "job stopped", "suspects": [], "time": time.time(),
             "generation": latest["generation"]}))


def read_stop(store: dist.Store) -> Optional[dict]:
    """The job's stop record, or None while it runs."""
    if not store.check([_STOP_KEY]):
        return None
    return json.loads(store.get(_STOP_KEY).decode())


# The longest a store request of a worker blocks (etcd's client; a TCPStore client is bounded
# by its own timeout): also how long peers may stay silent after an outage (``_Liveness``).
STORE_REQUEST_TIMEOUT_S = 2.0


def _parse_hostport(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def connect_store(store_addr: str, timeout_s: float, request_timeout_s: Optional[float] = None) -> dist.Store:
    """A new client of the job's store: the coordinator's TCPStore at ``host:port``, or etcd
    (``etcd://h1:2379,h2:2379/<job>``); MembershipError if unreachable in time.
    ``request_timeout_s`` (etcd): each request's limit before the next member is tried, when
    shorter than ``timeout_s`` and the default 2 s (a liveness client's: a fraction of the
    heartbeat timeout)."""
    digest = job_digest()
    if is_etcd(store_addr):
        endpoints, prefix = parse_etcd(store_addr)
        limit = min(STORE_REQUEST_TIMEOUT_S, timeout_s, request_timeout_s or STORE_REQUEST_TIMEOUT_S)
        try:
            raw = EtcdStore(endpoints, prefix, timeout=timedelta(seconds=max(timeout_s, 1.0)),
                            request_timeout_s=limit)
            if not raw.client.healthy():
                raise MembershipError(f"etcd at {', '.join(endpoints)}: no member answered within "
                                      f"{raw.client.timeout_s:.1f} s with a quorum")
            _checked(raw, digest, f"etcd at {', '.join(endpoints)} (job {prefix})")
        except (EtcdRefused, ConfigError) as exc:  # no retry mends these: the launcher stops
            raise MembershipError(f"refused by etcd at {', '.join(endpoints)}: {exc}") from None
        return EtcdStore(endpoints, f"{prefix}{digest}/", timeout=raw.timeout,
                         request_timeout_s=raw.client.timeout_s, security=raw.client.security)
    host, port = _parse_hostport(store_addr)
    try:
        raw = _within(lambda: dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                            timeout=timedelta(seconds=timeout_s)),
                      2 * timeout_s + 1.0)
    except Exception as exc:  # DistNetworkError, RuntimeError, TimeoutError
        raise MembershipError(
            f"coordinator store at {store_addr} unreachable after {timeout_s:.1f} s: {exc}"
        ) from exc
    _checked(raw, digest, f"the coordinator at {store_addr}")
    return namespaced(raw, digest)


def _within(make, deadline_s: float):
    """``make()`` on a thread of its own, given up after ``deadline_s`` (TimeoutError).

    torch 2.13's TCPStore client constructor waits without a deadline for a server that
    accepted the connection and never answers its handshake (measured: over 20 s with a 0.5 s
    timeout; it releases the GIL meanwhile).  A given-up constructor is left to its thread
    (a daemon), and what it makes, if it ever returns, is dropped."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = make()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc
    worker = threading.Thread(target=run, daemon=True, name="cft-store-connect")
    worker.start()
    worker.join(deadline_s)
    if worker.is_alive():
        raise TimeoutError(f"no answer to the store's handshake within {deadline_s:.1f} s "
                           "(the server accepted the connection)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _checked(raw: dist.Store, digest: str, where: str) -> None:
    try:
        check_token(raw, digest, where)
    except JobTokenError as exc:
        raise MembershipError(str(exc)) from None
