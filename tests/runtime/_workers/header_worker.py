"""Test worker: one member of a fixed 3-member gloo group (no launcher, no membership) that
runs deliberately mismatched collectives through ``GroupManager``'s header check and writes
what each call returned to ``<out>/header_<rank>.json``.

    python header_worker.py --rank R --world 3 --store HOST:PORT --out DIR
"""

import argparse
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from chameleon_ft.runtime.groups import CollectiveFailure, CollectiveMismatch, GroupManager
from chameleon_ft.runtime.membership import MembershipView


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--store", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    host, port = a.store.rsplit(":", 1)

    def client():
        return dist.TCPStore(host, int(port), a.world, False, timedelta(seconds=10))

    r, n = a.rank, a.world
    gm = GroupManager(client(), r, client, op_timeout_s=10.0)
    gm.rebuild(MembershipView(1, tuple(range(n)), r, n, "hdr-test"))
    out: dict = {}

    def step(value: float, size: int = 1000) -> float:
        t = torch.full((size,), value)
        gm.allreduce(t, header="step", copy=False)
        return float(t[0])

    def control(name, fn):
        """Run a control collective; record 'ok' and its value, 'mismatch' or 'skipped'."""
        try:
            out[name] = {"result": "ok", "value": fn()}
        except CollectiveMismatch as exc:
            out[name] = {"result": "skipped" if exc.skipped else "mismatch", "message": str(exc),
                         "peers": [list(x) for x in exc.peers]}

    def reduce(shape):
        t = torch.ones(shape)
        gm.allreduce(t, header="reduce", label="sum")
        return t.tolist()

    def gather(t):
        return [x.tolist() for x in gm.all_gather(t)]

    # A: rank 0 in a barrier while its peers are already in the step's all-reduce.
    if r == 0:
        control("A_barrier", lambda: gm.checked("barrier").tolist() and None)
        control("A_reduce_after", lambda: reduce([2]))  # still realigning: skipped
    out["A_step"] = step(r + 1.0)
    # B: a barrier meets a gather (two control calls).
    if r == 0:
        control("B", lambda: gm.checked("barrier").tolist() and None)
    else:
        control("B", lambda: gather(torch.tensor([float(r)])))
    control("B_after", lambda: reduce([2]))  # everyone realigns: skipped
    out["B_step"] = step(1.0)
    # C: a reduce of different shapes; then a matching reduce moves data again.
    control("C", lambda: reduce([3] if r == 0 else [5]))
    out["C_step"] = step(2.0)
    control("C_live", lambda: reduce([2]))
    # D: gathers of different shapes (same number of dims) and of 8 dims pass the check.
    control("D_gather", lambda: gather(torch.arange(r + 1, dtype=torch.float32)))
    control("D_gather8", lambda: [list(x.shape) for x in
                                  gm.all_gather(torch.zeros([1] * 7 + [r + 1]))])
    # E: runtime collectives that differ cannot be reconciled: the generation is aborted.
    try:
        if r == 0:
            gm.allreduce(torch.zeros(4, dtype=torch.int64), header="sync")
        else:
            step(1.0)
        out["E"] = {"result": "ok"}
    except CollectiveFailure as exc:
        out["E"] = {"result": "failure", "kind": exc.kind, "suspects": list(exc.suspects)}
    with open(os.path.join(a.out, f"header_{r}.json"), "w") as f:
        json.dump(out, f)
    sys.stdout.flush()
    os._exit(0)  # an aborted generation may leave a parked gloo op behind


if __name__ == "__main__":
    sys.exit(main())
