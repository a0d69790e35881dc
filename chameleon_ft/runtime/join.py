"""Joining a running job: the membership, the first generation's group and its view.

``RecoveryCore.start`` joins by itself; an adapter whose framework needs collectives before the
model, optimizer and data exist (Lightning: logger versions, checkpoint directories, the sanity
check) calls ``join_job`` early and hands the result to ``start``."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from chameleon_ft.runtime.config import ElasticConfig
from chameleon_ft.runtime.env import WorkerEnv
from chameleon_ft.runtime.etcd import is_etcd
from chameleon_ft.runtime.groups import CollectiveFailure, GroupManager
from chameleon_ft.runtime.membership import Membership, MembershipError, MembershipView
from chameleon_ft.runtime.nccl import NcclData, choose_backend, configure_env

__all__ = ["Joined", "join_job"]


class Joined(NamedTuple):
    """A worker that joined the job: its membership, group manager and first view."""

    membership: Membership
    gm: GroupManager
    view: MembershipView


def join_job(env: WorkerEnv, cfg: ElasticConfig, hang_timeout_s: Optional[float] = None) -> Joined:
    """Join the job's membership and form the first generation's group.

    ``DataParallelExecutor.start`` does this itself; an adapter whose framework needs collectives
    before the model, optimizer and data exist (Lightning: logger versions, checkpoint
    directories, the sanity check) calls it early and passes the result to ``start``."""
    timeout = float(hang_timeout_s or cfg.hang_timeout_s or env.hang_timeout_s)
    membership = Membership(env.worker_id, env.store, env.lighthouse,
                            heartbeat_interval_s=cfg.heartbeat_s,
                            connect_timeout_s=cfg.connect_timeout_s,
                            heartbeat_timeout_s=env.heartbeat_timeout_s, cut_off_s=env.cut_off_s,
                            quorum_wait_s=env.quorum_wait_s)
    nccl = None
    if choose_backend(env.local_rank, env.local_world_size) == "nccl":
        configure_env()
        device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        nccl = NcclData(device, timeout)
    gm = GroupManager(membership.store, env.worker_id, membership.connect_store, nccl=nccl,
                      op_timeout_s=timeout, connect_timeout_s=cfg.connect_timeout_s,
                      paused=membership.paused, abort_seen=membership.abort_seen,
                      pause_limit_s=membership.pause_limit_s(), coordinator=f"the coordinator at {env.store}",
                      # etcd: every abort poll is an HTTP request (the watcher polls too)
                      abort_poll_s=0.02 if is_etcd(env.store) else 0.005)
    membership.on_early_view = gm.prebuild  # the next group's set-up overlaps compute
    min_world = env.min_world_size if env.replacement == 0 else 1
    try:
        view = membership.join(min_world_size=min_world, timeout_s=cfg.join_timeout_s)
    except dist.DistError as exc:  # the coordinator's store went away while joining
        raise MembershipError(f"worker {env.worker_id}: lost the coordinator at {env.store} while "
                              f"joining: {exc}") from exc
    try:
        gm.rebuild(view)
    except CollectiveFailure:
        pass  # the generation is aborted; DataParallelExecutor.start recovers from it
    return Joined(membership, gm, view)
