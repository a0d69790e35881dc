"""Every private torch API the package imports, in one place (a ``_`` segment in its path).

Private names can move or change between torch releases without notice; keeping them here
makes the list short, visible and testable (``tests/engine/test_imports.py``).  Checked on
torch 2.13.0 (CPU) only.  ``pyproject.toml`` allows torch >= 2.4; the sharded executor's
message on a failed import asks for torch >= 2.6 (FSDP2), which was not checked here.

Imported:

* ``torch.distributed.fsdp._fully_shard._fsdp_api.AllGather`` / ``ReduceScatter``: the base
  classes FSDP2's ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` take.  We need
  them to run FSDP's collectives over our per-generation gloo group, which fails fast on a
  dead peer (``runtime/executors/sharded/comms.py``).  Torch exports no public alias.

Used in place (an attribute, not an import; listed so that a torch upgrade checks them too):

* ``ProcessGroupGloo._allgather_base`` (``allgather_base`` below): gloo's all-gather into
  one flat tensor, straight into FSDP's buffer, on the generation's gloo group itself (it
  returns the ``Work`` that the runtime's fail-fast waiter polls).
* ``ProcessGroup._set_group_name`` and ``group_name``, overridden by the no-communication
  group (``sharded/comms.py``): a Python ``ProcessGroup`` holds no C++ backend, which is
  where torch keeps a group's name (torchft's process groups do the same).
* ``FSDPModule._get_fsdp_state()._fsdp_param_group`` (``lightning_ft/sharded.py``): a unit's
  ``reshard_after_forward``, which FSDP2 has no getter for.
* ``torch._foreach_copy_`` (``foreach_copy`` below): the last gradient bucket filled from its
  parameters' gradients in one op (``runtime/executors/buckets.py``); a copy per tensor where a
  torch lacks it.
* ``LRScheduler._step_count`` (``accelerate_ft/step_protocol.py``): the steps a scheduler
  with ``total_steps`` (``OneCycleLR``) has taken, so that a replay stops at its end.
"""

from __future__ import annotations

import torch

from chameleon_ft.runtime.errors import ConfigError

__all__ = ["allgather_base", "foreach_copy", "fsdp_comm_bases"]


def fsdp_comm_bases() -> tuple[type, type]:
    """FSDP2's ``(AllGather, ReduceScatter)`` comm base classes (imported when first needed:
    a torch without FSDP2 can still import the package)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError as exc:  # pragma: no cover - torch builds without distributed / FSDP2
        raise ConfigError(f"sharded training needs torch's FSDP2 (torch>=2.6): {exc}") from None
    return AllGather, ReduceScatter


def allgather_base(pg, out, inp):
    """``pg``'s all-gather of ``inp`` into the flat ``out`` (returns the ``Work``)."""
    return pg._allgather_base(out, inp)


_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)


def foreach_copy(dst: list, src: list) -> None:
    """``dst[i].copy_(src[i])`` for every ``i``, in one op where torch has ``_foreach_copy_``."""
    if _FOREACH_COPY is not None:
        _FOREACH_COPY(dst, src)
    else:  # pragma: no cover - torch builds without it
        for d, s in zip(dst, src):
            d.copy_(s)
