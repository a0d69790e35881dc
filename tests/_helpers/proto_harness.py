"""Process harness for the membership prototype: a coordinator plus N ``proto_worker``s
(tests/runtime/_workers/proto_worker.py), test-only.

Used by tests/runtime/test_membership.py and by the MTTR measurement::

    python tests/_helpers/proto_harness.py --kills 5 --where inside
    python tests/_helpers/proto_harness.py --kills 5 --where between

Workers run in their own sessions so cleanup can kill each process group by its id; the
harness never kills anything it did not start.  Timings are wall-clock on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from chameleon_ft.runtime.eventlog import read_jsonl
from chameleon_ft.runtime.membership import CoordinatorServer

PROTO_WORKER = Path(__file__).resolve().parents[1] / "runtime" / "_workers" / "proto_worker.py"


class ProtoCluster:
    """A coordinator in this process and ``n`` worker processes; use as a context manager."""

    def __init__(self, workdir: str, n: int = 4, *, steps: int = 200, numel: int = 1024,
                 step_sleep: float = 0.02, op_timeout: float = 10.0,
                 collective_timeout: Optional[float] = None, launcher_watch: bool = False,
                 coordinator_kwargs: Optional[dict] = None, extra_args: tuple = ()):
        self.workdir = Path(workdir)
        self.n = n
        self.args = ["--steps", str(steps), "--numel", str(numel), "--step-sleep",
                     str(step_sleep), "--op-timeout", str(op_timeout), "--min-world", str(n),
                     *extra_args]
        if collective_timeout is not None:
            self.args += ["--collective-timeout", str(collective_timeout)]
        self.coordinator_kwargs = coordinator_kwargs or {}
        self.launcher_watch = launcher_watch
        self.coordinator: Optional[CoordinatorServer] = None
        self.procs: dict[int, subprocess.Popen] = {}
        self._stop = threading.Event()

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> "ProtoCluster":
        self.coordinator = CoordinatorServer(**self.coordinator_kwargs)
        for wid in range(self.n):
            self.spawn(wid)
        if self.launcher_watch:
            threading.Thread(target=self._watch, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    def spawn(self, wid: int, store: Optional[str] = None,
              lighthouse: Optional[str] = None, extra: tuple = ()) -> subprocess.Popen:
        out = open(self.workdir / f"w{wid}.out", "ab")
        cmd = [sys.executable, str(PROTO_WORKER),
               "--worker-id", str(wid), "--log", str(self.log_path(wid)),
               "--store", store or self.coordinator.store_addr,
               "--lighthouse", lighthouse or self.coordinator.lighthouse_addr,
               *self.args, *extra]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.procs[wid] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True, env=env)
        out.close()
        return self.procs[wid]

    def cleanup(self) -> None:
        self._stop.set()
        for p in self.procs.values():
            if p.poll() is None:
                try:  # a SIGSTOPped process must be continued to die promptly
                    os.killpg(p.pid, signal.SIGCONT)
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self.coordinator is not None:
            self.coordinator.shutdown()
            self.coordinator = None

    def _watch(self) -> None:
        """Launcher fast path: report a worker process exit to the coordinator at once."""
        reported: set[int] = set()
        while not self._stop.wait(0.002):
            for wid, p in list(self.procs.items()):
                if wid not in reported and p.poll() is not None and p.returncode != 0:
                    reported.add(wid)
                    if self.coordinator is not None:
                        self.coordinator.report_dead(wid, f"exit code {p.returncode}")

    # ---------------------------------------------------------------- control
    def log_path(self, wid: int) -> Path:
        return self.workdir / f"w{wid}.jsonl"

    def events(self, wid: int) -> list[dict]:
        return read_jsonl(self.log_path(wid))  # a line still being written is skipped

    def steps_done(self, wid: int) -> int:
        return sum(1 for e in self.events(wid) if e["event"] == "step")

    def wait_for(self, pred: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(0.005)

    def kill(self, wid: int, sig: int = signal.SIGKILL) -> float:
        t = time.time()
        os.kill(self.procs[wid].pid, sig)
        return t

    def wait_exit(self, wids, timeout: float) -> dict[int, Optional[int]]:
        deadline = time.monotonic() + timeout
        for wid in wids:
            try:
                self.procs[wid].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return {wid: self.procs[wid].poll() for wid in wids}


def recovery_breakdown(cluster: ProtoCluster, survivors, t_kill: float) -> dict:
    """MTTR phases after a kill at ``t_kill`` (seconds), from the survivors' logs.

    detect: kill -> first survivor's failure event; agree: -> last survivor holding the final
    view; rebuild: -> last survivor's group formed; first_step: kill -> last survivor's first
    completed step (the MTTR).  ``rounds`` counts views agreed on after the kill.
    """
    fails, views, groups, steps, rounds = [], [], [], [], set()
    for wid in survivors:
        ev = [e for e in cluster.events(wid) if e["ts"] >= t_kill]
        # A step in flight at the kill may still complete; recovery starts at the failure.
        t_fail = min(e["ts"] for e in ev if e["event"] == "failure")
        first_step = next(e for e in ev if e["event"] == "step" and e["ts"] > t_fail)
        before = [e for e in ev if e["ts"] <= first_step["ts"]]
        fails.append(t_fail)
        rebuilt = [e for e in before if e["event"] == "rebuilt"][-1]
        views.append(rebuilt["t_view"])
        groups.append(rebuilt["t_group"])
        steps.append(first_step["ts"])
        rounds |= {e["token"] for e in before if e["event"] == "view"}
    detect = min(fails)
    return {"detect": detect - t_kill, "agree": max(views) - detect,
            "rebuild": max(groups) - max(views), "first_step": max(steps) - t_kill,
            "rounds": len(rounds)}


def recovered(cluster: ProtoCluster, wid: int, t: float) -> bool:
    """``wid`` logged a failure after ``t`` and then a completed step."""
    t_fail = None
    for e in cluster.events(wid):
        if e["ts"] < t:
            continue
        if e["event"] == "failure" and t_fail is None:
            t_fail = e["ts"]
        if e["event"] == "step" and t_fail is not None:
            return True
    return False


def measure(where: str, kills: int, launcher_watch: bool = False, seed: int = 0,
            join_timeout_ms: int = 50) -> list[dict]:
    rng = random.Random(seed)
    if where == "inside":  # big tensor, no compute: most of a step is the all-reduce
        kw = dict(numel=2_000_000, step_sleep=0.0)
    else:  # small tensor, 50 ms of emulated compute between collectives
        kw = dict(numel=1024, step_sleep=0.05)
    out = []
    for i in range(kills):
        with tempfile.TemporaryDirectory() as d, ProtoCluster(
                d, 4, steps=100_000, launcher_watch=launcher_watch,
                coordinator_kwargs={"join_timeout_ms": join_timeout_ms}, **kw) as c:
            c.wait_for(lambda: all(c.steps_done(w) >= 10 for w in range(4)), 60, "warm-up")
            time.sleep(rng.uniform(0.0, 0.1))
            victim = rng.randrange(4)
            t_kill = c.kill(victim)
            survivors = [w for w in range(4) if w != victim]
            c.wait_for(lambda: all(recovered(c, w, t_kill) for w in survivors),
                       30, "first step after recovery")
            r = recovery_breakdown(c, survivors, t_kill)
            out.append(r)
            print(f"kill {i} ({where}, victim {victim}): " +
                  ", ".join(f"{k}={v * 1000:.0f}ms" if k != "rounds" else f"{k}={v}"
                            for k, v in r.items()), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="MTTR of the membership/group prototype")
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--where", choices=["inside", "between"], default="inside")
    p.add_argument("--launcher-watch", action="store_true",
                   help="launcher reports child exits to the coordinator (fast path)")
    p.add_argument("--join-timeout-ms", type=int, default=50)
    a = p.parse_args(argv)
    rs = measure(a.where, a.kills, a.launcher_watch, join_timeout_ms=a.join_timeout_ms)
    med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
    print("median: " + ", ".join(f"{k}={v * 1000:.0f}ms" if k != "rounds" else f"{k}={v}"
                                 for k, v in med.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
