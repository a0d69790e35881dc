"""Straggler detection from step-phase timings.

Each step, every rank reports how long its compute took per micro-batch.  A rank's score is
the median of its last ``window`` samples divided by the median of the other ranks' — robust to
a single slow step and to the whole job slowing down together.  Scores come only from full
windows (a rank's first steps carry start-up noise).

A flag needs evidence that survives CPU time-sharing noise:

* the score stays above ``enter`` for ``windows`` disjoint windows in a row (``(windows - 1) ·
  window + 1`` consecutive full-window scores), so a burst shorter than a window's majority
  never counts, and one lucky window is not enough;
* and for at least ``min_evidence_s`` seconds of steps: on a loaded machine the OS starves one
  process or two for episodes of a few hundred milliseconds (measured: ~10 steps of 40 ms on 2
  shared cores, 0.4 s), which two windows of millisecond steps cannot tell from a straggler;
* the slowdown costs real time: its extra seconds per step, at the rank's even share of the
  micro-batches (``share``), exceed ``max(min_cost_s, min_cost_frac · step_s)``.  A 4x spike on
  a 1 ms micro-batch costs 3 ms: not worth moving work for.

A flagged rank is cleared after ``window`` consecutive scores below ``leave`` (hysteresis), or
when it has yielded no timing for ``window`` steps (stale evidence: an idle rank cannot be
measured, so it must not stay flagged for ever).  ``clear(rank, hold)`` drops a flag on the
caller's word (a rebalance that did not pay) and ignores the rank's evidence for ``hold``
steps.  A newly flagged straggler becomes an :class:`~chameleon_ft.engine.failures.Event` of kind
``straggler`` with its measured slowdown; ranks cleared by the last ``observe`` are in
``cleared``.

Limits: scores compare ranks doing the same work per micro-batch; in a heterogeneous
pipeline the caller normalises by each stage's predicted time first.  A slowdown that does not
scale with the number of micro-batches (a fixed per-step delay) is seen as a per-micro-batch
one; the runtime undoes a rebalance that does not pay (see ``runtime/engine_bridge.py``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field

from chameleon_ft.engine.failures import Event, EventKind


def _median(values) -> float:
    """``statistics.median`` of ``values`` (the same number), without its per-call overhead:
    the detector takes one per rank per step."""
    ordered = sorted(values)
    n = len(ordered)
    if n % 2:
        return ordered[n // 2]
    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def _median_without(ordered: list[float], i: int) -> float:
    """``statistics.median`` of sorted ``ordered`` without its element ``i``, in O(1) (the
    same number: the middle one, or the mean of the middle two as ``median`` computes it)."""
    n = len(ordered) - 1

    def at(j: int) -> float:
        return ordered[j] if j < i else ordered[j + 1]
    if n % 2:
        return at(n // 2)
    return (at(n // 2 - 1) + at(n // 2)) / 2


@dataclass
class StragglerDetector:
    window: int = 5
    enter: float = 1.5
    leave: float = 1.2
    windows: int = 2
    min_cost_s: float = 0.005
    min_cost_frac: float = 0.2
    min_evidence_s: float = 1.0
    _samples: dict[int, deque] = field(default_factory=dict, repr=False)
    _above: dict[int, int] = field(default_factory=dict, repr=False)
    _below: dict[int, int] = field(default_factory=dict, repr=False)
    _idle: dict[int, int] = field(default_factory=dict, repr=False)
    _hold: dict[int, int] = field(default_factory=dict, repr=False)
    _above_s: dict[int, float] = field(default_factory=dict, repr=False)
    flagged: dict[int, float] = field(default_factory=dict)
    cleared: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 1.0 < self.leave < self.enter:
            raise ValueError("need 1 < leave < enter for hysteresis")
        if self.window < 1 or self.windows < 1:
            raise ValueError("window and windows must be >= 1")
        if self.min_cost_s < 0 or not 0 <= self.min_cost_frac < 1 or self.min_evidence_s < 0:
            raise ValueError("need min_cost_s >= 0, 0 <= min_cost_frac < 1 and min_evidence_s >= 0")

    @property
    def evidence_steps(self) -> int:
        """Consecutive full-window scores above ``enter`` that flag a rank."""
        return (self.windows - 1) * self.window + 1

    def floor_s(self, step_s: float = 0.0) -> float:
        """Extra seconds per step a slowdown must cost before it counts."""
        return max(self.min_cost_s, self.min_cost_frac * max(step_s, 0.0))

    def observe(self, timings: dict[int, float], time_s: float = 0.0, *, share: float = 1.0,
                step_s: float = 0.0) -> list[Event]:
        """Feed one step's per-rank seconds per micro-batch (ranks that ran none are left out);
        ``share``: micro-batches per rank in an even split; ``step_s``: the step's seconds
        (default: the slowest rank's timing times ``share``).
        Returns newly flagged stragglers, worst first; ``cleared`` lists the ranks cleared."""
        for rank, t in timings.items():
            if not t > 0:  # also rejects NaN
                raise ValueError(f"rank {rank}: step timing must be a positive number, got {t}")
        self.cleared = []
        for rank in list(self._hold):
            self._hold[rank] -= 1
            if self._hold[rank] <= 0:
                del self._hold[rank]
        for rank, t in timings.items():
            if rank not in self._hold:
                self._samples.setdefault(rank, deque(maxlen=self.window)).append(t)
            self._idle[rank] = 0
        for rank in list(self.flagged):
            if rank not in timings:
                self._idle[rank] = self._idle.get(rank, 0) + 1
                if self._idle[rank] >= self.window:
                    self._drop(rank)
                    self.cleared.append(rank)
        if not step_s > 0:
            step_s = max(timings.values(), default=0.0) * share
        floor = self.floor_s(step_s)
        events = []
        for rank, (s, ref, own) in self._scored().items():
            if rank not in timings:
                continue
            if rank in self.flagged:
                self._below[rank] = self._below.get(rank, 0) + 1 if s < self.leave else 0
                if self._below[rank] >= self.window:
                    self._drop(rank)
                    self.cleared.append(rank)
                else:
                    self.flagged[rank] = s
                continue
            costly = (own - ref) * share > floor
            full = len(self._samples[rank]) == self.window
            above = full and s > self.enter and costly
            self._above[rank] = self._above.get(rank, 0) + 1 if above else 0
            self._above_s[rank] = self._above_s.get(rank, 0.0) + step_s if above else 0.0
            if self._above[rank] >= self.evidence_steps and self._above_s[rank] >= self.min_evidence_s:
                self.flagged[rank] = s
                events.append(Event(EventKind.STRAGGLER, (rank,), time_s, slowdown=s,
                                    detail=f"median step {s:.2f}x the job's median, above "
                                           f"{self.enter}x for {self._above[rank]} steps in a row "
                                           f"({self._above_s[rank]:.1f} s), "
                                           f"costing {(own - ref) * share * 1e3:.1f} ms"
                                           f" a step (floor {floor * 1e3:.1f} ms)"))
                self._above[rank] = self._below[rank] = 0
                self._above_s[rank] = 0.0
        return sorted(events, key=lambda e: -e.slowdown)

    def _scored(self) -> dict[int, tuple[float, float, float]]:
        """Score, reference (the other ranks' median) and own median of each rank with samples."""
        per_rank = {r: _median(q) for r, q in self._samples.items() if q}
        if len(per_rank) < 2:
            return {r: (1.0, m, m) for r, m in per_rank.items()}
        ordered = sorted(per_rank.values())
        out = {}
        for r, m in per_rank.items():
            ref = _median_without(ordered, bisect_left(ordered, m))
            out[r] = (m / ref if ref > 0 else 1.0, ref, m)
        return out

    def scores(self) -> dict[int, float]:
        """Each rank's median against the median of the *other* ranks (leave-one-out, so a
        straggler does not pull its own reference up: with two ranks, a 3x slow one scores 3)."""
        return {r: s for r, (s, _, _) in self._scored().items()}

    def _drop(self, rank: int) -> None:
        for d in (self._samples, self._above, self._above_s, self._below, self._idle, self.flagged):
            d.pop(rank, None)

    def clear(self, rank: int, hold: int = 0) -> None:
        """Drop ``rank``'s flag and evidence; ignore its timings for the next ``hold`` steps."""
        self._drop(rank)
        if hold > 0:
            self._hold[rank] = int(hold)

    def forget(self, ranks) -> None:
        """Drop ranks that left the job."""
        for r in ranks:
            self._drop(r)
            self._hold.pop(r, None)

    def state_dict(self) -> dict:
        def ints(d):
            return {str(k): v for k, v in d.items()}
        return {"flagged": ints(self.flagged), "samples": {str(k): list(v) for k, v in self._samples.items()},
                "above": ints(self._above), "above_s": ints(self._above_s), "below": ints(self._below),
                "idle": ints(self._idle),
                "hold": ints(self._hold)}

    def load_state_dict(self, state: dict) -> None:
        def back(name, cast):
            return {int(k): cast(v) for k, v in state.get(name, {}).items()}
        self.flagged = back("flagged", float)
        self._samples = {int(k): deque(v, maxlen=self.window) for k, v in state.get("samples", {}).items()}
        self._above, self._below = back("above", int), back("below", int)
        self._above_s = back("above_s", float)
        self._idle, self._hold = back("idle", int), back("hold", int)
        self.cleared = []
