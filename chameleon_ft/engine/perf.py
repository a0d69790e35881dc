"""Unified performance model: step time and memory of a plan, with a breakdown.

For each pipeline (``p`` stages, ``m`` micro-batches) the 1F1B time is the first micro-batch's
round trip plus ``m - 1`` steady-state periods: ``Σ_s c_s + 2 (p - 1) h + (m - 1) · T`` with
``c_s`` stage ``s``'s forward+backward seconds per micro-batch, ``h`` the slowest boundary's one
hop (activation out or gradient back) and ``T = max(c_max, max_s (Σ_{t >= s} c_t + 2 (p - 1 - s) h)
/ (p - s))``: stage ``s`` keeps at most ``p - s`` micro-batches in flight, so hops are hidden
where later stages leave slack and exposed where they do not (until 2026-12-01 the form was
``(m + p - 1) · (c_max + 2h)``: +5 % on a balanced 2 x PP4 and +10 % on an unbalanced PP3 + PP4 of
the pipeline benchmark, where this one is within 2 %).  The breakdown calls the busiest stage's
own work compute (``m · c_max`` without rerouting), the rest of the time without hop costs
bubble (fill, drain, waiting), and what the hops add p2p.  The
step is the slowest pipeline plus the exposed gradient synchronisation: a ring all-reduce per
group of devices holding the same layers (``2(n-1)·α + 2(n-1)/n · bytes/β``; one all-reduce of
the whole model over every device when ``workload.grad_sync == "model"``), and under FSDP
an all-gather of the weights for forward and backward and a reduce-scatter of the gradients
within the shard group.  Memory per device is weights + gradients + optimizer state (divided by
the shard degree) + in-flight activations (``min(m, p - i)`` micro-batches on stage ``i``; a
data-parallel worker whose share is merged into ``workload.items_per_step`` loop items holds
``ceil(m / items_per_step)``).

Rerouting is modelled without changing the plan: ``dead`` devices do no work and hold no state,
and ``extra`` gives a device ``e`` more micro-batches than its pipeline's count.  Data
parallelism: the rank accumulates ``m + e`` micro-batches (exact).  Pipelines: the pipelines
rerouting couples -- those with a dead stage and those whose stage workers take its
micro-batches -- are timed on the runtime's own schedule (``engine.schedule``: every micro-batch's
route and each worker's 1F1B order, task by task, with the same stage costs and hops), since a
rerouted micro-batch queues at the peer's doubled stage *and* at any slow stage of its own
pipeline, which no per-pipeline period captures (a quick trace's step with a 2x-slow worker in the
rerouted pipeline: 0.57 s per pipeline, 0.74 s on the schedule, 0.68 s measured).  Beyond
``COUPLED_TASKS`` tasks (rerouting across thousands of pipelines) the per-pipeline form prices
them: ``m + max_s e_s`` periods.

A fixed ``task_overhead_s`` per micro-batch and stage (measured by the pipeline runtime: what
a forward/backward task costs beyond its layers and the wire) is added to every stage's compute;
the optimizer step costs ``optimizer_s_per_param`` times the parameters of the busiest device
(part of the breakdown's overhead); a multi-stage pipeline pays ``hop_overhead_s`` more per
1F1B slot (``m + e + p - 1`` of them).

Limits: communication is not overlapped with compute (calibration folds overlap into
``comm_scale``); tensor parallelism is folded into a device; the optimizer step is part of
``step_overhead_s`` unless ``optimizer_s_per_param`` is calibrated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from chameleon_ft.engine.cluster import Cluster, Link
from chameleon_ft.engine.plan import Plan, device_matrix
from chameleon_ft.engine.schedule import ScheduleError, routes, slots_of, timed_orders
from chameleon_ft.engine.workload import Workload


@dataclass(frozen=True)
class Coefficients:
    """What calibration fits: multipliers on the workload's compute and on communication,
    plus a fixed per-step overhead (optimizer, framework)."""

    compute_scale: float = 1.0
    comm_scale: float = 1.0
    step_overhead_s: float = 0.0
    # Fixed seconds per micro-batch and stage beyond its layers' compute (kernel launches, the
    # runtime's per-task work, message hand-off): measured by the pipeline runtime.
    task_overhead_s: float = 0.0
    # The optimizer step: seconds per parameter a device updates (the busiest device counts).
    optimizer_s_per_param: float = 0.0
    # Fixed seconds per 1F1B slot of a multi-stage pipeline beyond its compute and transfer
    # (scheduling and hand-off between stages): measured by the pipeline runtime.
    hop_overhead_s: float = 0.0


def coefficients_to_json(c: Coefficients) -> dict:
    return dataclasses.asdict(c)


def coefficients_from_json(data: dict | None) -> Coefficients:
    return Coefficients(**(data or {}))


@dataclass
class Estimate:
    step_time: float
    compute: float
    bubble: float
    p2p: float
    allreduce: float
    fsdp: float
    overhead: float
    pipeline_times: tuple[float, ...] = field(repr=False)
    peak_memory: float = 0.0
    over_memory: tuple[int, ...] = field(default=(), repr=False)
    _memory: list = field(default_factory=list, repr=False)  # [(device ids, bytes)] arrays

    @property
    def fits(self) -> bool:
        return not self.over_memory

    @property
    def memory(self) -> dict[int, float]:
        """Bytes per (alive) device."""
        out: dict[int, float] = {}
        for ids, mem in self._memory:
            out.update(zip(ids.tolist(), mem.tolist()))
        return out

    def breakdown(self) -> dict[str, float]:
        return {
            "compute": self.compute,
            "bubble": self.bubble,
            "p2p": self.p2p,
            "allreduce": self.allreduce,
            "fsdp": self.fsdp,
            "overhead": self.overhead,
        }


def ring_allreduce_s(n: int, nbytes: float, link: Link) -> float:
    """Ring all-reduce: 2(n-1) steps, each moving nbytes/n (alpha-beta model)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * link.latency_s + 2 * (n - 1) / n * nbytes / link.bandwidth_Bps


