"""``runtime.imports.import_in_turn``: the workers of one machine import in turn (a file lock)."""

from __future__ import annotations

import subprocess
import sys
import time

PROBE = """
import sys, time
from chameleon_ft.runtime.imports import import_in_turn
def work():
    t0 = time.time(); time.sleep(0.3); print(t0, time.time(), flush=True)
import_in_turn(work, max_delay_s=0.0, lock_file=sys.argv[1]).join(10)
"""


def test_processes_take_turns(tmp_path):
    lock = str(tmp_path / "imports.lock")
    procs = [subprocess.Popen([sys.executable, "-c", PROBE, lock], stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    spans = sorted(tuple(map(float, p.communicate(timeout=30)[0].split())) for p in procs)
    assert len(spans) == 3 and all(p.returncode == 0 for p in procs)
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert start >= end - 0.01, f"overlapping imports: {spans}"  # one at a time


def test_an_unusable_lock_file_does_not_stop_the_import(tmp_path):
    from chameleon_ft.runtime.imports import import_in_turn

    done = []
    t = import_in_turn(lambda: done.append(time.time()), max_delay_s=0.0,
                       lock_file=str(tmp_path / "missing-folder" / "imports.lock"))
    t.join(5)
    assert done
