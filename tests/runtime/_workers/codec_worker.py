"""One member of test_codec_broadcast: broadcast the test's trees from rank 1 over a gloo group
(file rendezvous), then send the point-to-point trees from rank 1 to rank 2 only (rank 0 stands
by), then the same trees from ranks 1 and 0 together (``share``), and write what arrived as ``codec.encode``'s skeleton plus the tensors' values (and, on
rank 1, the bytes it sent)."""

import json
import sys

import torch.distributed as dist

from chameleon_ft.runtime.codec import SHARED_TAG, broadcast_tree, recv_tree, send_tree

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
    # The same trees held by ranks 1 and 0, sent to rank 2 together (rank 1 first: the skeleton).
    holders, shared, counted = [1, 0], [], []
    for t in p2p_trees():
        if rank in holders:
            n = [0]
            send_counted = lambda t_, dst, tag, n=n: (n.__setitem__(0, n[0] + 1), send(t_, dst, tag))[1]  # noqa: E731
            send_tree(send_counted, wait, t, [2], tag=SHARED_TAG, share=(holders.index(rank), 2))
            counted.append(n[0])
        else:
            shared.append(recv_tree(recv, wait, 1, tag=SHARED_TAG, holders=holders))
    dist.barrier()
finally:
    dist.destroy_process_group()
with open(out, "w") as f:
    json.dump({"broadcast": as_rows(got), "p2p": as_rows(p2p), "sent": sent, "shared": as_rows(shared),
               "messages": counted}, f)
