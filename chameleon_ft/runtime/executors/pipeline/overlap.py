"""An overlapped migration: the job trains on while a re-plan's state moves (issue 27, item 3).

``ElasticConfig.overlap_migration``.  When a Decision moves blocks (a re-plan, a grow, a heal)
and the layout that ran before it can still run over the members (no stage lost every replica:
the dead are rerouted around; joiners and replacements, which hold nothing of a slot yet, wait
idle), the recovery does not pause for the migration:

1. Every member runs the *running* layout (the one before the Decision, rerouted), and the
   engine state says so; the Decision's layout is the *target*, in the recovery payload.
2. Each sender encodes the blocks it sends *now* (a snapshot of weights, optimizer and scheduler
   state at the recovery's step, ``migration.encode_tree``), and a background thread walks the
   migration plan's rounds (``migration.walk``) on the generation's group, captured at the start
   (never a later generation's), while the main thread trains.
3. A receiving worker is a *shadow* holder of the blocks it receives: it joins those blocks'
   gradient reductions (``reduce.holder_sets(..., extra=shadows)``) with zeros, so it gets each
   step's reduced gradient.  Until the snapshot has arrived it keeps them; at the next step
   boundary after it arrives it loads the snapshot and replays the kept gradients through the
   block's optimizer (and scheduler) in order -- the same updates its holders applied -- then
   steps it with every later one.
4. Every member reports how many of its blocks are not yet caught up in the step's commit; the
   step whose commit sums to 0 is the last on the running layout: after it every member switches
   to the target (drops what its new slot does not hold; the shadows become holders), at the
   same step boundary, with nothing to move.

The trajectory is the failure-free one: the rerouted steps are (up to summation order), and a
shadow's copy equals its holders' (same snapshot, same gradients, same optimizer).  A failure or
a join meanwhile ends the overlap: the recovery drops what is not agreed (shadows hold no agreed
state) and decides again from what the holders hold, as after any failure.

Limits: the emulated link (``emulate_link``) holds the migration's transfers and the step's
messages each on its own -- they do not share its bandwidth; the overlapped migration's seconds
are logged, not fed to the calibration (they include the training they overlapped).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch

from chameleon_ft.engine.plan import Plan
from chameleon_ft.engine.reroute import reroute_load, unreplicated
from chameleon_ft.runtime.executors.pipeline import migration

__all__ = ["Overlap", "plan", "switch"]

# Tags of the overlapped transfers: above the step's and the commit's, apart from a paused
# migration's (``migration._BASE_TAG`` on), below 2**31 (gloo tags are C ints).
_TAG = (1 << 30) + (1 << 29)


class _CapturedPort:
    """Point-to-point ops on one generation's group, waited for in the calling (background)
    thread; an abort or the end of the overlap ends the wait at the next poll."""

    def __init__(self, pg, timeout_s: float, cancelled: threading.Event):
        self.pg, self.timeout_s, self.cancelled = pg, timeout_s, cancelled

    def send(self, t, dst: int, tag: int):
        return self.pg.send([t], dst, tag)

    def recv(self, t, src: int, tag: int):
        return self.pg.recv([t], src, tag)

    def wait(self, works: list) -> None:
        for w in works:  # a gloo p2p wait needs its own limit (waits.py)
            w.wait(timedelta(seconds=self.timeout_s))
        if self.cancelled.is_set():
            raise RuntimeError("the overlapped migration was ended by a recovery")


class Overlap:
    """One overlapped migration, from the recovery that decided it to the switch (module doc).

    ``migration_payload``: the recovery payload's ``migration`` (``rounds`` and ``overlap``: the
    target layout, ``EngineBridge.layout()``'s form)."""

    def __init__(self, ctx, migration_payload: dict):
        self.target = migration_payload["overlap"]
        self.rounds = migration_payload["rounds"]
        self.predicted_s = migration_payload.get("predicted_s")
        self.predicted_bytes = migration_payload.get("predicted_bytes")
        self.decisions = list(getattr(ctx, "last_decisions", []) or [])
        self.start_step, self.t0 = ctx.step, time.perf_counter()
        me = ctx.worker_id
        self.shadows: dict[int, set[int]] = {}  # block -> the workers receiving it
        for rnd in self.rounds:
            for src, dst, lo, hi in rnd:
                for b in range(lo, hi):
                    self.shadows.setdefault(b, set()).add(dst)
        self.mine = {b for b, ds in self.shadows.items() if me in ds}
        self.kept: dict[int, list[torch.Tensor]] = {b: [] for b in self.mine}  # reduced gradients
        self.installed: set[int] = set()
        self.arrived: dict[int, dict] = {}  # block -> its snapshot (from the background thread)
        self.moved = {"state_bytes": 0, "wire_bytes": 0, "transfers": 0, "durations": {}}
        self.error: str | None = None
        self.done_s: float | None = None  # when this member's part of the rounds ended
        self._lock = threading.Lock()
        self.cancelled = threading.Event()
        # The snapshot, now, in the main thread: what this member sends, encoded (a copy).
        self._encoded = {}
        for rnd in self.rounds:
            for src, dst, lo, hi in rnd:
                if src == me:
                    self._encoded[(lo, hi, dst)] = (migration.encode_tree(migration.blocks_tree(ctx, lo, hi)),
                                                    sum(ctx.state_bytes(b) for b in range(lo, hi)))
        port = _CapturedPort(ctx.gm.group(), ctx.hang_timeout_s, self.cancelled)
        self._members = list(ctx.view.members)  # the captured group's ranks
        self._thread = threading.Thread(target=self._run, args=(ctx, port), daemon=True,
                                        name=f"cft-overlap-{me}")
        self._thread.start()

    # ------------------------------------------------------------ background
    def _run(self, ctx, port) -> None:
        def encoded(lo, hi, dst):
            return self._encoded[(lo, hi, dst)][0]

        def state_bytes(lo, hi, dst):
            return self._encoded[(lo, hi, dst)][1]

        def received(lo, hi, tree):
            with self._lock:
                for b in range(lo, hi):
                    self.arrived[b] = tree[str(b)]

        def hold(seconds):
            end = time.monotonic() + seconds
            while (left := end - time.monotonic()) > 0 and not self.cancelled.is_set():
                time.sleep(min(left, 0.05))
        try:
            migration.walk(ctx, port, self.rounds, _TAG, encoded, received, self.moved, state_bytes, hold,
                           self._members)
            self.done_s = time.perf_counter() - self.t0
        except Exception as exc:  # the main thread turns it into a failure of the generation
            if not self.cancelled.is_set():
                self.error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            self._encoded = {}

    # ------------------------------------------------------------ main thread
    def pending(self) -> int:
        """Blocks this member receives that are not yet caught up (the commit sums them)."""
        return len(self.mine - self.installed)

    def keep(self, reduced: dict[int, torch.Tensor]) -> None:
        """A committed step's reduced gradients of the blocks whose snapshot is not loaded yet."""
        for b in self.mine - self.installed:
            if b in reduced:
                self.kept[b].append(reduced[b])

    def install(self, ctx) -> None:
        """Load the snapshots that arrived and replay the kept gradients through them.  They
        join ``ctx.held`` (stepped from now on) but not ``ctx.agreed`` until the switch."""
        with self._lock:
            ready, self.arrived = dict(self.arrived), {}
        for b in sorted(ready):
            ctx.put_block(b, ready[b])
            ctx.agreed.discard(b)
            for flat in self.kept.pop(b):
                ctx.step_block(b, flat)
            self.installed.add(b)

    def cancel(self) -> None:
        """A recovery ends the overlap (module doc); the thread stops at its next wait."""
        self.cancelled.set()

    def end(self, timeout_s: float) -> None:
        """The job ends before the switch: let the transfers finish (every peer does the same;
        up to ``timeout_s``, at most 10 s) so that no gloo wait outlives its group at exit; then
        stop them."""
        self._thread.join(min(timeout_s, 10.0))
        self.cancel()

    def record(self, ctx) -> dict:
        """The overlapped migration as the event log's ``migration`` end record."""
        return {"bytes": self.moved["state_bytes"], "wire_bytes": self.moved["wire_bytes"],
                "transfers": self.moved["transfers"], "rounds": len(self.rounds), "overlapped": True,
                "seconds": time.perf_counter() - self.t0, "transfer_s": self.done_s,
                "steps_overlapped": ctx.step - self.start_step, "predicted_bytes": self.predicted_bytes,
                "predicted_s": self.predicted_s}


