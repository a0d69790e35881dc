"""Plan search: the fastest feasible plan over the surviving devices.

Three pieces, usable on their own:

* :func:`balance_layers` splits the layer chain over a pipeline's stages so that the slowest
  stage (forward+backward seconds / device speed) is as fast as possible, subject to each
  stage's memory; binary search on the bottleneck with a greedy feasibility check, which is
  exact for an ordered chain.
* :func:`allocate_microbatches` gives each pipeline micro-batches so that the slowest pipeline
  finishes first: water-filling on ``(m_j + p_j - 1) · u_j`` (``u_j`` = one micro-batch's
  bottleneck time), i.e. micro-batches in proportion to throughput; a slow pipeline gets fewer,
  but no fewer than ``min_each`` when the batch has that many per pipeline.
* :func:`plan_search` enumerates layouts over the survivors — pipelines of depth ``p`` and
  ``p + 1`` (unequal lengths use every device) for every depth in the allowed range, and within
  the allowed data-parallel range — and keeps those that fit memory, fastest first.  The global
  batch (the number of micro-batches) is conserved exactly.  For very large clusters
  (``space.global_limit``), or when a current plan is given, it also tries a *local* re-plan:
  unbroken pipelines stay as they are and only the broken pipelines' survivors (plus idle
  devices) are re-formed, which keeps search and migration small.

Limits: devices are taken in (node, id) order so pipelines stay node-local; pipelines are not
interleaved across nodes to dodge slow links; tensor parallelism is folded into devices.
"""

from __future__ import annotations

import time
from functools import lru_cache
from itertools import chain, filterfalse
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from chameleon_ft.engine.cluster import Cluster
from chameleon_ft.engine.perf import Coefficients, Estimate, estimate, unit_times
from chameleon_ft.engine.plan import Pipeline, Plan, PlanError, split_and_load, validate
from chameleon_ft.engine.workload import Workload


@dataclass(frozen=True)
class SearchSpace:
    """Allowed pipeline depths and data-parallel widths (inclusive); None = unbounded."""

    pp_min: int = 1
    pp_max: int | None = None
    dp_min: int = 1
    dp_max: int | None = None
    shard_degree: int = 1
    # Above this many devices only local re-plans are searched: a global re-layout of a large job
    # moves most of the model (rarely worth it within D) and its search alone would cost more
    # than the decision budget.  Raise it to search globally anyway.
    global_limit: int = 256
    # Micro-batches every pipeline keeps (when the batch has enough): a runtime that measures
    # speeds needs each device to keep running something, or a slow device can never be seen
    # to recover.  0: a pipeline too slow to help gets none.
    min_microbatches: int = 0

    def depths(self, workload: Workload, n: int) -> range:
        hi = min(self.pp_max or workload.num_layers, workload.num_layers, n)
        return range(max(1, self.pp_min), hi + 1)


@dataclass
class Candidate:
    plan: Plan
    estimate: Estimate
    kind: str  # "global" or "local"


@dataclass
class SearchResult:
    candidates: list[Candidate]
    elapsed_s: float
    rejected: dict[str, str] = field(default_factory=dict)  # layout -> why

    @property
    def best(self) -> Candidate:
        if not self.candidates:
            why = "; ".join(f"{k}: {v}" for k, v in list(self.rejected.items())[:5])
            raise PlanError(f"no feasible plan over the survivors ({why or 'no layout in the allowed ranges'})")
        return self.candidates[0]


