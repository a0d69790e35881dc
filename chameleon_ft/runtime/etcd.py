"""Membership kept by an etcd cluster: no process of the job is a single point of failure.

``chameleon-ft run --rdzv-backend etcd --rdzv-endpoint h1:2379,h2:2379,h3:2379`` (torchrun's
convention) puts everything the embedded coordinator (``CoordinatorServer``: a TCPStore and
torchft's Lighthouse in node 0's launcher) kept into etcd: registrations, liveness counters,
generations, abort keys, the published view and every generation's gloo set-up.  Any node --
node 0 too -- may then be lost, and so may a minority of the etcd members.

The client speaks etcd's own JSON gateway (``/v3/kv/...``, ``/v3/lease/...``; etcd >= 3.4)
over HTTP with the standard library: no client package to pin, nothing home-made under the
agreement itself.  Two pieces:

* ``EtcdStore`` -- a ``torch.distributed.Store`` (what gloo's rendezvous and ``membership.py``
  use): ``set``/``get`` (waits for the key)/``add``/``compare_set``/``check``/``wait``/
  ``append``/``delete_key``, each a linearizable etcd request (``add``, ``append`` and
  ``compare_set`` are one compare-and-swap transaction, retried on a conflict) -- except a
  ``get`` right after a ``wait`` for its key, which returns what the wait read (gloo's
  rendezvous waits, then gets, keys written once).
* ``EtcdWatch`` -- the keys written under a prefix, pushed by etcd on a watch stream (the abort
  watcher's wait: no request while nothing ends).
* ``EtcdQuorum`` -- what the Lighthouse's client does (``heartbeat``, ``quorum``), with the
  Lighthouse's rules.  A heartbeat is a key on a lease of ``heartbeat_timeout`` seconds (kept
  alive by the heartbeat thread): etcd drops it when the worker stops, so etcd, not a clock of
  ours, decides who is alive.  A quorum is a round ``r``: each asker writes ``ask/<r>/<id>``;
  any asker may *decide* the round -- a create-only transaction on ``decided/<r>`` with the
  askers it sees -- once every member of the previous round asked, or every live worker asked,
  or ``join_timeout`` passed since it saw the first request and more than half of the live
  workers asked.  etcd's transaction is the agreement: the first decision of a round is the only
  one, and every asker reads that one.  An asker left out of ``decided/<r>`` asks in round
  ``r + 1``.

Security (``EtcdSecurity``, read from the environment that ``chameleon-ft run`` passes to its
workers): with ``--etcd-cacert`` (and ``--etcd-cert`` / ``--etcd-key`` for etcd's
``--client-cert-auth``) every request goes over TLS, the members' certificates checked against
that CA; with ``CHAMELEON_FT_ETCD_USER`` / ``CHAMELEON_FT_ETCD_PASSWORD`` the client
authenticates (``/v3/auth/authenticate``) and sends etcd's token with every request, fetching a
new one when etcd says it expired.  A refusal -- a certificate the members reject, a wrong
password, a role without read-write on the job's keys -- raises ``EtcdRefused`` at once, naming
what to fix, instead of being retried as an unreachable member.  etcd's JSON gateway refuses a
client certificate that carries a Common Name (etcd would take it for the user): issue the
workers' certificate without one.

Limits, honestly: every request is an HTTP round trip to one member (a few ms on a LAN), so
group set-up and the waits for a key (polled: ``EtcdStore.get``) cost more than over the
embedded TCPStore; keys are not
garbage-collected while the job runs (a few per generation); use one ``--rdzv-id`` per job
(a key space of its own).  Without the settings above the gateway is plain HTTP with no
credentials: keep such an etcd on a network only the job reaches (docs/security.md).
"""

from __future__ import annotations

import base64
import functools
import http.client
import json
import os
import select
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace
from typing import Callable, Mapping, Optional, Sequence

import torch.distributed as dist

from chameleon_ft.runtime import env as E
from chameleon_ft.runtime.errors import ConfigError

__all__ = ["ETCD_SCHEME", "EtcdError", "EtcdRefused", "EtcdSecurity", "EtcdClient", "EtcdWatch", "EtcdStore", "EtcdQuorum", "LeftOut",
           "is_etcd", "parse_etcd"]

ETCD_SCHEME = "etcd://"


class EtcdError(dist.DistStoreError):
    """No etcd member answered (a request timed out or every endpoint refused)."""


class EtcdRefused(EtcdError):
    """etcd answered and said no (its TLS handshake, the credentials, the role's permissions):
    asking another member, or again, will not help."""


