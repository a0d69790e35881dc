"""Started the framework's way, run under ``chameleon-ft run`` (issue 26).

A Lightning user types ``python train.py`` (Lightning starts ``devices - 1`` more processes,
rank 0 being the user's own) or ``srun python train.py``; an Accelerate user ``accelerate
launch train.py`` (torchrun starts them).  Either way a worker's death ends the job: Lightning's
launcher tears every child down, torchrun's agent restarts the world.  So when an adapter finds
itself started that way, it hands the job to our launcher instead of starting it:

* **the framework would start the workers itself** (``python train.py`` with ``devices=N``):
  this process *becomes* ``chameleon-ft run --nproc-per-node N train.py ...`` (``os.execv``:
  same PID, same terminal; the user sees the launcher's output and gets its exit code), which
  starts the N workers; each runs the script from the top, as Lightning's children do;
* **a cluster manager started one process per worker** (SLURM's ``srun``, torchrun under
  ``accelerate launch``): the node's local rank 0 becomes that node's launcher for every
  local worker, with the manager's node count, node rank and address (our coordinator on the
  manager's port + 1, so as not to meet torchrun's own store there), and the node's other
  processes leave at once with exit 0 -- the launcher's workers take their places.

``CHAMELEON_FT_NO_RELAUNCH=1`` turns it off (the adapters then say what to run instead);
``CHAMELEON_FT_RUN_ARGS`` adds the launcher's own flags (``"--max-replacements 1 --hang-timeout 5"``)
and ``CHAMELEON_FT_RUN_DIR`` names its run directory (event log).  The workers see what a
``chameleon-ft run`` worker sees: the manager's per-process variables (torchrun's ``RANK`` ...,
SLURM's ``SLURM_PROCID``, ``SLURM_NTASKS`` ...) are taken out, so that the framework inside a
worker does not mistake it for the manager's task 0 (``SLURM_JOB_ID``, ``SLURM_NODELIST`` and the
rest stay).
Limits: the script must be re-runnable from the top by ``python <its path> <its args>`` (as
with Lightning's own launcher); ``python -m pkg.module`` is re-run as its file.
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import Optional, Sequence

from chameleon_ft.runtime import env as E

__all__ = ["launched", "relaunch", "relaunch_local_rank_zero", "NO_RELAUNCH", "RUN_ARGS"]

NO_RELAUNCH = "CHAMELEON_FT_NO_RELAUNCH"
RUN_ARGS = "CHAMELEON_FT_RUN_ARGS"
# Set by a cluster manager per process; our launcher sets its own for each worker.
_PER_PROCESS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
                "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                # srun's per-task variables (Lightning's SLURMEnvironment reads them)
                "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NTASKS_PER_NODE",
                "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_GTIDS",
                "SLURM_TASK_PID", "PMI_RANK", "PMI_SIZE", "PMIX_RANK")


def launched() -> bool:
    """This process is a worker of ``chameleon-ft run``."""
    return bool(os.environ.get(E.WORKER_ID))


def relaunch(nproc_per_node: int, *, nnodes: int = 1, node_rank: int = 0, endpoint: Optional[str] = None,
             extra: Sequence[str] = (), why: str = "") -> None:
    """Become ``chameleon-ft run`` for this script (never returns; a no-op when turned off or
    already a worker).  ``extra``: more launcher flags (``--preload +lightning,lightning_ft``)."""
    if launched() or os.environ.get(NO_RELAUNCH) == "1":
        return
    script = os.path.abspath(sys.argv[0])
    argv = [sys.executable, "-m", "chameleon_ft.cli.launch", "--nproc-per-node", str(nproc_per_node)]
    if nnodes > 1:
        argv += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-endpoint", str(endpoint)]
    if os.environ.get(E.RUN_DIR):  # where the user wants the event log (else a new temp dir)
        argv += ["--run-dir", os.environ[E.RUN_DIR]]
    argv += [*extra, *shlex.split(os.environ.get(RUN_ARGS, "")), script, *sys.argv[1:]]
    env = {k: v for k, v in os.environ.items() if k not in _PER_PROCESS}
    print(f"chameleon-ft: {why + ': ' if why else ''}running this job under `chameleon-ft run` so that "
          f"the survivors of a failure train on (as `chameleon-ft run {shlex.join(argv[3:])}`)",
          file=sys.stderr, flush=True)
    sys.stderr.flush()
    sys.stdout.flush()
    os.execve(sys.executable, argv, env)


def relaunch_local_rank_zero(local_rank: int, nproc_per_node: int, nnodes: int, node_rank: int,
                             address: str, port: int, extra: Sequence[str] = (), why: str = "") -> None:
    """One process per worker was started by a cluster manager: local rank 0 becomes this
    node's launcher (coordinator on ``port + 1``), the others leave (exit 0)."""
    if launched() or os.environ.get(NO_RELAUNCH) == "1":
        return
    _quiesce()
    if local_rank != 0:
        print(f"chameleon-ft: local rank {local_rank} leaves its place to a worker of this node's "
              "`chameleon-ft run` (started by local rank 0)", file=sys.stderr, flush=True)
        os._exit(0)
    relaunch(nproc_per_node, nnodes=nnodes, node_rank=node_rank, endpoint=f"{address}:{int(port) + 1}",
             extra=extra, why=why)


def _quiesce() -> None:
    """Every rank at this point before any leaves: the script may have formed the launcher's
    process group already (``TrainingArguments`` does, on its ``device``), and a rank that
    exits while a peer is still connecting that group's full mesh makes the peer fail
    ("Connection closed by peer", seen under ``accelerate launch``)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except Exception:  # the launcher's group is about to be given up anyway
        pass