# -- layer split ------------------------------------------------------------------------
def balance_layers(
    workload: Workload,
    speeds: Sequence[float],
    coeffs: Coefficients = Coefficients(),
    memory: Sequence[float] | None = None,
    shard_degree: int = 1,
) -> tuple[int, ...] | None:
    """Layer bounds minimising the slowest stage; None when no split fits ``memory``.

    Binary search on the bottleneck; for each candidate, a reachability pass over the chain
    (which positions can stage ``s`` end at?) decides feasibility exactly, also when stages
    differ in speed and memory — packing each stage greedily is not enough then, because every
    stage must take at least one layer and a slow stage may be left with an expensive one."""
    p, n = len(speeds), workload.num_layers
    if p > n:
        return None
    per_param = (workload.weight_bytes + workload.grad_bytes + workload.optim_bytes) / shard_degree
    gathered = [layer.params * workload.weight_bytes if shard_degree > 1 else 0 for layer in workload.layers]
    cs = coeffs.compute_scale

    def fits(s: int, lo: int, hi: int, limit: float) -> bool:
        if workload.compute_s(lo, hi) / speeds[s] * cs > limit:
            return False
        if memory is None:
            return True
        # Stage s holds up to p - s micro-batches of activations under 1F1B.
        mem = workload.params_in(lo, hi) * per_param + (p - s) * workload.act_bytes_in(lo, hi)
        return mem + max(gathered[lo:hi]) <= memory[s]

    def split(limit: float) -> tuple[int, ...] | None:
        reach = [0]  # positions the previous stages can end at, ascending
        furthest: list[dict[int, int]] = []  # per stage: start -> furthest end
        for s in range(p):
            cap = n - (p - s - 1)  # leave a layer for every later stage
            ends = {}
            hi = 0
            for lo in reach:  # furthest end is non-decreasing in the start: two pointers
                hi = max(hi, lo)
                while hi < cap and fits(s, lo, hi + 1, limit):
                    hi += 1
                if hi > lo:
                    ends[lo] = hi
            if not ends:
                return None
            furthest.append(ends)
            marks = [0] * (n + 2)
            for lo, hi in ends.items():  # every end in (lo, hi] is reachable
                marks[lo + 1] += 1
                marks[hi + 1] -= 1
            reach, run = [], 0
            for pos in range(n + 1):
                run += marks[pos]
                if run > 0:
                    reach.append(pos)
        if not reach or reach[-1] != n:
            return None
        bounds, pos = [n], n
        for s in range(p - 1, -1, -1):
            pos = max(lo for lo, hi in furthest[s].items() if lo < pos <= hi)
            bounds.append(pos)
        return tuple(reversed(bounds))

    hi_t = workload.compute_s(0, n) / min(speeds) * cs * (1 + 1e-9)
    best = split(hi_t)
    if best is None:
        return None
    lo_t = 0.0
    for _ in range(60):
        mid = (lo_t + hi_t) / 2
        got = split(mid)
        if got is None:
            lo_t = mid
        else:
            hi_t, best = mid, got
        if hi_t - lo_t <= hi_t * 1e-9:
            break
    return best


@lru_cache(maxsize=4096)
def _balanced(workload, speeds, coeffs, memory, shard_degree):
    """:func:`balance_layers`, memoised: the same pipeline shapes recur across decisions."""
    return balance_layers(workload, speeds, coeffs, memory, shard_degree)


# -- micro-batch allocation -------------------------------------------------------------
def allocate_microbatches(unit_s: Sequence[float], depths: Sequence[int], total: int,
                          min_each: int = 0) -> list[int]:
    """Micro-batches per pipeline minimising max_j (m_j + p_j - 1)·u_j, summing to ``total``,
    each pipeline getting at least ``min_each``.

    Without ``min_each`` (or when ``total`` is below ``min_each`` per pipeline, which cannot be
    met), a pipeline that would finish later than the optimum with even one micro-batch gets
    none."""
    u = np.asarray(unit_s, dtype=float)
    d = np.asarray(depths, dtype=float)
    if len(u) == 0:
        raise PlanError("no pipelines to allocate micro-batches to")
    if min_each < 0:
        raise PlanError("min_each must be >= 0")
    if total == 0:
        return [0] * len(u)
    if np.any(u <= 0):
        raise PlanError("pipeline micro-batch times must be positive")
    floor_m = min_each if total >= min_each * len(u) else 0

    def count(t: float) -> np.ndarray:
        return np.maximum(floor_m, np.floor(t / u - d + 1 + 1e-9)).astype(np.int64)

    lo, hi = 0.0, float(((total + d - 1) * u).min())  # one pipeline alone can always do it
    for _ in range(200):
        mid = (lo + hi) / 2
        if count(mid).sum() >= total:
            hi = mid
        else:
            lo = mid
        if hi - lo <= hi * 1e-12:
            break
    m = count(hi)
    surplus = int(m.sum() - total)
    if surplus > 0:
        # Take the surplus from the pipelines that finish last (ties: lowest index first).
        t = np.where(m > floor_m, (m + d - 1) * u, -np.inf)
        order = np.lexsort((np.arange(len(u)), -t))
        for j in order[:surplus]:
            m[j] -= 1
    return m.tolist()


def at_least_one_each(counts: Sequence[int], members: Sequence[int]) -> list[int]:
    """``counts`` (micro-batches per member) with every zero raised to one, taken one at a time
    from the largest share (the highest member id among equals); unchanged when there are
    fewer micro-batches than members.  For executors whose members must each run at least one
    micro-batch per step (Lightning logs per ``training_step`` call, so a member that ran none
    in an epoch would skip the epoch-end metric sync its peers run)."""
    counts = list(counts)
    if 0 not in counts or sum(counts) < len(counts):
        return counts
    while 0 in counts:
        j = max(range(len(counts)), key=lambda k: (counts[k], members[k]))
        counts[j] -= 1
        counts[counts.index(0)] += 1
    return counts


