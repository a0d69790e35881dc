"""Lightning integration of chameleon-ft: add ``FaultToleranceCallback()`` to the Trainer's
callbacks and start the script with ``chameleon-ft run``; see docs/lightning.md."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_ft.callback import FaultToleranceCallback
from lightning_ft.data import NoMicroBatch, ShardSampler, StepLoader
from lightning_ft.sharded import FaultTolerantModelParallelStrategy
from lightning_ft.strategy import FaultTolerantDDPStrategy, LauncherError

__all__ = ["FaultToleranceCallback", "FaultTolerantDDPStrategy", "FaultTolerantModelParallelStrategy", "LauncherError", "NoMicroBatch",
           "ShardSampler", "StepLoader"]

FaultTolerantDDPStrategy.register_strategies(StrategyRegistry)
