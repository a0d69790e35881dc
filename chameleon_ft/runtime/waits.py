"""How a ``GroupManager`` member waits for an op: fail fast, without burning CPU.

A member waiting for a collective or a point-to-point op must notice a peer's death (another
member writes the generation's abort key), a hang (the watchdog, ``timeout_s``) and a paused
membership (that time does not count: peers wait too).  Three ways, each reading the abort key
every ``abort_poll_s``:

* a gloo collective: the op's own ``wait`` with a timeout of ``abort_poll_s`` (it releases the
  GIL and wakes the moment the op completes, as DDP's wait does; a wait that times out leaves
  the op running and is simply waited again): no polling latency, no CPU spent waiting;
* polling (``poller``): ``work.is_completed()`` with sleeps of 0.1-1 ms -- the only way for an
  NCCL op, whose ``wait()`` only makes the current CUDA stream wait;
* ``_await`` (point-to-point): a helper thread blocks in the ops' ``wait()``; gloo's
  point-to-point ``Work`` never reports ``is_completed()`` (measured on torch 2.13).  An
  abandoned wait keeps its thread until gloo's own timeout; the next call gets a fresh helper.
"""

from __future__ import annotations

import time
from datetime import timedelta
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Optional

from chameleon_ft.runtime.errors import MembershipError

__all__ = ["Waits", "poller"]


def poller(done: Callable[[], bool], cap: float) -> Callable[[float], bool]:
    """``within(seconds)``: poll ``done()`` for up to ``seconds``, sleeping 0.1 ms, then twice as
    long each time up to ``cap`` (the schedule carries over between calls: short ops finish
    within a few polls); True once done."""
    sleep = [0.0001]

    def within(seconds: float) -> bool:
        end = time.monotonic() + seconds
        while not done():
            if time.monotonic() >= end:
                return False
            time.sleep(sleep[0])
            sleep[0] = min(sleep[0] * 2, cap)
        return True
    return within


