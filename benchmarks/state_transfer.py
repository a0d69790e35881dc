"""A recovery's state transfer from one holder and from several (issue 48 item 3), over
rate-limited links between network namespaces.

    python benchmarks/state_transfer.py [--rate 400mbit] [--mb 64] [--repeats 3] [--json F]

Four nodes as Linux network namespaces on a bridge (``tests/_helpers/netns.py``; root and
iproute2), each node's link limited both ways (``tc tbf``: a NIC's two directions), one
process per node in one gloo group.  Every process builds the same replicated tree (``--mb``
MB of float32 parameters in 4 MB tensors, an optimizer state of the same size, a few small
tensors); the members behind (the last ``receivers`` ranks) get it with ``codec.send_tree`` /
``recv_tree`` -- the code a recovery runs (``RecoveryCore._sync``) -- from ``holders`` ranks
sharing the sending (1: the source alone, as before the sharing).  Time: from a barrier before
the transfer to one after it, on rank 0; median of ``--repeats``; the receivers check the tree
bit for bit once.

Cases: one member behind (a replacement: 1 holder vs 3) and two behind (1 holder vs 2).
Limits, honestly: the 2-core machine also runs the 4 processes' copies and gloo's threads; a
Linux bridge, not a switch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

CASES = [(1, 1), (1, 3), (2, 1), (2, 2)]  # (members behind, holders)
PORT = 29611


def tree(mb: int):
    import torch
    g = torch.Generator().manual_seed(0)
    n = max(1, mb // 4)
    return {"model": {f"layer{i}.weight": torch.randn(1 << 20, generator=g) for i in range(n)},
            "optimizer": {"state": {i: {"momentum_buffer": torch.randn(1 << 20, generator=g)} for i in range(n)},
                          "param_groups": [{"lr": 0.1, "momentum": 0.9, "params": list(range(n))}]},
            "small": [torch.randn(7, generator=g) for _ in range(20)]}


def checksum(t) -> int:
    from chameleon_ft.runtime.codec import encode
    _, tensors = encode(t)
    return zlib.crc32(b"".join(x.contiguous().view(-1).numpy().tobytes() for x in tensors))


def worker(a) -> None:
    import torch
    import torch.distributed as dist

    from chameleon_ft.runtime.codec import SHARED_TAG, recv_tree, send_tree
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}:{PORT}", rank=a.rank, world_size=a.world,
                            timeout=timedelta(seconds=300))
    pg = dist.group.WORLD
    send = lambda t, dst, tag: pg.send([t], dst, tag)  # noqa: E731
    recv = lambda t, src, tag: pg.recv([t], src, tag)  # noqa: E731
    wait = lambda works: [w.wait() for w in works]  # noqa: E731
    state, want = tree(a.mb), None
    rows = []
    for behind, n_holders in CASES:
        receivers, holders = list(range(a.world - behind, a.world)), list(range(n_holders))
        times, ok, sent = [], True, 0
        for rep in range(a.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            got = None
            if a.rank in holders:
                sent = send_tree(send, wait, state, receivers, tag=SHARED_TAG, share=(holders.index(a.rank), n_holders))
            elif a.rank in receivers:
                got = recv_tree(recv, wait, holders[0], tag=SHARED_TAG, holders=holders)
            dist.barrier()
            times.append(time.perf_counter() - t0)
            if got is not None and rep == 0:
                want = want if want is not None else checksum(state)
                ok = checksum(got) == want
        v = torch.tensor([int(not ok)], dtype=torch.int64)  # any receiver's tree not bit for bit
        dist.all_reduce(v)
        rows.append({"behind": behind, "holders": n_holders, "s": times, "median_s": statistics.median(times),
                     "bytes_per_receiver": sent if a.rank == 0 else None, "bit_for_bit": int(v) == 0})
    dist.destroy_process_group()
    if a.rank == 0:
        Path(a.out).write_text(json.dumps(rows))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--master", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--rate", default="400mbit")
    p.add_argument("--mb", type=int, default=64, help="MB of parameters (and as much optimizer state)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.worker:
        return worker(a)
    from _helpers import netns
    why = netns.available()
    if why:
        raise SystemExit(f"state_transfer: {why}")
    with tempfile.TemporaryDirectory(prefix="cft-xfer-") as tmp, netns.Net(4) as net:
        shaped = net.limit(a.rate, burst="512kb", both_ways=True)
        out = Path(tmp) / "rows.json"
        procs = [net.run(i, [sys.executable, __file__, "--worker", "--rank", str(i), "--world", "4",
                             "--master", net.addr(0), "--out", str(out), "--mb", str(a.mb), "--repeats", str(a.repeats)],
                         env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"})
                 for i in range(4)]
        for proc in procs:
            proc.wait(timeout=1800)
        if any(proc.returncode for proc in procs):
            raise SystemExit(f"state_transfer: a worker failed: {[proc.returncode for proc in procs]}")
        rows = json.loads(out.read_text())
    res = {"command": "python benchmarks/state_transfer.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "network": shaped, "rows": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    print(markdown(res))
    return res


def markdown(res: dict) -> str:
    base = {r["behind"]: r["median_s"] for r in res["rows"] if r["holders"] == 1}
    lines = [f"`{res['command']}` ({res['date']}; 4 namespace nodes, {res['network']})", "",
             "| members behind | holders sending | MB to each | transfer median (s) (runs) | vs one holder | bit for bit |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        mb = (r["bytes_per_receiver"] or 0) / 2 ** 20
        runs = ", ".join(f"{t:.2f}" for t in r["s"])
        lines.append(f"| {r['behind']} | {r['holders']} | {mb:.1f} | {r['median_s']:.2f} ({runs}) | "
                     f"{base[r['behind']] / r['median_s']:.2f}x | {'yes' if r['bit_for_bit'] else 'NO'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
