"""Heavy imports off a job's critical path, one worker of a machine at a time.

A pipeline job's first re-plan imports networkx and scipy.optimize (``engine.migration``); its
first decision took 0.09-0.26 s against 4-6 ms for the next ones, so every worker imports them in
a helper thread once it trains (``EngineBridge._warm_up``).  Each import is most of a second of
one core.  All eight workers of the benchmark job importing at once on two cores made one step
take 2.3-3.4 s (measured 2026-12-03), and a CPU that busy starves heartbeat threads too: in CI, a
stall like it (then in the main threads, see ``engine.calibrate._nnls``) left three live workers
out of a quorum and the job restarted from its checkpoint.  Here the workers of one machine take
turns (an ``flock`` on a file in the temporary folder: waiting for it costs no CPU), so at most one
core is spent on these imports at any time; the price is their CPU spread over the job's first
~8 steps (each 0.2-0.8 s slower on that job) instead of one long step (``docs/runtime-pipeline.md``)."""

from __future__ import annotations

import fcntl
import os
import random
import tempfile
import threading
from typing import Callable

__all__ = ["import_in_turn"]

LOCK_FILE = os.path.join(tempfile.gettempdir(), "chameleon-ft-imports.lock")


def _in_turn(fn: Callable[[], None], lock_file: str) -> None:
    f = None
    try:
        f = open(lock_file, "a")
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file is closed
    except OSError:  # no writable temporary folder: import without taking turns
        if f is not None:
            f.close()
        f = None
    try:
        fn()
    finally:
        if f is not None:
            f.close()


def import_in_turn(fn: Callable[[], None], max_delay_s: float = 0.0,
                   lock_file: str = LOCK_FILE) -> threading.Thread:
    """Run ``fn`` (imports) in a daemon thread after a random delay of up to ``max_delay_s``,
    holding the machine-wide lock; returns the thread (started)."""
    t = threading.Timer(random.uniform(0.0, max_delay_s), _in_turn, args=(fn, lock_file))
    t.daemon = True
    t.start()
    return t
