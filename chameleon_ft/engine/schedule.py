"""Which worker runs which blocks of which micro-batch, and in what order: pure, no torch.

The pipeline runtime runs these orders; the performance model times them (``finish_times``) to
price pipelines that rerouting couples (``perf.estimate``), so the schedule lives in the engine.

A step of a pipeline plan is a set of *routes*: micro-batch ``slot`` passes through *hops*
``(worker, first block, stop block)`` that cover the block chain ``0..L`` in order.  Without a
failure a route is its pipeline's stages.  Under rerouting (the engine's plan keeps dead
devices, see ``selector.reroute_load``) the hop of a dead stage goes to a same-stage peer in
another pipeline (same layer split, alive), so activations and gradients cross pipelines and
the global batch stays the failure-free one.

Each worker runs its tasks -- ``F`` (forward of its hop) and ``B`` (backward) per route -- in a
1F1B order: ``w`` warm-up forwards (the most hops that follow it on any of its routes), then one
forward and one backward alternately, then the remaining backwards.  Sends are asynchronous and
receives block, so the workers' local orders must be consistent: ``check`` simulates them and
``worker_orders`` falls back to all-forwards-then-all-backwards (GPipe order, always
consistent: the worker graph of monotone block chains is acyclic) where 1F1B would wait on
itself.  Every member computes the same schedule from the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

from chameleon_ft.engine.plan import Plan
from chameleon_ft.engine.reroute import reroute_load

__all__ = ["Hop", "Route", "Task", "routes", "worker_orders", "check", "finish_times", "timed_orders", "ScheduleError"]


class ScheduleError(RuntimeError):
    """The plan cannot be run by the survivors (a stage lost every copy)."""


@dataclass(frozen=True)
class Hop:
    worker: int
    lo: int
    hi: int


@dataclass(frozen=True)
class Route:
    slot: int  # the micro-batch's position in the global batch
    hops: tuple[Hop, ...]


@dataclass(frozen=True)
class Task:
    kind: str  # "F" or "B"
    slot: int
    hop: int  # index of the hop in its route

    def __repr__(self) -> str:
        return f"{self.kind}{self.slot}.{self.hop}"


def slots_of(plan: Plan) -> list[list[int]]:
    """Global-batch slots of each pipeline: pipeline ``j`` takes the next ``m_j`` slots."""
    out, at = [], 0
    for p in plan.pipelines:
        out.append(list(range(at, at + p.microbatches)))
        at += p.microbatches
    return out


def routes(plan: Plan, alive: Iterable[int], extra: Mapping[int, float] | None = None) -> list[Route]:
    """Every micro-batch's route under ``plan`` with only ``alive`` workers.

    A dead stage's micro-batches are handed to its same-stage peers in the counts the engine's
    ``reroute_load`` gives them (each peer takes a contiguous run, peers by id), or ``extra``
    where the caller has them (the performance model pricing a rerouted plan)."""
    alive = set(alive)
    dead = set(plan.devices) - alive
    if extra is None:
        extra, why = reroute_load(plan, dead, alive) if dead else ({}, "")
        if why:
            raise ScheduleError(why)
    slots = slots_of(plan)
    # (bounds, stage) -> slots whose hop there has to go to a peer, in slot order
    orphaned: dict[tuple, list[int]] = {}
    for j, pipe in enumerate(plan.pipelines):
        for s, d in enumerate(pipe.devices):
            if d in dead:
                orphaned.setdefault((pipe.bounds, s), []).extend(slots[j])
    peer_of: dict[tuple[int, int], int] = {}  # (slot, stage) -> worker
    for (bounds, s), todo in orphaned.items():
        peers = sorted(p.devices[s] for p in plan.pipelines
                       if p.bounds == bounds and p.devices[s] in alive and int(extra.get(p.devices[s], 0)) > 0)
        todo = sorted(todo)
        at = 0
        for peer in peers:
            n = int(round(extra[peer]))
            for slot in todo[at:at + n]:
                peer_of[(slot, s)] = peer
            at += n
        if at != len(todo):  # reroute_load pools per (template, stage): counts must add up
            raise ScheduleError(f"rerouting gives {at} of {len(todo)} micro-batches of layers "
                                f"{bounds[s]}-{bounds[s + 1]} a peer")
    out = []
    for j, pipe in enumerate(plan.pipelines):
        for slot in slots[j]:
            hops = tuple(Hop(peer_of.get((slot, s), d), pipe.bounds[s], pipe.bounds[s + 1])
                         for s, d in enumerate(pipe.devices))
            out.append(Route(slot, hops))
    return sorted(out, key=lambda r: r.slot)


def _tasks_by_worker(rs: Sequence[Route]) -> dict[int, list[tuple[Route, int]]]:
    by: dict[int, list[tuple[Route, int]]] = {}
    for r in rs:
        for i, h in enumerate(r.hops):
            by.setdefault(h.worker, []).append((r, i))
    return by


def _one_f_one_b(mine: list[tuple[Route, int]]) -> list[Task]:
    fwd = [Task("F", r.slot, i) for r, i in mine]
    bwd = [Task("B", r.slot, i) for r, i in mine]
    warm = min(len(fwd), max(len(r.hops) - i - 1 for r, i in mine))
    order = fwd[:warm]
    for k in range(warm, len(fwd)):
        order += [fwd[k], bwd[k - warm]]
    return order + bwd[len(fwd) - warm:]


def _gpipe(mine: list[tuple[Route, int]]) -> list[Task]:
    return [Task("F", r.slot, i) for r, i in mine] + [Task("B", r.slot, i) for r, i in mine]


def check(rs: Sequence[Route], orders: dict[int, list[Task]]) -> bool:
    """Whether the workers' local orders can all run to the end (no wait on each other)."""
    try:
        finish_times(rs, orders, lambda task, hop: 0.0, lambda a, b: 0.0)
    except ScheduleError:
        return False
    return True


