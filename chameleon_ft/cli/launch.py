"""``chameleon-ft run [flags] script.py [args]``: start elastic workers that survive failures.

One launcher per node (torchrun's flags).  Node 0's launcher hosts the job's coordinator
(``CoordinatorServer``: a TCPStore and torchft's Lighthouse) on loopback, or on the address
that ``--rdzv-endpoint`` names -- in an agent process forked from the warm-start template, so
that the launcher itself never imports torch (``cli/coordinator.py``; the agent ends with the
launcher); every launcher (node 0's too) then starts
``--nproc-per-node`` workers with the environment of ``runtime/env.py``, each a fork of a
template interpreter that imported the ``--preload`` modules once (``cli/warmstart.py``:
start-up imports are paid once per launcher, not per worker and replacement).  Worker ids are
``node_rank * nproc_per_node + local_rank`` and stay with their slot.

What a launcher does while the job runs:

* a worker that exits non-zero is reported to the coordinator at once (``report_dead``), so
  the survivors stop waiting for it; its peers are never torn down;
* up to ``--max-replacements`` times (per launcher) it starts a replacement in the dead
  worker's slot, which joins and heals from a peer;
* a worker left out of the agreed generation for longer than ``--hang-timeout`` + 2 s (it
  hangs, e.g. SIGSTOP) is killed, which also frees its slot for a replacement;
* once any worker finished successfully, the others get ``--hang-timeout`` + 5 s to finish;
* SIGTERM (a preemption's notice): forwarded to every worker's process group at once; each
  leaves the job at the end of its current step, announced to its peers, which carry on without
  redoing a step (``runtime/preemption.py``); those still running ``--term-grace`` seconds later
  are ended as below.  A worker that gets SIGTERM itself leaves the same way (exit 143: no
  failure is reported, no replacement started).  Ctrl-C: forwarded as SIGTERM; those still
  running 3 s later are killed.  The launcher then exits 128 + the signal.

Exit status: 0 when survivors finished; 75 when the engine chose checkpoint-restart and
``--max-restarts`` is spent (rerun the command; the script resumes from its checkpoint); 70 when
a worker's code raised (a bug, not a failure: the job stops on every node, the traceback
printed once; ``--on-worker-error continue`` makes it a lost worker); 78 for a configuration
error every worker meets; otherwise the first worker's failure code, or 1/2 for launcher errors
(bad flags: 2).

Limits, honestly: node 0's launcher is the single point of failure (it hosts the
coordinator); when it dies, workers fail their next collective with a clear error.  The
coordinator is not authenticated: bind it to a trusted network only.  Whole-job restart: ``--max-restarts N``
relaunches every worker (single node) when the engine chooses checkpoint-restart; otherwise
exit code 75 hands that to the caller (scheduler, shell loop).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

from chameleon_ft.cli.coordinator import CoordinatorOpError, CoordinatorOps
from chameleon_ft.cli.launch_flags import (LaunchError, apply_accelerate_flags, build_parser, parse_endpoint,
                                           parse_nnodes)
from chameleon_ft.cli.netif import NoRoute, route_interface, wait_reachable
from chameleon_ft.cli.warmstart import WarmSpawner, WarmStartError, preload_modules
from chameleon_ft.runtime import env as E
from chameleon_ft.runtime.eventlog import EventLog
from chameleon_ft.runtime.errors import CONFIG_EXIT_CODE, read_config_errors, read_user_errors
from chameleon_ft.runtime.faults import parse_faults
from chameleon_ft.runtime.preemption import PREEMPT_SIGNALS_ENV, PREEMPTED_EXIT_CODE, notice_signals
from chameleon_ft.runtime.presence import PRESENCE_NODE_ENV


# torch and torchft (the coordinator's TCPStore and Lighthouse) are imported where the
# coordinator is hosted: in an agent forked from the warm-start template, or here after the
# flags were checked (``cli/coordinator.py``): a bad flag is refused without paying for them.

__all__ = ["main", "build_parser", "LaunchError"]

_POLL_S = 0.005


@dataclass
class _Child:
    wid: int
    local_rank: int
    proc: subprocess.Popen
    incarnation: int
    started: float = field(default_factory=time.monotonic)
    seen: bool = False
    absent_since: Optional[float] = None
    rc: Optional[int] = None
    after_gen: int = -1  # the newest generation when it started: only a later one can hold it


class Launcher:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.min_nodes, self.max_nodes = parse_nnodes(args.nnodes)
        self.presence_node: Optional[int] = None  # etcd: the node whose launcher holds our workers' presence
        if args.nproc_per_node < 1:
            raise LaunchError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
        if not 0 <= args.node_rank < self.max_nodes:
            raise LaunchError(f"--node-rank {args.node_rank} outside 0..{self.max_nodes - 1}")
        if self.max_nodes > 1 and not args.rdzv_endpoint:
            raise LaunchError("more than one node needs --rdzv-endpoint host:port")
        if args.rdzv_backend == "etcd" and not args.rdzv_endpoint:
            raise LaunchError("--rdzv-backend etcd needs --rdzv-endpoint host:2379[,host:2379...]")
        self._etcd_security(args)
        if not args.rdzv_id or "/" in args.rdzv_id:
            raise LaunchError(f"--rdzv-id {args.rdzv_id!r}: a name without '/'")
        if args.mttf is not None and not args.mttf > 0:
            raise LaunchError(f"--mttf must be a positive number of seconds, got {args.mttf}")
        if args.term_grace < 0:
            raise LaunchError(f"--term-grace must be >= 0 seconds, got {args.term_grace}")
        try:
            self.notice_signals = notice_signals(args.preempt_signal)
        except ValueError as exc:
            raise LaunchError(f"--preempt-signal: {exc}") from None
        if args.preempt_signal:
            os.environ[PREEMPT_SIGNALS_ENV] = args.preempt_signal  # the workers take them too
        if args.max_replacements < 0 or args.hang_timeout <= 0:
            raise LaunchError("--max-replacements must be >= 0 and --hang-timeout > 0")
        if args.heartbeat_timeout < 0 or args.cut_off < 0:
            raise LaunchError("--heartbeat-timeout and --cut-off must be >= 0 (0: off)")
        if args.heartbeat_timeout and args.heartbeat_timeout < 0.3:
            raise LaunchError(f"--heartbeat-timeout {args.heartbeat_timeout}: at least 0.3 s (three "
                              "heartbeats), or 0 for off")
        if not os.path.isfile(args.script):
            raise LaunchError(f"script {args.script!r} not found")
        if args.rdzv_endpoint:
            self.endpoints = [parse_endpoint(e) for e in args.rdzv_endpoint.split(",") if e.strip()]
            if args.rdzv_backend == "c10d" and len(self.endpoints) != 1:
                raise LaunchError(f"--rdzv-endpoint {args.rdzv_endpoint!r}: one host:port (several are "
                                  "etcd members: --rdzv-backend etcd)")
            self.endpoint = self.endpoints[0]
        try:
            specs = parse_faults(args.faults)
        except ValueError as exc:
            raise LaunchError(f"--faults: {exc}") from None
        world = self.max_nodes * args.nproc_per_node
        for spec in specs:
            if spec.node is not None and spec.node >= self.max_nodes:
                raise LaunchError(f"--faults: node={spec.node} does not exist (nodes 0..{self.max_nodes - 1})")
            far = [r for r in spec.ranks if r >= world]
            if far:
                raise LaunchError(f"--faults: rank={','.join(map(str, far))} does not exist "
                                  f"(ranks 0..{world - 1} with {world} workers)")
        # The job token: given, inherited, or (one node, embedded coordinator) made up; set in
        # this process's environment before the template and the workers start, which inherit it.
        token = args.job_token if args.job_token is not None else os.environ.get(E.JOB_TOKEN)
        if token is None and self.max_nodes == 1 and args.rdzv_backend == "c10d":
            import secrets

            token = secrets.token_hex(16)
        elif token is None:
            _say("no --job-token: any process that reaches the coordinator can join this job "
                 "(docs/security.md)")
        if token is not None:
            os.environ[E.JOB_TOKEN] = token
        self.run_dir = args.run_dir or tempfile.mkdtemp(prefix="chameleon-ft-")
        os.makedirs(self.run_dir, exist_ok=True)
        self.ops = None  # the coordinator calls: CoordinatorOps here, or AgentOps
        self.children: dict[int, _Child] = {}
        self.replacements_left = args.max_replacements
        self.stop_signal: Optional[int] = None
        self._stop_at: Optional[float] = None  # when the main loop saw the stop signal
        self.warm: Optional[WarmSpawner] = None
        self.gloo_ifname: Optional[str] = None
        self._latest_gen = -1  # the newest generation the launcher read

    @staticmethod
    def _etcd_security(args: argparse.Namespace) -> None:
        """Export ``--etcd-cacert/-cert/-key`` (absolute paths) for this launcher's etcd client
        and its workers, and check them with the user variables (``EtcdSecurity``)."""
        flags = {E.ETCD_CACERT: args.etcd_cacert, E.ETCD_CERT: args.etcd_cert, E.ETCD_KEY: args.etcd_key}
        given = [k for k, v in flags.items() if v]
        if given and args.rdzv_backend != "etcd":
            raise LaunchError("--etcd-cacert, --etcd-cert and --etcd-key go with --rdzv-backend etcd")
        for k in given:
            os.environ[k] = os.path.abspath(flags[k])
        if args.rdzv_backend == "etcd":
            from chameleon_ft.runtime.errors import ConfigError
            from chameleon_ft.runtime.etcd import EtcdSecurity

            try:
                EtcdSecurity.from_env()
            except ConfigError as exc:
                raise LaunchError(str(exc)) from None

    # ---------------------------------------------------------------- coordinator
    def connect(self) -> tuple[str, str]:
        """Host the coordinator (node 0) or reach node 0's: (store address, Lighthouse address)."""
        a = self.args
        if a.rdzv_endpoint and (a.rdzv_backend == "etcd" or a.node_rank != 0):
            # Before the coordinator client (in the agent, once the template's imports are done).
            why = wait_reachable(self.endpoints, a.rdzv_timeout)
            if why is not None:
                what = "etcd" if a.rdzv_backend == "etcd" else "the coordinator"
                first = "start etcd" if a.rdzv_backend == "etcd" else "start node 0"
                raise LaunchError(f"cannot reach {what} (--rdzv-endpoint {a.rdzv_endpoint}): nothing accepted a "
                                  f"connection within {a.rdzv_timeout:g} s ({why}); {first} first, or check "
                                  "the address and the firewall")
        self.ops = self._coordinator_ops()
        if a.rdzv_backend == "etcd":  # every node alike: the coordinator is the etcd cluster
            store = "etcd://" + ",".join(f"{h}:{p}" for h, p in self.endpoints) + f"/{a.rdzv_id}"
            try:
                self.ops.connect_etcd(store, a.rdzv_timeout)
            except CoordinatorOpError as exc:
                if exc.kind == "refused":
                    raise LaunchError(str(exc)) from exc
                raise LaunchError(f"cannot reach etcd (--rdzv-endpoint {a.rdzv_endpoint}): {exc}") from exc
            return store, f"etcd?join_ms={a.join_timeout_ms}"
        if a.node_rank == 0:
            host, port = "127.0.0.1", 0
            if a.rdzv_endpoint:
                host, port = self.endpoint
            try:
                return self.ops.host(host, port, a.join_timeout_ms,
                                     int(1000 * (a.heartbeat_timeout or 1.0)),
                                     (a.heartbeat_timeout or None) if a.coordinator_judges else None)
            except CoordinatorOpError as exc:
                raise LaunchError(f"cannot host the coordinator on {host}:{port}: {exc}") from exc
        try:
            return a.rdzv_endpoint, self.ops.connect(a.rdzv_endpoint, a.rdzv_timeout)
        except CoordinatorOpError as exc:
            if exc.kind == "refused":
                raise LaunchError(str(exc)) from exc
            if exc.kind == "unreachable":
                raise LaunchError(f"cannot reach the coordinator (--rdzv-endpoint): {exc}") from exc
            raise LaunchError(f"coordinator at {a.rdzv_endpoint} did not answer: {exc}") from exc

    def _watch_presence(self) -> Optional[int]:
        """An etcd job of several nodes: this launcher holds the presence connections of the
        previous node's workers (``CoordinatorOps.watch_presence``); returns the node whose
        launcher holds this node's workers' (the next one)."""
        a = self.args
        if a.rdzv_backend != "etcd" or self.max_nodes < 2:
            return None
        h, p = self.endpoints[0]
        try:
            self.ops.watch_presence(self.store_addr, route_interface(h, p)[1], a.node_rank)
        except (NoRoute, CoordinatorOpError) as exc:
            _say(f"no presence socket on this node ({exc}): if node {(a.node_rank - 1) % self.max_nodes} is lost "
                 "whole, the heartbeat timeout finds it")
        return (a.node_rank + 1) % self.max_nodes

    def _gloo_interface(self) -> Optional[str]:
        """The interface gloo's workers listen on: the one this node reaches the coordinator
        through (``cli/netif.py``), unless the user set ``GLOO_SOCKET_IFNAME``."""
        if os.environ.get("GLOO_SOCKET_IFNAME"):
            return None
        host, port = self.endpoint if self.args.rdzv_endpoint else ("127.0.0.1", 0)
        if host in ("0.0.0.0", "::", ""):
            _say("the coordinator binds every address: gloo picks its interface from the hostname; "
                 "set GLOO_SOCKET_IFNAME to the interface that reaches the other nodes if they cannot connect")
            return None
        try:
            name, local = route_interface(host, port or 29500)
        except NoRoute as exc:
            raise LaunchError(f"{exc}: this node cannot reach the coordinator; set GLOO_SOCKET_IFNAME to "
                              "the interface that reaches the other nodes") from None
        if name is None:
            _say(f"no interface holds {local}, the address that reaches {host}: gloo picks its own "
                 "(set GLOO_SOCKET_IFNAME if the workers cannot connect)")
        return name

    def _warm_off(self, why: Exception) -> None:
        _say(f"warm start off, starting fresh interpreters: {why}")
        self.warm.close()
        self.warm = None

    def _coordinator_ops(self):
        """In an agent forked from the template when there is one (this process then never
        imports torch), else here."""
        if self.warm is not None:
            try:
                return self.warm.agent()
            except WarmStartError as exc:
                self._warm_off(exc)
        return CoordinatorOps()

    # ---------------------------------------------------------------- workers
    def spawn(self, local_rank: int, incarnation: int = 0) -> _Child:
        a = self.args
        wid = a.node_rank * a.nproc_per_node + local_rank
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        if self.gloo_ifname:
            env["GLOO_SOCKET_IFNAME"] = self.gloo_ifname
        env.update({
            E.STORE: self.store_addr, E.LIGHTHOUSE: self.lighthouse_addr, E.WORKER_ID: str(wid),
            "RANK": str(wid), "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(self.max_nodes * a.nproc_per_node),
            "LOCAL_WORLD_SIZE": str(a.nproc_per_node), "NODE_RANK": str(a.node_rank),
            E.RUN_DIR: self.run_dir, E.FAULTS: a.faults, E.REPLACEMENT: str(incarnation),
            E.HANG_TIMEOUT: str(a.hang_timeout), E.ON_ERROR: a.on_worker_error,
            E.BEAT_TIMEOUT: repr(a.heartbeat_timeout), E.CUT_OFF: repr(a.cut_off),
            E.QUORUM_WAIT: repr(a.quorum_wait),
            E.MIN_WORLD: str(self.min_nodes * a.nproc_per_node),
            E.MAX_REPLACEMENTS: str(self.replacements_left),
            E.MTTF: "" if a.mttf is None else repr(a.mttf),
            # torchrun's name for "how many times the whole job was relaunched".
            "TORCHELASTIC_RESTART_COUNT": str(getattr(a, "restart_count", 0)),
        })
        if self.presence_node is not None:
            env[PRESENCE_NODE_ENV] = str(self.presence_node)
        proc = None
        # A replacement starts as a fresh interpreter: it stands for a new machine, and what
        # one costs to start is what the engine's wait-for-replacement must weigh.
        if self.warm is not None and not incarnation:
            try:
                proc = self.warm.spawn([a.script, *a.script_args], env)
            except WarmStartError as exc:
                self._warm_off(exc)
        if proc is None:
            proc = subprocess.Popen([sys.executable, "-u", a.script, *a.script_args], env=env,
                                    start_new_session=True)
        child = _Child(wid, local_rank, proc, incarnation, after_gen=self._latest_gen if incarnation else -1)
        self.children[local_rank] = child
        what = f"replacement #{incarnation}" if incarnation else "worker"
        _say(f"started {what} {wid} (pid {proc.pid})")
        return child

    def run(self) -> int:
        modules = preload_modules(self.args.preload)
        if modules and self.warm is None:
            # Started first: its imports overlap the coordinator's start.
            tenv = dict(os.environ)
            tenv.setdefault("OMP_NUM_THREADS", "1")  # libgomp reads it when torch loads
            self.warm = WarmSpawner(modules, tenv)
        self.store_addr, self.lighthouse_addr = self.connect()
        self.presence_node = self._watch_presence()
        self.gloo_ifname = self._gloo_interface()
        log = EventLog(os.path.join(self.run_dir, "events.jsonl"), role="launcher",
                       node_rank=self.args.node_rank, pid=os.getpid())
        _say(f"run dir {self.run_dir}; coordinator {self.store_addr}"
             + (f"; gloo on {self.gloo_ifname}" if self.gloo_ifname else ""))
        for lr in range(self.args.nproc_per_node):
            self.spawn(lr)
        log.run_start(argv=sys.argv, workers={c.wid: c.proc.pid for c in self.children.values()},
                      store=self.store_addr)
        finished_at: Optional[float] = None
        exits: list[tuple[int, int]] = []
        next_view_check = 0.0
        while True:
            if self.stop_signal is not None and self._grace_over():
                self.terminate_all()
                log.run_end(status="interrupted", signal=self.stop_signal)
                return self._stop_status()
            running = [c for c in self.children.values() if c.rc is None]
            for c in running:
                rc = c.proc.poll()
                if rc is None:
                    continue
                c.rc = rc
                exits.append((c.wid, rc))
                if rc == 0:
                    finished_at = finished_at or time.monotonic()
                    continue
                if rc == PREEMPTED_EXIT_CODE:  # it left at a step boundary, announced: no failure
                    _say(f"worker {c.wid} (pid {c.proc.pid}) left the job on SIGTERM (announced to its peers)")
                    continue
                if rc == CONFIG_EXIT_CODE:
                    return self._config_error(log)
                if rc == E.USER_ERROR_EXIT_CODE:
                    return self._user_error(log, c.wid)
                others = any(o.rc is None for o in self.children.values())
                _say(f"worker {c.wid} (pid {c.proc.pid}) {_describe(rc)}"
                     + (" (it lost the coordinator)" if rc == E.MEMBERSHIP_EXIT_CODE else
                        "; survivors carry on" if others else "; no worker of this node is left"))
                if rc != E.MEMBERSHIP_EXIT_CODE:  # it lost the coordinator: nobody to tell
                    self._report(c.wid, _describe(rc))
                if (rc != E.RESTART_EXIT_CODE and finished_at is None and self.replacements_left > 0):
                    self.replacements_left -= 1
                    self.spawn(c.local_rank, c.incarnation + 1)
            running = [c for c in self.children.values() if c.rc is None]
            if not running:
                if self.stop_signal is not None:  # every worker left within the grace
                    log.run_end(status="interrupted", signal=self.stop_signal, exits=[[w, rc] for w, rc in exits])
                    log.close()
                    return self._stop_status()
                break
            now = time.monotonic()
            if now >= next_view_check:
                next_view_check = now + 0.05
                stop = self._watch(running, now)
                if stop is not None:
                    return self._stopped(log, stop)
            if finished_at is not None and now - finished_at > self.args.hang_timeout + 5:
                for c in running:
                    _say(f"worker {c.wid} (pid {c.proc.pid}) still running after the others "
                         "finished; killing it")
                    _kill_group(c.proc.pid)
            time.sleep(_POLL_S)
        status = self._status(exits)
        log.run_end(status=status, exits=[[w, rc] for w, rc in exits])
        log.close()
        return status

    def _config_error(self, log: EventLog) -> int:
        """A worker stopped on a configuration error (``runtime/errors.py``): every worker would
        meet it, so the job stops; each distinct message is said once."""
        # The others usually hit the same error within a second or two: let them say so (a
        # worker that does not stops waiting on the coordinator once the job is torn down).
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(c.proc.poll() is None for c in self.children.values()):
            time.sleep(_POLL_S)
        self.terminate_all()
        by_msg: dict[str, list[int]] = {}
        for wid, msg in read_config_errors(self.run_dir).items():
            by_msg.setdefault(msg, []).append(wid)
        for msg, wids in by_msg.items():
            _say(f"error: worker{'s' if len(wids) > 1 else ''} {','.join(map(str, sorted(wids)))}: {msg}")
        if not by_msg:
            _say("error: a worker stopped on a configuration error")
        log.run_end(status="config_error", errors={str(w): m for m, ws in by_msg.items() for w in ws})
        log.close()
        return 2

    def _stop_status(self) -> int:
        """128 + the signal; a preemption notice (SIGTERM, ``--preempt-signal``): 143."""
        return PREEMPTED_EXIT_CODE if self.stop_signal in self.notice_signals else 128 + self.stop_signal

    def _grace_over(self) -> bool:
        """After a SIGTERM the workers get ``--term-grace`` seconds to leave at a step boundary
        (runtime/preemption.py) before they are ended; after a SIGINT, none."""
        if self.stop_signal not in self.notice_signals:
            return True
        if self._stop_at is None:
            self._stop_at = time.monotonic()
        return time.monotonic() - self._stop_at > self.args.term_grace

    def _status(self, exits: list[tuple[int, int]]) -> int:
        codes = [rc for _, rc in exits]
        if 0 in codes:
            return 0
        if codes and all(rc == PREEMPTED_EXIT_CODE for rc in codes):
            return PREEMPTED_EXIT_CODE  # every worker of this node left on SIGTERM
        if E.RESTART_EXIT_CODE in codes:
            _say("the engine chose checkpoint-restart: rerun the same command to resume "
                 "from the script's checkpoint")
            return E.RESTART_EXIT_CODE
        bad = [rc for rc in codes if rc > 0]
        return bad[0] if bad else 1

    def _report(self, wid: int, reason: str) -> None:
        try:
            self.ops.report_dead(wid, reason)
        except Exception as exc:  # the coordinator may be gone; workers will say so
            _say(f"could not report worker {wid} to the coordinator: {exc}")

    def _user_error(self, log: EventLog, wid: int) -> int:
        """A worker's code raised (``runtime/errors.py``: a bug, not a failure): the job stops on
        every node (the stop record in the coordinator), each distinct traceback is printed once
        with the workers that raised it, and the launcher exits 70."""
        texts = read_user_errors(self.run_dir)
        last = (texts.get(wid) or "").strip().splitlines()
        record = {"worker": wid, "node": self.args.node_rank, "error": last[-1] if last else "an exception"}
        try:
            self.ops.stop_job(record)
        except Exception as exc:  # the coordinator may be gone: this node stops anyway
            _say(f"could not tell the other nodes to stop: {exc}")
        deadline = time.monotonic() + 2.0  # a peer that raised the same error says so too
        while time.monotonic() < deadline and any(c.proc.poll() is None for c in self.children.values()):
            time.sleep(_POLL_S)
        self.terminate_all()
        by_text: dict[str, list[int]] = {}
        for w, text in read_user_errors(self.run_dir).items():
            by_text.setdefault(text, []).append(w)
        for text, wids in by_text.items():
            sys.stderr.write(f"chameleon-ft run: worker{'s' if len(wids) > 1 else ''} "
                             f"{','.join(map(str, sorted(wids)))} raised:\n{text}")
        _say(f"error: worker {wid} raised {record['error']}: an error in the script is a bug, not a "
             "failure to survive, so the job stops on every node (--on-worker-error continue treats it "
             "as a lost worker)")
        log.run_end(status="user_error", worker=wid, error=record["error"])
        log.close()
        return E.USER_ERROR_EXIT_CODE

    def _stopped(self, log: EventLog, stop: dict) -> int:
        """Another node's worker raised: end this node's workers, exit 70."""
        self.terminate_all()
        _say(f"error: the job stopped: worker {stop.get('worker')} (node {stop.get('node')}) raised "
             f"{stop.get('error')}")
        log.run_end(status="user_error", worker=stop.get("worker"), error=stop.get("error"))
        log.close()
        return E.USER_ERROR_EXIT_CODE

    def _watch(self, running: list[_Child], now: float) -> Optional[dict]:
        """Poll the coordinator: the job's stop record (returned), and workers left out of the
        agreed generation for too long (hung: killed)."""
        try:
            polled = self.ops.poll()
        except Exception:
            return None
        if polled.get("stop") is not None:
            return polled["stop"]
        self._evict_hung(running, now, polled.get("latest"))
        return None

    def _evict_hung(self, running: list[_Child], now: float, latest: Optional[dict]) -> None:
        members = set(latest["members"]) if latest else set()
        gen = int(latest.get("generation", -1)) if latest else -1
        self._latest_gen = max(self._latest_gen, gen)
        for c in running:
            if c.wid in members and gen > c.after_gen:  # (not its predecessor's generation)
                c.seen, c.absent_since = True, None
            elif c.seen:
                c.absent_since = c.absent_since or now
                if now - c.absent_since > self.args.hang_timeout + 2:
                    _say(f"worker {c.wid} (pid {c.proc.pid}) left out of the job for "
                         f"{now - c.absent_since:.1f} s (hung?); killing it")
                    c.seen = False
                    _kill_group(c.proc.pid)

    def forward(self, sig: int) -> None:
        """Send ``sig`` to every live worker's process group (safe in a signal handler)."""
        for c in list(self.children.values()):
            if c.rc is None:
                _signal_group(c.proc.pid, sig)
                _signal_group(c.proc.pid, signal.SIGCONT)  # a stopped worker must run to die

    def terminate_all(self) -> None:
        live = [c for c in self.children.values() if c.proc.poll() is None]
        for c in live:
            _signal_group(c.proc.pid, signal.SIGTERM)
            _signal_group(c.proc.pid, signal.SIGCONT)  # a stopped worker must run to die
        deadline = time.monotonic() + 3.0
        for c in live:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(c.proc.pid)
        for c in live:
            try:
                c.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        self.terminate_all()
        if self.ops is not None:
            self.ops.close()
            self.ops = None
        if self.warm is not None:
            self.warm.close()
            self.warm = None


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(pid: int) -> None:
    _signal_group(pid, signal.SIGCONT)
    _signal_group(pid, signal.SIGKILL)


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"


