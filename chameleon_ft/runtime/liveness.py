"""Which members of a generation went silent, judged once per job.

**The embedded coordinator judges** when it was started with a liveness timeout (the
launcher's ``--coordinator-judges``: its ``--heartbeat-timeout``): each worker beats on its presence connection, one byte ten
times a second, no answer awaited and no store request (``runtime/presence.py``); the
coordinator counts the beats and, ten times a second, ``JobJudge`` applies the rule below to
the newest generation's members, ends the generation of one found silent (the abort record,
``by: "coordinator"``), writes the counts that moved as the members' counters (one request) and
the quiet members' record (one).  A worker then sends no liveness request at all.  A worker
whose presence connection does not take beats (it could not open one, or the coordinator's
presence thread closed it) beats to the store, where the coordinator reads its counter, and
judges as below -- on counters that move for every member, since the coordinator writes the
beats it counts -- so no member is left unjudged.  ``JUDGED_KEY`` tells a worker the
coordinator judges (it then reads the coordinator's record where it needs one).

**Otherwise (etcd, or a coordinator without a judge)** every worker bumps its liveness counter
in the job's store (``LivenessMonitor``, on a thread and store client of its own).  The
*judge* -- the lowest worker id of the current
generation -- reads every member's counter in one request (``multi_get``) ten times a second,
reports the ones that stopped moving, and publishes how long each quiet member has been quiet
as one key; every other member reads three keys in one request, four times a second: the
judge's counter, its own and that record (a silent judge is found within the timeout and a
quarter of a second).  So the store serves O(N) requests a second for N workers (each worker a
constant rate), not N², and a judge that goes silent is reported by everyone.  Only durations
are compared: the record carries seconds measured on the judge's clock, translated onto the
reader's own (``last_moved``), never a timestamp across machines.  While its own requests fail
or stall a member judges nobody, and afterwards only after a grace: 2 s, or, when etcd's answer
shows the stall was an election, the liveness request timeout and three beats with the clocks
kept (``Liveness.back``)."""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable, Iterable, Optional

__all__ = ["Liveness", "LivenessMonitor", "JobJudge", "await_the_missing", "LIVENESS_KEY", "JUDGED_KEY", "beat_key", "silent_reason"]

log = logging.getLogger(__name__)

LIVENESS_KEY = "cft/liveness"  # the judge's record: {"token", "quiet": {worker: [count, seconds]}}
JUDGED_KEY = "cft/liveness/judge"  # "coordinator": the embedded coordinator judges (no member does)


def beat_key(worker_id: int) -> str:
    return f"cft/beat/{worker_id}"


