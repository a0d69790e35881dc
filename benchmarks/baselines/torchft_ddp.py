"""Baseline: TorchFT — Lighthouse + one replica group per worker (``torchft`` 0.2.0, or the
nightly in ``benchmarks/.venv-torchft``).

    torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000 --bind [::]:PORT
    BENCH_OUT=D TORCHFT_LIGHTHOUSE=http://localhost:PORT REPLICA_GROUP_ID=r NUM_REPLICA_GROUPS=4 \
        RANK=0 WORLD_SIZE=1 MASTER_ADDR=localhost MASTER_PORT=P_r python benchmarks/baselines/torchft_ddp.py

Configured as torchft's ``train_ddp.py`` example: ``Manager(min_replica_size=1, ...)``, the
``torchft.Optimizer`` wrapper (``zero_grad`` starts the quorum, ``step`` commits only when
``should_commit``), a fixed data shard per replica group (``REPLICA_GROUP_ID`` of
``NUM_REPLICA_GROUPS``: when a group dies its shard is not reassigned, so its samples are lost
while it is away).  Each replica group is one process (what ``torchrun --nproc-per-node 1``
would start, without the extra agent process).  A dead group is not relaunched here: the
survivors go on, as in chameleon-ft's kill scenario.

``--variant shipped``: ``torchft.DistributedDataParallel`` and the defaults (``ProcessGroupGloo()``
and Manager timeouts of 60 s).  Known pitfall of 0.2.0: when an all-reduce fails mid-step the DDP
communication hook hits ``assert fut._fut`` and the surviving replicas crash (the results say
whether the torchft that ran has it).
``--variant workaround``: the smallest change we found — no DDP wrapper; gradients are
all-reduced with ``manager.allreduce`` after the backward (errors are reported to the Manager,
``should_commit`` returns False, the step is retried in the next quorum), and the example's
short timeouts (process group 5 s, Manager 30 s).
``--variant tuned``: the workaround with the tight timeouts a user tuning for fast recovery sets
(the harness starts the Lighthouse with ``--heartbeat_timeout_ms 300 --join_timeout_ms 300
--quorum_tick_ms 10``; here the Manager heartbeats every 50 ms, six beats per Lighthouse timeout,
and process group / Manager timeouts are 2 s).

Sample ids (``common.StepLog``): logged before the all-reduce; a committed step whose group sat
the quorum out (``manager.is_participating()`` False while it heals: its gradients are zeroed)
logs ``trained: false``.
The harness runs this script with the newest torchft the registry offers when
``benchmarks/.venv-torchft`` exists (``python benchmarks/matrix.py --setup-torchft``).
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch

from common import GLOBAL_BATCH, MICRO_BATCH, StepLog, add_args, microbatch_indices, tb, train_microbatch


def wait_for_groups(log: StepLog, groups: int, timeout: float = 180.0) -> None:
    """Start training once every replica group is up (a scheduler starts them together): the
    groups' imports take seconds apart on a loaded machine, and with a 300 ms join timeout the
    first quorums would otherwise hold whichever groups were ready.  A replacement group finds
    them all ready and goes on at once."""
    import json
    import time

    log.write("ready", rank=log.rank)
    path, deadline = os.path.join(os.environ["BENCH_OUT"], "steps.jsonl"), time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(path, "rb") as f:
            ready = {json.loads(line)["rank"] for line in f.read().split(b"\n")[:-1] if b'"ready"' in line}
        if len(ready) >= groups:
            return
        time.sleep(0.01)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_args(ap)
    ap.add_argument("--variant", choices=["shipped", "workaround", "tuned"], default="shipped")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    gid, groups = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    log = StepLog(gid)
    net = tb.model()
    base_opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)

    def load_state_dict(sd):
        net.load_state_dict(sd["model"])
        base_opt.load_state_dict(sd["optim"])

    def state_dict():
        return {"model": net.state_dict(), "optim": base_opt.state_dict()}

    # torchrun's agent would host the group's TCPStore at MASTER_ADDR:MASTER_PORT; one process
    # per group here, so the group's rank 0 hosts it (the Manager connects to it as a client).
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 1,
                                       is_master=True, wait_for_workers=False)
    shipped = a.variant == "shipped"
    tuned = a.variant == "tuned"
    pg = ProcessGroupGloo() if shipped else ProcessGroupGloo(timeout=timedelta(seconds=2 if tuned else 5))
    kw = {} if shipped else {"timeout": timedelta(seconds=2 if tuned else 30)}
    if tuned:
        kw.update(quorum_timeout=timedelta(seconds=5), heartbeat_interval=timedelta(milliseconds=50))
    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"bench_{gid}", **kw)
    wait_for_groups(log, groups)
    model = DistributedDataParallel(manager, net) if shipped else net
    opt = Optimizer(manager, base_opt)
    data = tb.dataset()
    per = GLOBAL_BATCH // MICRO_BATCH // groups
    while manager.current_step() < a.steps:
        opt.zero_grad()
        step = manager.current_step()
        mbs = microbatch_indices(step, range(gid * per, (gid + 1) * per))
        for k, idx in enumerate(mbs):
            if k == (per - 1 if shipped else 0):   # before the gradients can reach an all-reduce
                key = log.attempt(step, [i for idx in mbs for i in idx])
            with (model.no_sync() if shipped and k < per - 1 else torch.enable_grad()):
                train_microbatch(model, data, idx, a.mb_sleep, 1.0 / per, gid, step)
        if not shipped:
            works = [manager.allreduce(p.grad) for p in net.parameters() if p.grad is not None]
            for w in works:
                w.wait()
        participants, trained = manager.num_participants(), manager.is_participating()
        opt.step()
        if manager.current_step() > step:
            log.step(step, participants, participants * per * MICRO_BATCH, key=key, trained=trained)
    if manager.participating_rank() == 0:
        log.final(net, a.steps)
    manager.shutdown(wait=False)
    del store
    os._exit(0)


if __name__ == "__main__":
    main()
