"""The emulated link's hold in a migration ends as soon as a member ends the generation (a
transfer in flight is abandoned at once), and lasts its whole time otherwise."""

from __future__ import annotations

import time

import pytest

from chameleon_ft.runtime.executors.pipeline.migration import _hold


class _Gm:
    def __init__(self, abort_after: float | None):
        self.t0, self.abort_after, self.checks = time.monotonic(), abort_after, 0

    def raise_if_aborted(self) -> None:
        self.checks += 1
        if self.abort_after is not None and time.monotonic() - self.t0 >= self.abort_after:
            raise RuntimeError("generation aborted by peer")


def test_the_hold_ends_when_the_generation_is_aborted():
    gm = _Gm(abort_after=0.2)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="aborted"):
        _hold(gm, 5.0)
    assert time.monotonic() - t0 < 1.0


def test_the_hold_lasts_its_time_otherwise():
    gm = _Gm(abort_after=None)
    t0 = time.monotonic()
    _hold(gm, 0.3)
    assert 0.3 <= time.monotonic() - t0 < 1.0 and gm.checks >= 3
