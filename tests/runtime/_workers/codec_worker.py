"""One member of test_codec_broadcast: broadcast the test's trees from rank 1 over a gloo group
(file rendezvous) and write what arrived as ``codec.encode``'s skeleton plus the tensors' values."""

import json
import sys

import torch.distributed as dist

from chameleon_ft.runtime.codec import broadcast_tree, encode

sys.path.insert(0, sys.argv[4])
from test_codec_broadcast import trees  # noqa: E402

rank, world, init, _, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
try:
    pg = dist.group.WORLD
    got = [broadcast_tree(lambda fn: fn(pg).wait(), 1, rank, t if rank == 1 else None) for t in trees()]
finally:
    dist.destroy_process_group()
rows = []
for tree in got:
    skeleton, tensors = encode(tree)
    rows.append({"skeleton": skeleton, "tensors": [[str(t.dtype), t.tolist()] for t in tensors]})
with open(out, "w") as f:
    json.dump(rows, f)
