"""Migration planning (Chameleon's restorer): how to get from the old plan's state to a new plan's, cheaply.

1. **Assignment** — survivors are matched to the new plan's slots so that the bytes of weights
   and optimizer state they lack are minimal (``scipy.optimize.linear_sum_assignment``).
   Devices may only trade places with interchangeable devices (same speed, memory and node by
   default), so the performance estimate of the new plan stays valid.  Pipelines that the new
   plan keeps verbatim cost nothing and never enter the assignment: by the triangle inequality on
   missing layers, moving one of their devices can never lower the total, so solving only the
   affected devices is still optimal — and keeps a 100k-device local re-plan cheap.
2. **Transfers** — each missing layer range is fetched from a surviving holder (same node first,
   then the least loaded sender).  Ranges that no survivor holds are reported as ``lost``: they
   need a snapshot (recompute or rehabilitate).
3. **Rounds** — transfers that share a device conflict; a DSATUR colouring of the conflict graph
   (networkx) gives rounds in which no device appears twice.  Rounds are an order, not
   barriers: the runtime starts a transfer as soon as both its ends are done with their
   transfers of earlier rounds, so the transition time is the critical path of that order
   (:func:`critical_path`), at most the sum over rounds of the slowest transfer in each.

Limits: bandwidth of concurrent transfers on one node's NIC is not shared out; a sharded slot
can only be served by the same shard index or a full replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Callable, Hashable

import numpy as np

from chameleon_ft.engine.cluster import Cluster
from chameleon_ft.engine.plan import Pipeline, Plan
from chameleon_ft.engine.workload import Workload

Held = tuple[int, int, int, int]  # (first layer, stop layer, shard index, shard degree)


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    layers: tuple[int, int]
    nbytes: float
    seconds: float


@dataclass
class MigrationPlan:
    plan: Plan  # the new plan with devices placed by the assignment
    moves: dict[int, int]  # device -> device whose planned slot it takes (only changed ones)
    transfers: list[Transfer]
    rounds: list[list[Transfer]]
    lost: list[Held] = field(default_factory=list)  # state no survivor holds

    @property
    def total_bytes(self) -> float:
        return sum(t.nbytes for t in self.transfers)

    @property
    def seconds(self) -> float:
        return critical_path(self.rounds, lambda t: (t.src, t.dst, t.seconds))[0]

    def summary(self) -> dict:
        return {
            "bytes": self.total_bytes,
            "transfers": len(self.transfers),
            "rounds": len(self.rounds),
            "seconds": self.seconds,
            "lost": [list(x) for x in self.lost],
            "moved_devices": len(self.moves),
        }


def held_state(plan: Plan | None, alive: set[int]) -> dict[int, Held]:
    """What each surviving device of ``plan`` holds."""
    out: dict[int, Held] = {}
    if plan is None:
        return out
    k = plan.shard_degree
    per_split: dict[tuple, list[Held]] = {}  # (layer split, shard) -> what its stages hold
    stages = []
    for j, pipe in enumerate(plan.pipelines):
        key = (pipe.bounds, j % k)
        held = per_split.get(key)
        if held is None:
            b = pipe.bounds
            held = per_split[key] = [(b[s], b[s + 1], j % k, k) for s in range(len(b) - 1)]
        stages.append(held)
    out = dict(zip(plan.devices, chain.from_iterable(stages)))  # (one pass in C: 131k devices)
    for d in plan.device_set.difference(alive):
        del out[d]
    return out


def _covers(held: Held | None, shard: int, degree: int) -> tuple[int, int] | None:
    """The layer range of ``held`` usable for a slot of (shard, degree), if any."""
    if held is None:
        return None
    a, b, q, k = held
    if k == 1 or (k == degree and q == shard):
        return a, b
    return None


def missing_ranges(need: tuple[int, int], have: tuple[int, int] | None) -> list[tuple[int, int]]:
    lo, hi = need
    if have is None:
        return [(lo, hi)]
    a, b = have
    out = []
    if lo < min(a, hi):
        out.append((lo, min(a, hi)))
    if max(b, lo) < hi:
        out.append((max(b, lo), hi))
    return out


def _cost(workload: Workload, held: Held | None, need: tuple[int, int], shard: int, degree: int) -> float:
    per_param = workload.state_bytes_per_param / degree
    return sum(workload.params_in(a, b) for a, b in missing_ranges(need, _covers(held, shard, degree))) * per_param


def _default_class(cluster: Cluster) -> Callable[[int], Hashable]:
    return lambda d: (cluster[d].speed, cluster[d].memory_bytes, cluster[d].node)


def migrate(
    old: Plan | None,
    new: Plan,
    workload: Workload,
    cluster: Cluster,
    alive: set[int] | None = None,
    interchangeable: Callable[[int], Hashable] | None = None,
    empty: set[int] | frozenset[int] = frozenset(),
) -> MigrationPlan:
    """Assign survivors to ``new``'s slots with minimal bytes to move, then schedule transfers.

    ``empty`` devices are alive but hold nothing (a repaired or replacement device)."""
    alive = set(cluster.ids) if alive is None else set(alive)
    held = held_state(old, alive - set(empty))
    klass = interchangeable or _default_class(cluster)
    k = new.shard_degree
    kept_verbatim: set[tuple] = set()
    if old is not None:
        for j, p in enumerate(old.pipelines):
            kept_verbatim.add((p.devices, p.bounds, j % old.shard_degree, old.shard_degree))
    # Slots that are not kept verbatim, grouped by the class of the device planned there.
    classes: dict[Hashable, list[tuple[int, int, int]]] = {}  # class -> [(pipeline, stage, device)]
    for j, pipe in enumerate(new.pipelines):
        if (pipe.devices, pipe.bounds, j % k, k) in kept_verbatim and all(map(held.__contains__, pipe.devices)):
            continue
        for s, d in enumerate(pipe.devices):
            classes.setdefault(klass(d), []).append((j, s, d))

    # Only the pipelines with a slot that is not kept verbatim are touched (at 131k devices,
    # copying and comparing every pipeline was a tenth of a decision).
    placed: dict[int, list[int]] = {}
    moves: dict[int, int] = {}
    for slots in classes.values():
        devices = [d for _, _, d in slots]
        cost = np.array([
            [_cost(workload, held.get(d), new.pipelines[j].layers_of_stage(s), j % k, k) for (j, s, _) in slots]
            for d in devices
        ])
        from scipy.optimize import linear_sum_assignment  # on first use (import cost)

        rows, cols = linear_sum_assignment(cost)
        for r, c in zip(rows, cols):
            j, s, planned = slots[c]
            if j not in placed:
                placed[j] = list(new.pipelines[j].devices)
            placed[j][s] = devices[r]
            if devices[r] != planned:
                moves[devices[r]] = planned
    pipes = list(new.pipelines)
    for j, devs in placed.items():
        if tuple(devs) != pipes[j].devices:
            pipes[j] = Pipeline(tuple(devs), pipes[j].bounds, pipes[j].microbatches)
    plan = Plan(tuple(pipes), shard_degree=k)
    transfers, lost = _transfers(old, plan, workload, cluster, held,
                                 sorted((j, s) for slots in classes.values() for (j, s, _) in slots))
    return MigrationPlan(plan, moves, transfers, schedule_rounds(transfers), lost)


def _transfers(old, plan, workload, cluster, held, slots) -> tuple[list[Transfer], list[Held]]:
    """The transfers that fill ``slots`` ((pipeline, stage), in plan order) of ``plan``."""
    k = plan.shard_degree
    sources = None  # built for the first slot that needs state (O(devices): often none does)
    out: list[Transfer] = []
    lost: list[Held] = []
    for j, s in slots:
        pipe = plan.pipelines[j]
        d = pipe.devices[s]
        if sources is None and old is not None:
            sources = _SourceIndex(held, cluster)
        need = pipe.layers_of_stage(s)
        for lo, hi in missing_ranges(need, _covers(held.get(d), j % k, k)):
            at = lo
            while at < hi:
                src = sources.pick(at, j % k, k, d) if sources else None
                if src is None:
                    nxt = sources.next_covered(at, hi, j % k, k) if sources else hi
                    lost.append((at, nxt, j % k, k))
                    at = nxt
                    continue
                src_id, (_, b) = src
                stop = min(b, hi)
                nbytes = workload.params_in(at, stop) * workload.state_bytes_per_param / k
                out.append(Transfer(src_id, d, (at, stop), nbytes, cluster.state_link(src_id, d).transfer_s(nbytes)))
                at = stop
    return out, lost


class _SourceIndex:
    """Survivors grouped by the state they hold, to pick senders without scanning everyone."""

    def __init__(self, held: dict[int, Held] | list[tuple[int, Held]], cluster: Cluster):
        self.cluster = cluster
        self.by_state: dict[Held, list[int]] = {}
        for d, h in (held.items() if isinstance(held, dict) else held):
            self.by_state.setdefault(h, []).append(d)
        self.load: dict[int, int] = {}

    def pick(self, layer: int, shard: int, degree: int, dst: int):
        """A holder of ``layer``: same node as ``dst`` first, then least loaded, then lowest id."""
        best = None
        node = self.cluster[dst].node
        for h, devices in self.by_state.items():
            rng = _covers(h, shard, degree)
            if rng is None or not rng[0] <= layer < rng[1]:
                continue
            for d in devices:
                if d == dst:
                    continue
                key = (self.cluster[d].node != node, self.load.get(d, 0), d)
                if best is None or key < best[0]:
                    best = (key, d, rng)
        if best is None:
            return None
        self.load[best[1]] = self.load.get(best[1], 0) + 1
        return best[1], best[2]

    def next_covered(self, at: int, hi: int, shard: int, degree: int) -> int:
        """First layer after ``at`` (up to ``hi``) that some survivor holds."""
        starts = [r[0] for h in self.by_state if (r := _covers(h, shard, degree)) and at < r[0] < hi]
        return min(starts, default=hi)


def transfers_to(plan: Plan, holdings: dict[int, list[tuple[int, int]]], workload: Workload,
                 cluster: Cluster) -> MigrationPlan:
    """Transfers that give every device of ``plan`` (placed as it is, no reassignment) the
    layers of its slot, from the devices that hold them now.

    ``holdings``: the layer ranges each alive device holds at the agreed step (a runtime whose
    migration was interrupted, or a replacement that holds nothing, differs from any plan's
    ``held_state``).  Unsharded plans only."""
    if plan.shard_degree != 1:
        raise ValueError("transfers_to handles unsharded plans only")
    pairs = [(d, (a, b, 0, 1)) for d, ranges in sorted(holdings.items()) for a, b in ranges]
    sources = _SourceIndex(pairs, cluster)
    out: list[Transfer] = []
    lost: list[Held] = []
    for pipe in plan.pipelines:
        for s, d in enumerate(pipe.devices):
            if d not in holdings:
                continue  # dead (a rerouted-around slot): nothing to deliver
            todo = [pipe.layers_of_stage(s)]
            for have in holdings[d]:
                todo = [m for need in todo for m in missing_ranges(need, have)]
            for lo, hi in todo:
                at = lo
                while at < hi:
                    src = sources.pick(at, 0, 1, d)
                    if src is None:
                        nxt = sources.next_covered(at, hi, 0, 1)
                        lost.append((at, nxt, 0, 1))
                        at = nxt
                        continue
                    src_id, (_, b) = src
                    stop = min(b, hi)
                    nbytes = workload.params_in(at, stop) * workload.state_bytes_per_param
                    out.append(Transfer(src_id, d, (at, stop), nbytes, cluster.state_link(src_id, d).transfer_s(nbytes)))
                    at = stop
    return MigrationPlan(plan, {}, out, schedule_rounds(out), lost)


def critical_path(rounds, ends: Callable) -> tuple[float, list]:
    """Time to carry out ``rounds`` when each transfer starts as soon as both its ends finished
    their transfers of earlier rounds (rounds are an order, not barriers), and the transfers
    on the path that sets it.  ``ends(t)`` gives ``(src, dst, seconds)``."""
    done: dict[Hashable, tuple[float, list]] = {}  # device -> (free at, the chain that got it there)
    for r in rounds:
        for t in r:
            src, dst, sec = ends(t)
            start, chain = max(done.get(src, (0.0, [])), done.get(dst, (0.0, [])), key=lambda x: x[0])
            done[src] = done[dst] = (start + sec, chain + [t])
    return max(done.values(), key=lambda x: x[0], default=(0.0, []))


def warm_imports() -> None:
    """Import what a migration plan imports on first use (scipy.optimize: ~0.6 s, networkx:
    ~0.14 s on a 2-core machine), so that a pipeline job's first re-plan does not: its first
    decision would take 0.09-0.26 s against 4-6 ms for the next ones.  For a helper thread."""
    import networkx  # noqa: F401
    from scipy.optimize import linear_sum_assignment  # noqa: F401


def schedule_rounds(transfers: list[Transfer]) -> list[list[Transfer]]:
    """Rounds in which no device appears twice (DSATUR colouring of the conflict graph)."""
    if not transfers:
        return []
    import networkx as nx  # on first use (import cost)

    g = nx.Graph()
    g.add_nodes_from(range(len(transfers)))
    by_device: dict[int, list[int]] = {}
    for i, t in enumerate(transfers):
        by_device.setdefault(t.src, []).append(i)
        by_device.setdefault(t.dst, []).append(i)
    for ids in by_device.values():
        for a in range(len(ids)):
            for b in range(a + 1, len(ids)):
                g.add_edge(ids[a], ids[b])
    colour = nx.greedy_color(g, strategy="DSATUR")
    rounds: list[list[Transfer]] = [[] for _ in range(max(colour.values()) + 1)]
    for i in sorted(colour):
        rounds[colour[i]].append(transfers[i])
    return rounds
