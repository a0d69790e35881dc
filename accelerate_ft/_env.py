"""The launcher's environment as this worker saw it at import time.

``chameleon-ft run`` sets torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` ...)
with their meaning *at launch*.  Accelerate reads them when an ``Accelerator`` is built and
then creates a default process group: a fixed world that cannot survive a death (and that
would wait for a ``MASTER_ADDR`` nobody serves).  So when ``accelerate_ft`` is imported in a
process that ``chameleon-ft run`` started, it records the launch environment and removes
torchrun's variables from ``os.environ``; the live membership comes from the coordinator.
Processes started otherwise (``accelerate launch``, torchrun, plain python) are left alone.
"""

from __future__ import annotations

import os
from typing import Optional

from chameleon_ft.runtime.env import WORKER_ID, WorkerEnv

_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
                  "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT")
_captured: Optional[WorkerEnv] = None


def capture() -> Optional[WorkerEnv]:
    """Record the launch environment and hide torchrun's variables (see module doc)."""
    global _captured
    if _captured is None and os.environ.get(WORKER_ID):
        _captured = WorkerEnv.from_env()
        for k in _TORCHRUN_VARS:
            os.environ.pop(k, None)
    return _captured


def launch_env() -> Optional[WorkerEnv]:
    """The worker's ``chameleon-ft run`` environment, or None under any other launcher."""
    return capture()


def other_launcher() -> bool:
    """Started by another multi-process launcher (accelerate launch, torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 or "LOCAL_RANK" in os.environ