# -- search -----------------------------------------------------------------------------
def _ordered(cluster: Cluster, devices: Iterable[int]) -> list[int]:
    """``devices`` by (node, id); vectorised (131k devices: a Python sort key was ~60 ms)."""
    ids = np.fromiter(devices, dtype=np.int64)
    arrays = cluster.arrays()
    known = (ids >= 0) & (ids < len(arrays.index))
    pos = arrays.index[np.where(known, ids, 0)]
    if not bool((known & (pos >= 0)).all()):  # an unknown device: the same KeyError as cluster[d]
        return sorted(ids.tolist(), key=lambda d: (cluster[d].node, d))
    return ids[np.lexsort((ids, arrays.node[pos]))].tolist()


class _Builder:
    """Builds pipelines for chunks of devices, caching layer splits by the chunk's speeds."""

    def __init__(self, workload: Workload, cluster: Cluster, coeffs: Coefficients, shard_degree: int,
                 min_each: int = 0):
        self.w, self.c, self.k, self.shard = workload, cluster, coeffs, shard_degree
        self.min_each = min_each
        self._unit: dict[tuple, float] = {}
        self._fixed: tuple = ((), [])  # the last ``fixed`` pipelines and their unit times

    def pipeline(self, devs: Sequence[int], facts: tuple | None = None) -> tuple[tuple[int, ...], float] | None:
        """``facts``: the chunk's (speeds, memories, nodes), when the caller has them already."""
        if facts is None:
            facts = (tuple(self.c[d].speed for d in devs), tuple(self.c[d].memory_bytes for d in devs),
                     tuple(self.c[d].node for d in devs))
        speeds, mems, nodes = facts
        bounds = _balanced(self.w, speeds, self.k, mems, self.shard)
        if bounds is None:
            return None
        ukey = (speeds, bounds, tuple(a == b for a, b in zip(nodes, nodes[1:])))
        if ukey not in self._unit:
            self._unit[ukey] = float(unit_times([Pipeline(tuple(devs), bounds, 0)], self.w, self.c, self.k)[0])
        return bounds, self._unit[ukey]

    def plan(self, chunks: Sequence[Sequence[int]], total: int, fixed: Sequence[Pipeline] = ()) -> Plan | None:
        """A plan of ``fixed`` pipelines (kept as they are, micro-batches re-allocated) plus one
        pipeline per chunk."""
        if not fixed and not chunks:
            return None
        pipes = [(pipe.devices, pipe.bounds) for pipe in fixed]
        if fixed and self._fixed[0] is not fixed:  # (one search passes the same intact pipelines each time)
            self._fixed = (fixed, unit_times(fixed, self.w, self.c, self.k).tolist())
        units = list(self._fixed[1]) if fixed else []
        # Every chunk's device facts in one gather (131k dict look-ups per plan otherwise).
        flat = [d for devs in chunks for d in devs]
        arrays = self.c.arrays()
        pos = arrays.index[np.asarray(flat, dtype=np.int64)] if flat else np.zeros(0, dtype=np.int64)
        speed, mem, node = (arrays.speed[pos].tolist(), arrays.memory[pos].tolist(), arrays.node[pos].tolist())
        at = 0
        for devs in chunks:
            n = len(devs)
            facts = (tuple(speed[at:at + n]), tuple(mem[at:at + n]), tuple(node[at:at + n]))
            at += n
            built = self.pipeline(devs, facts)
            if built is None:
                return None
            pipes.append((tuple(devs), built[0]))
            units.append(built[1])
        if self.shard > 1:
            if len(pipes) % self.shard:
                return None
            for g in range(0, len(pipes), self.shard):  # a shard group shares one split
                bounds = pipes[g][1]
                if any(pipes[g + i][1] != bounds for i in range(self.shard)):
                    return None
        alloc = allocate_microbatches(units, [len(d) for d, _ in pipes], total, self.min_each)
        # A fixed pipeline whose micro-batches did not change is kept as the same object.
        kept = [pipe if pipe.microbatches == m else Pipeline(pipe.devices, pipe.bounds, m)
                for pipe, m in zip(fixed, alloc)]
        kept += [Pipeline(d, b, m) for (d, b), m in zip(pipes[len(fixed):], alloc[len(fixed):])]
        if self.shard == 1:
            kept = [p for p in kept if p.microbatches > 0]
        return Plan(tuple(kept), shard_degree=self.shard)


