"""``codec.broadcast_tree`` over a real gloo group of 3 processes: small trees travel inline in
the first broadcast, a skeleton or tensors over ``INLINE_BYTES`` in broadcasts of their own;
every member gets the root's tree, tensors bit for bit."""

from __future__ import annotations

import math
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chameleon_ft.runtime.codec import INLINE_BYTES, broadcast_tree


def _trees() -> list:
    g = torch.Generator().manual_seed(7)
    return [
        {"a": 1, "t": (1.5, float("nan")), "none": None},  # skeleton only, inline
        {"x": torch.arange(10, dtype=torch.float64), "i": torch.tensor([3], dtype=torch.int64)},  # both inline
        {"big": "y" * (2 * INLINE_BYTES), "t": torch.ones(3)},  # skeleton too big: its own broadcast
        {"w": torch.randn(INLINE_BYTES, generator=g), "k": 2},  # tensors too big: their own broadcast
        {},
    ]


def _worker(rank: int, world: int, port: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        pg = dist.group.WORLD
        got = [broadcast_tree(lambda fn: fn(pg).wait(), 1, rank, t if rank == 1 else None) for t in _trees()]
        q.put((rank, got))
    finally:
        dist.destroy_process_group()


def _same(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    if isinstance(x, float) and math.isnan(x):
        return isinstance(y, float) and math.isnan(y)
    return x == y


def test_every_member_gets_the_roots_tree_inline_or_not():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 3, port, q)) for r in range(3)]
    for p in procs:
        p.start()
    try:
        got = dict(q.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    for rank in range(3):
        assert len(got[rank]) == len(_trees())
        for want, have in zip(_trees(), got[rank]):
            assert _same(want, have), (rank, want.keys())
