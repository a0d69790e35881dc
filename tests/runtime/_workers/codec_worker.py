"""One member of test_codec_broadcast: broadcast the test's trees from rank 1 over a gloo group
(file rendezvous), then send the point-to-point trees from rank 1 to rank 2 only (rank 0 stands
by), and write what arrived as ``codec.encode``'s skeleton plus the tensors' values (and, on
rank 1, the bytes it sent)."""

import json
import sys

import torch.distributed as dist

from chameleon_ft.runtime.codec import broadcast_tree, recv_tree, send_tree

sys.path.insert(0, sys.argv[4])
from test_codec_broadcast import as_rows, p2p_trees, trees  # noqa: E402

rank, world, init, _, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
try:
    pg = dist.group.WORLD
    got = [broadcast_tree(lambda fn: fn(pg).wait(), 1, rank, t if rank == 1 else None) for t in trees()]
    send = lambda t, dst, tag: pg.send([t], dst, tag)  # noqa: E731
    recv = lambda t, src, tag: pg.recv([t], src, tag)  # noqa: E731
    wait = lambda works: [w.wait() for w in works]  # noqa: E731
    sent, p2p = [], []
    for t in p2p_trees():
        if rank == 1:
            sent.append(send_tree(send, wait, t, [2]))
        elif rank == 2:
            p2p.append(recv_tree(recv, wait, 1))
    dist.barrier()
finally:
    dist.destroy_process_group()
with open(out, "w") as f:
    json.dump({"broadcast": as_rows(got), "p2p": as_rows(p2p), "sent": sent}, f)
