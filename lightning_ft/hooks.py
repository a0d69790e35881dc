"""``StrategyHooks``: what ``FaultTolerantDDPStrategy`` asks of the callback that configures it.

The strategy and the callback each need the other: the callback checks the strategy and reads
its runtime state; the strategy takes its configuration, resume state and logging hand-over
from the callback.  This interface lets the strategy find the callback among the trainer's
callbacks without importing the callback module (which imports the strategy).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

from chameleon_ft.runtime.recovery import ElasticConfig

__all__ = ["StrategyHooks"]


class StrategyHooks(ABC):
    #: JSONL event log path chosen by the user (None: the run dir's ``events.jsonl``).
    event_log: Optional[str] = None
    #: fault-tolerance state loaded from a checkpoint (sampler cursor, engine, global batch).
    resume_state: Optional[dict] = None

    @abstractmethod
    def elastic_config(self) -> ElasticConfig:
        """The runtime configuration the user asked for."""

    @abstractmethod
    def before_stage(self, trainer) -> None:
        """Called by the strategy once the job is joined, before each trainer stage."""

    @abstractmethod
    def take_over_logging(self, trainer) -> None:
        """This member became rank 0 after a failure: continue the loggers of the dead one."""
