"""Buddy snapshots of the sharded executor's rows (a mixin of ``ShardedExecutor``).

Every ``K`` committed steps each member copies its row (parameters and optimizer tensors, plus
the scalars, buffers and run state: sampler, scheduler, RNG, counters) and sends the row to
its *buddy* (the next rank) with a CRC32 checksum, while the next step computes; one failure
never loses a row and its snapshot together.  Each member keeps its last two own snapshots and
the last two it holds for its predecessor.  A snapshot that arrives damaged is discarded with a
log line and a ``snapshot`` event; the previous good one stays.

Limits: one buddy (a member and its buddy failing together lose a row and its snapshot: heal
from a replica or the disk checkpoint then); a snapshot belongs to the layout it was taken in
(``_valid``): after a re-shard the old ones are dropped and a new one is taken at once.
"""

from __future__ import annotations

import sys
import time

import torch

from chameleon_ft.runtime.executors.sharded.layout import _crc

_KEEP = 2  # snapshots kept (own and held)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A snapshot's copy in host memory (pinned when it comes from an accelerator: the copy to
    the host is the point of a snapshot, and gloo sends it from there)."""
    if t.device.type == "cpu":
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
    host.copy_(t)
    return host
_SNAP_TAG = 1 << 20


class _BuddySnapshots:
    """Snapshots of this member's row, and those it holds for its predecessor (``_own``,
    ``_held``, ``_inflight``: the executor's attributes)."""

    def _take_snapshot(self, wait: bool) -> None:
        """Copy this member's row and send it to its buddy (the next rank); the transfer runs
        while the next step computes (``_complete_snapshot``), or at once with ``wait``."""
        self._complete_snapshot()
        t0 = time.perf_counter()
        n, r = self.view.world_size, self.view.rank
        self._current_keys()
        own = {"step": self.step, "row": _to_host(self._row_vector()), "k": self.layout.row_of(r),
               "layout": self.layout.to_json(), "keys": list(self._keys), "scalars": self._scalars(),
               "groups": self._groups_json(), "buffers": self._buffers(), "run": self._run_state()}
        if n < 2:
            self._push(self._own, own)
            self.snapshot_cost_s = time.perf_counter() - t0
            return
        prev = (r - 1) % n
        prev_row = self.layout.row_of(prev)
        size = (1 + len(self._keys)) * self.layout.numel(prev_row)
        incoming = torch.empty(size, dtype=self.dtype)
        tag = _SNAP_TAG + 2 * (self.step % (_SNAP_TAG // 2))
        out_crc = torch.tensor([_crc(own["row"])], dtype=torch.int64)
        sent = own["row"]
        if self.faults.corrupt(self.step):  # test-only: damaged in flight, after its checksum
            sent = sent.clone()
            sent.view(-1)[: max(1, sent.numel() // 10)] += 1.0
        in_crc = torch.zeros(1, dtype=torch.int64)
        works = [self.gm.send(sent, (r + 1) % n, tag), self.gm.send(out_crc, (r + 1) % n, tag + 1),
                 self.gm.recv(incoming, prev, tag), self.gm.recv(in_crc, prev, tag + 1)]
        self._inflight = {"own": own, "held": {"step": self.step, "row": incoming, "k": prev_row,
                                               "layout": self.layout.to_json(), "from": self.view.members[prev]},
                          "crc": in_crc, "works": works, "t": time.perf_counter() - t0}
        if wait:
            self._complete_snapshot()

    def _complete_snapshot(self) -> None:
        fl, self._inflight = self._inflight, None
        if fl is None:
            return
        t0 = time.perf_counter()
        self.gm.wait_p2p(fl["works"], self.hang_timeout_s)
        self._push(self._own, fl["own"])
        held = fl["held"]
        if _crc(held["row"]) == int(fl["crc"][0]):
            self._push(self._held, held)
        else:  # keep the last good one; say so: a later failure may have to fall back further
            msg = (f"worker {self.worker_id}: the snapshot of row {held['k']} from worker {held['from']} "
                   f"at step {held['step']} is corrupt (checksum mismatch): discarded, the previous one is kept")
            print(f"chameleon-ft: {msg}", file=sys.stderr, flush=True)
            if self.log:
                self.log.write("snapshot", step=held["step"], ok=False, row=held["k"],
                               sender=held["from"], message=msg)
        self.snapshot_cost_s = fl["t"] + time.perf_counter() - t0

    @staticmethod
    def _push(lst: list, snap: dict) -> None:
        lst.append(snap)
        del lst[:-_KEEP]

    def _valid(self, snaps: list[dict]) -> list[dict]:
        return [s for s in snaps if self.layout is not None and s["layout"] == self.layout.to_json()]
