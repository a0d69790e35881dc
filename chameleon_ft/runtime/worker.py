"""Where a worker's runtime lives (kept for imports): the shared recovery core
(``recovery.py``) and the data-parallel executor (``dp.py``); the pipeline executor is
``pipeline/context.py``."""

from chameleon_ft.runtime.dp import ElasticContext
from chameleon_ft.runtime.recovery import (ElasticConfig, Joined, NothingToHeal, RecoveryCore,
                                           WorldTooSmall, join_job, layer_params, seed_generators)

__all__ = ["ElasticConfig", "ElasticContext", "RecoveryCore", "WorldTooSmall", "NothingToHeal",
           "layer_params", "Joined", "join_job", "seed_generators"]
