"""``LocalJob``: start a ``chameleon-ft run`` job on this machine and act on it from outside.

The demo, the benchmarks and the real-process tests share it: start the launcher in its own
process group, read the run's event log (workers log their PID in ``run_start``), wait for a
step, kill a worker by PID with a real signal, and clean every process up by PID — also when
the caller fails half-way.

Limits: one node (the launcher runs here); a worker's PID is known only once it logged its
``run_start``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from chameleon_ft.runtime.eventlog import EventTail, committed_attempts


def kill_processes(pids, popens=(), wait_s: float = 10.0) -> None:
    """SIGCONT then SIGKILL each PID's process group and the PID itself (a stopped process
    would not die until continued), then reap ``popens``.  Gone processes are skipped."""
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
    for p in popens:
        try:
            p.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            pass


class LocalJob:
    def __init__(self, run_dir: str | Path, script: str | Path, script_args: Sequence[str] = (), *,
                 nproc: int = 4, hang_timeout: float = 5.0, max_replacements: int = 0,
                 launch_args: Sequence[str] = (), env: Optional[dict] = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cmd_tail = ["--run-dir", str(self.run_dir), "--hang-timeout", str(hang_timeout),
                         "--max-replacements", str(max_replacements), *launch_args,
                         str(script), *script_args]
        self.nproc = nproc
        self.env = dict(os.environ, **(env or {}))
        self.launchers: list[subprocess.Popen] = []
        self._log = EventTail(self.run_dir / "events.jsonl")

    # ---------------------------------------------------------------- processes
    def command(self, nproc: Optional[int] = None, extra: Sequence[str] = ()) -> list[str]:
        return [sys.executable, "-m", "chameleon_ft.cli.launch", "--nproc-per-node",
                str(nproc or self.nproc), *extra, *self.cmd_tail]

    def start(self, nproc: Optional[int] = None, extra: Sequence[str] = (),
              wrap: Sequence[str] = ()) -> subprocess.Popen:
        """Start one launcher (``extra``: its own flags, e.g. ``--node-rank``; ``wrap``: a
        command prefix, e.g. ``ip netns exec NS`` to run it inside a network namespace)."""
        out = open(self.run_dir / f"launcher{len(self.launchers)}.out", "wb")
        p = subprocess.Popen([*wrap, *self.command(nproc, extra)], stdout=out, stderr=subprocess.STDOUT,
                             env=self.env, start_new_session=True)
        out.close()
        self.launchers.append(p)
        return p

    def wait(self, timeout: float = 60.0) -> list[int]:
        deadline = time.monotonic() + timeout
        return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in self.launchers]

    def running(self) -> bool:
        return any(p.poll() is None for p in self.launchers)

    def output(self) -> str:
        return "".join(f.read_text(errors="replace") for f in sorted(self.run_dir.glob("launcher*.out")))

    def cleanup(self) -> None:
        """Kill the launchers' and every worker's process group (SIGCONT first: a stopped
        process would not die until continued)."""
        kill_processes({p.pid for p in self.launchers} | set(self.worker_pids().values()), self.launchers)

    def __enter__(self) -> "LocalJob":
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    # ---------------------------------------------------------------- the run
    def events(self) -> list[dict]:
        return self._log.read()

    def worker_pids(self) -> dict[tuple[int, int], int]:
        """(worker id, replacement number) -> pid, for every worker that started."""
        return {(e["worker"], e.get("replacement", 0)): e["pid"] for e in self.events()
                if e["event"] == "run_start" and "worker" in e and "pid" in e}

    def pid(self, wid: int, timeout: float = 30.0) -> int:
        """PID of the newest process in worker slot ``wid``, waiting up to ``timeout`` for a
        worker that has not joined yet (on a loaded machine one worker can start so late that
        the others form a generation and train without it first)."""
        def started(evs) -> bool:
            return any(e["event"] == "run_start" and e.get("worker") == wid and "pid" in e for e in evs)
        self.wait_for(started, timeout, f"worker {wid} to start")
        return max((r, pid) for (w, r), pid in self.worker_pids().items() if w == wid)[1]

    def wait_for(self, pred: Callable[[list[dict]], bool], timeout: float, what: str) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            evs = self.events()
            if pred(evs):
                return evs
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout} s waiting for {what}; the launchers' output "
                                   f"ends:\n{self.output()[-3000:]}")
            if not self.running():
                raise RuntimeError(f"the job ended while waiting for {what}:\n{self.output()[-2000:]}")
            time.sleep(0.002)

    def wait_step(self, step: int, timeout: float = 120.0) -> None:
        """Until some worker attempts global step ``step`` (its record precedes the all-reduce)."""
        self.wait_for(lambda evs: any(e["event"] == "step" and e["step"] >= step for e in evs),
                      timeout, f"step {step}")

    def kill(self, wid: int, sig: int = signal.SIGKILL) -> float:
        """Send ``sig`` to worker ``wid`` from outside; returns the wall-clock time it was sent."""
        pid = self.pid(wid)
        t = time.time()
        os.kill(pid, sig)
        return t

    def drive(self, kill: Optional[int], at_step: int, timeout: float,
              on_tick: Optional[Callable[[int, dict], None]] = None,
              on_kill: Optional[Callable[[int, int, int], None]] = None,
              sig: int = signal.SIGKILL) -> Optional[int]:
        """Start the launcher, send ``sig`` to worker ``kill`` by PID (from outside) once
        ``at_step`` steps are committed, and wait for the launcher to end.  ``on_tick(done,
        pids)`` is called every poll, ``on_kill(worker, pid, done)`` once after the kill.
        Returns the launcher's exit code, or None after ``timeout`` seconds.  The caller
        still calls ``cleanup``."""
        launcher = self.start()
        deadline = time.monotonic() + timeout
        killed = kill is None or kill < 0
        while launcher.poll() is None:
            if time.monotonic() > deadline:
                return None
            pids = {w: pid for (w, _), pid in self.worker_pids().items()}
            # The newest committed step may still be running on some worker.
            done = max(0, len(committed_attempts(self.events())) - 1)
            if on_tick is not None:
                on_tick(done, pids)
            if not killed and done >= at_step and kill in pids:
                os.kill(pids[kill], sig)
                killed = True
                if on_kill is not None:
                    on_kill(kill, pids[kill], done)
            time.sleep(0.05)
        return launcher.returncode
