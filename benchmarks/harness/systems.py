"""How each system is started on the shared benchmark script, and acted on from outside.

Every system runs ``benchmarks/baselines/*.py`` on ``nproc`` CPU workers; each worker logs
its PID and rank to ``RUN/steps.jsonl`` (``common.StepLog``).  ``Job`` starts the system's
processes in their own sessions, finds a worker's newest PID in that log, signals it, and
kills every process group and every PID it saw at the end, also when the caller fails.

``SYSTEMS`` is the table the matrix iterates over; a new system or variant is one row.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from chameleon_ft.cli.localjob import kill_processes

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "benchmarks" / "baselines"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class System:
    name: str               # row label in the report
    family: str             # chameleon-ft | torchrun-restart | torchft | lightning-ddp
    variant: str            # "adaptive", "policy=reroute", "as shipped", "workaround: ..."
    start: Callable[["Job"], None]
    note: str = ""
    # How the system brings a new worker for a dead rank (None: it cannot, or does it itself).
    replace: Optional[Callable[["Job", int], None]] = None


class Job:
    """One run of one system: its processes, its run directory, its progress log."""

    def __init__(self, run_dir: Path, nproc: int, steps: int, mb_sleep: float, *, replace: bool = False,
                 env: Optional[dict] = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.nproc, self.steps, self.mb_sleep = nproc, steps, mb_sleep
        self.replace = replace                    # the scenario expects a replacement worker
        self.extra_env = dict(env or {})          # the scenario's (BENCH_SLOW)
        self.procs: list[subprocess.Popen] = []   # launchers / workers we started directly
        self.main: list[subprocess.Popen] = []    # the ones whose exit ends the run
        self.seen_pids: set[int] = set()
        self.stopped: set[int] = set()            # PIDs we SIGSTOPped: a hung process never exits
        self.spawners: dict[int, Callable[[], subprocess.Popen]] = {}  # rank -> restart it (torchft)

    # ------------------------------------------------------------------ processes
    def env(self, **extra) -> dict:
        # CHAMELEON_FT_LOG_SAMPLES: every step's sample ids in the event log (samples lost / duplicated)
        return dict(os.environ, BENCH_OUT=str(self.run_dir), OMP_NUM_THREADS="1", CHAMELEON_FT_LOG_SAMPLES="1",
                    PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                    **{k: str(v) for k, v in {**self.extra_env, **extra}.items()})

    def spawn(self, cmd: list[str], env: dict, name: str, main: bool = True) -> subprocess.Popen:
        out = open(self.run_dir / f"{name}.out", "wb")
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                             cwd=str(ROOT))
        out.close()
        self.procs.append(p)
        if main:
            self.main.append(p)
        return p

    def script_args(self) -> list[str]:
        return ["--steps", str(self.steps), "--mb-sleep", str(self.mb_sleep)]

    def wait(self, timeout: float) -> Optional[list[int]]:
        """Exit codes of the main processes, or None when they did not all end in time.  A
        process we stopped ourselves (a hung TorchFT replica group) is not waited for."""
        deadline = time.monotonic() + timeout
        codes = []
        for p in list(self.main):
            if p.pid in self.stopped:
                continue
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                return None
        return codes

    def running(self) -> bool:
        return any(p.poll() is None for p in self.main)

    def cleanup(self) -> None:
        """SIGCONT then SIGKILL every process group we started, every worker PID logged, and
        every descendant of the launchers (torchrun starts its workers in their own sessions,
        and a hung restarted round never logs its PIDs)."""
        self.records()
        pids = {p.pid for p in self.procs} | self.seen_pids
        kill_processes(pids | _descendants({p.pid for p in self.procs}), self.procs)

    def output(self) -> str:
        return "".join(f"--- {f.name}\n" + f.read_text(errors="replace")[-3000:]
                       for f in sorted(self.run_dir.glob("*.out")))

    # ------------------------------------------------------------------ progress log
    def records(self) -> list[dict]:
        path = self.run_dir / "steps.jsonl"
        if not path.exists():
            return []
        recs = []
        for line in path.read_bytes().split(b"\n")[:-1]:
            try:
                recs.append(json.loads(line))
            except ValueError:
                continue
        self.seen_pids |= {r["pid"] for r in recs if "pid" in r}
        return recs

    def worker_pid(self, rank: int) -> int:
        starts = [r for r in self.records() if r["kind"] == "start" and r.get("rank") == rank]
        return max(starts, key=lambda r: (r.get("restart", 0), r["ts"]))["pid"]

    def wait_step(self, step: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(r["kind"] == "step" and r["step"] >= step for r in self.records()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no step {step} after {timeout} s")
            if not self.running():
                raise RuntimeError(f"the job ended before step {step}:\n{self.output()}")
            time.sleep(0.005)

    def signal(self, rank: int, sig: int) -> float:
        pid = self.worker_pid(rank)
        if sig == signal.SIGSTOP:
            self.stopped.add(pid)
        t = time.time()
        os.kill(pid, sig)
        return t

    def wait_exit(self, rank: int, timeout: float = 10) -> None:
        """Until the newest process of ``rank`` is gone (a SIGKILL is asynchronous)."""
        pid, deadline = self.worker_pid(rank), time.monotonic() + timeout
        for p in self.main:
            if p.pid == pid:
                p.wait(timeout=timeout)
                return
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
            time.sleep(0.01)


# ---------------------------------------------------------------------- launchers
def _torchrun(job: Job, script: str, extra: list[str], torchrun_args: list[str], env: dict) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(job.nproc),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", *torchrun_args,
           str(BASE / script), *job.script_args(), *extra]
    job.spawn(cmd, env, "torchrun")


def start_chameleon(policy: Optional[str] = None) -> Callable[[Job], None]:
    def start(job: Job) -> None:
        extra = ["--policy", policy] if policy else []
        launch = ["--max-replacements", "1"] if job.replace else []
        if policy == "restart":  # checkpoint-restart: the launcher relaunches, the script resumes
            launch += ["--max-restarts", "3"]
            extra += ["--ckpt", str(job.run_dir / "ckpt.pt"), "--ckpt-every", "10"]
        cmd = [sys.executable, "-m", "chameleon_ft.cli.launch", "--nproc-per-node", str(job.nproc),
               "--run-dir", str(job.run_dir), "--hang-timeout", "5", *launch, str(BASE / "chameleon.py"),
               *job.script_args(), *extra]
        job.spawn(cmd, job.env(), "launcher")
    return start


def start_torchrun_restart(workaround: bool) -> Callable[[Job], None]:
    def start(job: Job) -> None:
        env = job.env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) if workaround else job.env()
        _torchrun(job, "ddp_restart.py", ["--ckpt", str(job.run_dir / "ckpt.pt"), "--ckpt-every", "10"],
                  ["--max-restarts", "3"], env)
    return start


def start_lightning(job: Job) -> None:
    _torchrun(job, "lightning_ddp.py", [], [], job.env())


TORCHFT_VENV = ROOT / "benchmarks" / ".venv-torchft"


def torchft_bin(name: str = "python") -> str:
    """``name`` from ``benchmarks/.venv-torchft`` (the newest torchft, ``matrix.py --setup-torchft``)
    when it exists, else this interpreter / the installed ``torchft_lighthouse`` (0.2.x, which the
    package itself uses)."""
    venv = TORCHFT_VENV / "bin" / name
    if venv.exists():
        return str(venv)
    return sys.executable if name == "python" else name


def torchft_version() -> str:
    out = subprocess.run([torchft_bin(), "-c", "import importlib.metadata as m\nfor d in ('torchft-nightly', "
                          "'torchft'):\n  try: print(d, m.version(d)); break\n  except m.PackageNotFoundError: pass"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or "torchft: not installed"


# Lighthouse options per variant: torchft's README / train_ddp.py example (min_replicas 1, join
# timeout 10 s, default 5 s heartbeat timeout) and tight ones for fast recovery (tuned).
LIGHTHOUSE = {
    "shipped": ["--quorum_tick_ms", "100", "--join_timeout_ms", "10000"],
    "workaround": ["--quorum_tick_ms", "100", "--join_timeout_ms", "10000"],
    "tuned": ["--quorum_tick_ms", "10", "--join_timeout_ms", "300", "--heartbeat_timeout_ms", "300"],
}


def start_torchft(variant: str) -> Callable[[Job], None]:
    def start(job: Job) -> None:
        port = free_port()
        job.spawn([torchft_bin("torchft_lighthouse"), "--min_replicas", "1", *LIGHTHOUSE[variant],
                   "--bind", f"[::]:{port}"], job.env(), "lighthouse", main=False)
        time.sleep(0.5)
        for g in range(job.nproc):
            def spawn(g=g, n=[0]):
                env = job.env(TORCHFT_LIGHTHOUSE=f"http://localhost:{port}", REPLICA_GROUP_ID=g,
                              NUM_REPLICA_GROUPS=job.nproc, RANK=0, WORLD_SIZE=1, LOCAL_RANK=0,
                              MASTER_ADDR="localhost", MASTER_PORT=free_port())
                n[0] += 1
                return job.spawn([torchft_bin(), str(BASE / "torchft_ddp.py"), *job.script_args(),
                                  "--variant", variant], env, f"group{g}" + (f"-{n[0] - 1}" if n[0] > 1 else ""))
            job.spawners[g] = spawn
            spawn()
    return start


def replace_torchft(job: Job, rank: int) -> None:
    """What torchft's supervisor (torchx / a scheduler) does: start the replica group again; the
    new group joins the next quorum and recovers the model from a live peer."""
    job.spawners[rank]()


SYSTEMS: dict[str, System] = {s.name: s for s in [
    System("chameleon-ft", "chameleon-ft", "adaptive", start_chameleon()),
    *[System(f"chameleon-ft[{p}]", "chameleon-ft", f"policy fixed: {p}", start_chameleon(p),
             "restart: --max-restarts 3, checkpoint every 10 steps" if p == "restart" else "")
      for p in ("reroute", "replan", "shrink", "restart")],
    System("torchrun-restart", "torchrun-restart", "as shipped", start_torchrun_restart(False),
           "torchrun --max-restarts 3, checkpoint every 10 steps"),
    System("torchrun-restart+fix", "torchrun-restart", "workaround: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
           start_torchrun_restart(True), "torchrun --max-restarts 3, checkpoint every 10 steps"),
    System("torchft", "torchft", "as shipped: torchft DDP, default timeouts", start_torchft("shipped"),
           replace=replace_torchft),
    System("torchft+fix", "torchft", "workaround: manager.allreduce of grads, example timeouts (5 s / 30 s)",
           start_torchft("workaround"), replace=replace_torchft),
    System("torchft-tuned", "torchft", "workaround + tight timeouts: Lighthouse heartbeat 300 ms, join 300 ms, "
           "quorum tick 10 ms; Manager heartbeat 50 ms; process group / Manager 2 s", start_torchft("tuned"),
           replace=replace_torchft),
    System("lightning-ddp", "lightning-ddp", "as shipped (no fault tolerance)", start_lightning),
]}


def _descendants(roots: set[int]) -> set[int]:
    """Every live process below ``roots`` (from /proc; empty where /proc is missing)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out

