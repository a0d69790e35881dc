"""Root conftest: puts the repository root (for ``tests.fidelity.trials``) and ``tests/`` (for the
shared ``_helpers``) on ``sys.path`` once, instead of a ``sys.path.insert`` in each test file.

Scripts that run as separate processes (``tests/*/_workers/*.py``, ``tests/fidelity/trials.py``
run as a CLI) do not see this file, so they keep their own inserts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

for _p in (str(ROOT), str(TESTS)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# Every worker the tests start logs its sample ids per step: the exactly-once checks read them.
os.environ.setdefault("CHAMELEON_FT_LOG_SAMPLES", "1")


def pytest_sessionstart(session) -> None:
    """Compile the repository's packages to ``__pycache__`` once.  The real-process tests
    start a few hundred worker interpreters, each importing these packages; where
    ``PYTHONDONTWRITEBYTECODE`` is set (this project's machines set it) none of them would
    write a cache, so each one compiled every module from source again (about half a second
    of CPU per worker on 2 cores).  ``compileall`` writes the cache regardless of that
    variable; an interpreter only reads it, so behaviour is unchanged."""
    import compileall

    for pkg in ("chameleon_ft", "lightning_ft", "accelerate_ft", "transformers_ft", "benchmarks", "recipes", "tests"):
        if (ROOT / pkg).is_dir():
            compileall.compile_dir(str(ROOT / pkg), quiet=1, workers=1)


def pytest_collection_modifyitems(session, config, items) -> None:
    """The longest files first (``tests/file_seconds.json``, from a run's ``--durations``),
    in a stable order: pytest-xdist (``--dist loadfile --no-loadscope-reorder``) hands the
    files out in this order as its workers free up, so the short files fill the end and the
    two workers end together instead of one running a long file alone.  Every worker computes
    the same order (xdist requires it)."""
    path = TESTS / "file_seconds.json"
    if not path.exists():
        return
    import json

    seconds = json.loads(path.read_text())
    rank = {f: -s for f, s in seconds.items()}
    items[:] = [it for _, it in sorted(enumerate(items), key=lambda p: (rank.get(p[1].nodeid.split("::")[0], 0.0), p[0]))]


_LOCKS: list = []  # this xdist worker's open gate and lock files (flock holds per open file)


def _lock_files():
    """The run's gate and lock files, opened once per worker; None outside pytest-xdist."""
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not uid:
        return None
    if not _LOCKS:
        import tempfile

        base = os.path.join(tempfile.gettempdir(), f"cft-pytest-{uid}")
        _LOCKS.extend([open(base + ".gate", "a+"), open(base + ".lock", "a+")])
    return _LOCKS


def _take(mode: int) -> None:
    """Take the lock in ``mode`` through the turnstile: a waiting exclusive taker holds the
    gate, so no new shared taker passes it and the exclusive one is not starved."""
    import fcntl

    gate, lock = _LOCKS
    fcntl.flock(gate, fcntl.LOCK_EX)
    try:
        fcntl.flock(lock, mode)
    finally:
        fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist (the default run takes two files at a time), every test holds a
    shared lock from its set-up to its teardown; a test marked ``serial`` turns it into the
    exclusive lock for its call (``pytest_runtest_call``), so that its timing does not meet a
    neighbour's load (a 3-member etcd cluster that loses a member elects a new leader within
    the workers' 3 s quorum wait on this machine, but not always beside another job).  Its
    set-up and teardown (namespaces, an etcd cluster, a reference run in a fixture) run beside
    other tests.  Taken before pytest-timeout starts its clock (``tryfirst``)."""
    if _lock_files() is None:
        yield
        return
    import fcntl

    _take(fcntl.LOCK_SH)
    try:
        yield
    finally:
        fcntl.flock(_LOCKS[1], fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_call(item):
    """A ``serial`` test's call alone: its shared lock given up, the exclusive one taken (the
    shared one is released first, so that two ``serial`` tests cannot wait on each other), and
    the shared one taken again for its teardown."""
    if _lock_files() is None or item.get_closest_marker("serial") is None:
        yield
        return
    import fcntl

    fcntl.flock(_LOCKS[1], fcntl.LOCK_UN)
    _take(fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(_LOCKS[1], fcntl.LOCK_UN)
        _take(fcntl.LOCK_SH)


@pytest.fixture(autouse=True)
def _no_exec_of_the_test_process(monkeypatch):
    """The adapters turn ``python train.py`` into ``chameleon-ft run`` by exec (issue 26).  Done
    in the pytest process by mistake, it replaces pytest with a launcher that keeps
    pytest-timeout's pending SIGALRM and dies of it ("Alarm clock"), ending the whole run with
    no report: refuse it here so that the test that did it fails by name."""
    import os

    def refuse(path, argv, env=None):
        raise AssertionError(f"a test tried to exec the pytest process into {argv[:6]}...; "
                             "set CHAMELEON_FT_NO_RELAUNCH=1 or patch os.execve in that test")

    monkeypatch.setattr(os, "execve", refuse)
    monkeypatch.setattr(os, "execv", refuse)
