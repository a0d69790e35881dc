"""Collective headers (``GroupManager.checked``): collectives that do not match on every member
never reach gloo's data exchange (where a size mismatch aborts the process).

Fast: three real processes on one gloo group (no launcher), each running the same script of
deliberately mismatched calls; every process must finish and report what each call did.  The
training-level checks (a stray barrier during the step's all-reduce, mismatched control calls
between steps, exactly-once data and equal replicas after) are in ``test_collective_mismatch.py``.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from _helpers.workers import run_workers
from chameleon_ft.runtime.groups import (HEADER_LEN, CollectiveMismatch, describe_header,
                                         encode_header)

pytestmark = [pytest.mark.timeout(90)]

WORKER = Path(__file__).with_name("_workers") / "header_worker.py"


def test_header_is_fixed_size_and_names_the_call():
    step = encode_header("step", torch.zeros(10))
    barrier = encode_header("barrier")
    gather = encode_header("all_gather", torch.zeros(2, 3), label="metric sync")
    assert step.shape == barrier.shape == gather.shape == (HEADER_LEN,)
    assert step.dtype == torch.int64
    assert describe_header(step) == "the training step's gradient all-reduce of float32[10]"
    assert describe_header(barrier) == "barrier"
    assert describe_header(gather) == "all_gather 'metric sync' of float32[6]"
    # gathers agree on dtype and number of dims only; reduces on the whole shape
    assert torch.equal(encode_header("all_gather", torch.zeros(2, 3))[:8],
                       encode_header("all_gather", torch.zeros(5, 1))[:8])
    assert not torch.equal(encode_header("reduce", torch.zeros(2, 3))[:8],
                           encode_header("reduce", torch.zeros(3, 2))[:8])
    with pytest.raises(ValueError):
        encode_header("gather")


def test_mismatched_collectives_resolve_without_moving_data(tmp_path):
    server = dist.TCPStore("127.0.0.1", 0, 4, True, timedelta(seconds=30), wait_for_workers=False)
    procs, outs = run_workers(WORKER, [["--rank", str(r), "--world", "3", "--store", f"127.0.0.1:{server.port}",
                                        "--out", str(tmp_path)] for r in range(3)])
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{outs[r][-3000:]}"
    res = [json.loads((tmp_path / f"header_{r}.json").read_text()) for r in range(3)]

    # A: the barrier gave way to the peers' step; its next control call stayed local; the
    # step then committed once with everyone's gradient.
    a = res[0]["A_barrier"]
    assert a["result"] == "mismatch"
    assert [p[0] for p in a["peers"]] == [1, 2]
    assert "barrier on rank 0 (worker 0) met rank 1 (worker 1) in the training step's gradient" in a["message"]
    assert res[0]["A_reduce_after"]["result"] == "skipped"
    assert [x["A_step"] for x in res] == [6.0, 6.0, 6.0]
    assert "headers are exchanged again" in outs[1]  # the step side said why it waited

    # B: a barrier against gathers: every member gives up, stays local, meets at the step.
    assert [x["B"]["result"] for x in res] == ["mismatch"] * 3
    assert "all_gather of float32[1]" in res[0]["B"]["message"]
    assert [x["B_after"]["result"] for x in res] == ["skipped"] * 3
    assert [x["B_step"] for x in res] == [3.0] * 3

    # C: a reduce of different shapes, then live again after the step.
    assert [x["C"]["result"] for x in res] == ["mismatch"] * 3
    assert [x["C_step"] for x in res] == [6.0] * 3
    assert [x["C_live"] for x in res] == [{"result": "ok", "value": [3.0, 3.0]}] * 3

    # D: gathers of different shapes are not a mismatch (the header carries each shape).
    for x in res:
        assert x["D_gather"]["value"] == [[0.0], [0.0, 1.0], [0.0, 1.0, 2.0]]
        assert x["D_gather8"]["value"] == [[1] * 7 + [k] for k in (1, 2, 3)]

    # E: two runtime collectives that differ end the generation (recovery realigns them); the
    # first member to see it writes the abort key, which a slower one may read first.
    assert all(x["E"]["result"] == "failure" and x["E"]["suspects"] == [] for x in res)
    kinds = [x["E"]["kind"] for x in res]
    assert "mismatch" in kinds and set(kinds) <= {"mismatch", "aborted"}, kinds


def test_collective_mismatch_is_not_a_failure():
    # Adapters catch CollectiveFailure to recover the job; a mismatch must not trigger that.
    from chameleon_ft.runtime.groups import CollectiveFailure
    assert not issubclass(CollectiveMismatch, CollectiveFailure)


def test_control_collectives_are_refused_where_the_step_has_no_header():
    # The data-parallel executor's step all-reduce runs without a header unless it is built
    # with control_collectives=True (the adapters do): a control collective could meet it
    # there and abort the process in gloo's size check, so it is refused before any I/O.
    from chameleon_ft.runtime.errors import ConfigError
    from chameleon_ft.runtime.executors.dp import DataParallelExecutor
    from chameleon_ft.runtime.groups import GroupManager

    assert DataParallelExecutor.step_header is None
    gm = GroupManager(None, 0, lambda: None)
    gm.control_allowed = False
    for kind in ("barrier", "reduce", "all_gather", "broadcast"):
        with pytest.raises(ConfigError, match="control_collectives=True"):
            gm.checked(kind)


def test_a_step_header_is_posted_until_a_step_of_the_generation_agreed():
    # Where the buckets travel on a group of their own, a data-parallel step skips its header
    # once a step header of the generation agreed; a mismatch or a new generation brings it back.
    from chameleon_ft.runtime.groups import GroupManager
    from chameleon_ft.runtime.membership import MembershipView

    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10), wait_for_workers=False)

    def client():
        return dist.TCPStore("127.0.0.1", server.port, 1, False, timedelta(seconds=10))

    gm = GroupManager(client(), 0, client, op_timeout_s=5.0)
    gm.separate_data = True
    gm.rebuild(MembershipView(1, (0,), 0, 1, "gen-a"))
    assert not gm.step_aligned()
    gm.settle_header(gm.post_header("barrier"))  # a control call does not align
    assert not gm.step_aligned()
    gm.settle_header(gm.post_header("step", label="buckets", arg=1))
    assert gm.step_aligned()
    gm.rebuild(MembershipView(2, (0,), 0, 1, "gen-b"))
    assert not gm.step_aligned()
    gm.settle_header(gm.post_header("step", label="buckets", arg=1))
    gm.separate_data = False  # the step on the control group: always checked
    assert not gm.step_aligned()
    gm.close()
