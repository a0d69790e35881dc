"""The sharded (FSDP2 / HSDP) executor; see ``executor.ShardedExecutor`` and
docs/runtime-sharded.md."""

from chameleon_ft.runtime.executors.sharded.executor import FsdpComms, ShardedExecutor

__all__ = ["FsdpComms", "ShardedExecutor"]
