"""What every member of a pipeline job holds, as the recovery all-reduce reported it.

Each member reports per block 2 (it holds the job's state of the block), 1 (only built here:
an initialisation, or a shadow copy of an overlapped migration, ``overlap.py``) or 0
(``PipelineExecutor.recovery_fields``); the source turns that into layer ranges per member,
what the migration plan starts from.
"""

from __future__ import annotations

from chameleon_ft.engine.plan import Plan

__all__ = ["covers", "held_ranges"]


def held_ranges(peer_fields, peer_steps, members, n_blocks: int) -> dict[int, list[tuple[int, int]]]:
    """Layer ranges each member holds at the agreed step.  Before the first step a block nobody
    holds agreed state of is taken from the lowest member that built it (every copy is a valid
    initialisation; one must win)."""
    top = max(peer_steps)
    own: dict[int, set[int]] = {w: set() for w in members}
    for b in range(n_blocks):
        flags = [f[b] for f in peer_fields]
        if 2 in flags:
            for w, f in zip(members, flags):
                if f == 2:
                    own[w].add(b)
        elif top == 0 and 1 in flags:
            own[members[flags.index(1)]].add(b)
    out = {}
    for w, blocks in own.items():
        ranges, lo = [], None
        for b in range(n_blocks + 1):
            if b in blocks and lo is None:
                lo = b
            elif b not in blocks and lo is not None:
                ranges.append((lo, b))
                lo = None
        out[w] = ranges
    return out


def covers(plan: Plan, holdings: dict) -> bool:
    """Every alive device of ``plan`` holds its slot's blocks."""
    for pipe in plan.pipelines:
        for s, d in enumerate(pipe.devices):
            if d in holdings:
                lo, hi = pipe.layers_of_stage(s)
                have = {b for a, c in holdings[d] for b in range(a, c)}
                if not set(range(lo, hi)) <= have:
                    return False
    return True