@dataclass(frozen=True)
class EtcdSecurity:
    """How this process reaches etcd: TLS (``cacert``; ``cert`` and ``key`` for a client
    certificate) and etcd's user/role authentication (``user``, ``password``).  All None: plain
    HTTP without credentials."""

    cacert: Optional[str] = None
    cert: Optional[str] = None
    key: Optional[str] = None
    user: Optional[str] = None
    password: Optional[str] = None

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "EtcdSecurity":
        """The settings ``chameleon-ft run`` exported (``--etcd-cacert/-cert/-key``, the user
        and password variables), checked (``ConfigError`` naming the flag)."""
        env = os.environ if environ is None else environ
        sec = cls(*(env.get(k) or None for k in (E.ETCD_CACERT, E.ETCD_CERT, E.ETCD_KEY, E.ETCD_USER,
                                                  E.ETCD_PASSWORD)))
        sec.check()
        return sec

    @property
    def tls(self) -> bool:
        return bool(self.cacert or self.cert)

    def check(self) -> None:
        for path, flag in ((self.cacert, "--etcd-cacert"), (self.cert, "--etcd-cert"), (self.key, "--etcd-key")):
            if path and not os.path.isfile(path):
                raise ConfigError(f"{flag} {path!r}: no such file")
        if bool(self.cert) != bool(self.key):
            raise ConfigError("--etcd-cert and --etcd-key go together (the client certificate and its key)")
        if bool(self.user) != bool(self.password):
            raise ConfigError(f"${E.ETCD_USER} and ${E.ETCD_PASSWORD} go together (etcd's user authentication)")

    @functools.cached_property
    def context(self) -> Optional[ssl.SSLContext]:
        """The TLS context (the members checked against ``cacert``, or the system's CAs), or None;
        made once and shared by the clients of these settings (a store's clones: one per group
        set-up)."""
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=self.cacert)
        if self.cert:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx




def is_etcd(addr: str) -> bool:
    return addr.startswith(ETCD_SCHEME)


def parse_etcd(addr: str) -> tuple[list[str], str]:
    """``etcd://h1:2379,h2:2379/<job>`` -> (endpoints, the job's key prefix)."""
    rest = addr[len(ETCD_SCHEME):]
    hosts, _, job = rest.partition("/")
    endpoints = [h for h in hosts.split(",") if h]
    if not endpoints:
        raise ValueError(f"{addr!r}: no etcd endpoint")
    return endpoints, f"/cft/{job or 'default'}/"


def _b64(s) -> str:
    return base64.b64encode(s if isinstance(s, bytes) else str(s).encode()).decode()


def _unb64(s: str) -> bytes:
    return base64.b64decode(s)


def _prefix_end(key: bytes) -> bytes:
    """The range end that covers every key starting with ``key``."""
    b = bytearray(key)
    while b and b[-1] == 0xFF:
        b.pop()
    if not b:
        return b"\0"
    b[-1] += 1
    return bytes(b)


# Members that failed a request lately (a timeout, a refused connection, "no leader"), by
# endpoint: the monotonic time until which this process's clients -- every thread and every
# clone of a store -- open no new connection to them, and move an open one away before its next
# request, while another member is trusted: a member that stopped answering costs the process
# one request timeout, not one per thread or store clone.  A member that answers a request is
# trusted again at once (an election makes every member fail requests for a while; afterwards
# the process's new connections go to one that answers, not round to one that is cut off).
SUSPECT_S = 10.0
_suspect: dict[str, float] = {}
# A member's host must take a TCP connection within CONNECT_S (its kernel answers, whatever
# etcd's own load); a request not answered within PROBE_AFTER_S makes the client try such a
# connection once: a member cut off by a partition is left after about PROBE_AFTER_S +
# CONNECT_S, not after the whole request timeout, while a member that is only slow (a leader
# election, a loaded machine) is waited for.
CONNECT_S = 0.15
PROBE_AFTER_S = 0.2
TERM_CHECK_S = 0.05  # how often a request waiting for its answer looks at ``_term``
# When each member last answered a request of this process: a new connection goes to the member
# that answered last (another thread's connection vouches for it) rather than to one whose state
# nobody here has seen lately.
_answered: dict[str, float] = {}


# The highest raft term any answer to this process carried.  A request still unanswered when
# another answer brings a newer term was most likely lost in the election (a proposal forwarded
# to a leader that is gone is never answered): it is asked again at once, not after its timeout.
_term = [0]


def _trusted(endpoint: str) -> bool:
    return _suspect.get(endpoint, 0.0) <= time.monotonic()


