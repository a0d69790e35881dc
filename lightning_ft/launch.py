"""Lightning's own ways of starting a job, handed to ``chameleon-ft run`` (issue 26):
``python train.py`` with ``devices=N`` (Lightning would start the workers itself: this process
becomes the launcher), ``srun python train.py`` and torchelastic (one process per worker:
local rank 0 becomes the node's launcher, the others leave).  The mechanism is the shared
``chameleon_ft.runtime.relaunch``; this module only reads Lightning's cluster environment."""

from __future__ import annotations

from chameleon_ft.runtime.relaunch import relaunch, relaunch_local_rank_zero

__all__ = ["relaunch_lightning"]


def relaunch_lightning(env, devices: int, num_nodes: int) -> None:
    """``runtime/relaunch.py`` for a Lightning job: Lightning would start the workers itself
    (``python train.py``: this process becomes the launcher), or a cluster manager started one
    process per worker (SLURM, torchelastic: local rank 0 becomes this node's launcher)."""
    extra = ("--preload", "+lightning,lightning_ft")
    if env is not None and env.creates_processes_externally:
        relaunch_local_rank_zero(env.local_rank(), devices, num_nodes, env.node_rank(), env.main_address,
                                 env.main_port, extra, why=f"started by {type(env).__name__}")
    elif num_nodes > 1:
        relaunch(devices, nnodes=num_nodes, node_rank=env.node_rank(), endpoint=f"{env.main_address}:{env.main_port}",
                 extra=extra, why="Lightning would start the workers itself")
    else:
        relaunch(devices, extra=extra, why="Lightning would start the workers itself")
