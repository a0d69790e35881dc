"""What the matrix injects.  Kills and hangs are sent from the harness, by PID, with real signals.

A scenario is a list of ``Fault``s: at ``at_step`` (plus a seeded random delay inside that step,
so that faults land between steps and inside collectives alike) the harness sends ``signal`` to
each victim rank (counted from the end when negative; ``"half"`` = the last half of the ranks,
one node of two).  ``slow`` makes a rank a straggler instead: the system's worker reads
``BENCH_SLOW=rank:factor:from_step`` (``baselines/common.py``) and pads that rank's emulated
compute by ``factor`` from that step on — a slower accelerator, the same way for every system.
``replace``: the system brings a new worker for the dead one in its own way (chameleon-ft:
``--max-replacements 1``; TorchFT: the harness restarts the replica group, as its supervisor
would; torchrun: its restart relaunches every worker anyway; plain Lightning: nothing).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Union

Victims = Union[tuple[int, ...], str]


@dataclass(frozen=True)
class Fault:
    at_step: int
    signal: int
    victims: Victims


@dataclass(frozen=True)
class Scenario:
    name: str
    faults: tuple[Fault, ...] = ()
    slow: tuple[int, float, int] | None = None    # (rank from the end when negative, factor, from step)
    replace: bool = False
    description: str = ""
    steps: int | None = None    # at least this many steps (a replacement needs time to start and join)

    @property
    def injects(self) -> bool:
        return bool(self.faults or self.slow)

    def slow_env(self, nproc: int) -> dict:
        if not self.slow:
            return {}
        rank, factor, start = self.slow
        return {"BENCH_SLOW": f"{rank % nproc}:{factor:g}:{start}"}


def victim_ranks(victims: Victims, nproc: int) -> list[int]:
    if victims == "half":
        return list(range(nproc - nproc // 2, nproc))
    return [v % nproc for v in victims]


KILL = signal.SIGKILL
SCENARIOS: dict[str, Scenario] = {s.name: s for s in [
    Scenario("failure-free", description="no fault"),
    Scenario("kill", (Fault(15, KILL, (-1,)),), description="one SIGKILL of the last rank mid-epoch"),
    Scenario("two-kills", (Fault(15, KILL, (-1,)), Fault(30, KILL, (-2,))),
             description="SIGKILL of the last rank at step 15, of the one before it at step 30"),
    Scenario("node-loss", (Fault(15, KILL, "half"),),
             description="half the ranks (one node of two) SIGKILLed at once"),
    Scenario("hang", (Fault(15, signal.SIGSTOP, (-1,)),), description="SIGSTOP of the last rank (a hang)"),
    Scenario("straggler", slow=(-1, 3.0, 15), description="the last rank's compute 3x slower from step 15"),
    Scenario("replacement", (Fault(10, KILL, (-1,)),), replace=True, steps=100,
             description="SIGKILL of the last rank at step 10; a replacement worker joins (100 steps)"),
]}

SHORT = ("failure-free", "kill")
