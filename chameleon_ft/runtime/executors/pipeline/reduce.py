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

Rank 0 posts its receives of the next commit when the step starts (``post_commit``; the
buffer's size is the generation's, known from its first commit): gloo moves a message only once
its receive is posted, so otherwise each contribution waited for rank 0 to reach the commit
(a round trip through every member on the critical path).  Posted early, the contributions
arrive while rank 0 (stage 0: the last to finish a 1F1B step) still computes: its wait for them
0.4 ms, of a commit of 6-8 ms a step (the sum and the sends back;
``benchmarks/pipeline_profile.py``, 2026-12-03).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from chameleon_ft.engine.plan import Plan

__all__ = ["CommitPosts", "holder_sets", "post_commit", "reduce_at_root", "reduce_sets"]

# Point-to-point tags of the commit: above every step message's (step.py: slot * 1024 + ...,
# for fewer than 2**19 micro-batches a step), below the migration's (migration.py, 2**30 on).
_COMMIT_TAG = 1 << 29


def holder_sets(plan: Plan, alive: Iterable[int], n_blocks: int, extra: Optional[dict] = None
                ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``[(holders, blocks)]``: the alive workers holding each block under ``plan`` (sorted
    worker ids), blocks with the same holders together, ordered by their first block.
    ``extra``: block -> more workers that take part in its reduction (an overlapped migration's
    shadow holders, ``overlap.py``)."""
    alive = set(alive)
    holders: dict[int, list[int]] = {b: [] for b in range(n_blocks)}
    for pipe in plan.pipelines:
        for s, d in enumerate(pipe.devices):
            if d in alive:
                lo, hi = pipe.layers_of_stage(s)
                for b in range(lo, hi):
                    holders[b].append(d)
    for b, ws in (extra or {}).items():  # (members of the generation, alive or waiting for a slot)
        holders[b].extend(w for w in ws if w not in holders[b])
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


def post_commit(gm, numel: int, dtype: torch.dtype) -> list:
    """Rank 0: the receives of the next commit's contributions, posted now (module doc):
    ``[(work, buffer)]`` for ranks 1..n-1, for ``reduce_at_root(posted=...)``; [] elsewhere."""
    n, r = gm.view.world_size, gm.view.rank
    if r != 0 or n == 1:
        return []
    parts = [torch.empty(numel, dtype=dtype) for _ in range(n - 1)]
    return [(gm.recv(p, i + 1, _COMMIT_TAG), p) for i, p in enumerate(parts)]


def reduce_at_root(gm, buf: torch.Tensor, timeout_s: float, posted: list = ()) -> None:
    """Sum ``buf`` (CPU) over every member of ``gm``'s generation, in place, through rank 0
    (module doc); the same bits everywhere.  ``posted``: rank 0's receives from
    ``post_commit`` on this generation's group, of ``buf``'s size.  Raises
    ``CollectiveFailure`` like a collective."""
    n, r = gm.view.world_size, gm.view.rank
    if n == 1:
        return
    if r == 0:
        if posted:
            if len(posted) != n - 1 or any(p.numel() != buf.numel() or p.dtype != buf.dtype for _, p in posted):
                raise RuntimeError("the commit's posted receives do not match its buffer")  # a bug, not a failure
            works, parts = [w for w, _ in posted], [p for _, p in posted]
        else:
            parts = [torch.empty_like(buf) for _ in range(n - 1)]
            works = [gm.recv(p, i + 1, _COMMIT_TAG) for i, p in enumerate(parts)]
        gm.wait_p2p(works, timeout_s)
        for p in parts:  # rank order
            buf += p
        gm.wait_p2p([gm.send(buf, i, _COMMIT_TAG + 1) for i in range(1, n)], timeout_s)
    else:
        mine = buf.clone()
        gm.wait_p2p([gm.send(mine, 0, _COMMIT_TAG), gm.recv(buf, 0, _COMMIT_TAG + 1)], timeout_s)


class CommitPosts:
    """Rank 0's early-posted receives of the commit, per generation (module doc): ``post``
    when a step starts (once the generation's commit size is known), ``reduce`` at its commit."""

    def __init__(self) -> None:
        self.size: tuple = (None, 0)  # (generation token, the commit buffer's elements)
        self.posted: tuple = (None, [])  # (generation token, post_commit's receives)

    def post(self, gm, token, dtype: torch.dtype) -> None:
        if self.size[0] == token and self.posted[0] != token:  # (a redone step keeps its posts)
            self.posted = (token, post_commit(gm, self.size[1], dtype))

    def reduce(self, gm, token, buf: torch.Tensor, timeout_s: float) -> None:
        posted = self.posted[1] if self.posted[0] == token else []
        self.posted, self.size = (None, []), (token, buf.numel())  # the next step posts anew
        reduce_at_root(gm, buf, timeout_s, posted)