def _in_1f1b_else_gpipe(rs: Sequence[Route], run: Callable[[dict[int, list[Task]]], object]):
    """``run`` on each worker's tasks in 1F1B order, or in GPipe order where 1F1B waits on itself
    (``run`` raises ``ScheduleError``); GPipe order waiting too cannot happen for monotone
    routes: a bug if it does."""
    by = _tasks_by_worker(rs)
    try:
        return run({w: _one_f_one_b(mine) for w, mine in by.items()})
    except ScheduleError:
        pass
    try:
        return run({w: _gpipe(mine) for w, mine in by.items()})
    except ScheduleError:
        raise ScheduleError("no consistent schedule for these routes") from None


def worker_orders(rs: Sequence[Route]) -> dict[int, list[Task]]:
    """Each worker's tasks in 1F1B order, or GPipe order where 1F1B would not be consistent."""
    def consistent(orders):
        finish_times(rs, orders, lambda task, hop: 0.0, lambda a, b: 0.0)
        return orders
    return _in_1f1b_else_gpipe(rs, consistent)


def finish_times(rs: Sequence[Route], orders: dict[int, list[Task]],
                 seconds: Callable[[Task, Hop], float], hop_s: Callable[[int, int], float]) -> dict[int, float]:
    """When each micro-batch's backward leaves its first hop, timing the workers' orders: a task
    starts once its worker finished the one before and its inputs arrived (``hop_s(from, to)``
    seconds between two workers, none on the same one); it lasts ``seconds(task, hop)``.  Raises
    ``ScheduleError`` where the orders wait on each other (as ``check``).  Linear in the tasks: a
    worker is looked at again only when the task it waits for is done."""
    route = {r.slot: r.hops for r in rs}
    wire: dict[tuple[int, int], float] = {}

    def link(a: int, b: int) -> float:
        if a == b:
            return 0.0
        if (a, b) not in wire:
            wire[(a, b)] = hop_s(a, b)
        return wire[(a, b)]

    plans = {}  # worker -> [(key, seconds, ((dependency key, its wire seconds), ...)), ...]
    for w, order in orders.items():
        steps = []
        for t in order:
            hops, slot, h = route[t.slot], t.slot, t.hop
            if t.kind == "F":
                deps = () if h == 0 else ((("F", slot, h - 1), link(hops[h - 1].worker, w)),)
                key = ("F", slot, h)
            else:
                deps = ((("F", slot, h), 0.0),) if h == len(hops) - 1 else (
                    (("F", slot, h), 0.0), (("B", slot, h + 1), link(hops[h + 1].worker, w)))
                key = ("B", slot, h)
            steps.append((key, seconds(t, hops[h]), deps))
        plans[w] = steps
    done: dict[tuple[str, int, int], float] = {}
    free = dict.fromkeys(orders, 0.0)
    at = dict.fromkeys(orders, 0)
    waiting: dict[tuple[str, int, int], list[int]] = {}
    todo = list(orders)
    while todo:
        w = todo.pop()
        steps, i, clock = plans[w], at[w], free[w]
        while i < len(steps):
            key, dur, deps = steps[i]
            start = clock
            for k, wire in deps:
                ready = done.get(k)
                if ready is None:
                    waiting.setdefault(k, []).append(w)
                    break
                start = max(start, ready + wire)
            else:
                clock = done[key] = start + dur
                i += 1
                more = waiting.pop(key, None)
                if more:
                    todo.extend(more)
                continue
            break
        at[w], free[w] = i, clock
    if any(at[w] != len(o) for w, o in orders.items()):
        raise ScheduleError("the orders wait on each other")
    return {slot: done[("B", slot, 0)] for slot in route}


def timed_orders(rs: Sequence[Route], seconds: Callable[[Task, Hop], float],
                 hop_s: Callable[[int, int], float]) -> dict[int, float]:
    """``finish_times`` of the orders ``worker_orders`` gives, without simulating them twice."""
    return _in_1f1b_else_gpipe(rs, lambda orders: finish_times(rs, orders, seconds, hop_s))
