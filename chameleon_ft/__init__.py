"""chameleon-ft: adaptive fault tolerance for data-parallel, pipelined and sharded training.

What users import lives here::

    from chameleon_ft import ElasticTrainer, ElasticConfig, elastic_main   # a training script
    from chameleon_ft import select, plan_search, JobState, Event          # the engine alone

The layers, top to bottom (arrows only go down):

* ``chameleon_ft.cli``      the product shell: ``chameleon-ft run | demo | report | simulate | bench``
* ``lightning_ft`` / ``accelerate_ft``  framework adapters (translate hooks and launchers)
* ``chameleon_ft.runtime``  carries Decisions out on torch.distributed: the recovery core, the
  membership, groups, sampler, codec, event log, the engine bridge; ``runtime.executors``
  holds one executor per kind of parallelism (``dp``, ``pipeline``, ``sharded``)
* ``chameleon_ft.sim``      discrete-event simulation and trace replay over the engine
* ``chameleon_ft.engine``   decides: workload, cluster, plans, performance model, calibration,
  plan search, migration planning, rehabilitation, stragglers, the selector -- pure Python plus
  numpy/scipy/networkx, never ``torch.distributed``

Names here are loaded on first use, so ``import chameleon_ft.engine`` stays free of torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "ElasticTrainer": "chameleon_ft.runtime.trainer",
    "elastic_main": "chameleon_ft.runtime.trainer",
    "ElasticConfig": "chameleon_ft.runtime.config",
    "ConfigError": "chameleon_ft.runtime.errors",
    "ElasticSampler": "chameleon_ft.runtime.sampler",
}
_ENGINE = ("Workload", "transformer", "Cluster", "homogeneous", "Event", "Plan", "SearchSpace",
           "plan_search", "JobState", "SelectorConfig", "Decision", "select", "estimate")
_EXPORTS.update({name: "chameleon_ft.engine" for name in _ENGINE})

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'chameleon_ft' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