class EtcdClient:
    """Requests to etcd's JSON gateway; a connection per thread, the next endpoint when one
    does not answer (and no new request to it for ``SUSPECT_S`` from this process while another
    answers); TLS and etcd's token as ``security`` says (default: ``from_env``)."""

    def __init__(self, endpoints: Sequence[str], timeout_s: float = 2.0, security: Optional[EtcdSecurity] = None):
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self.security = EtcdSecurity.from_env() if security is None else security
        self._ssl = self.security.context
        self._local = threading.local()
        self._next = 0
        self._token: Optional[str] = None  # etcd's auth token (shared by the threads)
        self._token_lock = threading.Lock()
        # The highest raft term an answer carried: it grows when etcd elects a new leader, so a
        # request that stalled across a change of term stalled in an election (``LivenessMonitor``).
        self.raft_term = 0

    def call(self, path: str, body: dict) -> dict:
        if self.security.user and self._token is None:
            self._authenticate()
        data = json.dumps(body)
        try:
            return self._post(path, data, auth=True)
        except _TokenExpired:  # simple tokens expire after etcd's --auth-token-ttl of idleness
            self._authenticate()
            return self._post(path, data, auth=True)

    def _authenticate(self) -> None:
        with self._token_lock:
            self._token = None
            body = json.dumps({"name": self.security.user, "password": self.security.password})
            self._token = self._post("/v3/auth/authenticate", body, auth=False)["token"]

    def _post(self, path: str, data: str, auth: bool) -> dict:
        last: Optional[Exception] = None
        tls_failures = 0  # members that took the connection and failed its TLS handshake
        for _ in range(len(self.endpoints)):
            conn = self._conn()
            headers = {"Content-Type": "application/json"}
            if auth and self._token:
                headers["Authorization"] = self._token
            try:
                if conn.sock is None:
                    self._connect(conn)
                conn.request("POST", path, data, headers)
                self._await_answer(conn)
                resp = conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException) as exc:
                last = exc
                tls_failures += isinstance(exc, ssl.SSLError)
                self._drop(suspect=not isinstance(exc, ssl.SSLError))
                continue
            try:
                out = json.loads(raw or b"{}")
            except ValueError:
                out = {"error": raw[:300].decode(errors="replace").strip()}
            if resp.status != 200 or "error" in out:
                msg = out.get("error") or out.get("message") or raw[:200]
                self._refused(resp.status, str(msg), path)
                last = EtcdError(f"etcd {self._endpoint()}: {path}: {msg}")
                self._drop(suspect=True)  # no leader, or a member going down: try another
                continue
            _answered[self._endpoint()] = time.monotonic()
            _suspect.pop(self._endpoint(), None)  # it answers: trusted again (after an election)
            head = out.get("header")
            if head and "raft_term" in head:
                self.raft_term = max(self.raft_term, int(head["raft_term"]))
                _term[0] = max(_term[0], self.raft_term)
            return out.get("result", out)
        # Every member refused the handshake (our certificate, or theirs, rejected: a member
        # going down refuses the connection instead).
        if tls_failures == len(self.endpoints):
            raise EtcdRefused(f"etcd ({', '.join(self.endpoints)}) refused the TLS handshake: {last} (check "
                              "--etcd-cacert, --etcd-cert and --etcd-key)")
        hint = ""
        if not self.security.tls and isinstance(last, (http.client.RemoteDisconnected, ConnectionResetError)):
            hint = " (an etcd that speaks TLS only? pass --etcd-cacert)"
        raise EtcdError(f"no etcd member answered ({', '.join(self.endpoints)}): {last}{hint}")

    def _refused(self, status: int, msg: str, path: str) -> None:
        """Raise for the answers no other member would change (``EtcdRefused``), or
        ``_TokenExpired``; return for the others (no leader, a member going down)."""
        low = msg.lower()
        if "invalid auth token" in low or (status == 401 and self.security.user):
            if path != "/v3/auth/authenticate":
                raise _TokenExpired(msg)
        if "authentication failed" in low:
            raise EtcdRefused(f"etcd refused user {self.security.user!r}: {msg} (${E.ETCD_USER} / ${E.ETCD_PASSWORD})")
        if "permission denied" in low or status == 403:
            who = (f"user {self.security.user!r}: its role needs read-write on the job's keys (etcdctl role "
                   "grant-permission ROLE --prefix=true readwrite /cft/)") if self.security.user else (
                   f"no user: etcd has authentication on (set ${E.ETCD_USER} and ${E.ETCD_PASSWORD})")
            raise EtcdRefused(f"etcd: {path}: permission denied for {who}")
        if "user name is empty" in low or "user name not found" in low:
            raise EtcdRefused(f"etcd: {path}: {msg} (etcd has authentication on: set ${E.ETCD_USER} and "
                              f"${E.ETCD_PASSWORD})")
        if "commonname" in low:
            raise EtcdRefused(f"etcd: {msg.strip()} -- its JSON gateway refuses a client certificate with a Common "
                              "Name: issue --etcd-cert without one (e.g. subject /O=chameleon-ft)")

    def _open(self, endpoint: str, timeout_s: float) -> http.client.HTTPConnection:
        host, _, port = endpoint.rpartition(":")
        if self._ssl is not None:
            return http.client.HTTPSConnection(host.strip("[]"), int(port), timeout=timeout_s, context=self._ssl)
        return http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout_s)

    def _connect(self, conn: http.client.HTTPConnection) -> None:
        """Open ``conn``'s socket: the TCP connection within ``CONNECT_S``, then the TLS
        handshake and every request within its timeout."""
        sock = socket.create_connection((conn.host, conn.port), min(CONNECT_S, conn.timeout))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(conn.timeout)
        if self._ssl is not None:
            sock = self._ssl.wrap_socket(sock, server_hostname=conn.host)
        conn.sock = sock

    def _await_answer(self, conn: http.client.HTTPConnection) -> None:
        """Return once the answer to the request just sent starts to arrive; raise
        ``TimeoutError`` after the request timeout, or as soon as another answer to this process
        carried a newer raft term (``_term``: the request was most likely lost in the election),
        or ``ConnectionError`` as soon as the member's host no longer takes a connection (probed
        once, after ``PROBE_AFTER_S``)."""
        sock = conn.sock
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            return
        deadline = time.monotonic() + self.timeout_s
        probed, term = False, _term[0]
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer within {self.timeout_s:.1f} s")
            if select.select([sock], [], [], min(TERM_CHECK_S, left))[0]:
                return
            if term and _term[0] > term:  # (0: no term known yet, e.g. a process's first requests)
                raise TimeoutError(f"no answer, and etcd elected a leader meanwhile (term {_term[0]})")
            if not probed and time.monotonic() >= deadline - self.timeout_s + PROBE_AFTER_S:
                probed = True
                try:
                    socket.create_connection((conn.host, conn.port), CONNECT_S).close()
                except OSError as exc:
                    raise ConnectionError(f"no answer, and {conn.host}:{conn.port} takes no connection: {exc}") from exc

    def _endpoint(self) -> str:
        return self.endpoints[getattr(self._local, "i", 0) % len(self.endpoints)]

    def _conn(self) -> http.client.HTTPConnection:
        c = getattr(self._local, "conn", None)
        if c is not None and not _trusted(self._endpoint()):
            other = self._a_trusted_one(self._local.i + 1)
            if other is not None:  # another thread found its member failing: move before this request
                c.close()
                self._local.i = other
                c = self._local.conn = self._open(self._endpoint(), self.timeout_s)
        if c is None:
            i = self._a_trusted_one(self._next)
            self._local.i = self._next if i is None else i
            self._next = self._local.i + 1
            c = self._open(self._endpoint(), self.timeout_s)
            self._local.conn = c
        return c

    def _a_trusted_one(self, start: int) -> Optional[int]:
        """The index (from ``start``, round) of the trusted member that answered this process
        last, or else the first trusted one; None if none is trusted."""
        n = len(self.endpoints)
        trusted = [start + k for k in range(n) if _trusted(self.endpoints[(start + k) % n])]
        if not trusted:
            return None
        return max(trusted, key=lambda i: _answered.get(self.endpoints[i % n], 0.0))

    def _drop(self, suspect: bool = False) -> None:
        c = getattr(self._local, "conn", None)
        if c is not None:
            c.close()
        if suspect:
            _suspect[self._endpoint()] = time.monotonic() + SUSPECT_S
        self._local.conn = None
        self._local.i = getattr(self._local, "i", 0) + 1
        self._next = self._local.i

    # ------------------------------------------------------------ kv
    def get(self, key: bytes) -> Optional[tuple[bytes, int]]:
        """(value, mod_revision) or None."""
        kvs = self.call("/v3/kv/range", {"key": _b64(key)}).get("kvs") or []
        return (_unb64(kvs[0].get("value", "")), int(kvs[0]["mod_revision"])) if kvs else None

    def get_many(self, keys: Sequence[bytes]) -> list[Optional[tuple[bytes, int]]]:
        """``get`` of each key, in one request (a transaction of range reads: one revision)."""
        return [(_unb64(kvs[0].get("value", "")), int(kvs[0]["mod_revision"])) if kvs else None
                for kvs in self._ranges([(k, False) for k in keys])]

    def read(self, *specs: tuple[bytes, bool]) -> list[dict[bytes, bytes]]:
        """Several reads in one request (a transaction of ranges: one revision), each a key
        (``(key, False)``) or every key under a prefix (``(prefix, True)``); each answer
        ``{key: value}`` (empty when nothing is there)."""
        return [{_unb64(kv["key"]): _unb64(kv.get("value", "")) for kv in kvs} for kvs in self._ranges(specs)]

    def _ranges(self, specs: Sequence[tuple[bytes, bool]]) -> list[list[dict]]:
        """The key-values etcd answers for each range of ``specs`` (a key, or a prefix when
        ``True``), all in one transaction."""
        ops = [{"request_range": {"key": _b64(k), **({"range_end": _b64(_prefix_end(k))} if prefix else {})}}
               for k, prefix in specs]
        out = self.call("/v3/kv/txn", {"success": ops})
        return [(r.get("response_range") or {}).get("kvs") or [] for r in out.get("responses") or [{}] * len(specs)]

    def range_prefix(self, prefix: bytes) -> dict[bytes, bytes]:
        kvs = self.call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))}).get("kvs") or []
        return {_unb64(kv["key"]): _unb64(kv.get("value", "")) for kv in kvs}

    def put(self, key: bytes, value: bytes, lease: Optional[str] = None) -> None:
        body = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = lease
        self.call("/v3/kv/put", body)

    def delete(self, key: bytes) -> int:
        return int(self.call("/v3/kv/deleterange", {"key": _b64(key)}).get("deleted", 0))

    def swap(self, key: bytes, value: bytes, mod_revision: Optional[int]) -> int:
        """Write ``value`` if the key is still at ``mod_revision`` (None: does not exist); the
        key's new revision, or 0 when it was not."""
        cmp = ({"key": _b64(key), "target": "CREATE", "create_revision": "0", "result": "EQUAL"}
               if mod_revision is None else
               {"key": _b64(key), "target": "MOD", "mod_revision": str(mod_revision), "result": "EQUAL"})
        out = self.call("/v3/kv/txn", {"compare": [cmp], "success": [{"request_put": {"key": _b64(key), "value": _b64(value)}}]})
        return int((out.get("header") or {}).get("revision", 0)) if out.get("succeeded") else 0

    # ------------------------------------------------------------ leases
    def grant(self, ttl_s: int) -> str:
        return self.call("/v3/lease/grant", {"TTL": str(int(ttl_s))})["ID"]

    def keepalive(self, lease: str) -> bool:
        return int(self.call("/v3/lease/keepalive", {"ID": lease}).get("TTL", 0)) > 0

    def answers(self) -> bool:
        """Whether some member answers at all (its status needs no quorum): etcd is there but
        may have lost its quorum -- as against a partition, where nothing answers."""
        for ep in self.endpoints:
            try:
                c = self._open(ep, 0.5)
                self._connect(c)
                c.request("POST", "/v3/maintenance/status", "{}", {"Content-Type": "application/json"})
                ok = c.getresponse().status == 200
                c.close()
                if ok:
                    return True
            except (OSError, http.client.HTTPException):
                continue
        return False

    def healthy(self) -> bool:
        """Whether a linearizable read goes through (etcd has a leader and a quorum)."""
        try:
            self.call("/v3/kv/range", {"key": _b64(b"/cft/health")})
            return True
        except EtcdRefused:
            raise
        except EtcdError:
            return False


