"""The flat rows of a sharded state: which elements a member holds, and the pure helpers that
flatten, slice and check them.

FSDP2 shards every parameter on dim 0 in ``S = world / R`` chunks (``R`` replica groups);
chunk ``k`` of every parameter (and of every optimizer tensor of that parameter's shape) makes
*row* ``k``, held by the members with ``rank % S == k``.  A row in memory is one flat vector:
the parameters' chunks, then each tensor state's chunks in the same order (its *blocks*).  A
re-shard builds each new row from the old rows' overlaps with it (``_overlaps``: per parameter,
the intersection of two dim-0 ranges), so nothing is assembled whole on the way.

No process state and no communication here.  Limits: dim-0 sharding as FSDP2's default
``Shard(0)`` places it (``ceil(d0 / S)`` slices per chunk, the last ones possibly short or
empty); parameters of one dtype.
"""

from __future__ import annotations

import math
import zlib
from typing import Callable, Optional

import torch


class _Layout:
    """Rows of the flat state for a sharding over ``shards`` (FSDP2's dim-0 chunks)."""

    def __init__(self, shapes: list[torch.Size], world: int, replicas: int):
        self.world, self.replicas = world, replicas
        self.shards = world // replicas
        self.shapes = shapes
        self.numels = [math.prod(s) for s in shapes]
        self.offsets = [0]
        for k in self.numels:
            self.offsets.append(self.offsets[-1] + k)
        self.total = self.offsets[-1]

    def row_of(self, rank: int) -> int:
        return rank % self.shards

    def segments(self, row: int) -> list[tuple[int, int]]:
        """Flat ranges ``[start, stop)`` of ``row``, one per parameter (empty where a parameter
        has fewer dim-0 slices than rows), in the order of the parameters' local shards."""
        out = []
        for shape, off in zip(self.shapes, self.offsets):
            d0 = shape[0] if len(shape) else 1
            rest = math.prod(shape[1:]) if len(shape) > 1 else 1
            c = -(-d0 // self.shards)
            lo, hi = min(row * c, d0), min((row + 1) * c, d0)
            out.append((off + lo * rest, off + hi * rest))
        return out

    def numel(self, row: int) -> int:
        return sum(b - a for a, b in self.segments(row))

    def to_json(self) -> list[int]:
        return [self.world, self.replicas]


def _overlaps(src: list[tuple[int, int]], dst: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(offset in the source row, offset in the destination row, length) of every flat range
    two rows share; both are segment lists of the same parameters (``_Layout.segments``)."""
    out, so, do = [], 0, 0
    for (a1, b1), (a2, b2) in zip(src, dst):
        lo, hi = max(a1, a2), min(b1, b2)
        if lo < hi:
            out.append((so + lo - a1, do + lo - a2, hi - lo))
        so, do = so + b1 - a1, do + b2 - a2
    return out


def _copy_overlaps(dst: torch.Tensor, m: int, dst_segs, src: torch.Tensor, mk: int, src_segs,
                   parts: int) -> None:
    """Copy into ``dst`` (``parts`` blocks of ``m``: parameters, then each state) what the
    source row ``src`` (blocks of ``mk``) shares with it.  A snapshot taken before the
    optimizer had state carries the parameters only: its missing blocks are left alone."""
    avail = min(parts, src.numel() // mk) if mk else 0
    for so, do, n in _overlaps(src_segs, dst_segs):
        for j in range(avail):
            dst[j * m + do:j * m + do + n] = src[j * mk + so:j * mk + so + n]


def _restored(plan: dict, new: _Layout, row: int) -> list[tuple[int, int]]:
    """(offset, length) in ``new``'s ``row`` of the elements a rehabilitation restored from a
    stale snapshot (the plan's lost rows of the old layout)."""
    old = _Layout(new.shapes, *plan["old"])
    return [(at, n) for k in plan["decision"]["lost_rows"]
            for _, at, n in _overlaps(old.segments(k), new.segments(row))]


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().contiguous().view(torch.uint8).numpy().tobytes())


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def _state_keys(optimizer: torch.optim.Optimizer, params) -> list[str]:
    """The optimizer's per-parameter states shaped like their parameter (sharded like it)."""
    keys = set()
    for p in params:
        for k, v in optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and _local(v).shape == _local(p).shape:
                keys.add(k)
    return sorted(keys)


def _scalars(optimizer: torch.optim.Optimizer, params, keys) -> dict:
    """Per-parameter optimizer state that is not sharded (e.g. Adam's step), by index."""
    return {i: {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                for k, v in optimizer.state.get(p, {}).items() if k not in keys}
            for i, p in enumerate(params)}


def _flatten(tensors, state: Callable[[int, str], Optional[torch.Tensor]], keys, dtype) -> torch.Tensor:
    """``tensors`` flattened, then for each key every tensor's state (zeros where it has none)."""
    parts = [t.detach().reshape(-1) for t in tensors]
    for key in keys:
        for i, t in enumerate(tensors):
            v = state(i, key)
            parts.append(_local(v).detach().reshape(-1) if v is not None
                         else torch.zeros(t.numel(), dtype=dtype, device=t.device))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)


def _unflatten_into(flat: torch.Tensor, tensors) -> None:
    """Copy consecutive pieces of ``flat`` into ``tensors`` (in place)."""
    at = 0
    for t in tensors:
        t.copy_(flat[at:at + t.numel()].view_as(t))
        at += t.numel()
