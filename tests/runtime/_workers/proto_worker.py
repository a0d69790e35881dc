"""Prototype worker for membership/group tests and MTTR measurements (not a training loop).

Each step all-reduces a tensor filled with ``(worker_id + 1) * (step + 1)``; the correct
result is ``(step + 1) * sum(m + 1 for m in members)``, so a result also proves that every
member reduced the same step.  Every event is one JSON line in ``--log``.  After a failure
the survivors agree on the step to redo (MIN of their counters over the new group): a step
that some members finished and others did not is redone by all.  That is the prototype's
stand-in for the runtime's commit protocol, nothing more.

Run: ``python tests/runtime/_workers/proto_worker.py --worker-id 0 --store 127.0.0.1:PORT
--lighthouse http://127.0.0.1:PORT --log w0.jsonl --steps 100``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from chameleon_ft.runtime.groups import CollectiveFailure, GroupManager
from chameleon_ft.runtime.membership import Membership, MembershipError

_NOT_A_MEMBER_YET = 2**62  # a joiner's step counter; MIN over members ignores it


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker-id", type=int, required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--numel", type=int, default=1024)
    p.add_argument("--step-sleep", type=float, default=0.0, help="emulated compute per step (s)")
    p.add_argument("--min-world", type=int, default=1, help="members needed before starting")
    p.add_argument("--op-timeout", type=float, default=10.0, help="gloo per-op timeout (s)")
    p.add_argument("--collective-timeout", type=float, default=None,
                   help="watchdog for one collective (s); default: --op-timeout")
    p.add_argument("--connect-timeout", type=float, default=5.0)
    p.add_argument("--view-timeout", type=float, default=30.0)
    p.add_argument("--heartbeat", type=float, default=0.1)
    p.add_argument("--heartbeat-timeout", type=float, default=1.0, help="Membership.heartbeat_timeout_s")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)

    logf = open(a.log, "a", buffering=1)

    def emit(event: str, **kw) -> None:
        kw.update(event=event, worker=a.worker_id, ts=time.time(), pid=os.getpid())
        logf.write(json.dumps(kw) + "\n")

    try:
        m = Membership(a.worker_id, a.store, a.lighthouse, heartbeat_interval_s=a.heartbeat,
                       connect_timeout_s=a.connect_timeout, heartbeat_timeout_s=a.heartbeat_timeout)
        view = m.join(min_world_size=a.min_world, timeout_s=a.view_timeout)
    except MembershipError as exc:
        emit("error", message=str(exc))
        print(f"worker {a.worker_id}: {exc}", file=sys.stderr, flush=True)
        logf.close()
        return 3
    emit("view", phase="join", generation=view.generation, members=list(view.members),
         token=view.token)
    gm = GroupManager(m.store, a.worker_id, m.connect_store, op_timeout_s=a.op_timeout,
                      connect_timeout_s=a.connect_timeout)
    step = _NOT_A_MEMBER_YET
    collective_timeout = a.collective_timeout or a.op_timeout

    def agree_step(local: int) -> int:
        t = torch.tensor([local], dtype=torch.int64)
        gm.allreduce(t, op=dist.ReduceOp.MIN, timeout_s=collective_timeout)
        agreed = int(t.item())
        return 0 if agreed == _NOT_A_MEMBER_YET else agreed

    def establish(view, failure=None):
        """Rebuild on ``view``; on another failure, reconfigure again (never deadlock)."""
        nonlocal step
        t_detect = time.time()
        while True:
            t_view = time.time()
            try:
                gm.rebuild(view)
                t_group = time.time()
                step = agree_step(step)
                emit("rebuilt", generation=view.generation, members=list(view.members),
                     token=view.token, step=step, t_detect=t_detect, t_view=t_view,
                     t_group=t_group, after_failure=failure is not None)
                return view
            except CollectiveFailure as exc:
                emit("failure", kind=exc.kind, generation=exc.generation, where="rebuild",
                     suspects=list(exc.suspects), message=str(exc)[:300])
                failure = exc
                m.report_failure(exc.suspects, f"{exc.kind}: {str(exc)[:200]}")
                # after=: the watcher may have agreed on the next generation already; asking
                # after the current one would end that one and leave out whoever took it
                view = m.next_view(a.view_timeout, after=view.token)
                emit("view", phase="recover", generation=view.generation,
                     members=list(view.members), token=view.token)

    try:
        view = establish(view)
        while step < a.steps:
            if a.step_sleep:
                time.sleep(a.step_sleep)
            t = torch.full((a.numel,), float((a.worker_id + 1) * (step + 1)))
            try:
                gm.allreduce(t, timeout_s=collective_timeout, copy=False)
            except CollectiveFailure as exc:
                t_detect = time.time()
                emit("failure", kind=exc.kind, generation=exc.generation, where="step",
                     step=step, suspects=list(exc.suspects), reporter=exc.reporter,
                     message=str(exc)[:300], t_detect=t_detect)
                m.report_failure(exc.suspects, f"{exc.kind}: {str(exc)[:200]}")
                view = m.next_view(a.view_timeout, after=exc.token or view.token)
                emit("view", phase="recover", generation=view.generation,
                     members=list(view.members), token=view.token)
                view = establish(view, exc)
                continue
            expected = float((step + 1) * sum(w + 1 for w in view.members))
            got = float(t[0].item())
            emit("step", step=step, generation=view.generation, members=list(view.members),
                 token=view.token, result=got, expected=expected,
                 ok=bool(torch.all(t == expected).item()))
            step += 1
        emit("done", generation=view.generation, members=list(view.members), step=step,
             liveness_requests=m._monitor.requests, judged_by_coordinator=m.judged_by_coordinator)
        _finish_together(m.connect_store(), view, a.op_timeout)
        return 0
    except MembershipError as exc:
        emit("error", message=str(exc))
        return 3
    finally:
        logf.flush()
        m.close()


def _finish_together(store, view, timeout_s: float) -> None:
    """Stay until every member of the final view has finished its last step.  gloo lets one
    member finish an all-reduce before the others have all their bytes; a member that exited
    at once could fail its peers' last step (the runtime's commit protocol adopts such a step;
    this prototype would redo it on a smaller view).  A member that died meanwhile ends the
    wait at ``timeout_s``."""
    key = f"proto/finished/{view.token}"
    store.add(key, 1)
    deadline = time.time() + timeout_s
    while time.time() < deadline and store.add(key, 0) < len(view.members):
        time.sleep(0.02)


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # An abandoned gloo op may still block a thread until its timeout; don't let the
    # interpreter's teardown (process-group destructors) wait for it.
    os._exit(rc)
