"""The executor protocol: what an executor implements for the recovery core.

The recovery core (``runtime/recovery.py``, ``RecoveryCore``) owns everything every kind of
training shares: membership, the generation's group, the step all-reduce and its commit, the
agreement after a reconfiguration (who is the source, what it ships), the engine bridge, the
counters of committed / adopted / redone steps and the off-step recovery of an adapter's
evaluation, barrier or save.  An executor -- ``dp.DataParallelExecutor``,
``pipeline.executor.PipelineExecutor``, ``sharded.executor.ShardedExecutor`` -- is a subclass
that adds how a step of its plan is computed and how a Decision's layout is carried out,
through the hooks below and nothing else.  The core calls them at fixed points:

``start`` / a failure -> membership view -> ``recovery_fields()`` on every member (one
all-reduce) -> ``source_payload(view, info)`` on the source (it asks the engine) -> payload
broadcast -> state loaded where behind -> ``carry_out(payload, top, n, r)`` on every member ->
training resumes.  ``apply_allocation()`` runs wherever the engine's allocation changes (start,
a failure or join Decision, a straggler Decision); ``reset_step()`` whenever a step's partial
work is thrown away.

``POLICIES`` is the one place where an executor says which of the engine's policies it can
carry out; the core intersects it with ``ElasticConfig.allowed_policies`` and hands the result to
the engine (``EngineBridge(allowed=...)`` -> ``SelectorConfig.allowed``), so the engine never
proposes what the executor cannot do.  The adapters offer their executor's set less the
policies that change the global batch (``adapter_kit.adapter_config``).

This module holds the interface only, for readers and type checkers; ``RecoveryCore`` gives
each hook its default.
"""

from __future__ import annotations

from typing import ClassVar, Optional, Protocol, runtime_checkable

__all__ = ["Executor"]


@runtime_checkable
class Executor(Protocol):
    """The hooks an executor overrides on ``RecoveryCore`` (defaults there)."""

    #: The engine's policies this executor carries out (``engine.selector.POLICIES`` names).
    POLICIES: ClassVar[frozenset]

    #: The step all-reduce's header kind, or None for executors whose members run nothing but
    #: the same collectives in the same order between two syncs (see ``RecoveryCore``).
    step_header: ClassVar[Optional[str]]

    def recovery_fields(self) -> list[int]:
        """Integers this member reports in the recovery all-reduce (its facts: e.g. the blocks a
        pipeline worker holds, the row a sharded worker has); every member reports as many.
        Read back as ``peer_fields`` (one list per member) in ``source_payload``/``carry_out``."""
        ...

    def source_payload(self, view, info: Optional[dict]) -> dict:
        """On the source only: ask the engine what to do for ``view`` and return the payload
        every member receives (the core's keys: ``engine``, ``sampler``, ``decisions``,
        ``restart``, ``dead``; an executor adds its own, e.g. a migration's rounds)."""
        ...

    def carry_out(self, payload: dict, top: int, n: int, r: int) -> None:
        """On every member, after the agreed state is loaded: carry the payload out (rebuild
        the layout, move state, salvage an interrupted step) before training resumes.  ``top``
        is the agreed step, ``n`` the world size, ``r`` this member's rank."""
        ...

    def apply_allocation(self) -> None:
        """Give the sampler the engine's current allocation (micro-batches per member)."""
        ...

    def reset_step(self) -> None:
        """Forget this executor's bookkeeping of a step whose work is discarded."""
        ...

    def state_dict(self) -> dict:
        """The whole run state a behind member receives (tensors + JSON, ``runtime/codec``)."""
        ...

    def load_state_dict(self, state: dict) -> None:
        ...
