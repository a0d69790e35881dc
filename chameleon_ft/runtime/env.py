"""The environment contract between ``chameleon-ft run`` (the launcher) and a worker.

The launcher sets these variables for every worker process; ``WorkerEnv.from_env()`` reads
and checks them.  torchrun's names (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``NODE_RANK``) keep their meaning *at launch*; after a failure the live
membership comes from the coordinator, not from these.  See docs/runtime.md for the table.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Mapping, Optional

__all__ = ["WorkerEnv", "EnvError", "process_age_s", "startup_s", "PRELOAD_S", "RESTART_EXIT_CODE", "MEMBERSHIP_EXIT_CODE",
           "USER_ERROR_EXIT_CODE", "ON_ERROR",
           "STORE", "LIGHTHOUSE", "WORKER_ID", "RUN_DIR", "FAULTS", "REPLACEMENT",
           "HANG_TIMEOUT", "MIN_WORLD", "MAX_REPLACEMENTS", "MTTF", "BEAT_TIMEOUT", "CUT_OFF", "QUORUM_WAIT",
           "JOB_TOKEN"]

STORE = "CHAMELEON_FT_STORE"                # host:port of the coordinator's TCPStore
LIGHTHOUSE = "CHAMELEON_FT_LIGHTHOUSE"      # http://host:port of the coordinator's Lighthouse
WORKER_ID = "CHAMELEON_FT_WORKER_ID"        # stable id of this slot (a replacement reuses it)
RUN_DIR = "CHAMELEON_FT_RUN_DIR"            # where events.jsonl (and worker files) go
FAULTS = "CHAMELEON_FT_FAULTS"              # fault-injection spec, see runtime/faults.py
REPLACEMENT = "CHAMELEON_FT_REPLACEMENT"     # 0 for an original worker, n for its n-th replacement
HANG_TIMEOUT = "CHAMELEON_FT_HANG_TIMEOUT"   # watchdog on every collective, seconds
MIN_WORLD = "CHAMELEON_FT_MIN_WORLD"        # members needed before the first step
MAX_REPLACEMENTS = "CHAMELEON_FT_MAX_REPLACEMENTS"  # replacement budget of this worker's launcher
MTTF = "CHAMELEON_FT_MTTF"                  # fixed D for the engine, seconds (--mttf); unset: estimated
BEAT_TIMEOUT = "CHAMELEON_FT_HEARTBEAT_TIMEOUT"  # a member silent this long is lost (s; 0: off)
CUT_OFF = "CHAMELEON_FT_CUT_OFF"            # no answer from the coordinator this long: stop (s; 0: off)
QUORUM_WAIT = "CHAMELEON_FT_QUORUM_WAIT"    # etcd without a quorum: paused this long at most (s)
JOB_TOKEN = "CHAMELEON_FT_JOB_TOKEN"        # the job's shared secret (runtime/coordination.py)
ETCD_CACERT = "CHAMELEON_FT_ETCD_CACERT"    # etcd over TLS: the CA that signed its members' certificates
ETCD_CERT = "CHAMELEON_FT_ETCD_CERT"        # ... this client's certificate (etcd --client-cert-auth)
ETCD_KEY = "CHAMELEON_FT_ETCD_KEY"          # ... and its private key
ETCD_USER = "CHAMELEON_FT_ETCD_USER"        # etcd's user/role authentication: the user ...
ETCD_PASSWORD = "CHAMELEON_FT_ETCD_PASSWORD"  # ... and its password (never on a command line)
PRELOAD_S = "CHAMELEON_FT_PRELOAD_S"        # warm start: seconds the template spent importing
                                            # what this worker inherited (cli/warmstart.py)

# A worker exits with this code when the engine chose checkpoint-restart (EX_TEMPFAIL).
RESTART_EXIT_CODE = 75
# ... and with this one when the coordinator is gone or no quorum formed.
MEMBERSHIP_EXIT_CODE = 3
# ... and with this one when the user's code raised (a bug, not a failure to survive: the
# launcher stops the job; sysexits' EX_SOFTWARE).
USER_ERROR_EXIT_CODE = 70
LOG_SAMPLES = "CHAMELEON_FT_LOG_SAMPLES"    # 1: every step's sample ids in the event log (ElasticConfig.log_samples)
ON_ERROR = "CHAMELEON_FT_ON_WORKER_ERROR"   # stop (default) | continue: what a user-code exception means


class EnvError(RuntimeError):
    """The process was not started by ``chameleon-ft run`` (or a variable is malformed)."""


@dataclass(frozen=True)
class WorkerEnv:
    store: str
    lighthouse: str
    worker_id: int
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    run_dir: Optional[str] = None
    faults: str = ""
    replacement: int = 0
    hang_timeout_s: float = 10.0
    min_world_size: int = 1
    max_replacements: int = 0
    mttf_s: Optional[float] = None
    heartbeat_timeout_s: Optional[float] = 1.0
    cut_off_s: Optional[float] = 3.0
    quorum_wait_s: float = 60.0

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "WorkerEnv":
        env = os.environ if env is None else env
        missing = [k for k in (STORE, LIGHTHOUSE, WORKER_ID) if not env.get(k)]
        if missing:
            raise EnvError(f"{', '.join(missing)} not set: start this script with "
                           "`chameleon-ft run [flags] script.py` (python -m chameleon_ft.cli.launch)")

        def num(name: str, default, kind=int):
            raw = env.get(name)
            if raw in (None, ""):
                return default
            try:
                return kind(raw)
            except ValueError:
                raise EnvError(f"{name}={raw!r} is not a valid {kind.__name__}") from None

        wid = num(WORKER_ID, 0)
        mttf = num(MTTF, None, float)
        if mttf is not None and not mttf > 0:
            raise EnvError(f"{MTTF}={mttf!r} must be a positive number of seconds")
        world = num("WORLD_SIZE", 1)
        local_world = num("LOCAL_WORLD_SIZE", world)
        return cls(
            store=env[STORE], lighthouse=env[LIGHTHOUSE], worker_id=wid,
            rank=num("RANK", wid), local_rank=num("LOCAL_RANK", wid % max(local_world, 1)),
            world_size=world, local_world_size=local_world,
            node_rank=num("NODE_RANK", wid // max(local_world, 1)),
            run_dir=env.get(RUN_DIR) or None, faults=env.get(FAULTS, ""),
            replacement=num(REPLACEMENT, 0), hang_timeout_s=num(HANG_TIMEOUT, 10.0, float),
            min_world_size=num(MIN_WORLD, 1), max_replacements=num(MAX_REPLACEMENTS, 0),
            mttf_s=mttf, heartbeat_timeout_s=num(BEAT_TIMEOUT, 1.0, float) or None,
            cut_off_s=num(CUT_OFF, 3.0, float) or None, quorum_wait_s=num(QUORUM_WAIT, 60.0, float))


def process_age_s() -> Optional[float]:
    """Seconds since this process started (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return max(0.0, time.time() - (boot + ticks / os.sysconf("SC_CLK_TCK")))
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def startup_s(env: Optional[Mapping[str, str]] = None) -> Optional[float]:
    """How long this worker took to get here, as a fresh interpreter would have: its own age
    plus, when it was forked from a warm-start template, the imports it inherited (a
    replacement starts as a fresh interpreter and pays them again)."""
    age = process_age_s()
    if age is None:
        return None
    env = os.environ if env is None else env
    try:
        return age + max(0.0, float(env.get(PRELOAD_S) or 0.0))
    except ValueError:
        return age
