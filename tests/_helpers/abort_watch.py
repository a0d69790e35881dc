"""What the abort watcher's tests check with either stream of the ends (etcd's watch, the
embedded coordinator's lines on the presence connection)."""

from __future__ import annotations

import time
from typing import Callable


def reads_a_few_times_a_second_and_sees_an_end_at_once(watcher, seen: list, requests: Callable[[], int],
                                                       end: Callable[[], None], token: str, max_per_s: float,
                                                       settle_s: float = 0.5) -> None:
    """Over 2 s the watcher's client makes at most ``max_per_s`` requests a second (and some);
    after ``end()`` ends generation ``token`` the watcher's ``on_ended`` (appending ``(token,
    time)`` to ``seen``) runs within 0.1 s -- the stream, not the watcher's own read."""
    time.sleep(settle_s)  # the stream open, the first reads done
    c0 = requests()
    time.sleep(2.0)
    per_s = (requests() - c0) / 2.0
    assert 0 < per_s <= max_per_s, per_s
    assert watcher.abort_seen(token) is False and not seen
    t0 = time.monotonic()
    end()
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.002)
    assert seen and seen[0][0] == token and seen[0][1] - t0 < 0.1, (seen, t0)
    assert watcher.abort_seen(token) is True
