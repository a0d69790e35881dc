"""Test-only: force uneven or zero micro-batch allocations in a worker process.

The engine gives a member fewer micro-batches (``rebalance``) or none at all, and a partial last
global batch leaves slots empty; the fidelity trials need those states on demand, at any
membership.  ``force_allocations(spec)`` wraps ``DataParallelExecutor._apply_allocation`` (where every
allocation the engine decides -- start, failure, straggler -- reaches the sampler) so that each
one is then skewed deterministically: every member applies the same change to the same
allocation, as the runtime requires.  An adapter's own correction (Lightning's
``at_least_one_each``) still runs after it.

Spec ``KIND:POS`` (POS counts members in the allocation's order, modulo their number):
  * ``zero:POS``  -- member POS gets no micro-batch; its share goes to the next member;
  * ``uneven:POS`` -- member POS gives one micro-batch to the next member (when it has two).
"""

from __future__ import annotations

from chameleon_ft.runtime.executors.dp import DataParallelExecutor


def skew(counts: list[int], spec: str) -> list[int]:
    kind, pos = spec.split(":")
    counts = list(counts)
    n = len(counts)
    if n < 2:
        return counts
    i = int(pos) % n
    j = (i + 1) % n
    if kind == "zero":
        counts[j] += counts[i]
        counts[i] = 0
    elif kind == "uneven":
        if counts[i] >= 2:
            counts[i] -= 1
            counts[j] += 1
    else:
        raise ValueError(f"unknown allocation spec {spec!r}: use zero:POS or uneven:POS")
    return counts


def force_allocations(spec: str | None) -> None:
    if not spec:
        return
    skew([1, 1], spec)  # validate before any worker starts
    original = DataParallelExecutor._apply_allocation

    def _apply_allocation(self) -> None:
        original(self)
        s = self.sampler
        counts = skew(list(s.allocation), spec)
        if counts != list(s.allocation):
            s.set_allocation(list(s.members), counts)

    DataParallelExecutor._apply_allocation = _apply_allocation
