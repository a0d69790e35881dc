"""The optimizers' hyperparameters at a step's commit (``lr``, ``momentum``, ``betas``...: what LR
schedulers write into the param groups), for a worker that adopts a step its peers committed.

A framework that steps its schedulers itself after the update (Lightning, the HF ``Trainer``'s
own scheduler) has, by the time a peer sends its state, moved the peer's ``lr`` past the commit;
the adopter then steps its own scheduler for the adopted step, and a chainable scheduler (StepLR
at its boundary) is applied twice.  The executor takes the hyperparameters at the commit and the
adopter restores them after loading the optimizer's state."""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["group_hyperparams", "restore_group_hyperparams", "scale_lr"]


def group_hyperparams(optimizers: Iterable) -> list[list[dict]]:
    """Per optimizer, per param group: every entry but ``params`` (tensors cloned: a scheduler
    may write them in place)."""
    out = []
    for opt in optimizers:
        groups = []
        for g in opt.param_groups:  # taken at every commit: a dict copy, a pass for tensors
            hp = g.copy()
            hp.pop("params", None)
            for k, v in hp.items():
                if isinstance(v, torch.Tensor):
                    hp[k] = v.clone()
            groups.append(hp)
        out.append(groups)
    return out


def restore_group_hyperparams(optimizers: Iterable, groups: list) -> None:
    for opt, gs in zip(optimizers, groups or []):
        for g, hp in zip(opt.param_groups, gs):
            for k, v in hp.items():
                if torch.is_tensor(g.get(k)) and torch.is_tensor(v):
                    g[k].copy_(v)
                else:
                    g[k] = v.clone() if torch.is_tensor(v) else v


def scale_lr(groups: list, factor: float) -> None:
    """``lr`` (and ``initial_lr``) of a snapshot times ``factor`` (the linear scaling rule)."""
    for gs in groups:
        for g in gs:
            for k in ("lr", "initial_lr"):
                if k in g:
                    g[k] = g[k] * factor