class EtcdWatch:
    """The keys written under ``prefix``, as etcd pushes them: one watch stream (the JSON
    gateway's ``/v3/watch``) on a connection of its own, so a waiter makes no request while
    nothing changes.  ``keys(timeout_s)`` returns the names (after ``prefix``) put since the last
    call, waiting up to ``timeout_s`` for the first (a ``select`` on the socket: no request);
    it raises ``EtcdError`` when the stream ends or cannot be opened, and the next call opens it
    again on the member that answered this process last, from the revision after the last one
    seen: no write is missed across a member's loss.

    Limits: a member cut off from its quorum keeps the stream open and reports nothing more --
    the caller also reads the key it cares about now and then (a linearizable read fails over);
    etcd's compaction of the revisions in between (none by default) ends a resumed watch with an
    error, and the caller's read covers that too."""

    def __init__(self, client: EtcdClient, prefix: bytes):
        self.client, self.prefix = client, prefix
        self.revision: Optional[int] = None  # the newest revision the stream reported
        self._sock: Optional[socket.socket] = None
        self._raw = b""  # bytes received, not yet de-chunked
        self._body = b""  # de-chunked: newline-delimited JSON messages
        self._chunk_left = 0  # bytes of the current chunk still to come (with its CRLF)
        self._i = 0

    @property
    def streaming(self) -> bool:
        return self._sock is not None

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock, self._raw, self._body, self._chunk_left = None, b"", b"", 0

    def keys(self, timeout_s: float) -> list[bytes]:
        if self._sock is None:
            self._open()
        out: list[bytes] = []
        deadline = time.monotonic() + timeout_s
        while True:
            out += self._messages()
            left = deadline - time.monotonic()
            if out or left <= 0:
                return out
            self._receive(left)

    # ------------------------------------------------------------ the stream
    def _open(self) -> None:
        c = self.client
        n = len(c.endpoints)
        start = c._a_trusted_one(self._i)
        self._i = self._i if start is None else start
        create = {"key": _b64(self.prefix), "range_end": _b64(_prefix_end(self.prefix))}
        if self.revision is not None:
            create["start_revision"] = str(self.revision + 1)
        body = json.dumps({"create_request": create}).encode()
        if c.security.user and c._token is None:
            c._authenticate()
        ep = c.endpoints[self._i % n]
        try:
            conn = c._open(ep, c.timeout_s)
            c._connect(conn)
            sock, conn.sock = conn.sock, None
            head = ["POST /v3/watch HTTP/1.1", f"Host: {ep}", "Content-Type: application/json",
                    f"Content-Length: {len(body)}"]
            if c._token:
                head.append(f"Authorization: {c._token}")
            sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
            self._sock = sock
            raw = b""
            deadline = time.monotonic() + c.timeout_s
            while b"\r\n\r\n" not in raw:
                if time.monotonic() > deadline:
                    raise EtcdError("no answer in time")
                raw += self._read(deadline - time.monotonic())
        except (OSError, EtcdError) as exc:
            self.close()
            self._i += 1  # the next member next time; the process's other clients leave it too
            _suspect[ep] = time.monotonic() + SUSPECT_S
            raise EtcdError(f"etcd {ep}: cannot open a watch: {exc}") from None
        headers, _, self._raw = raw.partition(b"\r\n\r\n")
        status = headers.split(b"\r\n", 1)[0]
        if b" 200 " not in status + b" " or b"chunked" not in headers.lower():
            self.close()
            if b" 401 " in status + b" " and c.security.user:  # etcd's token expired: a new one next time
                c._token = None
            else:
                self._i += 1
                _suspect[ep] = time.monotonic() + SUSPECT_S
            raise EtcdError(f"etcd {ep}: the watch was refused: {status.decode(errors='replace')}")
        self._dechunk()

    def _read(self, left: float) -> bytes:
        """What the stream brings within ``left`` seconds (b"": nothing came); EtcdError when it
        ended or failed."""
        sock = self._sock
        pending = isinstance(sock, ssl.SSLSocket) and sock.pending()
        if not pending and not select.select([sock], [], [], max(0.0, left))[0]:
            return b""
        try:
            data = sock.recv(65536)
        except OSError as exc:
            raise EtcdError(f"the watch stream failed: {exc}") from None
        if not data:
            raise EtcdError("the member closed the watch stream")
        return data

    def _receive(self, left: float) -> None:
        try:
            self._raw += self._read(left)
        except EtcdError:
            self.close()
            raise
        self._dechunk()

    def _dechunk(self) -> None:
        while True:
            if self._chunk_left == 0:
                i = self._raw.find(b"\r\n")
                if i < 0:
                    return
                size = int(self._raw[:i].split(b";")[0] or b"0", 16)
                self._raw = self._raw[i + 2:]
                if size == 0:
                    self.close()
                    raise EtcdError("the member ended the watch stream")
                self._chunk_left = size + 2
            take = min(self._chunk_left, len(self._raw))
            if take == 0:
                return
            self._body += self._raw[:min(take, self._chunk_left - 2)]
            self._raw, self._chunk_left = self._raw[take:], self._chunk_left - take

    def _messages(self) -> list[bytes]:
        out = []
        while b"\n" in self._body:
            line, _, self._body = self._body.partition(b"\n")
            if not line.strip():
                continue
            try:
                msg = json.loads(line)
            except ValueError:
                self.close()
                raise EtcdError(f"the watch stream sent {line[:100]!r}") from None
            result = msg.get("result", msg)
            if "error" in msg or result.get("canceled"):
                self.close()
                why = str(msg.get("error") or result.get("cancel_reason"))
                if "auth token" in why.lower():  # etcd's token expired: a new one at the next opening
                    self.client._token = None
                raise EtcdError(f"etcd ended the watch: {why}")
            rev = (result.get("header") or {}).get("revision")
            if rev is not None:
                self.revision = max(self.revision or 0, int(rev))
            for ev in result.get("events") or []:
                if ev.get("type", "PUT") == "PUT":
                    out.append(_unb64(ev["kv"]["key"])[len(self.prefix):])
        return out


