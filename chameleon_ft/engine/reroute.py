"""Reroute arithmetic: which state of a plan no alive device holds, and how a dead device's
micro-batches spread over its same-stage data-parallel peers (the ``reroute`` candidate and the
pipeline schedule's hop to a peer).
"""

from __future__ import annotations

import heapq
from typing import Iterable

from chameleon_ft.engine.plan import Plan


def _stage_counts(plan: Plan, alive: set[int]) -> dict[tuple, int]:
    """Alive devices per (layer bounds, shard index, stage) — grouped by pipeline template so
    that this costs O(pipelines + dead devices), not O(devices)."""
    k = plan.shard_degree
    counts = {(bounds, q, s): len(js) for (bounds, q), js in plan.templates().items() for s in range(len(bounds) - 1)}
    for d in plan.device_set.difference(alive):
        j, s = plan.locate(d)
        counts[(plan.pipelines[j].bounds, j % k, s)] -= 1
    return counts


def unreplicated(plan: Plan, alive: Iterable[int]) -> list[tuple[int, int, int, int]]:
    """State of ``plan`` that no alive device holds: (first layer, stop, shard, degree)."""
    k = plan.shard_degree
    counts = _stage_counts(plan, set(alive))
    n = plan.pipelines[0].bounds[-1]
    lost = []
    for q in range(k):
        covered = sorted((b[s], b[s + 1]) for (b, qq, s), c in counts.items() if qq == q and c > 0)
        at = 0
        for a, b in covered:
            if a > at:
                lost.append((at, a, q, k))
            at = max(at, b)
        if at < n:
            lost.append((at, n, q, k))
    return lost


def reroute_load(plan: Plan, dead: set[int], alive: set[int]) -> tuple[dict[int, float], str]:
    """Extra micro-batches per same-stage peer, or ({}, why rerouting is impossible).

    Peers of a dead device are the alive devices of other pipelines that hold exactly its
    layers (same split, same stage, same shard).  The dead devices' micro-batches of one such
    peer group are pooled and handed out one at a time to the peer with the lowest load (its
    pipeline's micro-batches plus what it already took; ties to the lower device id), which
    makes the most loaded peer as light as possible -- per dead device, one peer could end up
    with a whole remainder (8 workers losing 4: ``{5,1,1,1}`` instead of ``{2,2,2,2}``)."""
    k = plan.shard_degree
    by_template = plan.templates()
    work: dict[tuple, int] = {}  # (template, stage) -> micro-batches to reroute
    for d in sorted(dead):
        where = plan.locate(d)
        if where is None:
            continue
        j, s = where
        pipe = plan.pipelines[j]
        key = (pipe.bounds, j % k, s)
        if not any(plan.pipelines[i].devices[s] in alive for i in by_template[key[:2]] if i != j):
            lo, hi = pipe.layers_of_stage(s)
            return {}, f"stage with layers {lo}-{hi} lost all of its replicas"
        work[key] = work.get(key, 0) + pipe.microbatches
    extra: dict[int, float] = {}
    for key, total in sorted(work.items()):
        s = key[2]
        heap = [(plan.pipelines[i].microbatches, plan.pipelines[i].devices[s]) for i in by_template[key[:2]]
                if plan.pipelines[i].devices[s] in alive]
        heapq.heapify(heap)
        for _ in range(total):
            load, peer = heapq.heappop(heap)
            extra[peer] = extra.get(peer, 0.0) + 1
            heapq.heappush(heap, (load + 1, peer))
    return extra, ""
