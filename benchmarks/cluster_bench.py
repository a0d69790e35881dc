"""Recovery across nodes (issue 24): MTTR of a lost worker, a lost node and a partitioned node
over a real (namespace) network, with the embedded coordinator and with etcd.

    python benchmarks/cluster_bench.py [--repeats 5] [--markdown docs/benchmarks-cluster.md]

Three nodes as Linux network namespaces on a bridge (``tests/_helpers/netns.py``; root and
iproute2; etcd for the etcd rows), one ``chameleon-ft run --nnodes 3`` per namespace with 2
workers (``tests/runtime/_workers/mlp_worker.py``, ``ElasticTrainer``, data parallel, 6 epochs
of 8 steps, 20 ms of emulated compute per micro-batch; the ``/accelerate`` cases run
``tests/accelerate/_workers/acc_train.py``, an Accelerate loop with ``FaultTolerantAccelerator``,
gradient accumulation 2, an evaluation per epoch, from step 8).  At step 5, from outside:

* **worker**: one worker of node 1 SIGKILLed (by PID);
* **node**: every process of node 1 SIGKILLed (its launcher and workers; with etcd, node 0
  and its etcd member);
* **partition**: node 2's link taken down at the bridge (nothing is reset: found by heartbeats;
  with etcd, node 2's etcd member is cut off with it).

With etcd, whether the lost or cut-off node held etcd's leader is recorded (``etcd_leader_hit``,
asked of etcd with ``etcdctl endpoint status`` a few steps before the fault, so that the asking
does not push the fault past its step; each run records the step it landed at, ``fault_step``): such a run
includes etcd's election, during which no request that needs the quorum is answered (500 ms
election timeout in these tests; ``--etcd-election-ms`` sets it, heartbeats a tenth of it).
``--etcd-leader hit`` (``spared``) moves the leadership onto (away from) the node about to fail
at that point (``etcdctl move-leader``), so that each case is measured on purpose rather than
as the election happened to fall; ``any`` (the default) leaves it where it is.

MTTR = the first step a survivor attempts after the fault (its event-log record) - the moment
the fault was made (wall clocks of one machine).  For a partition also the detection (the
survivors' recovery record: collective start to failure) and the moment the minority's
launcher exited by itself, and a survivor's recovery record by phase (where the time goes).
Medians over ``--repeats``; every run's figure in the table.

Limits, honestly: one 2-core machine plays three nodes; the network is a Linux bridge.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "runtime" / "_workers")]

from chameleon_ft.runtime.eventlog import MTTR_PHASES, resumed_after  # noqa: E402
from elastic_job import Job  # noqa: E402
from chameleon_ft.cli.localjob import LocalJob  # noqa: E402
from _helpers import netns  # noqa: E402

PORT = 29531
ACC_SCRIPT = ROOT / "tests" / "accelerate" / "_workers" / "acc_train.py"


def _job(adapter: str, run: Path):
    if adapter == "accelerate":  # an Accelerate loop (FaultTolerantAccelerator), the same workers
        return LocalJob(run, ACC_SCRIPT, ["--out", str(run), "--epochs", "12", "--mb-sleep", "0.02"], nproc=2,
                        hang_timeout=10)
    return Job(run, nproc=2, epochs=6, mb_sleep=0.02, hang_timeout=10)


def _members(net, endpoints: list) -> tuple[list[int], Optional[int]]:
    """The etcd members' ids, in the order of ``endpoints``, and the index of the one that says
    it leads (None if none does): one ``etcdctl endpoint status``."""
    st = net.etcdctl("endpoint", "status", "-w", "json", endpoints=endpoints)
    if st.returncode != 0:
        raise RuntimeError(f"etcdctl endpoint status: {st.stderr}")
    status = [s["Status"] for s in json.loads(st.stdout)]
    ids = [s["header"]["member_id"] for s in status]
    return ids, next((i for i, s in enumerate(status) if s["header"]["member_id"] == s["leader"]), None)


def etcd_leader(net, endpoints: list) -> Optional[int]:
    """The node whose etcd member leads now, or None."""
    return _members(net, endpoints)[1]


def move_leader(net, endpoints: list, onto: Optional[int] = None, off: Optional[int] = None) -> None:
    """Move etcd's leadership onto node ``onto``, or off node ``off`` (to the next node), unless
    it is already where asked."""
    ids, lead = _members(net, endpoints)
    if lead is None:
        raise RuntimeError("etcd has no leader to move")
    target = onto if onto is not None else (lead if lead != off else (off + 1) % len(ids))
    if target == lead:
        return
    r = net.etcdctl("move-leader", format(ids[target], "x"), endpoints=[endpoints[lead]])
    if r.returncode != 0:
        raise RuntimeError(f"etcdctl move-leader: {r.stdout} {r.stderr}")


def one(kind: str, backend: str, work: Path, adapter: str = "elastic", leader: str = "any",
        election_ms: int = 500) -> dict:
    with netns.Net(3) as net:
        flags = ["--nnodes", "3"]
        if backend == "etcd":
            eps = net.etcd_up(str(work / "etcd"), election_ms=election_ms)
            flags += ["--rdzv-backend", "etcd", "--rdzv-endpoint", ",".join(eps), "--rdzv-id", f"b{os.getpid()}"]
        else:
            flags += ["--rdzv-endpoint", f"{net.addr(0)}:{PORT}"]
        (work / "run").mkdir(parents=True)
        job = _job(adapter, work / "run")
        try:
            for i in range(3):
                job.start(extra=[*flags, "--node-rank", str(i)], wrap=net.wrap(i))
            out = {}
            victim = 0 if backend == "etcd" else 1  # with etcd: node 0 holds an etcd member too
            if backend == "etcd":  # a lost or cut-off leader costs an etcd election first
                job.wait_step(2, 180)  # (asked before the step is awaited: an etcdctl call or three)
                lost = 2 if kind == "partition" else victim
                if leader != "any":
                    move_leader(net, eps, **({"onto": lost} if leader == "hit" else {"off": lost}))
                out["etcd_leader_hit"] = etcd_leader(net, eps) == lost
            job.wait_step(5 if adapter == "elastic" else 8, 180)
            if kind == "worker":
                t = job.kill(2 * victim + 1)
            elif kind == "node":
                t = net.kill_node(victim)
            else:
                t = net.partition(2)
                job.launchers[2].wait(60)
                out["minority_exit_s"] = time.time() - t
            live = [p for i, p in enumerate(job.launchers) if not (kind != "worker" and i == (2 if kind == "partition" else victim))]
            codes = [p.wait(180) for p in live]
            evs = job.events()
        finally:
            job.cleanup()
        if codes != [0] * len(codes):
            raise RuntimeError(f"{kind}/{backend}: {codes}\n{job.output()[-3000:]}")
        out["mttr_s"] = resumed_after(evs, t)
        out["fault_step"] = max((e["step"] for e in evs if e["event"] == "step" and e["ts"] <= t), default=None)
        rec = [e for e in evs if e["event"] == "recovery" and e["ts"] > t]
        if rec:
            out["detect_s"] = rec[0]["mttr"]["detect"]
            out["recovery_s"] = rec[0]["mttr"]["total"]
            out["phases"] = {k: rec[0]["mttr"][k] for k in MTTR_PHASES if k in rec[0]["mttr"]}
        return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--cases", default="worker/c10d,node/c10d,partition/c10d,node/etcd,partition/etcd,"
                                      "node/c10d/accelerate,partition/c10d/accelerate,node/etcd/accelerate,"
                                      "partition/etcd/accelerate",
                   help="KIND/BACKEND[/accelerate] (default: ElasticTrainer)")
    p.add_argument("--etcd-leader", choices=("any", "hit", "spared"), default="any",
                   help="etcd's leader moved onto (hit) or off (spared) the node about to fail, or left (any)")
    p.add_argument("--etcd-election-ms", type=int, default=500,
                   help="etcd's election timeout (heartbeats a tenth of it; default 500)")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    a = p.parse_args(argv)
    why = netns.available()
    if why:
        raise SystemExit(f"cluster_bench: {why}")
    res: dict = {"command": "python benchmarks/cluster_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cases": {},
                 "etcd_election_ms": a.etcd_election_ms, "etcd_leader": a.etcd_leader}
    for case in a.cases.split(","):
        kind, backend, *adapter = case.split("/")
        runs = []
        for r in range(a.repeats):
            with tempfile.TemporaryDirectory(prefix="cft-cluster-") as tmp:
                runs.append(one(kind, backend, Path(tmp), *adapter, leader=a.etcd_leader,
                                election_ms=a.etcd_election_ms))
            print(case, r, json.dumps(runs[-1]), flush=True)
        res["cases"][case] = runs
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    text = markdown(res)
    if a.markdown:
        Path(a.markdown).write_text(text)
    print(text)
    return res


def markdown(res: dict) -> str:
    names = {"worker/c10d": "one worker of node 1 killed (embedded coordinator)",
             "node/c10d": "node 1 killed: launcher + workers (embedded coordinator)",
             "partition/c10d": "node 2's link down (embedded coordinator)",
             "node/etcd": "node 0 killed with its etcd member (etcd backend)",
             "partition/etcd": "node 2's link down, its etcd member with it (etcd backend)"}
    names.update({f"{k}/accelerate": f"{v}, Accelerate" for k, v in list(names.items())})
    lines = ["# Recovery across nodes (network namespaces)", "",
             f"`{res['command']}` ({res['date']}; 3 namespace nodes x 2 workers on one 2-core machine; "
             "method in `benchmarks/cluster_bench.py`).  MTTR: fault -> the survivors' first step; `*`: "
             "the lost or cut-off node held etcd's leader, so the figure includes etcd's election "
             f"({res.get('etcd_election_ms', 500)} ms election timeout here).", "",
             "| fault | MTTR median (runs) | median without etcd's leader hit | detection median | minority's launcher exited after |",
             "| --- | --- | --- | --- | --- |"]
    for case, runs in res["cases"].items():
        med = lambda key: statistics.median(r[key] for r in runs if key in r) if any(key in r for r in runs) else None  # noqa: E731
        fmt = lambda x: "-" if x is None else f"{x:.3f} s"  # noqa: E731
        each = ", ".join(f"{r['mttr_s']:.3f}" + ("*" if r.get("etcd_leader_hit") else "") for r in runs)
        calm = [r["mttr_s"] for r in runs if r.get("etcd_leader_hit") is False]
        lines.append(f"| {names.get(case, case)} | {fmt(med('mttr_s'))} ({each}) | "
                     f"{fmt(statistics.median(calm)) if calm else '-'} | {fmt(med('detect_s'))} | "
                     f"{fmt(med('minority_exit_s'))} |")
    lines += ["", "Where the time goes (medians, s; a survivor's recovery record): *detect* = the failed "
              "collective's start to its failure, then the new generation's *membership* agreed, the groups "
              "*rebuild*, the *state_transfer* (and the engine's decision), the *first_step* of the new "
              "generation committed; *recovery* is their sum.", "",
              "| fault | " + " | ".join(MTTR_PHASES) + " | recovery |", "| --- |" + " --- |" * (len(MTTR_PHASES) + 1)]
    for case, runs in res["cases"].items():
        cells = []
        for k in MTTR_PHASES:
            xs = [r["phases"][k] for r in runs if k in r.get("phases", {})]
            cells.append(f"{statistics.median(xs):.3f}" if xs else "-")
        tot = [r["recovery_s"] for r in runs if "recovery_s" in r]
        cells.append(f"{statistics.median(tot):.3f}" if tot else "-")
        lines.append(f"| {names.get(case, case)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