class _TokenExpired(Exception):
    """etcd no longer knows the client's token: authenticate again."""


class EtcdStore(dist.Store):
    """A ``torch.distributed.Store`` in etcd under ``prefix`` (module docstring)."""

    def __init__(self, endpoints: Sequence[str], prefix: str, timeout: timedelta = timedelta(seconds=30),
                 request_timeout_s: float = 2.0, security: Optional[EtcdSecurity] = None):
        super().__init__()  # the pybind trampoline
        self.client = EtcdClient(endpoints, min(request_timeout_s, timeout.total_seconds()), security)
        self.prefix = prefix.encode()
        self._timeout = timeout
        self.poll_s = 0.005
        self._written: dict[bytes, tuple[bytes, int]] = {}  # key -> (value, revision) this client wrote
        self._waited: dict[bytes, bytes] = {}  # key -> the value ``wait`` read, for the next ``get``

    def _k(self, key) -> bytes:
        return self.prefix + (key if isinstance(key, bytes) else str(key).encode())

    @property
    def raft_term(self) -> int:
        """The highest raft term etcd's answers to this client carried (``EtcdClient.raft_term``)."""
        return self.client.raft_term

    def watch(self, prefix: str) -> EtcdWatch:
        """A watch stream (``EtcdWatch``) on this store's keys starting with ``prefix``."""
        return EtcdWatch(self.client, self._k(prefix))

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
        self.client.timeout_s = min(self.client.timeout_s, max(0.2, timeout.total_seconds()))

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def set(self, key, value) -> None:
        self._waited.pop(self._k(key), None)
        self.client.put(self._k(key), value if isinstance(value, bytes) else str(value).encode())

    def get(self, key) -> bytes:
        """``key``'s value, waited for up to the store's timeout.  Right after a ``wait`` for it,
        the value that wait read (once; no second request): gloo's rendezvous waits for each
        peer's address and then gets it -- keys written once -- so a group's set-up takes half
        the requests.  A write by another client between the two is not seen (TCPStore's two
        requests would see it); no key of this package is written after it is waited for."""
        got = self._waited.pop(self._k(key), None)
        if got is not None:
            return got
        got = self._wait_get(key, self._timeout.total_seconds())
        if got is None:
            raise dist.DistStoreError(f"key {key!r} not in the store after {self._timeout}")
        return got

    def get_or_none(self, key) -> Optional[bytes]:
        """``key``'s value, or None at once when it is absent (one request)."""
        got = self.client.get(self._k(key))
        return None if got is None else got[0]

    def _wait_get(self, key, timeout_s: float) -> Optional[bytes]:
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.client.get(self._k(key))
            if got is not None:
                return got[0]
            if time.monotonic() > deadline:
                return None
            time.sleep(self.poll_s)

    def _update(self, key, fn) -> bytes:
        """Compare-and-swap ``key`` to ``fn(current or None)`` (retried on a conflict); ``fn``
        returning None leaves it as it is.  The value this client last wrote, and its revision,
        are tried first: a key only this client writes (a liveness counter) takes one request,
        not a read and a write."""
        k = self._k(key)
        self._waited.pop(k, None)
        mine = self._written.get(k)
        while True:
            got = mine or self.client.get(k)
            new = fn(None if got is None else got[0])
            if new is None and mine is not None:  # a remembered value proves nothing: read it
                mine = None
                continue
            mine = None
            if new is None:
                return b"" if got is None else got[0]
            rev = self.client.swap(k, new, None if got is None else got[1])
            if rev:
                self._written[k] = (new, rev)
                return new
            self._written.pop(k, None)

    def add(self, key, amount: int) -> int:
        if int(amount) == 0:  # TCPStore's way of reading a counter: a read, no write, when it exists
            got = self.client.get(self._k(key))
            if got is not None:
                return int(got[0] or b"0")
        return int(self._update(key, lambda cur: str(int(cur or b"0") + int(amount)).encode()))

    def append(self, key, value) -> None:
        v = value if isinstance(value, bytes) else str(value).encode()
        self._update(key, lambda cur: (cur or b"") + v)

    def compare_set(self, key, expected, desired) -> bytes:
        exp = expected if isinstance(expected, bytes) else str(expected).encode()
        des = desired if isinstance(desired, bytes) else str(desired).encode()
        # TCPStore's rule: a missing key is set when ``expected`` is empty (else ``expected`` is
        # returned); an existing one when it equals ``expected``; the value after is returned.
        if not exp or self.client.get(self._k(key)) is not None:
            return self._update(key, lambda cur: des if (cur is None and not exp) or cur == exp else None)
        return exp

    def check(self, keys) -> bool:
        return all(self.client.get(self._k(k)) is not None for k in keys)

    def wait(self, keys, timeout: Optional[timedelta] = None) -> None:
        t = (timeout or self._timeout).total_seconds()
        self._waited.clear()  # (only the newest wait's values stand for a get)
        for k in keys:
            got = self._wait_get(k, t)
            if got is None:
                raise dist.DistStoreError(f"wait for {k!r} timed out after {t:.1f} s")
            self._waited[self._k(k)] = got

    def delete_key(self, key) -> bool:
        self._waited.pop(self._k(key), None)
        return self.client.delete(self._k(key)) > 0

    def clone(self) -> "EtcdStore":
        """An independent client of the same key space (gloo clones its store)."""
        c = EtcdStore(self.client.endpoints, self.prefix.decode(), self._timeout, self.client.timeout_s,
                      self.client.security)
        c.poll_s = self.poll_s
        return c

    def multi_get(self, keys) -> list[bytes]:
        """The values of ``keys``; keys under one parent (``a/b/1``, ``a/b/2`` ...) in one range
        request (the liveness judge's every counter), a missing one waited for as ``get``."""
        keys = [k.decode() if isinstance(k, bytes) else str(k) for k in keys]
        parents: dict[str, list[str]] = {}
        for k in keys:
            parents.setdefault(k.rpartition("/")[0], []).append(k)
        got: dict[str, bytes] = {}
        for parent, ks in parents.items():
            if len(ks) > 2:
                found = self.client.range_prefix(self._k(parent + "/"))
                got.update({k: found[self._k(k)] for k in ks if self._k(k) in found})
        rest = [k for k in keys if k not in got]
        if len(rest) > 1:  # the others in one transaction
            got.update({k: v[0] for k, v in zip(rest, self.client.get_many([self._k(k) for k in rest])) if v})
        return [got[k] if k in got else self.get(k) for k in keys]

    def multi_set(self, keys, values) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def has_extended_api(self) -> bool:
        return True

    def num_keys(self) -> int:
        return len(self.client.range_prefix(self.prefix))