def slurm_job_id() -> Optional[str]:
    """The id ``scontrol requeue`` takes: an array task's ``<array job>_<task>``, else
    ``SLURM_JOB_ID``; None outside SLURM."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return os.environ.get("SLURM_JOB_ID") or None


def requeue_slurm_job() -> bool:
    """``--requeue``: the whole job left on a preemption notice; put it back in SLURM's queue
    (``scontrol requeue``, as Lightning's SLURM auto-requeue does).  Says what it did; False
    when it could not (not under SLURM, no ``scontrol``, or scontrol refused)."""
    job = slurm_job_id()
    if job is None:
        _say("--requeue: not under SLURM (no SLURM_JOB_ID): nothing requeued")
        return False
    try:
        r = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        _say(f"--requeue: scontrol requeue {job} failed: {exc}")
        return False
    if r.returncode != 0:
        _say(f"--requeue: scontrol requeue {job} exited {r.returncode}: {(r.stderr or r.stdout).strip()}")
        return False
    _say(f"every worker left on the preemption notice: job {job} requeued (scontrol requeue); "
         "it resumes from the script's checkpoint")
    return True


def _say(msg: str) -> None:
    print(f"chameleon-ft run: {msg}", file=sys.stderr, flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        # accelerate launch's flags, before ours are checked; the script's own args are not ours
        ours = argv[:len(argv) - len(args.script_args) - 1]
        for key, value in apply_accelerate_flags(args, ours).items():
            os.environ.setdefault(key, value)
        launcher = Launcher(args)
    except LaunchError as exc:
        _say(f"error: {exc}")
        return 2
    previous = {}

    def on_signal(signum, _frame):
        # Forwarded at once (the main loop may be waiting on an unreachable coordinator for a
        # second or two); the loop then ends every worker and exits.
        launcher.stop_signal = signum
        launcher.forward(signal.SIGTERM)

    for sig in (signal.SIGINT, *launcher.notice_signals):
        previous[sig] = signal.signal(sig, on_signal)
    restarts_left = args.max_restarts
    try:
        while True:
            status = launcher.run()
            if status == PREEMPTED_EXIT_CODE and args.requeue and args.node_rank == 0:
                requeue_slurm_job()
            if status != E.RESTART_EXIT_CODE or restarts_left <= 0 or launcher.stop_signal is not None:
                return status
            if launcher.max_nodes > 1:
                _say("--max-restarts relaunches a single node only; exiting for the caller to restart")
                return status
            restarts_left -= 1
            _say(f"checkpoint-restart: relaunching every worker ({restarts_left} restart(s) left)")
            launcher.close()
            args.run_dir = launcher.run_dir  # one event log across restarts
            args.restart_count = args.max_restarts - restarts_left
            launcher = Launcher(args)
    except LaunchError as exc:
        _say(f"error: {exc}")
        return 1
    finally:
        launcher.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
