"""The model's blocks on one pipeline worker: how they are given, and how a block this worker
comes to hold is made -- so that a worker never materialises a block it does not hold.

Three ways to give the blocks (``PipelineExecutor(blocks, ...)``, ``ElasticTrainer(blocks, ...,
stages=P)``):

* **per-block factories** -- a list of ``fn() -> nn.Module``, one per block (recommended for
  real models).  Every worker builds each block once on the ``meta`` device (shapes only, no
  memory) and calls a block's factory only when it comes to hold it, under the block's own
  seed (``block_seed``), on the CPU, then moves it to the job's device.  Replicas of a block
  are therefore bitwise equal without any start-up transfer.
* **a model built on the meta device** (``with torch.device("meta"): model = nn.Sequential(...)``)
  -- a held block is materialised with ``to_empty`` and every submodule's
  ``reset_parameters()`` under the block's seed (torch's convention for deferred
  initialisation; a submodule with parameters or buffers of its own but no
  ``reset_parameters`` is refused: give factories then).
* **a built model** (an ``nn.Sequential`` on a device, as before): every worker holds the
  whole model until the first plan, and the lowest worker's copy of each block is sent to its
  holders before the first step (DDP's initial broadcast); the other blocks are then released
  to ``meta``.  Peak memory is the whole model's, once.

Whatever the form, a block a worker no longer holds goes back to ``meta``; a block received
from a peer (a migration) is made as above, then loaded with the peer's state.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from chameleon_ft.runtime.errors import ConfigError

__all__ = ["Blocks", "block_seed"]


def block_seed(seed: int, b: int) -> int:
    """The seed block ``b``'s parameters are initialised under (factories, meta models)."""
    return (int(seed) * 1_000_003 + 104_729 * (b + 1)) % (2 ** 63 - 1)


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _on_meta(m: torch.nn.Module) -> Optional[bool]:
    """True / False when all of ``m``'s tensors are / none is on ``meta``; None: it has none."""
    flags = {t.is_meta for t in list(m.parameters()) + list(m.buffers())}
    if len(flags) > 1:
        raise ConfigError(f"block {type(m).__name__} is partly on the meta device")
    return flags.pop() if flags else None


class Blocks:
    """The ordered blocks (``modules``, a list; ``model``, the same as an ``nn.Sequential``).

    ``lazy``: blocks are made only by their holders (factories or a meta model); ``device``:
    where held blocks live."""

    def __init__(self, blocks, seed: int = 0, device=None):
        self.seed = int(seed)
        self.factories: Optional[list[Callable]] = None
        if isinstance(blocks, torch.nn.Module):
            modules = list(blocks.children())
        else:
            items = list(blocks)
            if items and all(callable(x) and not isinstance(x, torch.nn.Module) for x in items):
                self.factories = items
                with torch.device("meta"):
                    modules = [f() for f in items]
                bad = [i for i, m in enumerate(modules) if not isinstance(m, torch.nn.Module)]
                if bad:
                    raise ConfigError(f"block factory {bad[0]} did not return an nn.Module")
            elif all(isinstance(x, torch.nn.Module) for x in items):
                modules = items
            else:
                raise ConfigError("blocks must be an nn.Sequential, a list of modules or a list of "
                                  "fn() -> nn.Module (one per block)")
        if not modules:
            raise ConfigError("a pipeline job needs the model as an ordered list of blocks")
        meta = {f for f in map(_on_meta, modules) if f is not None}
        if len(meta) > 1:
            raise ConfigError("some blocks are on the meta device and some are not: build all of them "
                              "on meta (or give per-block factories), or none")
        self.lazy = self.factories is not None or meta == {True}
        self.made: list[int] = []  # the blocks materialised here (``make``), in order
        self.modules = modules
        self.model = torch.nn.Sequential(*modules)
        if device is not None:
            self.device = torch.device(device)
        elif self.lazy:
            self.device = _default_device()
        else:
            self.device = next((t.device for m in modules for t in m.parameters()), torch.device("cpu"))
        if self.lazy and self.factories is None:
            for b, m in enumerate(modules):
                self._check_resettable(b, m)

    @staticmethod
    def _check_resettable(b: int, m: torch.nn.Module) -> None:
        for name, sub in m.named_modules():
            own = list(sub.parameters(recurse=False)) + list(sub.buffers(recurse=False))
            if own and not callable(getattr(sub, "reset_parameters", None)):
                raise ConfigError(f"block {b}'s submodule {name or type(sub).__name__} "
                                  f"({type(sub).__name__}) has tensors but no reset_parameters(): a "
                                  "meta-device model is initialised by reset_parameters; give the "
                                  "blocks as factories fn() -> nn.Module instead")

    def make(self, b: int) -> torch.nn.Module:
        """Materialise block ``b`` on ``device``, initialised under its seed (lazy forms) or
        empty (a built model's block: its state comes from a peer).  Returns the module now in
        ``modules[b]``."""
        self.made.append(b)
        if not self.lazy:
            self.modules[b].to_empty(device=self.device)
            return self.modules[b]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(block_seed(self.seed, b))
            if self.factories is not None:
                with torch.device("cpu"):
                    m = self.factories[b]()
            else:
                m = self.modules[b].to_empty(device="cpu")
                for sub in m.modules():
                    if callable(getattr(sub, "reset_parameters", None)):
                        sub.reset_parameters()
        m = m.to(self.device)
        self.modules[b] = m
        self.model[b] = m
        return m

    def release(self, b: int) -> None:
        """Block ``b`` is no longer held here: its tensors go to ``meta`` (no memory)."""
        self.modules[b].to("meta")

    def materialised(self) -> list[int]:
        """The blocks whose tensors take memory here (not on ``meta``)."""
        return [b for b, m in enumerate(self.modules) if _on_meta(m) is False]
