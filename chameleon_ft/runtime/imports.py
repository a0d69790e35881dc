"""Heavy imports off a job's critical path, one worker of a machine at a time.

A pipeline job's first re-plan imports networkx and scipy.optimize (``engine.migration``); its
first decision took 0.09-0.26 s against 4-6 ms for the next ones, so every worker imports them in
a helper thread once it trains (``EngineBridge._warm_up``).  Each import is most of a second of
one core.  Eight workers importing within the same two seconds on two cores starved every
worker's heartbeat thread for seconds: seen in CI, a 4 s stall at step 3 of an 8-worker pipeline
job, three live workers left out of the next quorum, and the job restarted from its checkpoint.
Here the workers of one machine take turns (an ``flock`` on a file in the temporary folder:
waiting for it costs no CPU), so at most one core is spent on imports at any time."""

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
    try:
        with open(lock_file, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file is closed
            fn()
    except OSError:  # no writable temporary folder: import without taking turns
        fn()


def import_in_turn(fn: Callable[[], None], max_delay_s: float = 2.0,
                   lock_file: str = LOCK_FILE) -> threading.Thread:
    """Run ``fn`` (imports) in a daemon thread after a random delay of up to ``max_delay_s``,
    holding the machine-wide lock; returns the thread (started)."""
    t = threading.Timer(random.uniform(0.0, max_delay_s), _in_turn, args=(fn, lock_file))
    t.daemon = True
    t.start()
    return t
