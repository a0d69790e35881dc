"""Predicted vs measured: what the engine said a failure or join Decision would give, beside
what the job then measured.

After each Decision that changed the job (``reroute``, ``replan``, ``heal``...), the tracker
keeps the chosen candidate's predicted step time and transition time and every candidate's
figures; it then times the committed steps.  The first step after the reconfiguration is
skipped (it carries caches warming up and the recovery's tail); once ``steps`` more are
committed it returns one record: the median measured step, the measured transition (the
recovery's group rebuild + state agreement and transfer, which is what the selector's
``transition_s`` models; detection and the membership agreement are paid by every candidate
alike and left out), and the relative errors.  Only the chosen candidate can be measured in
a run; the others are measured by runs that chose them (the benchmark's fixed policies).

Limits: a second failure before the steps are measured drops the record; step times are this
member's commit-to-commit intervals.
"""

from __future__ import annotations

import statistics
from typing import Optional

__all__ = ["PredictionTracker"]


class PredictionTracker:
    def __init__(self, steps: int = 5):
        self.steps = int(steps)
        self._open: Optional[dict] = None

    def start(self, step: int, decisions: list[dict], mttr: dict, now: float) -> None:
        """A recovery committed its first step at ``step`` after ``decisions`` (JSON)."""
        self._open = None
        decided = [d for d in decisions if d.get("candidates")]
        if not decided:
            return
        d = decided[-1]
        chosen = next((c for c in d["candidates"] if c["policy"] == d["chosen"]), None)
        if chosen is None or chosen.get("step_time_s") is None:
            return
        self._open = {
            "decision_step": step, "chosen": d["chosen"], "decision_event": d.get("event"), "mttf_s": d.get("mttf_s"),
            "predicted_step_s": chosen["step_time_s"], "predicted_transition_s": chosen.get("transition_s"),
            "measured_transition_s": (mttr.get("rebuild") or 0.0) + (mttr.get("state_transfer") or 0.0),
            "mttr": dict(mttr),
            "candidates": {c["policy"]: {k: c.get(k) for k in ("feasible", "step_time_s", "transition_s", "score")}
                           for c in d["candidates"]},
            "commits": [now]}

    def cancel(self) -> None:
        self._open = None

    def commit(self, step: int, now: float) -> Optional[dict]:
        """A step committed at ``now``: the record once enough steps were measured."""
        tr = self._open
        if tr is None or tr["decision_step"] == step:
            return None
        tr["commits"].append(now)
        gaps = [b - a for a, b in zip(tr["commits"][1:], tr["commits"][2:])]
        if len(gaps) < self.steps:
            return None
        self._open = None
        measured = statistics.median(gaps)
        rec = {k: v for k, v in tr.items() if k != "commits"}
        pt, mt = tr["predicted_transition_s"], tr["measured_transition_s"]
        rec.update(measured_step_s=measured, steps_measured=len(gaps),
                   step_error=tr["predicted_step_s"] / measured - 1 if measured > 0 else None,
                   transition_error=pt / mt - 1 if pt and mt else None)
        return rec