class Waits:
    """The waiting half of ``GroupManager`` (a mixin): it uses the manager's ``group()``,
    ``abort_record()``, ``paused()``, ``_failure`` / ``_local_failure`` (which build the
    ``CollectiveFailure``), ``_park``, ``_pg``, ``op_timeout_s``, ``abort_poll_s``,
    ``pause_limit_s``, ``coordinator`` (its name in errors), ``worker_id`` and ``_wait_pool``
    (the helper thread, None until first used)."""

    def wait(self, work, timeout_s: Optional[float] = None, abandon: Optional[Callable[[], None]] = None,
             poll: bool = False) -> None:
        """Wait for ``work`` (from ``start``), failing fast; see ``collective``.
        ``abandon``: what to do with the op on a failure (default: park its gloo group).
        ``poll``: wait by polling ``work.is_completed()`` only -- an NCCL op's ``wait()`` only
        makes the current CUDA stream wait (it returns before the op completes, and a dead peer
        leaves the kernel waiting), so no blocking wait may stand for its completion."""
        pg = self.group()
        abandon = abandon or (lambda: self._park(pg, work))
        if poll:
            self._watch(poller(work.is_completed, 0.001), timeout_s, abandon, "collective")
            try:  # Not work.result(): deprecated in torch 2.13 (a warning per op).
                work.wait()
            except Exception as exc:
                raise self._local_failure(f"collective failed: {exc}", "peer_error")
            return

        def within(seconds: float) -> bool:
            try:
                work.wait(timedelta(seconds=seconds))
                return True
            except Exception:
                if not work.is_completed():
                    return False  # our own time limit: the op goes on
            try:  # completed, maybe just after the time limit: its own outcome decides
                work.wait()
                return True
            except Exception as exc:
                raise self._local_failure(f"collective failed: {exc}", "peer_error")
        self._watch(within, timeout_s, abandon, "collective")

    def _await(self, block: Callable[[], object], timeout_s: Optional[float], abandon: Callable[[], None],
               what: str) -> None:
        """Run ``block`` (a blocking wait for ops, which releases the GIL) in the helper thread
        and wait for it (module doc); see ``_watch``."""
        if self._wait_pool is None:
            self._wait_pool = ThreadPoolExecutor(1, thread_name_prefix=f"cft-wait-{self.worker_id}")
        fut = self._wait_pool.submit(block)

        def within(seconds: float) -> bool:
            try:
                fut.result(timeout=seconds)
                return True
            except FutureTimeout:
                return False
            except Exception as exc:
                raise self._local_failure(f"{what} failed: {exc}", "peer_error")

        def give_up() -> None:  # the helper stays blocked until gloo's own timeout
            self._wait_pool.shutdown(wait=False)
            self._wait_pool = None
            abandon()
        self._watch(within, timeout_s, give_up, what)

    def _watch(self, within: Callable[[float], bool], timeout_s: Optional[float], abandon: Callable[[], None],
               what: str) -> None:
        """Until ``within(abort_poll_s)`` says the op completed, reading the abort key between
        its calls; on the watchdog (``timeout_s``, default ``op_timeout_s``; time while the
        membership is paused does not count: peers wait too, nobody is hung) or an abort of the
        generation, ``abandon()`` the op and raise ``CollectiveFailure`` -- unless the op has
        completed by then (peers that finished it may end the generation at once)."""
        timeout_s = self.op_timeout_s if timeout_s is None else float(timeout_s)
        start = last = time.monotonic()
        paused_since = None
        while not within(self.abort_poll_s):
            now = time.monotonic()
            if self.paused():
                start += now - last
                paused_since = paused_since or last
                self.pause_over(paused_since, abandon)
            else:
                paused_since = None
            last = now
            if now - start > timeout_s:
                abandon()
                raise self._local_failure(f"{what} timed out after {timeout_s:.3f} s (peer hung or slow)", "timeout")
            record = self.abort_record()
            if record is not None:
                if within(self.abort_poll_s):
                    return  # completed meanwhile: a completed op is not undone by a later abort
                abandon()
                raise self._failure("generation aborted by peer", "aborted", record)

    def pause_over(self, since: float, abandon: Optional[Callable[[], None]] = None) -> None:
        """Raise ``MembershipError`` once the membership has been paused since ``since`` for
        longer than ``pause_limit_s`` (after ``abandon()``-ing the op waited for): a deadline
        of its own, not the membership guard thread's."""
        limit = self.pause_limit_s
        if limit is not None and time.monotonic() - since > limit:
            if abandon is not None:
                abandon()
            raise MembershipError(f"worker {self.worker_id}: {self.coordinator} has not answered for "
                                  f"{time.monotonic() - since:.1f} s (paused longer than {limit:.1f} s); "
                                  "stopping without committing anything more")

    def wait_p2p(self, works: list, timeout_s: Optional[float] = None) -> None:
        """Wait for point-to-point works, failing fast like ``collective`` (``_await``).

        Gloo's send/recv ``Work`` never reports ``is_completed()`` (measured on torch 2.13),
        and a send completes only once its receiver posted the matching recv: waited for in
        the helper thread as every op is."""
        if not works:
            return
        pg = self._pg

        def abandon() -> None:
            if pg is not None:
                self._park(pg, works[-1])
        # A gloo send/recv ``wait()`` without a timeout gives up after the group's *construction*
        # timeout (``connect_timeout_s``), not ``set_timeout``'s (measured on torch 2.13: a recv
        # failed after 5 s under a 30 s watchdog -- every migration round over a slow link
        # longer than that broke off).  The watchdog here decides; gloo's own limit is the op's.
        limit = timedelta(seconds=max(self.op_timeout_s, 0.0 if timeout_s is None else float(timeout_s)))
        self._await(lambda: [w.wait(limit) for w in works], timeout_s, abandon, "point-to-point op")
