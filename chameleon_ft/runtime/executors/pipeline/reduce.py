"""Gradients reduced among the replicas of each block only (per-stage groups).

Each pipeline holds each block once, so the gradient of block ``b`` over the global batch is
the sum of its alive holders' gradients (a rerouting peer ran the dead stage's micro-batches
too).  Blocks with the same holders form one *reduction set*; every member derives the same
sets from the plan (``holder_sets``), and reduces the sets it belongs to, in that order, one
all-reduce each over a gloo subgroup of the generation (``GroupManager.subgroup``; set up
on first use, rebuilt per generation), so a worker sends its own share of the model, not the
whole model.

The commit stays atomic: the step's small all-reduce over every member (loss, calibration,
timings; ``RecoveryCore._reduce_step``) comes *after* these and is the commit point.  It can
complete somewhere only once every member has contributed to it, hence once every member has
finished its own sets: a member that a failure left one step behind therefore holds the
reduced gradients of its blocks for that step (``staged``) and rolls forward with them.

That commit all-reduce (a few hundred numbers) is ``reduce_at_root``: every member sends its
buffer to rank 0, which adds them in rank order and sends the sum back -- two message latencies
after the last member's contribution, where gloo's ring all-reduce takes 2 (n - 1) (measured on
8 workers sharing 2 cores: 15 ms per step on the critical path).  It completes everywhere or
fails like the ring: a member that got the sum committed, one that did not rolls forward.
"""

from __future__ import annotations

from typing import Iterable

import torch

from chameleon_ft.engine.plan import Plan

__all__ = ["holder_sets", "reduce_at_root", "reduce_sets"]

# Point-to-point tags of the commit: above every step message's (step.py: slot * 1024 + ...,
# for fewer than 2**19 micro-batches a step), below the migration's (migration.py, 2**30 on).
_COMMIT_TAG = 1 << 29


def holder_sets(plan: Plan, alive: Iterable[int], n_blocks: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``[(holders, blocks)]``: the alive workers holding each block under ``plan`` (sorted
    worker ids), blocks with the same holders together, ordered by their first block."""
    alive = set(alive)
    holders: dict[int, list[int]] = {b: [] for b in range(n_blocks)}
    for pipe in plan.pipelines:
        for s, d in enumerate(pipe.devices):
            if d in alive:
                lo, hi = pipe.layers_of_stage(s)
                for b in range(lo, hi):
                    holders[b].append(d)
    sets: dict[tuple[int, ...], list[int]] = {}
    for b in range(n_blocks):
        sets.setdefault(tuple(sorted(holders[b])), []).append(b)
    return sorted(((k, tuple(v)) for k, v in sets.items()), key=lambda kv: kv[1][0])


def reduce_sets(gm, sets, me: int, rank_of: dict[int, int], grads_of, dtype: torch.dtype,
                timeout_s: float) -> dict[int, torch.Tensor]:
    """Sum this member's gradients of every set it belongs to with the set's other holders.
    ``grads_of(b)``: block ``b``'s flat gradient pieces (CPU, ``dtype``).  Returns block ->
    its flat reduced gradient.  Raises ``CollectiveFailure`` like any collective."""
    out: dict[int, torch.Tensor] = {}
    for holders, blocks in sets:
        if me not in holders:
            continue
        pieces = [grads_of(b) for b in blocks]
        buf = torch.cat([t for p in pieces for t in p]) if pieces else torch.zeros(0, dtype=dtype)
        if len(holders) > 1:
            gm.allreduce(buf, copy=False, timeout_s=timeout_s, ranks=[rank_of[w] for w in holders])
        at = 0
        for b, p in zip(blocks, pieces):
            n = sum(t.numel() for t in p)
            out[b] = buf[at:at + n]
            at += n
    return out


def reduce_at_root(gm, buf: torch.Tensor, timeout_s: float) -> None:
    """Sum ``buf`` (CPU) over every member of ``gm``'s generation, in place, through rank 0
    (module doc); the same bits everywhere.  Raises ``CollectiveFailure`` like a collective."""
    n, r = gm.view.world_size, gm.view.rank
    if n == 1:
        return
    if r == 0:
        parts = [torch.empty_like(buf) for _ in range(n - 1)]
        gm.wait_p2p([gm.recv(p, i + 1, _COMMIT_TAG) for i, p in enumerate(parts)], timeout_s)
        for p in parts:  # rank order
            buf += p
        gm.wait_p2p([gm.send(buf, i, _COMMIT_TAG + 1) for i in range(1, n)], timeout_s)
    else:
        mine = buf.clone()
        gm.wait_p2p([gm.send(mine, 0, _COMMIT_TAG), gm.recv(buf, 0, _COMMIT_TAG + 1)], timeout_s)