class Liveness:
    """One watcher's clocks for the members of its current generation (see module doc)."""

    def __init__(self, worker_id: int, timeout_s: Optional[float], *, grace_s: float, every_s: float = 0.1,
                 election_grace_s: Optional[float] = None):
        self.worker_id, self.timeout_s, self.every_s = worker_id, timeout_s, every_s
        # After an outage: a peer's store request may still be blocked this long (the store
        # client's request timeout, ``membership.STORE_REQUEST_TIMEOUT_S``).
        self.grace_s = grace_s
        # After an etcd election: how long a live peer's beat may still take to get through
        # (its liveness client's request timeout and a beat interval or two; ``back``).
        self.election_grace_s = grace_s if election_grace_s is None else election_grace_s
        self._next = 0.0
        self._token: Optional[str] = None
        self._seen: dict[int, tuple[int, float]] = {}
        self._reported: set[int] = set()
        self._judge_after = 0.0
        self._backdate: Optional[float] = None  # when the moves seen next happened at the latest (``back``)
        # (count, when it last moved) per worker across generations (``last_moved``)
        self._moved: dict[int, tuple[int, float]] = {}

    def reset(self) -> None:
        """This worker's own store requests failed (an outage): start every clock afresh, and
        judge nobody until the peers' requests blocked by the same outage have given up (the
        store client's request timeout): a peer whose beat thread is still inside one when the
        store answers again is not lost (as when etcd's quorum comes back)."""
        self._token = None
        self._judge_after = time.monotonic() + self.grace_s

    def stalled(self, seconds: float) -> bool:
        """Whether a store request of this worker's that took ``seconds`` stalled: half the
        timeout (at most 0.5 s) is an outage too -- an etcd leader election blocks every write
        for a while, and when it ends the first beats through are not all at once, so a reader
        whose own beat got through first would otherwise take a peer still waiting for its write
        (or failing over to another member) for silent."""
        return self.timeout_s is not None and seconds > min(0.5, self.timeout_s / 2)

    def took(self, seconds: float) -> None:
        """One of this worker's store requests took ``seconds``: ``reset`` if it stalled."""
        if self.stalled(seconds):
            self.reset()

    def outage(self) -> None:
        """This worker's store requests fail: judge nobody until ``back``."""
        self._judge_after = float("inf")

    def back(self, election: bool, since: Optional[float] = None) -> None:
        """The store answers again after an outage or a stall of this worker's requests that
        began at ``since`` (monotonic).  After anything but an election, ``reset``.  After an
        etcd election (the answer carried a newer raft term than the last one before it) every
        member's writes were blocked by the same election and go through once it is over,
        within a peer's liveness request timeout: the clocks are kept -- a member silent since
        before the election is not given a new timeout -- and nobody is judged for
        ``election_grace_s``, in which every live peer has beaten.  A counter first seen moved
        after the election is taken to have moved when the stall began (``since``): the new
        leader also commits the writes the old one had replicated, a lost member's last beats
        among them; a live member beats again within the grace, which dates it afresh."""
        if election:
            self._judge_after = time.monotonic() + self.election_grace_s
            self._backdate = since
        else:
            self.reset()

    def heard(self, quiet: dict[int, tuple[int, float]]) -> None:
        """The judge's record: each quiet member's counter and how long it has not moved (s),
        onto this worker's clock (a member it watches itself keeps its own record)."""
        now = time.monotonic()
        for w, (count, age) in quiet.items():
            mine = self._moved.get(w)
            if mine is None or mine[0] != count:
                self._moved[w] = (count, now - age)

    def quiet(self, min_s: float) -> dict[int, list]:
        """The members of the current generation quiet for more than ``min_s``: [count, seconds]."""
        now = time.monotonic()
        return {w: [c, round(now - t, 3)] for w, (c, t) in self._seen.items() if now - t > min_s}

    def heard_record(self, record: dict, token: Optional[str] = None) -> None:
        """``heard`` of a judge's record as published under ``LIVENESS_KEY`` (for generation
        ``token`` only, when given)."""
        if token is None or record.get("token") == token:
            self.heard({int(w): (int(c), float(s)) for w, (c, s) in record.get("quiet", {}).items()})

    def quiet_any(self, min_s: float) -> dict[int, list]:
        """Like ``quiet``, over every worker this clock has seen in any generation (a member
        left out of the newest generation is still reported)."""
        now = time.monotonic()
        return {w: [c, round(now - t, 3)] for w, (c, t) in self._moved.items() if now - t > min_s}

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
        moved_at, self._backdate = (now if self._backdate is None else self._backdate), None
        for w, c in counts.items():
            last = self._seen.get(w)
            if last is None or last[0] != c:
                self._seen[w] = (c, now if last is None else moved_at)
            if self._moved.get(w, (None,))[0] != c:
                self._moved[w] = (c, moved_at)
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


def silent_reason(worker: int, silent_s: float) -> str:
    """The abort record's reason for a member found silent (``timeout: ...``: a hang)."""
    return (f"timeout: no heartbeat from worker {worker} for {silent_s:.1f} s "
            "(a lost node, a network partition or a stopped process)")


def watched(worker_id: int, members: Iterable[int]) -> list[int]:
    """The counters ``worker_id`` reads: every member's if it is the judge (the lowest id),
    else the judge's and its own."""
    members = sorted(members)
    return members if worker_id == members[0] else sorted({members[0], worker_id})