def reallocate(plan: Plan, workload: Workload, cluster: Cluster, coeffs: Coefficients = Coefficients(),
               min_each: int = 1) -> Plan:
    """``plan``'s pipelines as they are (devices, layer splits), their micro-batches re-allocated
    for ``cluster``'s speeds, each keeping at least ``min_each`` (>= 1: no pipeline is dropped).
    A straggler rebalance that moves no state: only which micro-batches each pipeline runs."""
    got = _Builder(workload, cluster, coeffs, plan.shard_degree, max(1, min_each)).plan(
        [], plan.num_microbatches, fixed=plan.pipelines)
    if got is None or len(got.pipelines) != len(plan.pipelines):
        raise PlanError("the running pipelines cannot share the step's micro-batches at these speeds")
    return got


def _layouts(n: int, depth: int, space: SearchSpace) -> list[list[int]]:
    """Pipeline depths for ``n`` devices around ``depth``: all equal (spares idle), or mixed
    depth/depth+1 using every device."""
    q, r = divmod(n, depth)
    out = []
    if q:
        out.append([depth] * q)
    pp_max = space.pp_max or n
    if r and depth + 1 <= pp_max and r <= q:
        out.append([depth + 1] * r + [depth] * (q - r))
    k = space.shard_degree
    ok = []
    for lay in out:
        if k > 1:
            lay = lay[: len(lay) - len(lay) % k]
            if len(set(lay)) != 1:
                continue
        if lay and space.dp_min <= len(lay) <= (space.dp_max or len(lay)):
            ok.append(lay)
    return ok


def plan_search(
    workload: Workload,
    cluster: Cluster,
    coeffs: Coefficients = Coefficients(),
    space: SearchSpace = SearchSpace(),
    survivors: Iterable[int] | None = None,
    base: Plan | None = None,
    num_microbatches: int | None = None,
    limit: int = 8,
) -> SearchResult:
    """Feasible plans over ``survivors`` (default: every device of ``cluster``), fastest first.

    With ``base`` (the plan before the failure), local re-plans that keep its unbroken pipelines
    are searched too; above ``space.global_limit`` devices only those are."""
    t0 = time.perf_counter()
    alive = _ordered(cluster, cluster.ids if survivors is None else survivors)
    alive_set = set(alive)
    total = workload.num_microbatches if num_microbatches is None else num_microbatches
    builder = _Builder(workload, cluster, coeffs, space.shard_degree, space.min_microbatches)
    found: dict[tuple, Candidate] = {}
    rejected: dict[str, str] = {}

    def consider(plan: Plan | None, kind: str, label: str) -> None:
        if plan is None:
            rejected[label] = "no layer split fits memory or the shard groups do not line up"
            return
        try:
            validate(plan, workload, alive_set, total)
        except PlanError as e:
            rejected[label] = str(e)
            return
        width = len(plan.pipelines)
        if not space.dp_min <= width <= (space.dp_max or width):
            rejected[label] = f"{width} pipelines is outside the allowed data-parallel range"
            return
        est = estimate(plan, workload, cluster, coeffs)
        if not est.fits:
            rejected[label] = f"needs more memory than devices {list(est.over_memory[:4])} have"
            return
        key = (plan.devices, tuple(map(split_and_load, plan.pipelines)))
        found.setdefault(key, Candidate(plan, est, kind))

    if len(alive) <= space.global_limit or base is None:
        for depth in space.depths(workload, len(alive)):
            for lay in _layouts(len(alive), depth, space):
                chunks, at = [], 0
                for p in lay:
                    chunks.append(alive[at:at + p])
                    at += p
                label = f"global {len(lay)}x~PP{depth}"
                consider(builder.plan(chunks, total), "global", label)
    if base is not None:
        intact = [p for p in base.pipelines if alive_set.issuperset(p.devices)]
        used = set(chain.from_iterable(p.devices for p in intact))
        loose = list(filterfalse(used.__contains__, alive))
        depths = sorted({p.depth for p in base.pipelines} | {p.depth - 1 for p in base.pipelines})
        for depth in depths:
            if depth < max(1, space.pp_min) or depth > (space.pp_max or workload.num_layers):
                continue
            if not loose:
                consider(builder.plan([], total, intact), "local", "local keep")
                break
            q = len(loose) // depth
            chunks = [loose[i * depth:(i + 1) * depth] for i in range(q)]
            consider(builder.plan(chunks, total, intact), "local", f"local +{q}xPP{depth}")
    ranked = sorted(found.values(), key=lambda c: (c.estimate.step_time, len(c.plan.devices), c.kind))
    return SearchResult(ranked[:limit], time.perf_counter() - t0, rejected)
