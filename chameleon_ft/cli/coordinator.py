"""The launcher's side of the coordinator: host it (node 0) or reach it (other nodes), report a
dead worker, read the agreed generation -- in the launcher, or in an agent forked from the
warm-start template.

``CoordinatorOps`` does it in this process: it needs torch (the TCPStore) and torchft (the
Lighthouse), about 4 s of CPU to import.  With warm start (``cli/warmstart.py``) the template
has imported both already, so the launcher asks it to fork an *agent* that holds the
``CoordinatorOps`` and answers the launcher over a pipe (``AgentOps``, the same four calls):
the launcher itself never imports torch.  The agent hosts the coordinator's threads; it forks
nothing (workers are forked from the template, which holds no threads).  When the launcher
goes away the agent's pipe ends and it shuts the coordinator down and exits -- as the
coordinator died with the launcher before.

Errors cross the pipe as ``(kind, message)``: ``unreachable`` (the coordinator did not answer:
``MembershipError``), ``failed`` (anything else).
"""

from __future__ import annotations

import json
import os
import select
import time
from datetime import timedelta
from typing import Optional

__all__ = ["CoordinatorOps", "AgentOps", "CoordinatorOpError", "serve_agent", "send_json", "LIGHTHOUSE_KEY"]

LIGHTHOUSE_KEY = "cft/launch/lighthouse"


