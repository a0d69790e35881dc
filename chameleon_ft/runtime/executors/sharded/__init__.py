"""The sharded (FSDP2 / HSDP) executor; see ``executor.ShardedExecutor`` (its module lists the
others) and docs/runtime-sharded.md."""

from chameleon_ft.runtime.executors.sharded.comms import FsdpComms
from chameleon_ft.runtime.executors.sharded.executor import ShardedExecutor

__all__ = ["FsdpComms", "ShardedExecutor"]