def ring_allgather_s(n: int, nbytes: float, link: Link) -> float:
    """Ring all-gather (or reduce-scatter) of a buffer of nbytes in total."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) * link.latency_s + (n - 1) / n * nbytes / link.bandwidth_Bps


COUPLED_TASKS = 20_000  # the most tasks the coupled pipelines' schedule is timed for


def _coupled_times(plan: Plan, rows, members, dead: frozenset, extra: Mapping[int, float], workload: Workload,
                   cluster: Cluster, speed_of, lut, cs: float, task_s: float, hop_over: float,
                   hop_s: float) -> dict[int, float] | None:
    """Each coupled pipeline's time (row -> seconds) on the runtime's schedule, or None when it
    is too large to time (see the module docstring)."""
    pipes = [plan.pipelines[members[i]] for i in rows]
    if 2 * sum(p.microbatches * len(p.devices) for p in pipes) > COUPLED_TASKS:
        return None
    sub = Plan(tuple(pipes))
    alive = set(sub.devices) - set(dead)
    try:
        rs = routes(sub, alive, {d: e for d, e in extra.items() if d in alive})
    except ScheduleError:  # a dead stage whose micro-batches nobody takes: not a rerouted plan
        return None
    layers, memo = workload.layers, {}
    fixed = task_s / 2 + hop_over / 2

    def seconds(task, hop) -> float:
        key = (task.kind, hop.lo, hop.hi, hop.worker)
        if key not in memo:
            work = sum((l.fwd_s if task.kind == "F" else l.bwd_s) for l in layers[hop.lo:hop.hi])
            memo[key] = work / float(speed_of[lut[hop.worker]]) * cs + fixed
        return memo[key]

    done = timed_orders(rs, seconds, lambda a, b: hop_s)
    return {i: max((done[s] for s in slots), default=0.0) for i, slots in zip(rows, slots_of(sub))}


def estimate(
    plan: Plan,
    workload: Workload,
    cluster: Cluster,
    coeffs: Coefficients = Coefficients(),
    dead: frozenset[int] | set[int] = frozenset(),
    extra: Mapping[int, float] | None = None,
) -> Estimate:
    """Step time and memory of ``plan`` (see the module docstring for the model).

    Pipelines that share a layer split are evaluated together as numpy arrays, so a plan over
    100k devices costs milliseconds."""
    extra = extra or {}
    cs, ms = coeffs.compute_scale, coeffs.comm_scale
    k = plan.shard_degree
    arrays = cluster.arrays()
    lut = arrays.index
    speed_of, node_of, mem_of = arrays.speed, arrays.node, arrays.memory
    # One extra slot at the end stands for every device the cluster does not know: such a
    # device (e.g. still dead while another one rejoins) does no work and holds nothing.
    unknown = len(speed_of)
    speed_of = np.append(speed_of, 1.0)
    node_of = np.append(node_of, -1)
    mem_of = np.append(mem_of, np.inf)
    dead_mask_flat = np.zeros(unknown + 1, dtype=bool)
    dead_mask_flat[unknown] = True
    if dead:
        dead_mask_flat[lut[np.fromiter((d for d in dead if d in cluster), dtype=np.int64)]] = True
    extra_flat = np.zeros(unknown + 1)
    if extra:
        known = {d: e for d, e in extra.items() if d in cluster}
        extra_flat[lut[np.fromiter(known.keys(), dtype=np.int64)]] = np.fromiter(known.values(), dtype=float)
    per_param_state = (workload.weight_bytes + workload.grad_bytes + workload.optim_bytes) / k

    groups = plan.by_split()

    busiest = 0  # most parameters any alive device updates
    times = np.zeros(len(plan.pipelines))
    parts = np.zeros((len(plan.pipelines), 3))  # compute, bubble, p2p
    memory: list = []
    over: list[int] = []
    node_lo, node_hi = None, None  # the alive devices' lowest and highest node (one node: equal)
    peak = 0.0
    for bounds, members in groups.items():
        p = len(bounds) - 1
        dev = plan.device_rows(members)
        idx = _positions(lut, dev, unknown)
        m = plan.loads()[members][:, None]
        dead_m = dead_mask_flat[idx]
        e = extra_flat[idx]
        c, x_max = _stage_times(bounds, idx, workload, cluster, speed_of, node_of, cs, ms, coeffs.task_overhead_s)
        c = np.where(dead_m, 0.0, c)
        mm = m[:, 0]
        n = mm + e.max(axis=1)  # micro-batches through the busiest stage (its own + rerouted)
        rerouted = (e * c).max(axis=1)
        busy = (mm > 0) | (rerouted > 0)
        suffix = _suffix(c)
        fill, period = _fill_and_period(c, x_max / 2.0, suffix)
        bare_fill, bare_period = _fill_and_period(c, None, suffix)  # the same without hops
        hop = coeffs.hop_overhead_s if p > 1 else 0.0
        # A pipeline with only rerouted work has no fill: its peers' stages take it in turn.
        t = np.where(mm > 0, fill + (n - 1) * period + hop * (n + p - 1), rerouted)
        bare = np.where(mm > 0, bare_fill + (n - 1) * bare_period, rerouted)
        t, bare = np.where(busy, t, 0.0), np.where(busy, bare, 0.0)
        coupled = (dead_m.any(axis=1) | (e > 0).any(axis=1)) if p > 1 else np.zeros(len(members), dtype=bool)
        if coupled.any():
            rows = np.flatnonzero(coupled).tolist()
            timed = _coupled_times(plan, rows, members, frozenset(dead), extra, workload, cluster, speed_of, lut,
                                   cs, coeffs.task_overhead_s, coeffs.hop_overhead_s,
                                   float(x_max[rows].max()) / 2.0)
            if timed is not None:
                for i, ti in timed.items():
                    bare[i] = ti - (t[i] - bare[i])  # the hops' share kept as the formula's
                    t[i] = ti
        times[members] = t
        # Breakdown: the busiest stage's own work, waiting without any hop cost, what hops add.
        compute = np.where(busy, ((m + e) * c).max(axis=1), 0.0)
        parts[members, 0] = compute
        parts[members, 1] = bare - compute
        parts[members, 2] = t - bare

        state = np.array([workload.params_in(bounds[s], bounds[s + 1]) for s in range(p)]) * per_param_state
        if k > 1:  # one gathered layer of full weights at a time
            state = state + np.array(
                [max(layer.params for layer in workload.layers[bounds[s]:bounds[s + 1]]) for s in range(p)]
            ) * workload.weight_bytes
        acts = np.array([workload.act_bytes_in(bounds[s], bounds[s + 1]) for s in range(p)], dtype=float)
        if p == 1 and workload.items_per_step > 0:  # the share merged into the loop's items
            in_flight = np.ceil((m + e) / workload.items_per_step)
        else:
            in_flight = np.minimum(m + e, (p - np.arange(p))[None, :])
        mem = state[None, :] + in_flight * acts[None, :]
        alive = ~dead_m
        if coeffs.optimizer_s_per_param and alive.any():
            held = np.array([workload.params_in(bounds[s], bounds[s + 1]) for s in range(p)]) / k
            busiest = max(busiest, float(np.where(alive, held[None, :], 0.0).max()))
        ids, mem_alive = dev[alive], mem[alive]
        memory.append((ids, mem_alive))
        if mem_alive.size:
            peak = max(peak, float(mem_alive.max()))
            over.extend(ids[mem_alive > mem_of[idx[alive]]].tolist())
            nodes = node_of[idx[alive]]
            lo, hi = int(nodes.min()), int(nodes.max())
            node_lo = lo if node_lo is None else min(node_lo, lo)
            node_hi = hi if node_hi is None else max(node_hi, hi)

    coll_link = cluster.inter if node_lo is not None and node_lo != node_hi else cluster.intra
    allreduce, fsdp = _sync_times(plan, workload, cluster, dead, coll_link)
    allreduce *= ms
    fsdp *= ms
    worst = int(np.argmax(times)) if len(times) else 0
    overhead = coeffs.step_overhead_s + busiest * coeffs.optimizer_s_per_param
    return Estimate(
        step_time=float(times[worst]) + allreduce + fsdp + overhead,
        compute=float(parts[worst, 0]),
        bubble=float(parts[worst, 1]),
        p2p=float(parts[worst, 2]),
        allreduce=allreduce,
        fsdp=fsdp,
        overhead=overhead,
        pipeline_times=tuple(times.tolist()),
        peak_memory=peak,
        over_memory=tuple(sorted(over)),
        _memory=memory,
    )


def _positions(lut: np.ndarray, dev: np.ndarray, unknown: int) -> np.ndarray:
    """Array positions of device ids; ``unknown`` for ids the cluster does not have."""
    ok = (dev >= 0) & (dev < len(lut))
    idx = np.where(ok, lut[np.where(ok, dev, 0)], -1)
    return np.where(idx >= 0, idx, unknown)


def _stage_times(bounds, idx, workload: Workload, cluster: Cluster, speed, node, cs: float, ms: float,
                 task_s: float = 0.0):
    """Per-stage compute seconds per micro-batch (pipelines x stages) and each pipeline's slowest
    boundary transfer (activation out, gradient back)."""
    p = len(bounds) - 1
    stage_cost = np.array([workload.compute_s(bounds[s], bounds[s + 1]) for s in range(p)])
    c = stage_cost[None, :] / speed[idx] * cs + task_s
    if p == 1:
        return c, np.zeros(len(idx))
    out = np.array([workload.layers[bounds[s + 1] - 1].out_bytes for s in range(p - 1)], dtype=float)
    same = node[idx[:, :-1]] == node[idx[:, 1:]]
    lat = np.where(same, cluster.intra.latency_s, cluster.inter.latency_s)
    bw = np.where(same, cluster.intra.bandwidth_Bps, cluster.inter.bandwidth_Bps)
    x = np.where(out[None, :] > 0, 2 * (lat + out[None, :] / bw) * ms, 0.0)
    return c, x.max(axis=1)


def _fill_and_period(c: np.ndarray, hop_s: np.ndarray | None,
                     suffix: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """1F1B of pipelines (rows) with per-micro-batch stage seconds ``c`` (forward + backward)
    and one hop's seconds ``hop_s`` (an activation out or a gradient back): the first
    micro-batch's round trip (every stage's work + 2 (p - 1) hops) and the steady-state period.
    Stage ``s`` keeps at most ``p - s`` micro-batches in flight, and a micro-batch leaves it for
    the work of stages ``s..p-1`` and ``2 (p - 1 - s)`` hops before its backward comes back:
    the period is the slowest stage's work, or that round trip shared by ``p - s`` micro-batches
    when it is longer (hops are hidden where later stages leave slack, exposed where they do not)."""
    p = c.shape[1]
    if suffix is None:
        suffix = _suffix(c)
    if hop_s is None:  # no hops (the pipeline's bare schedule)
        period = np.maximum(c.max(axis=1), (suffix / (p - np.arange(p))[None, :]).max(axis=1))
        return suffix[:, 0].copy(), period
    hops = 2.0 * (p - 1 - np.arange(p))[None, :] * hop_s[:, None]
    period = np.maximum(c.max(axis=1), ((suffix + hops) / (p - np.arange(p))[None, :]).max(axis=1))
    return suffix[:, 0] + 2.0 * (p - 1) * hop_s, period


def _suffix(c: np.ndarray) -> np.ndarray:
    """Per pipeline (row) and stage ``s``: the work of stages ``s..p-1`` per micro-batch."""
    return np.cumsum(c[:, ::-1], axis=1)[:, ::-1]


def unit_times(pipelines, workload: Workload, cluster: Cluster, coeffs: Coefficients = Coefficients()) -> np.ndarray:
    """Seconds one micro-batch adds to each pipeline in steady state (the 1F1B period)."""
    arrays = cluster.arrays()
    out = np.zeros(len(pipelines))
    groups: dict[tuple[int, ...], list[int]] = {}
    for j, pipe in enumerate(pipelines):
        groups.setdefault(pipe.bounds, []).append(j)
    for bounds, members in groups.items():
        idx = arrays.index[device_matrix([pipelines[j] for j in members], len(bounds) - 1)]
        c, x_max = _stage_times(bounds, idx, workload, cluster, arrays.speed, arrays.node,
                                coeffs.compute_scale, coeffs.comm_scale, coeffs.task_overhead_s)
        out[members] = _fill_and_period(c, x_max / 2.0)[1] + (coeffs.hop_overhead_s if len(bounds) > 2 else 0.0)
    return out


def _sync_times(
    plan: Plan, workload: Workload, cluster: Cluster, dead, coll_link: Link
) -> tuple[float, float]:
    """Exposed gradient synchronisation: the slowest device's sum of bucket all-reduces, and
    the slowest stage's FSDP all-gathers + reduce-scatter.

    Work is grouped by pipeline template (layer split) so that 100k-device plans stay cheap."""
    k = plan.shard_degree
    coll_link = cluster.collective or coll_link
    if workload.grad_sync == "model":  # one buffer of the whole model over every alive device
        n = len(plan.device_set) - len(plan.device_set.intersection(dead))
        return ring_allreduce_s(n, workload.total_params * workload.grad_bytes, coll_link), 0.0
    # Segments of the layer chain over which the holder set is constant.
    first = plan.by_split()  # every layer split, in order of first use
    cuts = sorted({b for bounds in first for b in bounds})
    index = {c: i for i, c in enumerate(cuts)}
    nseg = len(cuts) - 1
    # (template, shard) -> pipelines
    count = {key: len(js) for key, js in plan.templates().items()} if k > 1 else \
        {(b, 0): len(js) for b, js in first.items()}
    holders = [[0] * k for _ in range(nseg)]
    for (bounds, q), n in count.items():
        for s in range(len(bounds) - 1):
            for i in range(index[bounds[s]], index[bounds[s + 1]]):
                holders[i][q] += n
    for d in dead:
        where = plan.locate(d)
        if where is not None:
            j, s = where
            bounds = plan.pipelines[j].bounds
            for i in range(index[bounds[s]], index[bounds[s + 1]]):
                holders[i][j % k] -= 1
    seg_cost = [
        max(
            ring_allreduce_s(n, workload.params_in(cuts[i], cuts[i + 1]) * workload.grad_bytes / k, coll_link)
            for n in holders[i]
        )
        for i in range(nseg)
    ]
    allreduce = fsdp = 0.0
    for bounds in first:
        for s in range(len(bounds) - 1):
            allreduce = max(allreduce, sum(seg_cost[index[bounds[s]]:index[bounds[s + 1]]]))
    if k > 1:  # every shard group: its stages' all-gathers and reduce-scatter, on its own links
        for g in range(0, len(plan.pipelines), k):
            group = plan.pipelines[g:g + k]
            for s in range(group[0].depth):
                alive = [p.devices[s] for p in group if p.devices[s] not in dead]
                link = cluster.group_link(alive) if alive else coll_link
                params = workload.params_in(group[0].bounds[s], group[0].bounds[s + 1])
                fsdp = max(
                    fsdp,
                    2 * ring_allgather_s(len(alive), params * workload.weight_bytes, link)
                    + ring_allgather_s(len(alive), params * workload.grad_bytes, link),
                )
    return allreduce, fsdp