def _suspects(asks) -> frozenset:
    """The worker ids the askers' requests (JSON ``{"suspects": [...]}``) name."""
    out = set()
    for raw in asks:
        try:
            out.update(str(int(w)) for w in json.loads(raw or b"{}").get("suspects", ()))
        except (ValueError, TypeError, AttributeError):
            continue
    return frozenset(out)


class LeftOut(Exception):
    """A round this worker asked in was decided without it (it asked after the join window):
    ``quorum`` is that round's decision, which the worker ends to be admitted at once
    (``Membership._agree``) rather than leave its members waiting for it."""

    def __init__(self, quorum: SimpleNamespace) -> None:
        super().__init__(f"round {quorum.quorum_id} was decided without this worker")
        self.quorum = quorum


def _member(replica_id: str) -> SimpleNamespace:
    return SimpleNamespace(replica_id=replica_id)


class EtcdQuorum:
    """The Lighthouse client's two calls over etcd (module docstring); one per thread that
    asks, like ``LighthouseClient``."""

    def __init__(self, store: EtcdStore, *, join_timeout_s: float = 0.05, heartbeat_timeout_s: float = 1.0,
                 poll_s: float = 0.01, gone: Optional[Callable[[], set]] = None):
        self.store = store
        self._gone = gone or set  # worker ids known dead (their launcher saw them exit)
        self.client = store.client
        self.join_timeout_s = join_timeout_s
        self.ttl = max(1, int(round(heartbeat_timeout_s)))
        # The heartbeat's own client, whose requests give up after a third of the lease: a
        # keep-alive stuck on a member that stopped answering (partitioned away) moves to
        # another member before the lease runs out, so a live worker stays in the live set that
        # ``_ready`` counts.
        self._beats = EtcdClient(store.client.endpoints, min(store.client.timeout_s, heartbeat_timeout_s / 3),
                                 store.client.security)
        self.poll_s = poll_s
        self._lease: Optional[str] = None
        self._renewed_at = 0.0  # the lease's last grant or keep-alive (monotonic)
        self._lease_lock = threading.Lock()

    def _k(self, *parts) -> bytes:
        return self.store._k("lh/" + "/".join(str(p) for p in parts))

    # ------------------------------------------------------------ liveness
    def heartbeat(self, replica_id: str, timeout: Optional[timedelta] = None) -> None:
        """Keep this worker's liveness key alive (a lease etcd expires ``heartbeat_timeout``
        after the last heartbeat): a keep-alive when the last one is a quarter of the lease
        old (a worker heartbeats every 0.1 s; a lease of 1 s needs no more than 4 a second)."""
        with self._lease_lock:
            now = time.monotonic()
            if self._lease is not None and now - self._renewed_at < self.ttl / 4:
                return
            if self._lease is None or not self._beats.keepalive(self._lease):
                self._lease = self._beats.grant(self.ttl)
                self._beats.put(self._k("alive", replica_id), b"1", lease=self._lease)
            self._renewed_at = now

    def alive(self) -> set[str]:
        return self._alive_ids(self.client.range_prefix(self._k("alive", "")))

    def _alive_ids(self, keys) -> set[str]:
        """The worker ids of liveness keys read under ``alive/``."""
        base = self._k("alive", "")
        return {k[len(base):].decode() for k in keys}

    # ------------------------------------------------------------ quorum
    def quorum(self, replica_id: str, timeout: timedelta, data=None, after: Optional[int] = None) -> SimpleNamespace:
        """Block until the round this worker asked in is decided with it; the Lighthouse's
        ``Quorum`` shape (``quorum_id``, ``participants``, ``created``).  Raises ``LeftOut``
        when that round, or the last round decided after generation ``after`` (this worker's
        last), was decided without it -- it asked late -- so that the caller ends that round's
        generation to be admitted at once instead of waiting in the next round for peers that
        wait for it; TimeoutError."""
        deadline = time.monotonic() + timeout.total_seconds()
        r = self._round()
        if after is not None and r - 1 > after:
            last = self.client.get(self._k("decided", r - 1))
            q = json.loads(last[0]) if last is not None else None
            if q is not None and replica_id not in q["members"]:
                raise LeftOut(self._as_quorum(r - 1, q))
        self.client.put(self._k("ask", r, replica_id), json.dumps(data or {}).encode())
        first_seen: Optional[float] = None
        while True:
            # One request a poll: this round's decision and askers, the previous round's
            # decision, the live workers (the dead marks only when someone live did not ask).
            decided, asked_kv, prev, alive = self.client.read(
                (self._k("decided", r), False), (self._k("ask", r, ""), True),
                (self._k("decided", r - 1), False), (self._k("alive", ""), True))
            if decided:
                q = json.loads(next(iter(decided.values())))
                if replica_id in q["members"]:
                    return self._as_quorum(r, q)
                raise LeftOut(self._as_quorum(r, q))
            asked = {k.rsplit(b"/", 1)[1].decode(): v for k, v in asked_kv.items()}
            askers = set(asked)
            now = time.monotonic()
            first_seen = first_seen or now
            previous = set(json.loads(next(iter(prev.values())))["members"]) if prev and r > 1 else None
            if self._ready(askers, now - first_seen, _suspects(asked.values()), previous, self._alive_ids(alive)):
                created = time.time()
                q = {"members": sorted(askers, key=int), "created": [int(created), int((created % 1) * 1e9)]}
                self.client.swap(self._k("decided", r), json.dumps(q).encode(), None)
                continue  # read what was decided (ours, or an earlier decision)
            if now > deadline:
                raise TimeoutError(f"no quorum in round {r} within {timeout.total_seconds():.1f} s")
            time.sleep(self.poll_s)

    def _round(self) -> int:
        """The first undecided round."""
        base = self._k("decided", "")
        rounds = [int(k[len(base):]) for k in self.client.range_prefix(base)]
        return max(rounds, default=0) + 1

    def _ready(self, askers: set[str], waited_s: float, suspects: frozenset, previous: Optional[set],
               alive: set[str]) -> bool:
        """The Lighthouse's rules for deciding a round now (``previous``: the members the round
        before decided, if any; ``alive``: the workers whose liveness lease lasts).  A worker an
        asker names as a suspect (silent, or gone, in the generation that failed) or one
        reported dead (``gone``, read only when a live worker did not ask) does not count as
        alive while its lease lasts -- etcd extends every lease when its leader changes, so a
        partitioned worker's can outlive the partition's detection by a second -- so the
        survivors agree as soon as all of them asked, as the Lighthouse's stand-in requests
        make it do."""
        if not askers:
            return False
        if previous is not None and previous <= askers:
            return True  # every member of the previous quorum asked again
        waiting = alive - suspects - askers
        if waiting:
            waiting -= self._gone()
        if not waiting:
            return True
        return waited_s >= self.join_timeout_s and len(askers) > len(askers | waiting) / 2

    @staticmethod
    def _as_quorum(r: int, q: dict) -> SimpleNamespace:
        return SimpleNamespace(quorum_id=r, participants=[_member(m) for m in q["members"]],
                               created=SimpleNamespace(seconds=q["created"][0], nanos=q["created"][1]))
