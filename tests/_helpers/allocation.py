"""Test-only: force uneven or zero micro-batch allocations in a worker process.

The engine gives a member fewer micro-batches (``rebalance``) or none at all, and a partial last
global batch leaves slots empty; the fidelity trials need those states on demand, at any
membership.  ``force_allocations(spec)`` wraps ``EngineBridge._allocation_of`` (where every
data-parallel allocation the engine decides -- start, failure, straggler -- is computed) so that
each one is then skewed deterministically: every member applies the same change to the same
allocation, as the runtime requires.  An executor's own constraint
(``ElasticConfig.one_microbatch_each``, set by the Lightning adapter) still applies after it.

Spec ``KIND:POS`` (POS counts members in the allocation's order, modulo their number):
  * ``zero:POS``  -- member POS gets no micro-batch; its share goes to the next member;
  * ``uneven:POS`` -- member POS gives one micro-batch to the next member (when it has two).
"""

from __future__ import annotations

from chameleon_ft.runtime.engine_bridge import EngineBridge


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
    original = EngineBridge._allocation_of

    def _allocation_of(self, plan, alive, extra, batch=None):
        alloc = original(self, plan, alive, extra, batch)
        if alloc is None or plan.max_depth != 1:
            return alloc
        return dict(zip(alloc, skew(list(alloc.values()), spec)))

    EngineBridge._allocation_of = _allocation_of
