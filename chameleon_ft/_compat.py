"""Old import paths, kept working: modules that moved when the tree took the shape of its
layers (engine / sim / runtime / executors / cli, 2026-12) and names that were renamed.

A script written against ``chameleon_ft.selector`` or ``chameleon_ft.runtime.worker`` still
imports (and ``python -m chameleon_ft.launch`` still runs): the old name is the new module,
the same object, and a ``ChameleonFTDeprecationWarning`` says where it lives now.  The warning
is a ``FutureWarning`` so that Python shows it to users by default (a plain
``DeprecationWarning`` raised inside a library is hidden).  Nothing here is used by the package
itself.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

__all__ = ["ChameleonFTDeprecationWarning", "MOVED_MODULES", "install", "renamed_getattr"]


class ChameleonFTDeprecationWarning(FutureWarning):
    """An old import path or name of chameleon-ft; it still works, and says what replaces it."""


#: old module -> the module it is now (the same object under both names), or a tuple of the
#: modules whose names a removed re-export module served.
MOVED_MODULES = {
    "chameleon_ft.workload": "chameleon_ft.engine.workload",
    "chameleon_ft.cluster": "chameleon_ft.engine.cluster",
    "chameleon_ft.failures": "chameleon_ft.engine.failures",
    "chameleon_ft.plan": "chameleon_ft.engine.plan",
    "chameleon_ft.perf": "chameleon_ft.engine.perf",
    "chameleon_ft.calibrate": "chameleon_ft.engine.calibrate",
    "chameleon_ft.planner": "chameleon_ft.engine.planner",
    "chameleon_ft.restorer": "chameleon_ft.engine.migration",
    "chameleon_ft.rehab": "chameleon_ft.engine.rehab",
    "chameleon_ft.stragglers": "chameleon_ft.engine.stragglers",
    "chameleon_ft.shard_recovery": "chameleon_ft.engine.shard_recovery",
    "chameleon_ft.selector": "chameleon_ft.engine.selector",
    "chameleon_ft.sim": "chameleon_ft.sim",  # a package now; its names are re-exported
    "chameleon_ft.trace": "chameleon_ft.sim.trace",
    "chameleon_ft.launch": "chameleon_ft.cli.launch",
    "chameleon_ft.demo": "chameleon_ft.cli.demo",
    "chameleon_ft.report": "chameleon_ft.cli.report",
    "chameleon_ft.localjob": "chameleon_ft.cli.localjob",
    "chameleon_ft.runtime.worker": ("chameleon_ft.runtime.recovery", "chameleon_ft.runtime.executors.dp"),
    "chameleon_ft.runtime.policy": "chameleon_ft.runtime.engine_bridge",
    "chameleon_ft.runtime.state": "chameleon_ft.runtime.codec",
    "chameleon_ft.runtime.adapters": "chameleon_ft.runtime.adapter_kit",
    "chameleon_ft.runtime.dp": "chameleon_ft.runtime.executors.dp",
    "chameleon_ft.runtime.sharded": "chameleon_ft.runtime.executors.sharded.executor",
    "chameleon_ft.runtime.pipeline": "chameleon_ft.runtime.executors.pipeline",
    "chameleon_ft.runtime.pipeline.context": "chameleon_ft.runtime.executors.pipeline.executor",
    "chameleon_ft.runtime.pipeline.executor": "chameleon_ft.runtime.executors.pipeline.step",
    "chameleon_ft.runtime.pipeline.schedule": "chameleon_ft.engine.schedule",
    "chameleon_ft.runtime.executors.pipeline.schedule": "chameleon_ft.engine.schedule",
    "chameleon_ft.runtime.pipeline.migration": "chameleon_ft.runtime.executors.pipeline.migration",
    "chameleon_ft.runtime.pipeline_calibration": "chameleon_ft.runtime.executors.pipeline.calibration",
    "accelerate_ft.runtime": "accelerate_ft.step_protocol",
}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} has moved: import it from {new} (the old path will be removed)",
                  ChameleonFTDeprecationWarning, stacklevel=3)


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def create_module(self, spec):
        if isinstance(self.new, tuple):
            _warn(self.old, " or ".join(self.new))
            return _merged(self.old, self.new)
        _warn(self.old, self.new)
        return importlib.import_module(self.new)

    def exec_module(self, module) -> None:
        sys.modules[self.old] = module  # the same object under both names

    # ``python -m OLD`` (runpy) runs the new module's code as __main__.
    def get_code(self, fullname):
        _warn(self.old, self.new)
        spec = importlib.util.find_spec(self.new)
        return spec.loader.get_code(self.new)

    def is_package(self, fullname) -> bool:
        if isinstance(self.new, tuple):
            return False
        spec = importlib.util.find_spec(self.new)
        return spec.submodule_search_locations is not None


def _merged(old: str, sources: tuple) -> types.ModuleType:
    """A module that serves the public names of ``sources`` (a removed re-export module)."""
    mod = types.ModuleType(old, f"Deprecated: import from {' or '.join(sources)}.")

    def __getattr__(name: str):
        for src in sources:
            m = importlib.import_module(src)
            try:
                return getattr(m, name)
            except AttributeError:
                continue
        raise AttributeError(f"module {old!r} has no attribute {name!r}")
    mod.__getattr__ = __getattr__
    return mod


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED_MODULES.get(fullname)
        if new is None or new == fullname:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(fullname, new))


def install() -> None:
    """Put the alias finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())


def renamed_getattr(module_name: str, names: dict[str, str]):
    """A module ``__getattr__`` that serves each old name in ``names`` (old -> new, both in
    that module) with a deprecation warning."""
    def __getattr__(name: str):
        if name in names:
            warnings.warn(f"{module_name}.{name} is now {names[name]}",
                          ChameleonFTDeprecationWarning, stacklevel=2)
            return getattr(sys.modules[module_name], names[name])
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
    return __getattr__
