"""A point-to-point wait lasts as long as the watchdog allows, not gloo's construction timeout.

gloo's send/recv ``wait()`` without an argument gives up after the timeout the group was
*built* with (``GroupManager.connect_timeout_s``, 5 s by default), whatever ``set_timeout`` says
(torch 2.13).  A pipeline re-plan over a slow link has migration rounds longer than that: a
member waiting for a sender still busy in an earlier round broke off, the migration failed and
the recovery started over (seen on the ``slowlink`` trace, 2026-12-03).  Two real processes,
real gloo: the receiver waits 3x the construction timeout and gets the tensor."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from _helpers.workers import run_workers

WORKER = Path(__file__).parent / "_workers" / "p2p_worker.py"


def test_recv_waits_past_the_groups_construction_timeout(tmp_path):
    server = dist.TCPStore("127.0.0.1", 0, 3, True, timedelta(seconds=30), wait_for_workers=False)
    procs, outs = run_workers(WORKER, [["--rank", str(r), "--store", f"127.0.0.1:{server.port}", "--delay", "3.0",
                                        "--out", str(tmp_path)] for r in range(2)], timeout_s=90)
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{outs[r][-3000:]}"
    got = json.loads((tmp_path / "p2p_1.json").read_text())
    assert got["result"] == "ok", got  # before the fix: "Timed out waiting 1000ms for recv operation"
    assert got["value"] == [0.0, 1.0, 2.0, 3.0]
    assert got["seconds"] >= 2.5, got  # it really waited for the late sender
