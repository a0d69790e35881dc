"""Test worker: one of 2 members of a gloo group built by ``GroupManager`` with a short
construction timeout (``connect_timeout_s``) and a longer op timeout; rank 0 sends after
``--delay`` seconds, rank 1 waits for it with ``wait_p2p``.  Writes ``p2p_<rank>.json``: what
the wait did and how long it took.

    python p2p_worker.py --rank R --store HOST:PORT --delay S --out DIR
"""

import argparse
import json
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from chameleon_ft.runtime.groups import CollectiveFailure, GroupManager
from chameleon_ft.runtime.membership import MembershipView


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--delay", type=float, required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    host, port = a.store.rsplit(":", 1)

    def client():
        return dist.TCPStore(host, int(port), 2, False, timedelta(seconds=10))

    gm = GroupManager(client(), a.rank, client, op_timeout_s=15.0, connect_timeout_s=1.0)
    gm.rebuild(MembershipView(1, (0, 1), a.rank, 2, "p2p-test"))
    t = torch.zeros(4)
    t0 = time.monotonic()
    try:
        if a.rank == 0:
            time.sleep(a.delay)
            gm.wait_p2p([gm.send(torch.arange(4.0), 1, 5)], 15.0)
        else:
            gm.wait_p2p([gm.recv(t, 0, 5)], 15.0)
        out = {"result": "ok", "value": t.tolist()}
    except CollectiveFailure as exc:
        out = {"result": "failure", "message": str(exc)[:300]}
    out["seconds"] = time.monotonic() - t0
    Path(a.out, f"p2p_{a.rank}.json").write_text(json.dumps(out))
    time.sleep(0.5)  # let the peer finish before this side's connections close
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
