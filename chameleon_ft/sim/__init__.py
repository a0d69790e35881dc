"""Simulation over the engine: weeks of training under failures with every policy
(``simulator``), and replay of a measured failure trace (``trace``).  Imports the engine, never
the runtime.  The simulator's names are served here too (``from chameleon_ft.sim import
simulate, PRESETS``), as before this became a package."""

from __future__ import annotations

import importlib


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    simulator = importlib.import_module("chameleon_ft.sim.simulator")
    try:
        return getattr(simulator, name)
    except AttributeError:
        raise AttributeError(f"module 'chameleon_ft.sim' has no attribute {name!r}") from None
