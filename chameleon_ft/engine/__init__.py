"""The engine: decides what to do about a failure, a straggler or a join -- and nothing else.

Pure Python plus numpy/scipy/networkx; it never imports ``torch.distributed`` nor anything of
``chameleon_ft`` outside this folder (``tests/engine/test_imports.py`` checks both), so it is
tested in seconds without processes.  Modules, bottom up:

* ``workload``, ``cluster``, ``plan``, ``failures``  -- the types (with their JSON codecs)
* ``perf``        step time and memory of a plan (the 1F1B form, the all-reduce, FSDP)
* ``calibrate``   fits the model's coefficients to measured step timings
* ``planner``     ``plan_search`` over the survivors; ``balance_layers``, micro-batch allocation
* ``migration``   which survivor takes which slot (Hungarian) and the transfer rounds (DSATUR)
* ``rehab``, ``shard_recovery``  recompute vs rehabilitate; a sharded job's lost rows
* ``stragglers``  the straggler detector
* ``decision``    the ``Option`` / ``Decision`` types and their score
* ``reroute``     what no survivor holds; a dead device's micro-batches over its peers
* ``selector``    candidates -> a scored ``Decision`` (``select``)

The names below are loaded on first use.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Layer": "workload", "Workload": "workload", "transformer": "workload",
    "Device": "cluster", "Link": "cluster", "Cluster": "cluster", "homogeneous": "cluster",
    "Event": "failures", "EventKind": "failures", "FailureRateEstimator": "failures",
    "Pipeline": "plan", "Plan": "plan", "PlanError": "plan",
    "Coefficients": "perf", "estimate": "perf",
    "SearchSpace": "planner", "plan_search": "planner", "balance_layers": "planner",
    "MigrationPlan": "migration", "migrate": "migration",
    "Decision": "decision", "Option": "decision",
    "JobState": "selector", "SelectorConfig": "selector", "select": "selector", "POLICIES": "selector",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'chameleon_ft.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"chameleon_ft.engine.{module}"), name)
    globals()[name] = value
    return value