def send_json(fd: int, msg) -> None:
    """One JSON message as one line on a pipe, written whole (the launcher, the template and
    the agent speak this way)."""
    data = (json.dumps(msg) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


class CoordinatorOpError(RuntimeError):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class CoordinatorOps:
    """The coordinator calls, done in this process (imports torch and torchft on first use)."""

    def __init__(self):
        self.server = None
        self.store = None
        self.lighthouse_addr: Optional[str] = None  # None: etcd keeps the membership
        self.presence = None  # etcd jobs: this node's presence socket (``watch_presence``)

    def host(self, host: str, port: int, join_timeout_ms: int,
             heartbeat_timeout_ms: int = 1000, liveness_timeout_s: Optional[float] = None) -> tuple[str, str]:
        """Host the TCPStore and the Lighthouse; (store address, Lighthouse address).
        ``liveness_timeout_s``: the coordinator judges the workers' silence (None: they do)."""
        from chameleon_ft.runtime.membership import CoordinatorServer

        try:
            self.server = CoordinatorServer(host, store_port=port, join_timeout_ms=join_timeout_ms,
                                            heartbeat_timeout_ms=heartbeat_timeout_ms,
                                            liveness_timeout_s=liveness_timeout_s)
        except Exception as exc:
            raise CoordinatorOpError("failed", str(exc)) from exc
        self.store = self.server.store
        self.store.set(LIGHTHOUSE_KEY, self.server.lighthouse_addr)
        self.lighthouse_addr = self.server.lighthouse_addr
        return self.server.store_addr, self.server.lighthouse_addr

    def connect(self, endpoint: str, timeout_s: float) -> str:
        """Reach node 0's coordinator; its Lighthouse address."""
        from chameleon_ft.runtime.membership import MembershipError, connect_store

        try:
            self.store = connect_store(endpoint, timeout_s)
            self.store.wait([LIGHTHOUSE_KEY])
            lighthouse = self.store.get(LIGHTHOUSE_KEY).decode()
            # From here a call that gets no answer fails fast: the launcher polls every 50 ms
            # and must stay responsive (SIGTERM) when node 0 is out of reach.
            self.store.set_timeout(timedelta(seconds=2))
            self.lighthouse_addr = lighthouse
            return lighthouse
        except MembershipError as exc:
            raise CoordinatorOpError("refused" if "refused by" in str(exc) else "unreachable", str(exc)) from exc
        except Exception as exc:
            raise CoordinatorOpError("failed", str(exc)) from exc

    def connect_etcd(self, store_addr: str, timeout_s: float) -> None:
        """Reach the job's etcd cluster (``etcd://h1:2379,.../<job>``)."""
        from chameleon_ft.runtime.coordination import AUTH_KEY, job_digest
        from chameleon_ft.runtime.etcd import EtcdStore, parse_etcd
        from chameleon_ft.runtime.membership import MembershipError, connect_store

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                endpoints, prefix = parse_etcd(store_addr)  # the first launcher names the job's token
                EtcdStore(endpoints, prefix, request_timeout_s=2.0).compare_set(AUTH_KEY, "", job_digest())
            except Exception:  # unreachable: connect_store says so below
                pass
            try:
                self.store = connect_store(store_addr, min(2.0, timeout_s))
                self.store.set_timeout(timedelta(seconds=2))
                return
            except MembershipError as exc:
                if "refused" in str(exc):
                    raise CoordinatorOpError("refused", str(exc)) from exc
                if time.monotonic() > deadline:
                    raise CoordinatorOpError("unreachable", str(exc)) from exc
                time.sleep(0.5)

    def watch_presence(self, store_addr: str, host: str, node_rank: int) -> str:
        """An etcd job has no coordinator process to hold its workers' presence connections
        (``runtime/presence.py``): each node's launcher holds those of the next node's workers
        (``presence_node_key``), so a whole node lost -- its launcher with it -- is reported
        dead by its neighbour at once.  Its own store client; the socket's address."""
        from chameleon_ft.runtime.coordination import TOKEN_ENV, presence_ended
        from chameleon_ft.runtime.membership import connect_store
        from chameleon_ft.runtime.presence import PresenceServer, presence_node_key

        store = connect_store(store_addr, 5.0)
        where = f"node {node_rank}'s launcher"
        self.presence = PresenceServer(host, os.environ.get(TOKEN_ENV, ""),
                                       lambda w, inc: presence_ended(store, w, inc, where))
        store.set(presence_node_key(node_rank), self.presence.address)
        return self.presence.address

    def report_dead(self, worker_id: int, reason: str) -> None:
        from chameleon_ft.runtime.membership import report_dead, stand_in_for_the_dead

        report_dead(self.store, worker_id, reason)
        if self.lighthouse_addr:  # the survivors agree as soon as they all asked
            stand_in_for_the_dead(self.lighthouse_addr, worker_id)

    def read_latest(self) -> Optional[dict]:
        from chameleon_ft.runtime.membership import read_latest

        return read_latest(self.store)

    def poll(self) -> dict:
        """What a launcher watches: the newest generation and the job's stop record."""
        from chameleon_ft.runtime.membership import read_latest, read_stop

        return {"latest": read_latest(self.store), "stop": read_stop(self.store)}

    def stop_job(self, record: dict) -> None:
        from chameleon_ft.runtime.membership import stop_job

        stop_job(self.store, record)

    def close(self) -> None:
        if self.presence is not None:
            self.presence.close()
            self.presence = None
        if self.server is not None:
            self.server.shutdown()
            self.server = None


class AgentOps:
    """The same calls, answered by an agent process over a pipe pair (``serve_agent``)."""

    # A launcher's watch calls (poll, report_dead) must not hold its main loop when the
    # coordinator is out of reach (a partition): a store call may block far longer than its
    # own timeout.  A call that times out leaves its reply to be skipped (replies carry ids).
    QUICK_S = 2.5

    def __init__(self, to_agent: int, from_agent: int, pid: int, timeout_s: float = 120.0):
        self._out, self._in, self.pid, self.timeout_s = to_agent, from_agent, pid, timeout_s
        self._buf = b""
        self._id = 0

    def _call(self, op: str, *args, timeout_s: Optional[float] = None):
        self._id += 1
        try:
            send_json(self._out, {"op": op, "args": list(args), "id": self._id})
        except OSError as exc:
            raise CoordinatorOpError("failed", f"the coordinator agent is gone ({exc})") from None
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._in], [], [], left)[0]:
                    kind = "unreachable" if timeout_s else "failed"
                    raise CoordinatorOpError(kind, f"the coordinator agent did not answer {op!r} in time")
                data = os.read(self._in, 65536)
                if not data:
                    raise CoordinatorOpError("failed", "the coordinator agent exited")
                self._buf += data
            line, self._buf = self._buf.split(b"\n", 1)
            reply = json.loads(line)
            if reply.get("id") == self._id:
                break  # else: the late answer to a call that timed out
        if "error" in reply:
            raise CoordinatorOpError(*reply["error"])
        return reply["result"]

    def host(self, host: str, port: int, join_timeout_ms: int,
             heartbeat_timeout_ms: int = 1000, liveness_timeout_s: Optional[float] = None) -> tuple[str, str]:
        return tuple(self._call("host", host, port, join_timeout_ms, heartbeat_timeout_ms, liveness_timeout_s))

    def connect(self, endpoint: str, timeout_s: float) -> str:
        return self._call("connect", endpoint, timeout_s)

    def connect_etcd(self, store_addr: str, timeout_s: float) -> None:
        self._call("connect_etcd", store_addr, timeout_s)

    def watch_presence(self, store_addr: str, host: str, node_rank: int) -> str:
        return self._call("watch_presence", store_addr, host, node_rank)

    def report_dead(self, worker_id: int, reason: str) -> None:
        self._call("report_dead", worker_id, reason, timeout_s=self.QUICK_S)

    def read_latest(self) -> Optional[dict]:
        return self._call("read_latest", timeout_s=self.QUICK_S)

    def poll(self) -> dict:
        return self._call("poll", timeout_s=self.QUICK_S)

    def stop_job(self, record: dict) -> None:
        self._call("stop_job", record)

    def close(self) -> None:
        for fd in (self._out, self._in):
            try:
                os.close(fd)  # end of requests: the agent shuts the coordinator down, exits
            except OSError:
                pass
        # An agent stuck in a call to an unreachable coordinator (a partition) would outlive
        # the launcher and keep its node's connections open: give it a moment, then kill it.
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                if os.waitpid(self.pid, os.WNOHANG)[0] or not _alive(self.pid):
                    return
            except ChildProcessError:  # not our child (the template's): poll it
                if not _alive(self.pid):
                    return
            time.sleep(0.02)
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    from chameleon_ft.runtime.faults import process_state

    try:
        return process_state(pid) != "Z"  # a zombie is gone for our purposes
    except OSError:
        return False


def serve_agent(in_fd: int, out_fd: int) -> None:
    """The agent's loop: answer ``AgentOps`` calls with a ``CoordinatorOps`` until the pipe ends."""
    ops = CoordinatorOps()
    buf = b""
    try:
        while True:
            data = os.read(in_fd, 65536)
            if not data:
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                try:
                    reply = {"result": getattr(ops, req["op"])(*req["args"])}
                except CoordinatorOpError as exc:
                    reply = {"error": [exc.kind, str(exc)]}
                except Exception as exc:  # noqa: BLE001 - reported to the launcher, which decides
                    reply = {"error": ["failed", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"]}
                reply["id"] = req.get("id")
                try:
                    send_json(out_fd, reply)
                except BrokenPipeError:  # the launcher is gone
                    return
    finally:
        ops.close()
