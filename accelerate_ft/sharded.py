"""The model ``FaultTolerantAccelerator.prepare`` returns for FSDP2 (``ShardedModel``).

Plain Accelerate shards the user's model object in place (``fully_shard``).  Here every
generation of the job -- each re-formed membership -- has its own sharded module, made from a
template of the user's model (``LoopShardedExecutor``), so ``prepare`` returns a thin module that
calls the current one:

* ``model(...)`` in a training item runs the current generation's sharded module; inside an
  evaluation loader it runs the user's unsharded model object, which holds the committed
  weights (gathered once at the evaluation's start: ``LoopShardedExecutor.refresh_model``), so
  members with different numbers of evaluation batches run no FSDP collective;
* ``train()`` / ``eval()`` set the mode of every generation's module; ``parameters()``,
  ``named_parameters()`` and ``state_dict()`` are the current sharded module's (DTensors, as
  plain Accelerate's FSDP2 model gives); any other attribute (``config``, ``generate`` ...) is
  the user's model's;
* ``accelerator.unwrap_model(model)`` is the user's model object holding the committed weights
  and ``accelerator.get_state_dict(model)`` its whole ``state_dict`` -- both gather (a
  collective, as with plain Accelerate's FSDP2: every process calls them), so
  ``unwrap_model(model).save_pretrained(dir, state_dict=accelerator.get_state_dict(model))``
  writes what ``from_pretrained`` loads.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

__all__ = ["ShardedModel"]


class ShardedModel(torch.nn.Module):
    """See module doc; ``original``: the user's model (the template and evaluation copy)."""

    def __init__(self, runtime, original: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_rt", runtime)
        object.__setattr__(self, "_original", original)
        self.training = original.training

    def current(self) -> torch.nn.Module:
        """The module a call runs now (module doc)."""
        return self._original if self._rt.in_eval else self._sharded()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.current()(*args, **kwargs)

    def train(self, mode: bool = True) -> "ShardedModel":
        self.training = mode
        self._original.train(mode)
        ctx = self._rt.ctx
        if ctx is not None:
            ctx.training = mode
            if ctx.module is not None:
                ctx.module.train(mode)
        return self

    def _sharded(self) -> torch.nn.Module:
        """The current generation's sharded module (before the runtime starts: the user's model)."""
        ctx = self._rt.sharded_ctx
        return ctx.module if ctx is not None else self._original

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        return self._sharded().parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any):
        return self._sharded().named_parameters(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any):
        return self._sharded().state_dict(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_original"), name)


def sharded_executor(rt, model: torch.nn.Module, optimizer, dataset_len: int, global_batch: int,
                     micro_batch: int, **kwargs: Any):
    """The ``LoopShardedExecutor`` of ``rt`` (a ``StepProtocol`` with ``sharding`` set) over the
    user's unsharded ``model``: the units of its FSDP plugin's wrap policy, and the recovery paths
    a user's loop can carry out (heal, rehabilitate, restart: a recompute would roll the loop's
    counters back, as in lightning_ft)."""
    import copy

    from accelerate_ft.setups import unit_names
    from chameleon_ft.runtime.executors.sharded.loop import LoopShardedExecutor
    cfg = copy.copy(kwargs.pop("config"))
    paths = frozenset({"heal", "rehabilitate", "restart"})
    cfg.shard_recovery = paths & frozenset(cfg.shard_recovery or paths)
    ctx = LoopShardedExecutor(model, optimizer, dataset_len, global_batch, micro_batch, config=cfg,
                              units=unit_names(model, rt.sharding),
                              reshard_after_forward=rt.sharding.reshard_after_forward, user_loop=True, **kwargs)
    ctx.update_fn = rt._apply_update
    return ctx


def gathered(rt, fn, activity: int):
    """``fn()`` -- a gather of the whole state, called by every member at the same point --
    recovering the job and running it again when a member dies meanwhile."""
    from chameleon_ft.runtime.groups import CollectiveFailure
    while True:
        try:
            return fn()
        except CollectiveFailure as failure:
            if not rt.ctx.recover_off_step(failure, activity):
                raise RuntimeError("accelerate_ft: a worker died while the sharded model was gathered and the "
                                   "survivors were not all gathering it; the whole model cannot be assembled "
                                   "alone") from failure
