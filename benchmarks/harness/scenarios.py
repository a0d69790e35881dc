"""What the matrix injects.  Every fault is sent from the harness, by PID, with a real signal.

``victims``: worker ranks (replica groups for torchft) signalled at ``at_step`` (plus a seeded
random delay inside the step, so kills land between steps and inside collectives alike).
Rows for the full matrix (two successive kills, node loss, straggler, replacement) slot in
here; ``SHORT`` is the subset ``--short`` runs.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass


@dataclass(frozen=True)
class Scenario:
    name: str
    signal: int = 0                 # 0: failure-free
    victims: tuple[int, ...] = ()   # ranks, counted from the end when negative
    at_step: int = 15
    description: str = ""


SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario("failure-free", description="no fault"),
    Scenario("kill", signal.SIGKILL, (-1,), description="one SIGKILL of the last rank mid-epoch"),
    Scenario("hang", signal.SIGSTOP, (-1,), description="SIGSTOP of the last rank (a hang)"),
    # TODO(full matrix): "two-kills" (successive steps), "node-loss" (half the ranks at once),
    # "straggler" (3x slower: SIGSTOP/SIGCONT duty cycle), "replacement" (a new worker joins).
]}

SHORT = ("failure-free", "kill")
