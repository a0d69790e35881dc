"""A worker's death told by its own kernel: one idle TCP connection per worker to the coordinator.

Why: a lost worker is known dead at once only when its launcher sees it exit
(``coordination.report_dead``).  When the launcher goes with it -- a whole node's processes
killed, a container evicted, the OOM killer taking the launcher -- nobody reported it, and the
survivors' membership waited the heartbeat timeout before acting on a quorum without it
(``liveness.await_the_missing``: a live member merely not scheduled must not be taken for lost).
A process that exits has its sockets closed by its kernel, whatever killed it; a process that is
alive but stalled keeps them.  So each worker keeps one connection to the coordinator process
open (``PresenceClient``) and the coordinator (``PresenceServer``, a thread of the embedded
coordinator) reports the worker dead the moment that connection ends without a goodbye -- the
same report the launcher makes, with the same incarnation rule, so a replacement that reuses the
id is not affected.

Who may register: the server sends a random nonce; the client answers with its worker id, its
incarnation and ``HMAC-SHA256(job token, nonce | worker | incarnation)``.  The token itself is
never sent and never stored, so a process that can read the store (or replay an earlier
exchange) cannot register a worker and then close the connection to have it declared dead.

The same connection carries the generations' ends the other way (embedded coordinator only):
the server calls ``ended()`` every ``tick_s`` (20 ms) -- the coordinator reads the newest
generations' abort keys, a constant load whatever the job's size -- and writes ``ended TOKEN``
to every registered connection; a worker's abort watcher reads them (``PresenceClient.keys``)
instead of polling its generation's key 50 times a second (``runtime/abort_watch.py``).  A line
that does not fit a stalled worker's socket buffer is dropped: the watcher also reads its key
four times a second.

With a judge (the embedded coordinator started with a heartbeat timeout): the worker's
liveness beats come on the same connection, one byte each (``PresenceClient.beat``; no answer,
no store request), the server counts them per worker and every ``judge_every_s`` (0.1 s) hands
the counts to ``judge`` (``liveness.JobJudge``) and writes ``alive`` to every beating connection
(the worker's sign that the coordinator answers).

An etcd job has no coordinator process: there each node's launcher holds a presence socket
(``CoordinatorOps.watch_presence``, published at ``presence_node_key``) and each worker connects to
the *next* node's (``PRESENCE_NODE_ENV``), so a whole node lost is reported by its neighbour.

Limits: a machine that vanishes without its kernel closing the sockets (power loss, a
partition) sends nothing -- heartbeats find it; with etcd, two neighbouring nodes lost at once
(the second's workers were watched by the first) and a single-node job rely on the heartbeat
timeout too; the connection is closed in forked children (DataLoader workers), so it ends when
the worker itself does.
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import json
import logging
import os
import secrets
import select
import selectors
import socket
import threading
import time
from typing import Callable, Optional

log = logging.getLogger(__name__)

__all__ = ["PresenceServer", "PresenceClient", "PRESENCE_KEY", "PRESENCE_NODE_ENV", "presence_node_key", "goodbye",
           "proof"]

PRESENCE_KEY = "cft/presence"  # host:port of the coordinator's presence socket (in the job's store)
PRESENCE_NODE_ENV = "CHAMELEON_FT_PRESENCE_NODE"  # etcd jobs: the node whose launcher holds ours


def presence_node_key(node_rank: int) -> str:
    """Where an etcd job's node ``node_rank`` publishes its launcher's presence socket."""
    return f"{PRESENCE_KEY}/node{int(node_rank)}"
_BYE = b"bye\n"
_BEAT = b"."
_MAX_LINE = 512


def proof(token: str, nonce: bytes, worker: int, incarnation: int) -> str:
    """What a worker answers to the nonce: it holds the job token (module doc)."""
    msg = nonce + f"|{int(worker)}|{int(incarnation)}".encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


class PresenceServer:
    """Accepts the workers' connections on ``host`` (a random port: ``address``) and calls
    ``died(worker, incarnation)`` when a registered connection ends without a goodbye.  One
    thread; nothing is read from a registered connection but its beats, its goodbye and its
    end.  With ``ended``: that thread also calls it every ``tick_s`` and writes each token it
    returns to every registered connection; with ``judge``: it calls ``judge(beats)`` every
    ``judge_every_s`` with each registered worker's beat count and writes ``alive`` to the
    connections that beat (module doc)."""

    def __init__(self, host: str, token: str, died: Callable[[int, int], None],
                 ended: Optional[Callable[[], "list[str]"]] = None, tick_s: float = 0.02,
                 judge: Optional[Callable[["dict[int, int]"], None]] = None, judge_every_s: float = 0.1):
        self._token, self._died = token, died
        self._ended, self.tick_s = ended, tick_s
        self._judge, self.judge_every_s = judge, judge_every_s
        self.beats: dict[int, int] = {}  # worker -> beats received on its registered connections
        self._sel = selectors.DefaultSelector()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listen = socket.create_server((host.strip("[]"), 0), family=family, backlog=1024)
        self._listen.setblocking(False)
        self._sel.register(self._listen, selectors.EVENT_READ, None)
        self.address = f"{host}:{self._listen.getsockname()[1]}"
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self.registered: dict[int, int] = {}  # worker -> incarnation, for the live connections
        self._thread = threading.Thread(target=self._loop, name="cft-presence", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread; it closes the sockets itself on its way out (were they closed here
        while it still ran -- a slow ``died`` report -- both threads would close the same fd)."""
        try:
            self._wake_w.send(b"x")
        except OSError:
            return  # closed already
        self._thread.join(timeout=2)
        if self._thread.is_alive():
            log.warning("presence: the server thread is still reporting; it closes its sockets when done")

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        tick_at = judge_at = time.monotonic()
        try:
            while True:
                due = [t for t, on in ((tick_at, self._ended), (judge_at, self._judge)) if on is not None]
                wait = max(0.0, min(due) - time.monotonic()) if due else None
                for key, _ in self._sel.select(wait):
                    if key.data == "wake":
                        return
                    if key.data is None:
                        self._accept()
                    else:
                        self._readable(key.fileobj, key.data)
                if self._ended is not None and time.monotonic() >= tick_at:
                    tick_at = time.monotonic() + self.tick_s
                    self._tell_ended()
                if self._judge is not None and time.monotonic() >= judge_at:
                    judge_at = time.monotonic() + self.judge_every_s
                    self._tell_judge()
        finally:
            for key in list(self._sel.get_map().values()):
                key.fileobj.close()
            self._sel.close()
            self._wake_w.close()

    def _tell_ended(self) -> None:
        try:
            tokens = self._ended()
        except Exception as exc:  # (the store going down with the job: the workers read their keys)
            log.debug("presence: could not read the generations' ends: %s", exc)
            return
        if tokens:
            self._send_all(b"".join(b"ended " + t.encode() + b"\n" for t in tokens))

    def _send_all(self, lines: bytes) -> None:
        """``lines`` to every registered connection (non-blocking: a full buffer drops them,
        module doc; a connection that ended is read as such next)."""
        for key in list(self._sel.get_map().values()):
            if isinstance(key.data, dict) and key.data["who"] is not None:
                try:
                    key.fileobj.send(lines)
                except OSError:
                    pass

    def _tell_judge(self) -> None:
        beats = {w: self.beats.get(w, 0) for w in self.registered}
        try:
            self._judge(beats)
        except Exception as exc:  # (the store going down with the job)
            log.debug("presence: the liveness judge failed: %s", exc)
        self._send_all(b"alive\n")

    def _accept(self) -> None:
        try:
            conn, _ = self._listen.accept()
        except OSError:
            return
        conn.setblocking(False)
        nonce = secrets.token_bytes(16)
        try:
            conn.send(nonce.hex().encode() + b"\n")
        except OSError:
            conn.close()
            return
        self._sel.register(conn, selectors.EVENT_READ, {"nonce": nonce, "buf": b"", "who": None})

    def _readable(self, conn: socket.socket, state: dict) -> None:
        try:
            data = conn.recv(_MAX_LINE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if state["who"] is not None:  # registered: beats, a goodbye or the end
            if data and _BYE.strip() not in (state["buf"] + data):
                state["buf"] = (state["buf"] + data)[-8:]
                worker = state["who"][0]
                self.beats[worker] = self.beats.get(worker, 0) + data.count(_BEAT)
                return
            self._drop(conn)
            worker, incarnation = state["who"]
            if self.registered.get(worker) == incarnation:
                del self.registered[worker]
            if not data:  # the connection ended without a goodbye: the process is gone
                try:
                    self._died(worker, incarnation)
                except Exception as exc:  # (the store going down with the job)
                    log.warning("presence: could not report worker %d dead: %s", worker, exc)
            return
        if not data:
            self._drop(conn)
            return
        state["buf"] += data
        if b"\n" not in state["buf"]:
            if len(state["buf"]) > _MAX_LINE:
                self._drop(conn)
            return
        line = state["buf"].split(b"\n", 1)[0]
        state["buf"] = b""
        try:
            msg = json.loads(line)
            worker, incarnation = int(msg["worker"]), int(msg["incarnation"])
            ok = hmac.compare_digest(str(msg["proof"]), proof(self._token, state["nonce"], worker, incarnation))
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            log.warning("presence: a connection that does not hold the job token was refused")
            self._drop(conn)
            return
        state["who"] = (worker, incarnation)
        self.registered[worker] = incarnation
        try:
            conn.send(b" ".join([b"ok"] + [b"ended"] * (self._ended is not None)
                                + [b"beats"] * (self._judge is not None)) + b"\n")
        except OSError:
            pass

    def _drop(self, conn: socket.socket) -> None:
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()


_CLIENTS: "list[PresenceClient]" = []


def goodbye() -> None:
    """Say goodbye on every connection of this process: it ends normally (at exit, and before
    an ``os._exit`` that means no failure), so the coordinator takes no death from it."""
    for c in list(_CLIENTS):
        c.close()


def _forget_all() -> None:
    for c in _CLIENTS:
        c._forget()


os.register_at_fork(after_in_child=_forget_all)


class PresenceClient:
    """A worker's connection to the coordinator's ``PresenceServer`` (module doc): ``connect``
    registers it, ``close`` says goodbye (a normal end is not a death; ``goodbye`` closes every
    one, also at interpreter exit).  Forked children close their copy at once."""

    def __init__(self) -> None:
        self._sock: Optional[socket.socket] = None
        self.pushes = False  # the server writes the generations' ends on this connection
        self.beats = False  # the server takes this worker's liveness beats on it (and judges)
        self.heard_at = 0.0  # when the server last wrote anything here (monotonic)
        self._buf = b""
        if not _CLIENTS:
            atexit.register(goodbye)
        _CLIENTS.append(self)

    def connect(self, address: str, token: str, worker: int, incarnation: int, timeout_s: float = 2.0) -> None:
        """Register; raises OSError or ValueError when the coordinator refuses or does not answer."""
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
        try:
            f = sock.makefile("rb", buffering=0)  # (unbuffered: what follows the reply stays in the socket)
            nonce = bytes.fromhex(f.readline(100).decode().strip())
            sock.sendall(json.dumps({"worker": int(worker), "incarnation": int(incarnation),
                                     "proof": proof(token, nonce, worker, incarnation)}).encode() + b"\n")
            reply = f.readline(20).split()
            if reply[:1] != [b"ok"]:
                raise ValueError("the coordinator refused this worker's presence (another job token?)")
            self.pushes, self.beats = b"ended" in reply[1:], b"beats" in reply[1:]
            f.close()
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        self._sock = sock

    @property
    def streaming(self) -> bool:
        """The server writes the generations' ends here, and the connection is up."""
        return self._sock is not None and self.pushes

    def beat(self) -> bool:
        """One liveness beat on this connection (no answer is awaited; a full send buffer -- a
        coordinator that does not read -- drops it); False when the connection does not take
        beats (any more): beat to the store instead."""
        sock = self._sock
        if sock is None or not self.beats:
            return False
        try:
            sock.send(_BEAT, socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass
        except OSError:
            return False
        return True

    def keys(self, timeout_s: float) -> "list[bytes]":
        """The tokens of generations the server said ended, waiting up to ``timeout_s`` for
        one; raises OSError when this connection does not carry them (any more).  One reader
        (the abort watcher's thread)."""
        sock = self._sock
        if sock is None or not self.pushes:
            raise OSError("no presence connection that carries the generations' ends")
        if b"\n" not in self._buf and select.select([sock], [], [], timeout_s)[0]:
            data = sock.recv(4096)
            if not data:  # the coordinator's process is gone
                self.pushes = self.beats = False
                raise OSError("the coordinator closed the presence connection")
            self._buf += data
            self.heard_at = time.monotonic()
        lines, _, self._buf = self._buf.rpartition(b"\n")
        return [ln[6:] for ln in lines.split(b"\n") if ln.startswith(b"ended ")]

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if self in _CLIENTS:
            _CLIENTS.remove(self)
        if sock is None:
            return
        try:  # (never blocks: a coordinator that stopped reading has a full buffer; no bye then)
            sock.send(_BYE, socket.MSG_DONTWAIT)
        except OSError:
            pass
        sock.close()

    def _forget(self) -> None:
        """In a forked child: close our copy, so that the connection ends with the worker."""
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                os.close(sock.detach())
            except OSError:
                pass
