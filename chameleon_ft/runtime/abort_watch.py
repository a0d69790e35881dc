"""One worker's abort watcher and coordinator guard: a thread and a store client of their own.

* **The watcher** learns that the current generation ended from a stream -- over etcd a watch
  on the abort keys, over the embedded coordinator the ``ended`` lines the coordinator writes on
  the worker's presence connection (``runtime/presence.py``) -- and reads the current key every
  ``READ_EVERY_S`` besides, with its own store client (a client serialises its requests);
  without a stream it polls the key every ``poll_s`` (20 ms: well inside the Lighthouse's join
  window).  Once per generation it calls ``on_ended(view)`` when it sees it ended: the
  membership then asks for the next quorum on behalf of a main thread that is still computing
  (``Membership._generation_ended``).  Without it a member busy in a long forward, an
  evaluation batch or a checkpoint write would ask only at its next collective and, when that
  is more than the join window after the first survivor asked, be left out: a healthy worker
  evicted, then re-admitted one round later.  ``abort_seen(token)`` is its flag (no request).
  No blocking ``store.wait``: TCPStore's logs a c10d warning at every timeout.
* **The guard** stops the worker (exit 3, ``MEMBERSHIP_EXIT_CODE``) when the coordinator has not
  answered any of its threads for ``cut_off_s`` (``quorum_wait_s`` while an etcd member answers
  without a quorum): it is on the wrong side of a partition, or the coordinator is gone, and
  must commit nothing more.  ``paused()`` while no answer came for half a second
  (``GroupManager`` starts no collective then).  It does no I/O itself: a store call to an
  unreachable node may block far longer than its timeout.

Every thread of the worker that hears from the coordinator calls ``answered()``; a line the
embedded coordinator writes on the presence connection (its ``alive`` ten times a second when
it judges liveness) counts as an answer too.  Limits: a
watcher that cannot connect its store client for three connect timeouts stops the worker with
an error naming the coordinator (a job without it would run with no abort watch and nothing
would say so).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, Optional

from chameleon_ft.runtime.coordination import abort_key, connect_store
from chameleon_ft.runtime.errors import MembershipError
from chameleon_ft.runtime.etcd import EtcdStore, is_etcd

__all__ = ["AbortWatcher"]

PAUSED_AFTER_S = 0.5  # no answer for this long: paused (nothing is committed)
READ_EVERY_S = 0.25  # with a stream of the ends: the current generation's abort key read besides


class AbortWatcher:
    """See module doc.

    Args:
        worker_id, store_addr, connect_timeout_s: whose watcher, and its coordinator.
        view: the worker's current generation (None before the first).
        on_ended: called with a view the watcher saw ended; returns False when it cannot act
            yet (the watcher asks again at its next poll), True when it acted or the main thread
            was asking itself (it does not ask again for that generation).
        stop: the membership's stop event (set on close).
        cut_off_s: the guard's limit (None: no guard); quorum_wait_s: its limit while etcd
            answers without a quorum.
        presence: the worker's ``PresenceClient`` (or None), read when the watcher starts: over
            the embedded coordinator the generations' ends come on it.
    """

    def __init__(self, worker_id: int, store_addr: str, connect_timeout_s: float, *,
                 view: Callable[[], object], on_ended: Callable[[object], bool], stop: threading.Event,
                 cut_off_s: Optional[float], quorum_wait_s: float, poll_s: float = 0.02,
                 presence: Callable[[], object] = lambda: None) -> None:
        self.worker_id, self.store_addr, self.connect_timeout_s = worker_id, store_addr, connect_timeout_s
        self._view, self._on_ended, self._stop, self._presence = view, on_ended, stop, presence
        self.cut_off_s, self.quorum_wait_s, self.poll_s = cut_off_s, quorum_wait_s, poll_s
        self.last_ok = time.monotonic()  # the coordinator's last answer to any thread of the worker
        self.aborted_token: Optional[str] = None  # the last generation seen ended
        self.watching = False  # the watcher has its store client and polls
        self._no_quorum_at: Optional[float] = None  # an etcd member answered without a quorum
        self._paused_said = False
        self._thread: Optional[threading.Thread] = None

    # ---------------------------------------------------------------- what others read
    def answered(self) -> None:
        self.last_ok = time.monotonic()

    def abort_seen(self, token: str) -> Optional[bool]:
        """Whether the watcher saw generation ``token`` ended (a flag at most ``poll_s`` old,
        no store request), or None when no watcher polls (ask the store)."""
        return None if not self.watching or self._stop.is_set() else self.aborted_token == token

    def paused(self) -> bool:
        return time.monotonic() - self.last_ok > PAUSED_AFTER_S

    def pause_limit_s(self) -> float:
        """The longest a collective may wait for a paused membership (``GroupManager``): the
        guard's own limit and a margin, so that a guard thread that died cannot leave it
        waiting for ever (``--cut-off 0`` included: then etcd's ``quorum_wait_s``)."""
        if self.cut_off_s and not is_etcd(self.store_addr):
            return self.cut_off_s + 5.0
        return max(self.cut_off_s or 0.0, self.quorum_wait_s) + 5.0

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"cft-abort-watch-{self.worker_id}")
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout_s)

    # ---------------------------------------------------------------- the watcher
    def _loop(self) -> None:
        if self.cut_off_s is not None:
            threading.Thread(target=self._guard_loop, daemon=True, name=f"cft-cut-off-{self.worker_id}").start()
        store = self._store()
        if store is None:
            return  # closed meanwhile
        if isinstance(store, EtcdStore):
            watch = store.watch(abort_key(""))
            try:
                self._watch(store, watch)
            finally:
                watch.close()
        else:
            self._watch(store, self._presence())

    def _watch(self, store, stream) -> None:
        """The ends come on ``stream`` (etcd's watch, or the embedded coordinator's writes on
        the presence connection: no request while nothing ends), and the current generation's
        key is also read every ``READ_EVERY_S`` (and after each reopening of the stream) --
        what a stream from an etcd member cut off from its quorum, or a line the coordinator
        dropped, would not bring, and the guard's sign that the coordinator answers.  Without a
        stream (None, or one that fails) the key is read every ``poll_s``."""
        ended: set[str] = set()  # generations seen ended
        acted: Optional[str] = None
        read_at = 0.0
        while not self._stop.is_set():
            view = self._view()
            if view is not None and time.monotonic() >= read_at:
                try:
                    if store.check([abort_key(view.token)]):
                        ended.add(view.token)
                    self.last_ok, self.watching = time.monotonic(), True
                    read_at = time.monotonic() + READ_EVERY_S
                except Exception:  # unreachable: a partition, etcd without quorum, the coordinator gone
                    if isinstance(store, EtcdStore) and store.client.answers():
                        self._no_quorum_at = time.monotonic()
            try:
                if stream is None:
                    raise OSError("no stream")
                opened = stream.streaming
                # Wait on the stream until the next read is due (it wakes at a line): about
                # 1 / READ_EVERY_S wake-ups a second for a thread beside the training loop.
                pending = view is not None and view.token in ended and view.token != acted
                wait_s = 0.0 if pending else self.poll_s if view is None else \
                    min(READ_EVERY_S, max(self.poll_s, read_at - time.monotonic()))
                ended.update(k.decode() for k in stream.keys(wait_s))  # (waits; no request)
                self.last_ok = max(self.last_ok, getattr(stream, "heard_at", 0.0))  # the coordinator wrote
                if not opened:
                    read_at = 0.0  # a write before the stream began: read it once more
            except Exception:  # no stream, or its member lost: read each time until it is back
                read_at = 0.0
                self._stop.wait(self.poll_s)
            if self._ended(view, view is not None and view.token in ended, acted):
                acted = view.token

    def _ended(self, view, aborted: bool, acted: Optional[str]) -> bool:
        """Note what the watcher saw of ``view``; True when it acted on its end now (once per
        generation: not again for ``acted``; ``on_ended`` may decline, and is asked again)."""
        if aborted:
            self.aborted_token = view.token
        return aborted and view.token != acted and not self._stop.is_set() and self._on_ended(view)

    def _store(self):
        """The watcher's own store client, retried for three connect timeouts; past that the
        worker stops with an error naming the coordinator (module doc)."""
        deadline = time.monotonic() + 3 * self.connect_timeout_s
        while not self._stop.is_set():
            try:
                return connect_store(self.store_addr, self.connect_timeout_s)
            except MembershipError as exc:
                if time.monotonic() > deadline:
                    self.stop_worker(f"its abort watcher cannot reach the coordinator at {self.store_addr}: {exc}; "
                                     "stopping (without it a failure would go unseen until the collective watchdog)")
                self._stop.wait(0.2)
        return None

    # ---------------------------------------------------------------- the guard
    def _guard_loop(self) -> None:
        while not self._stop.wait(0.1):
            unanswered = time.monotonic() - self.last_ok
            if unanswered > 2.0 and not self._paused_said:  # said once it is more than a hiccup
                self._paused_said = True
                print(f"chameleon-ft worker {self.worker_id}: paused, nothing is committed: the "
                      f"coordinator at {self.store_addr} does not answer", file=sys.stderr, flush=True)
            elif unanswered < PAUSED_AFTER_S and self._paused_said:
                self._paused_said = False
                print(f"chameleon-ft worker {self.worker_id}: the coordinator answers again: training "
                      "goes on", file=sys.stderr, flush=True)
            # (an etcd request without a quorum blocks for the client's timeout before that is known)
            no_quorum = self._no_quorum_at is not None and time.monotonic() - self._no_quorum_at < 5.0
            if no_quorum and unanswered < self.quorum_wait_s:
                continue
            self._cut_off(unanswered)

    def _cut_off(self, unanswered_s: float) -> None:
        if self.cut_off_s is None or unanswered_s < self.cut_off_s or self._stop.is_set():
            return
        why = ("a network partition cut this worker off from etcd's quorum, or etcd lost its quorum "
               "for longer than --quorum-wait" if is_etcd(self.store_addr) else
               "a network partition cut this worker off, or the coordinator's node is gone: the embedded "
               "coordinator is a single point of failure, --rdzv-backend etcd is not")
        self.stop_worker(f"lost the coordinator at {self.store_addr}: no answer for {unanswered_s:.1f} s "
                         f"({why}); stopping without committing anything more")

    def stop_worker(self, why: str) -> None:
        """End this worker now, saying ``why``, with the exit code of a lost membership (the
        launcher tells it from a crash)."""
        from chameleon_ft.runtime.env import MEMBERSHIP_EXIT_CODE
        print(f"chameleon-ft worker {self.worker_id}: {why}", file=sys.stderr, flush=True)
        os._exit(MEMBERSHIP_EXIT_CODE)
