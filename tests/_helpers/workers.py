"""Start a test's own worker scripts as separate processes (each in its own session, the
package on their path) and collect what they printed, killing whatever is left."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from chameleon_ft.cli.localjob import kill_processes

ROOT = Path(__file__).resolve().parents[2]


def run_workers(script: Path, argv_per_worker: Sequence[Sequence[str]], timeout_s: float = 60.0):
    """Run ``python script *argv`` once per entry at the same time; returns (processes, outputs)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    procs = [subprocess.Popen([sys.executable, str(script), *argv], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for argv in argv_per_worker]
    try:
        outs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        kill_processes([p.pid for p in procs], procs)
    return procs, outs
