"""NCCL for the tensor collectives of a generation, beside the gloo group that carries control.

With one GPU per worker (``CHAMELEON_FT_BACKEND=nccl``, or ``auto`` when every local rank has
a GPU of its own), ``GroupManager`` builds, for each agreed generation, a
``ProcessGroupNCCL`` on the generation's key space next to its gloo group; CUDA tensors are
all-reduced over it, everything else (headers, recovery agreements, state broadcasts staged
through host memory) stays on gloo.  NCCL differs exactly where fault tolerance lives:

* a dead peer leaves an NCCL kernel waiting instead of raising: our own watchdog
  (``GroupManager.wait(poll=True)``: ``work.is_completed()``, the abort key, ``op_timeout_s``) decides,
  and then **aborts the communicator** (``ProcessGroupNCCL.abort``: ``ncclCommAbort``), which
  frees the stream; the group is dropped and the next generation makes a fresh one;
* NCCL's own watchdog must not tear a survivor down: the worker's environment sets
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (clean up, do not kill), ``TORCH_NCCL_ENABLE_MONITORING=0``
  and ``TORCH_NCCL_DUMP_ON_TIMEOUT=0`` unless the user set them (``configure_env``), and the
  group's own timeout is far above ours;
* before state is trusted after a recovery the current stream is synchronised.

Not verified on a GPU yet (this project's machines have none; docs/gpu.md lists what was and was
not run).  ``torch.distributed.shrink_group`` (``ncclCommShrink``) would keep the surviving
ranks' communicator instead of making a new one; it is not used.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["BACKEND_ENV", "choose_backend", "configure_env", "NcclData"]

BACKEND_ENV = "CHAMELEON_FT_BACKEND"  # gloo | nccl | auto (default)

_SAFE_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0",
             "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}


def choose_backend(local_rank: int, local_world: int) -> str:
    """``nccl`` when asked for, or (``auto``) when CUDA, NCCL and a GPU per local rank are
    there; else ``gloo``.  Asking for NCCL where it cannot run is an error, not a fallback."""
    want = os.environ.get(BACKEND_ENV, "auto").lower()
    usable = torch.cuda.is_available() and dist.is_nccl_available() and torch.cuda.device_count() >= local_world
    if want == "nccl" and not usable:
        from chameleon_ft.runtime.errors import ConfigError

        raise ConfigError(f"{BACKEND_ENV}=nccl needs CUDA, NCCL and a GPU per worker of the node "
                          f"({torch.cuda.device_count()} GPU(s) for {local_world} workers)")
    if want == "gloo" or not usable:
        return "gloo"
    return "nccl"


def configure_env() -> None:
    """NCCL's watchdog must not end a survivor: our own one decides (module docstring)."""
    for key, value in _SAFE_ENV.items():
        os.environ.setdefault(key, value)


class NcclData:
    """One generation's NCCL group for CUDA tensors (``GroupManager`` owns it)."""

    def __init__(self, device: torch.device, timeout_s: float):
        self.device = device
        self.timeout_s = timeout_s
        self.pg: Optional[dist.ProcessGroup] = None

    def build(self, store: dist.Store, rank: int, world: int) -> dist.ProcessGroup:
        """A fresh communicator for a new generation, not installed: a set-up thread builds it,
        the thread that waited for that generation's set-up installs it (``install``), so a
        set-up given up never replaces a newer generation's group."""
        opts = dist.ProcessGroupNCCL.Options()
        # Far above our watchdog: ours aborts first, NCCL's never has to.
        opts._timeout = timedelta(seconds=max(600.0, 10 * self.timeout_s))
        return dist.ProcessGroupNCCL(store, rank, world, opts)

    def install(self, pg: dist.ProcessGroup) -> None:
        """Make ``pg`` the current communicator (the old one is aborted first)."""
        self.abort()
        self.pg = pg

    def abort(self) -> None:
        """Abort the communicator (a blocked kernel returns), then release the group."""
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.abort()
            except Exception:  # already broken: nothing left to free
                pass
            if torch.cuda.is_available():
                torch.cuda.synchronize(self.device)
