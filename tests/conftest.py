"""Root conftest: puts the repository root (for ``tests.fidelity.trials``) and ``tests/`` (for the
shared ``_helpers``) on ``sys.path`` once, instead of a ``sys.path.insert`` in each test file.

Scripts that run as separate processes (``tests/*/_workers/*.py``, ``tests/fidelity/trials.py``
run as a CLI) do not see this file, so they keep their own inserts."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

for _p in (str(ROOT), str(TESTS)):
    if _p not in sys.path:
        sys.path.insert(0, _p)
