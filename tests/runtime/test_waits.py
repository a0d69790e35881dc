"""The wait's rule between a completed op and an abort (``runtime/waits.py: Waits._watch``).

Members that finished a collective may end the generation at once (an announced leave: the
survivors reconfigure right after the commit).  A member whose own side of that op completed a
moment later must see it completed, not aborted: otherwise it redoes a step its peers committed.
An op that has not completed is abandoned on the abort, as before.  Pure logic: the op's
``within`` and the abort record are stand-ins; the collective itself is tested with real
processes in ``test_preemption.py``."""

from __future__ import annotations

import pytest

from chameleon_ft.runtime.groups import CollectiveFailure
from chameleon_ft.runtime.waits import Waits


class _Manager(Waits):
    op_timeout_s, abort_poll_s, pause_limit_s, worker_id = 30.0, 0.005, None, 0

    def __init__(self, aborted_after: int):
        self.calls, self.aborted_after, self.parked = 0, aborted_after, []

    def paused(self) -> bool:
        return False

    def abort_record(self):
        return {"reason": "peer_error: a peer ended the generation"} if self.calls >= self.aborted_after else None

    def _failure(self, msg, kind, record):
        return CollectiveFailure(msg, kind=kind, token="t", generation=1)


def _op(m: _Manager, completes_at: int):
    def within(seconds: float) -> bool:
        m.calls += 1
        return m.calls >= completes_at
    return within


def test_an_op_completed_when_the_abort_is_seen_counts_as_completed():
    m = _Manager(aborted_after=1)
    m._watch(_op(m, completes_at=2), None, lambda: m.parked.append("op"), "collective")
    assert m.parked == [] and m.calls == 2


def test_an_op_still_running_when_the_abort_is_seen_is_abandoned():
    m = _Manager(aborted_after=1)
    with pytest.raises(CollectiveFailure, match="aborted by peer"):
        m._watch(_op(m, completes_at=10), None, lambda: m.parked.append("op"), "collective")
    assert m.parked == ["op"] and m.calls == 2


class _Ender:
    """What ``GroupManager._local_failure`` uses: the first writer of the abort record wins."""
    worker_id = 0

    def __init__(self, first_by):
        self.record = None if first_by is None else {"by": first_by, "reason": "mismatch: E", "suspects": []}

    def abort(self, reason, suspects=()):
        self.record = self.record or {"by": self.worker_id, "reason": reason, "suspects": list(suspects)}

    def abort_record(self):
        return self.record

    def _failure(self, msg, kind, record):
        return CollectiveFailure(msg, kind=kind, token="t", generation=1, reporter=record.get("by"))


@pytest.mark.parametrize("first_by, kind, reporter", [(None, "peer_error", 0), (0, "peer_error", 0),
                                                      (2, "aborted", 2)])
def test_a_broken_op_after_a_peers_abort_is_that_peers_abort(first_by, kind, reporter):
    """A peer that gives up an op breaks its connections: the op here fails with a connection
    error, but the generation's end is the peer's (its abort record came first)."""
    from chameleon_ft.runtime.groups import GroupManager
    m = _Ender(first_by)
    failure = GroupManager._local_failure(m, "collective failed: Connection closed by peer", "peer_error")
    assert (failure.kind, failure.reporter) == (kind, reporter)
    assert m.record["by"] == reporter