class LivenessMonitor:
    """This worker's part of the liveness check (module doc), on its own thread and store
    client.  ``view()``: the current generation (None before the first); ``report(worker,
    seconds, token)``: a member found silent; ``answered()``: the store answered (the
    coordinator-lost guard's clock); ``judge``: whether this worker watches others at all."""

    def __init__(self, worker_id: int, connect: Callable[[], object], *, timeout_s: Optional[float],
                 grace_s: float, beat_every_s: float, view: Callable[[], object],
                 report: Callable[[int, float, str], None], answered: Callable[[], None],
                 judge: bool = True, every_s: float = 0.1, peer_every_s: float = 0.25,
                 beat: Callable[[], bool] = lambda: False, election_grace_s: Optional[float] = None) -> None:
        self.worker_id, self.connect, self.view, self.report, self.answered = worker_id, connect, view, report, answered
        self.beat = beat  # a beat on the presence connection (True: sent there, no store request)
        self.clock = Liveness(worker_id, timeout_s, grace_s=grace_s, every_s=every_s, election_grace_s=election_grace_s)
        self._term: Optional[int] = None  # etcd's raft term at this monitor's last answer
        self._down: Optional[float] = None  # since when its requests failed (monotonic), if they do
        self.every_s, self.peer_every_s = every_s, peer_every_s  # the judge's reads, another member's
        self.beat_every_s, self.judge = beat_every_s, judge and timeout_s is not None
        self.requests = 0  # store requests made (the control-plane benchmark reads it)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"cft-liveness-{self.worker_id}")
        self._thread.start()

    def stop(self, join_s: float = 1.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=join_s)

    def _loop(self) -> None:
        store, next_beat = None, 0.0
        tick = min(self.beat_every_s, self.clock.every_s)
        while not self._stop.wait(tick):
            try:
                now = time.monotonic()
                if self.beat():  # the coordinator counts and judges: nothing else to do
                    continue  # (without such a connection: the store's counter, and judging)
                store = store or self.connect()
                if now >= next_beat:
                    next_beat = now + self.beat_every_s
                    store.add(beat_key(self.worker_id), 1)
                    self.requests += 1
                    self._answer(store, time.monotonic() - now)
                view = self.view()
                if self.judge and view is not None:
                    self.clock.every_s = self.every_s if self.worker_id == min(view.members) else self.peer_every_s
                    if self.clock.due():
                        self._check(store, view)
            except Exception as exc:  # unreachable: the coordinator-lost guard decides
                store, self._down = None, now if self._down is None else self._down
                self.clock.outage()  # counters could not be written either: judged afresh after
                log.debug("liveness of worker %d: %s", self.worker_id, exc)

    def _answer(self, store, seconds: float) -> None:
        """One of this monitor's requests was answered after ``seconds``.  Its first answer after
        failures, or one that stalled (its own write stalled: the peers' too), ends an outage
        (``Liveness.back``); an election's if the answer carries a newer etcd raft term than the
        last answer before it (``EtcdClient.raft_term``; a TCPStore has none)."""
        term = getattr(store, "raft_term", None)
        if self._down is not None or self.clock.stalled(seconds):
            since = time.monotonic() - seconds if self._down is None else self._down
            self.clock.back(election=term is not None and self._term is not None and term > self._term, since=since)
            self._down = None
        self._term = term
        self.answered()

    def _check(self, store, view) -> None:
        members = watched(self.worker_id, view.members)
        judge = self.worker_id == members[0] and len(members) > 1  # (alone: nobody to watch)
        keys = [beat_key(w) for w in members] + ([] if judge else [LIVENESS_KEY])
        t0 = time.monotonic()
        got = store.multi_get(keys)
        self.requests += 1
        self._answer(store, time.monotonic() - t0)
        counts = {w: int(v or b"0") for w, v in zip(members, got)}
        if not judge:
            self.clock.heard_record(json.loads(got[-1] or b"{}"), view.token)
        for w, silent in self.clock.silent(view.token, counts):
            self.report(w, silent, view.token)
        if judge:  # what the others need for await_the_missing: who has been quiet, how long
            store.set(LIVENESS_KEY, json.dumps({"token": view.token,
                                                "quiet": self.clock.quiet(2 * self.beat_every_s)}))
            self.requests += 1


class JobJudge:
    """The embedded coordinator's liveness judge (module doc), called by its presence thread
    with each registered worker's beat count (``PresenceServer``'s ``judge``).

    ``latest()``: the newest generation ({"token", "members", "generation"}, or None);
    ``report(worker, seconds, latest)``: end that generation, naming the silent worker.  The
    members that do not beat on a presence connection are judged by their store counters (one
    ``multi_get``, none when every member beats there).  A tick of its own that came late (the
    coordinator's process not scheduled for half the timeout) starts every clock afresh, as a
    member judge's own stalled request does (``Liveness.took``)."""

    def __init__(self, store, timeout_s: float, *, latest: Callable[[], Optional[dict]],
                 report: Callable[[int, float, dict], None], beat_every_s: float = 0.1, every_s: float = 0.1):
        self.store, self.latest, self.report, self.beat_every_s = store, latest, report, beat_every_s
        self.clock = Liveness(-1, timeout_s, grace_s=timeout_s, every_s=every_s)
        self._published: dict[int, int] = {}
        self._last_tick: Optional[float] = None
        self.requests = 0  # store requests made

    def __call__(self, beats: dict[int, int]) -> None:
        now = time.monotonic()
        if self._last_tick is not None and now - self._last_tick > min(0.5, self.clock.timeout_s / 2):
            self.clock.reset()
        self._last_tick = now
        latest = self.latest()
        if latest is None:
            return
        members = [int(w) for w in latest["members"]]
        counts = {w: beats[w] for w in members if w in beats}
        rest = [w for w in members if w not in counts]
        if rest:
            t0 = time.monotonic()
            got = self.store.multi_get([beat_key(w) for w in rest])
            self.requests += 1
            self.clock.took(time.monotonic() - t0)
            counts.update({w: int(v or b"0") for w, v in zip(rest, got)})
        moved = {w: c for w, c in beats.items() if self._published.get(w) != c}
        if moved:  # what a member's ``await_the_missing`` reads
            self.store.multi_set([beat_key(w) for w in moved], [str(c) for c in moved.values()])
            self.requests += 1
            self._published.update(moved)
        if len(counts) > 1:  # (alone: nobody to compare with)
            for w, silent in self.clock.silent(latest["token"], counts):
                self.report(w, silent, latest)
        self.store.set(LIVENESS_KEY, json.dumps({"token": latest["token"],
                                                 "quiet": self.clock.quiet_any(2 * self.beat_every_s)}))
        self.requests += 1


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
    scheduled for that long (a loaded machine) misses it, and without this wait its peers take
    it for lost (a pipeline job then declares live stages lost and restarts from its checkpoint).
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
