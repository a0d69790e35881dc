"""Straggler detection from step-phase timings.

Each step, every rank reports how long its compute took per micro-batch.  A rank's score is
the median of its recent samples divided by the median of the other ranks' — robust to a
single slow step and to the whole job slowing down together.  Hysteresis keeps noise from
flapping: a rank is flagged after ``patience`` consecutive scores above ``enter`` and cleared
after ``patience`` consecutive scores below ``leave``.  A newly flagged straggler becomes an
:class:`~chameleon_ft.failures.Event` of kind ``straggler`` with its measured slowdown; the
selector then weighs ``keep`` against ``rebalance`` (taken only when the predicted gain over
the expected time to the next failure exceeds its cost).

Limits: scores compare ranks doing the same work per micro-batch; in a heterogeneous
pipeline the caller normalises by each stage's predicted time first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median

from .failures import Event, EventKind


@dataclass
class StragglerDetector:
    window: int = 8
    enter: float = 1.5
    leave: float = 1.2
    patience: int = 3
    _samples: dict[int, deque] = field(default_factory=dict, repr=False)
    _above: dict[int, int] = field(default_factory=dict, repr=False)
    _below: dict[int, int] = field(default_factory=dict, repr=False)
    flagged: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1.0 < self.leave < self.enter:
            raise ValueError("need 1 < leave < enter for hysteresis")
        if self.window < 1 or self.patience < 1:
            raise ValueError("window and patience must be >= 1")

    def observe(self, timings: dict[int, float], time_s: float = 0.0) -> list[Event]:
        """Feed one step's per-rank seconds (per micro-batch); returns newly flagged stragglers."""
        for rank, t in timings.items():
            if not t > 0:  # also rejects NaN
                raise ValueError(f"rank {rank}: step timing must be a positive number, got {t}")
            self._samples.setdefault(rank, deque(maxlen=self.window)).append(t)
        scores = self.scores()
        events = []
        for rank, s in scores.items():
            if rank in self.flagged:
                self._below[rank] = self._below.get(rank, 0) + 1 if s < self.leave else 0
                if self._below[rank] >= self.patience:
                    del self.flagged[rank]
                    self._below[rank] = 0
                else:
                    self.flagged[rank] = s
            else:
                self._above[rank] = self._above.get(rank, 0) + 1 if s > self.enter else 0
                if self._above[rank] >= self.patience:
                    self.flagged[rank] = s
                    self._above[rank] = 0
                    events.append(Event(EventKind.STRAGGLER, (rank,), time_s, slowdown=s,
                                        detail=f"median step {s:.2f}x the job's median"))
        return events

    def scores(self) -> dict[int, float]:
        """Each rank's median against the median of the *other* ranks (leave-one-out, so a
        straggler does not pull its own reference up: with two ranks, a 3x slow one scores 3)."""
        per_rank = {r: median(q) for r, q in self._samples.items() if q}
        if len(per_rank) < 2:
            return {r: 1.0 for r in per_rank}
        out = {}
        for r, m in per_rank.items():
            ref = median(v for k, v in per_rank.items() if k != r)
            out[r] = m / ref if ref > 0 else 1.0
        return out

    def forget(self, ranks) -> None:
        """Drop ranks that left the job."""
        for r in ranks:
            for d in (self._samples, self._above, self._below, self.flagged):
                d.pop(r, None)

    def state_dict(self) -> dict:
        return {"flagged": {str(k): v for k, v in self.flagged.items()},
                "samples": {str(k): list(v) for k, v in self._samples.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.flagged = {int(k): float(v) for k, v in state.get("flagged", {}).items()}
        self._samples = {int(k): deque(v, maxlen=self.window) for k, v in state.get("samples", {}).items()}
