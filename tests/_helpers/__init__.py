"""Helpers shared by the real-process tests (tests/lightning, tests/accelerate, tests/runtime)
and their worker scripts.  Import them as ``_helpers`` with ``tests/`` on ``sys.path``."""
