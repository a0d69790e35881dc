"""Pipeline checkpoints: one file per block, written by its holders, resumable on any layout.

For a checkpoint ``path`` (``ElasticTrainer(..., stages=P, checkpoint="ckpt.pt")``):

* ``<path>.blocks/<step>/<b>.pt`` -- block ``b`` at that step: ``{"params": its state_dict,
  "optim": its optimizer's state_dict, "sched": its LR scheduler's or None}``, a plain
  ``torch.save`` that ``torch.load(f, weights_only=True)`` reads; written by the lowest alive
  holder of the block (every holder's copy is bitwise the same).
* ``path`` -- the run state (step, sampler, engine; ``codec.save_checkpoint``) with the SHA-256
  of every block file, written by rank 0 *after* every member wrote its blocks (a sum over all
  members carries the digests, so rank 0 has them).  It is the commit: a failure before it
  leaves the previous checkpoint in force; older step folders are removed after it.

A resumed job loads the run state on every worker, agrees on a layout over whoever is there
(any number of workers, any split), and each worker loads the blocks of its slot, checking
each file's digest (``CheckpointError`` on a damaged or missing file: nothing is trained on a
corrupt block).  ``model_state_dict(path)`` assembles the whole model's ``state_dict`` (the
keys of an ``nn.Sequential`` of the blocks) for a user who wants the trained model in one
piece: ``model.load_state_dict(model_state_dict("ckpt.pt"))``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from typing import Optional

import torch

from chameleon_ft.runtime import codec as run_state
from chameleon_ft.runtime.errors import CheckpointError

__all__ = ["blocks_dir", "write_block", "read_block", "prune", "model_state_dict", "read_run"]


def blocks_dir(path: str, step: int) -> str:
    """The folder of the blocks of ``path``'s checkpoint at ``step``."""
    return os.path.join(f"{os.fspath(path)}.blocks", str(int(step)))


def _digest(file: str) -> int:
    """The first 8 bytes of the file's SHA-256 as a signed int64 (it travels in a sum)."""
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return int.from_bytes(h.digest()[:8], "big", signed=True)


def write_block(folder: str, b: int, state: dict) -> int:
    """Write block ``b``'s state (tensors moved to the CPU) atomically; its digest."""
    os.makedirs(folder, exist_ok=True)
    file = os.path.join(folder, f"{b}.pt")
    run_state.atomic_save(_cpu(state), file)
    return _digest(file)


def _cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_cpu(v) for v in x)
    return x


def read_block(folder: str, b: int, digest: Optional[int]) -> dict:
    """Block ``b``'s state from ``folder``, checked against ``digest``."""
    file = os.path.join(folder, f"{b}.pt")
    if not os.path.exists(file):
        raise CheckpointError(f"pipeline checkpoint block {file} is missing")
    if digest is not None and _digest(file) != int(digest):
        raise CheckpointError(f"pipeline checkpoint block {file} does not match its digest (damaged)")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"pipeline checkpoint block {file} is corrupt: {exc}") from exc
    if not isinstance(state, dict) or "params" not in state:
        raise CheckpointError(f"pipeline checkpoint block {file} holds no block state")
    return state


def read_run(path: str, n_blocks: Optional[int] = None) -> dict:
    """The run state of a pipeline checkpoint (``CheckpointError`` if it is not one, or is one
    of a model with another number of blocks)."""
    tree = run_state.load_checkpoint(path)
    if not isinstance(tree, dict) or "blocks" not in tree:
        raise CheckpointError(f"checkpoint {path} is not a pipeline checkpoint (no block digests)")
    if n_blocks is not None and len(tree["blocks"]) != n_blocks:
        raise CheckpointError(f"checkpoint {path} holds {len(tree['blocks'])} blocks, the model has {n_blocks}")
    return tree


def prune(path: str, keep: int) -> None:
    """Remove the block folders of steps other than ``keep`` (after the run file names it)."""
    root = f"{os.fspath(path)}.blocks"
    for name in os.listdir(root) if os.path.isdir(root) else ():
        if name != str(int(keep)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def model_state_dict(path: str) -> dict:
    """The whole model's ``state_dict`` from a pipeline checkpoint: block ``b``'s parameter
    ``name`` under ``f"{b}.{name}"``, as an ``nn.Sequential`` of the blocks names it."""
    tree = read_run(path)
    folder = blocks_dir(path, tree["step"])
    out = {}
    for b, digest in enumerate(tree["blocks"]):
        for name, t in read_block(folder, b, digest)["params"].items():
            out[f"{b}.{name}"] = t
    return out