def plan(ctx, payload: dict, running: Plan, members, holdings: dict) -> bool:
    """The source's recovery: make the Decision's migration (``payload["migration"]``)
    overlapped when ``running`` (the layout before it) can run over ``members`` -- every stage
    still has a live holder.  The engine state then runs ``running`` (the dead rerouted around;
    a member that holds nothing of its slot yet -- a replacement to be healed, a joiner -- waits
    idle) and the payload carries the Decision's layout as the target.  ``holdings``: the layer
    ranges each member holds.  False: it cannot, the job pauses for the migration."""
    policy, alive = ctx.policy, set(members)
    have = {d: {b for a, c in holdings.get(d, []) for b in range(a, c)} for d in alive}
    empty = {d for p in running.pipelines for s, d in enumerate(p.devices)
             if d in alive and not set(range(*p.layers_of_stage(s))) <= have[d]}
    live = alive - empty
    dead = set(running.devices) - live
    if unreplicated(running, live):
        return False
    extra, why = reroute_load(running, dead, live) if dead else ({}, "")
    placed = live & set(running.devices)
    alloc = None if why else policy._allocation_of(running, placed, extra, policy.current_batch)
    if alloc is None:
        return False
    payload["migration"]["overlap"] = policy.layout()
    policy.plan, policy.alive = running, frozenset(live)
    policy.allocation = dict(sorted({**alloc, **{w: 0 for w in alive - placed}}.items()))
    policy._predicted = None
    return True


def switch(ctx) -> None:
    """After the commit that found every member caught up: every member runs the target from
    the next step (module doc, 4)."""
    ov, ctx._overlap = ctx._overlap, None
    t, pol = ov.target, ctx.policy
    pol.plan = Plan.from_json(t["plan"])
    pol.allocation = {int(w): int(n) for w, n in t["allocation"]}
    pol.current_batch = int(t["current_batch"])
    pol.alive = frozenset(int(w) for w in t["alive"])
    pol._predicted = None
    want = ctx.slot_blocks()
    if not want <= ctx.held:
        raise RuntimeError(f"worker {ctx.worker_id} switches to its new slot without blocks "
                           f"{sorted(want - ctx.held)}")  # a bug: the commit said all had arrived
    for b in sorted(ctx.held - want):
        ctx.drop_block(b)
    ctx.agreed = set(ctx.held)
    ctx._schedule_key = None
    rec = ctx.last_migration = ov.record(ctx)
    if ctx.log:
        ctx.log.write("migration", step=ctx.step, phase="end", **rec)
    # The Decision's steps are measured from here; its transition was the recovery's.
    mttr = {**((ctx.last_recovery or {}).get("mttr") or {}), "overlapped_s": rec["seconds"]}
    ctx._tracker.start(ctx.step, ov.decisions, mttr, time.perf_counter())
