"""Which members of a generation went silent: each worker's abort watcher reads every member's
liveness counter in the coordinator's store (bumped by the member's own beat thread,
``Membership._beat_loop``) and reports the ones that stopped moving (``Membership._check_liveness``).
Only this worker's clock is used: no clock is compared across machines."""

from __future__ import annotations

import time
from typing import Callable, Iterable, Optional

__all__ = ["Liveness", "await_the_missing"]


class Liveness:
    """One watcher's clocks for the members of its current generation (see module doc)."""

    def __init__(self, worker_id: int, timeout_s: Optional[float], *, grace_s: float, every_s: float = 0.1):
        self.worker_id, self.timeout_s, self.every_s = worker_id, timeout_s, every_s
        # After an outage: a peer's store request may still be blocked this long (the store
        # client's request timeout, ``membership.STORE_REQUEST_TIMEOUT_S``).
        self.grace_s = grace_s
        self._next = 0.0
        self._token: Optional[str] = None
        self._seen: dict[int, tuple[int, float]] = {}
        self._reported: set[int] = set()
        self._judge_after = 0.0
        # (count, when it last moved) per worker across generations (``last_moved``)
        self._moved: dict[int, tuple[int, float]] = {}

    def reset(self) -> None:
        """This worker's own store requests failed (an outage): start every clock afresh, and
        judge nobody until the peers' requests blocked by the same outage have given up (the
        store client's request timeout): a peer whose beat thread is still inside one when the
        store answers again is not lost (seen: etcd's quorum back, one member reported)."""
        self._token = None
        self._judge_after = time.monotonic() + self.grace_s

    def took(self, seconds: float) -> None:
        """One of this worker's store requests took ``seconds``.  A stall of half the timeout
        is an outage too (``reset``): an etcd leader election blocks every write for a while,
        and a peer whose beat thread failed over to another member beats later than the others
        (seen: a member reported lost when one etcd member was killed, about 1 run in 4)."""
        if self.timeout_s is not None and seconds > min(0.5, self.timeout_s / 2):
            self.reset()

    def last_moved(self, worker: int) -> Optional[tuple[int, float]]:
        """(counter, when this watcher saw it move to that value) for ``worker``, any generation;
        None when unknown or while this worker does not judge (after an outage of its own)."""
        seen = self._moved.get(worker)
        return None if time.monotonic() < self._judge_after else seen

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.every_s
        return True

    def silent(self, token: str, counts: dict[int, int]) -> list[tuple[int, float]]:
        """(member, seconds silent) of the members silent for longer than the timeout while
        more than half of the others (this worker included: ``counts`` holds every member's)
        moved in the last few heartbeats -- a store that stalls everyone's writes (an etcd
        leader election) is not a lost member -- each once per generation; a new generation
        starts every member's clock afresh."""
        now = time.monotonic()
        if token != self._token:
            self._token, self._seen, self._reported = token, {}, set()
        for w, c in counts.items():
            last = self._seen.get(w)
            if last is None or last[0] != c:
                self._seen[w] = (c, now)
            if self._moved.get(w, (None,))[0] != c:
                self._moved[w] = (c, now)
        if now < self._judge_after:
            return []
        # "the store takes writes now": counters that moved within a few heartbeats
        fresh = {w for w, (_, t) in self._seen.items() if now - t <= min(self.timeout_s, 4 * self.every_s)}
        out = []
        for w in counts:
            quiet = now - self._seen[w][1]
            others = len(counts) - 1
            if (quiet > self.timeout_s and w not in self._reported and w != self.worker_id
                    and len(fresh - {w}) > others / 2):
                self._reported.add(w)
                out.append((w, quiet))
        return out


def await_the_missing(missing: Iterable[int], timeout_s: float, *, beat: Callable[[int], int],
                      ended: Callable[[], bool], dead: Callable[[tuple], tuple],
                      last_moved: Callable[[int], Optional[tuple[int, float]]] = lambda w: None,
                      poll_s: float = 0.02) -> bool:
    """Before a quorum that left out members of the previous generation is acted on: wait until
    each of them is known dead (``dead``: the launcher saw it exit) or its liveness counter has
    not moved for ``timeout_s`` -- or until the generation is ended (``ended``), which is what a
    left-out member that is alive does when it comes to ask (``Membership._request_admission``).
    True when it was ended: ask again.  False: act on the quorum (every left-out member is lost,
    or one still beats but has not asked within ``timeout_s``: a busy main thread, excluded as
    before).

    Why: a quorum forms ``join_timeout_ms`` after its first request; a live member that was not
    scheduled for that long (a loaded machine) missed it, and its peers took it for lost --
    seen in CI: a pipeline job declared three live stages lost and restarted from its checkpoint.
    Only this worker's clock is used; a gap in its own polling (it was not scheduled either)
    starts every clock afresh, as ``Liveness.took`` does."""
    missing = tuple(sorted(set(missing)))
    seen_dead = set(dead(missing))  # the common case (a SIGKILL the launcher saw): all of them
    pending = [w for w in missing if w not in seen_dead]
    if not pending:
        return False
    now = time.monotonic()
    counts = {w: beat(w) for w in pending}
    known = {w: last_moved(w) for w in pending}  # the watcher's record, if the counter is where it saw it
    moved = {w: known[w][1] if known[w] is not None and known[w][0] == counts[w] else now for w in pending}
    deadline, tick = now + timeout_s, now
    while True:
        if ended():
            return True
        gone = set(dead(tuple(pending)))
        now = time.monotonic()
        if now - tick > min(0.5, timeout_s / 2):  # this worker was not scheduled: no judging on it
            moved = {w: now for w in pending}
            deadline = max(deadline, now + timeout_s)
        tick = now
        for w in pending:
            c = beat(w)
            if c != counts[w]:
                counts[w], moved[w] = c, now
        pending = [w for w in pending if w not in gone and now - moved[w] < timeout_s]
        if not pending or now > deadline:
            return False
        time.sleep(poll_s)
