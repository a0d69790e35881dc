"""Collectives outside the step never kill a process: ``chameleon-ft run`` with 4 gloo workers
on CPU, whose ``LiveCollectives`` calls (an adapter's barrier, gather, reduce) deliberately do
not match -- against each other, or against the step's gradient all-reduce on a peer.

Unchecked, gloo pairs such calls by order and aborts the process on the size mismatch
(SIGABRT).  With the header check every worker must finish, print a warning naming both calls,
evict nobody, keep every sample of every step exactly once and end with equal replicas that
match a run without the stray calls.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _helpers.recovery import (ScriptJob, assert_exactly_once, assert_replicas_equal,  # noqa: E402
                               rel_diff)

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

SCRIPT = Path(__file__).with_name("_workers") / "mismatch_worker.py"
DATASET, GLOBAL_BATCH, STEPS_PER_EPOCH = 256, 32, 8


def _run(run_dir: Path, *args: str) -> tuple[ScriptJob, dict]:
    job = ScriptJob(SCRIPT, run_dir, *args, nproc=4)
    finals = job.run_to_end(timeout=90)
    return job, finals


def _check(job: ScriptJob, finals: dict, reference: dict) -> dict:
    assert sorted(finals) == [0, 1, 2, 3]
    evs = job.events()
    assert not [e for e in evs if e["event"] in ("failure", "recovery")], "a worker was declared failed"
    assert [e["reason"] for e in evs if e["event"] == "membership"] == ["join"]  # one generation
    assert_exactly_once(evs, dataset=DATASET, steps_per_epoch=STEPS_PER_EPOCH, epochs=1,
                        global_batch=GLOBAL_BATCH)
    got = assert_replicas_equal(finals, same=("step", "members"))
    assert got["step"] == STEPS_PER_EPOCH
    assert rel_diff(got, reference) < 1e-6
    assert "Received data size" not in job.output() and "EnforceNotMet" not in job.output()
    return got


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """A run without stray calls."""
    _, finals = _run(tmp_path_factory.mktemp("reference"))
    return assert_replicas_equal(finals, same=("step", "members"))


def test_mismatched_control_collectives_go_local_and_training_goes_on(tmp_path, reference):
    job, finals = _run(tmp_path, "--mismatch", "2")
    _check(job, finals, reference)
    out = job.output()
    print(out[-3000:])
    # barrier vs gather: every worker gave up its call, with a warning naming both calls
    assert "mismatch_worker: barrier on rank 0 (worker 0) met rank 1 (worker 1) in all_gather" in out
    assert "mismatch_worker: all_gather of float32[1] on rank 1 (worker 1) met rank 0 (worker 0) in barrier" in out
    # reduces of 3 vs 5 elements: no data moved
    assert "reduce 'sum' (SUM) of float32[3] on rank 0 (worker 0) met rank 1 (worker 1) in reduce 'sum' (SUM) of float32[5]" in out
    seen = {w: f["seen"] for w, f in finals.items()}
    assert seen[0]["barrier"] == "returned" and seen[0]["realigning"] is True
    for w in (1, 2, 3):
        assert seen[w]["gather"] == [[float(w)]]  # the local value
        assert seen[w]["realigning"] is True
    assert seen[0]["reduce_mismatch"] == [1.0] * 3
    assert all(seen[w]["reduce_mismatch"] == [1.0] * 5 for w in (1, 2, 3))
    # after the next step's sync, collectives move data again
    for w in range(4):
        assert seen[w]["reduce_live"] == [4.0, 4.0]
        assert seen[w]["gather_live"] == [[0.0], [1.0], [2.0], [3.0]]


def test_stray_barrier_during_the_generations_first_step(tmp_path, reference):
    """The first step of a generation posts its header: the stray call gives way at once."""
    job, finals = _run(tmp_path, "--stray-barrier", "0")
    _check(job, finals, reference)
    out = job.output()
    print(out[-3000:])
    assert "mismatch_worker: barrier on rank 1 (worker 1) met rank 0 (worker 0) in the training step's gradient all-reduce" in out
    assert "headers are exchanged again" in out  # the step side waited for it
    assert finals[1]["seen"]["stray_barrier_realigning"] is True
    # step 0 committed once, on its first attempt (no redo)
    steps = [e for e in job.events() if e["event"] == "step" and e["step"] == 0]
    assert len(steps) == 4


def test_stray_barrier_once_the_generation_is_aligned(tmp_path, reference):
    """Once a step of the generation agreed, steps post no header (``GroupManager.step_aligned``):
    a stray call inside a later step (a rank-dependent barrier, which deadlocks plain DDP) is
    met by the watchdog instead -- the step is redone in a new generation of the same members,
    and the run ends as the one without the stray call."""
    job, finals = _run(tmp_path, "--stray-barrier", "3")
    assert sorted(finals) == [0, 1, 2, 3]
    evs = job.events()
    recoveries = [e for e in evs if e["event"] == "recovery"]
    # Met by a watchdog: the recording member's own ("timeout"), or a peer's whose abort reached
    # it first on a loaded machine ("aborted", with the failure marked a hang).
    assert recoveries and all(e["kind"] == "timeout" or (e["kind"] == "aborted" and e["hang"])
                              for e in recoveries), recoveries
    assert all(e["members"] == [0, 1, 2, 3] for e in evs if e["event"] == "membership"), "a member was evicted"
    assert_exactly_once(evs, dataset=DATASET, steps_per_epoch=STEPS_PER_EPOCH, epochs=1,
                        global_batch=GLOBAL_BATCH)
    got = assert_replicas_equal(finals, same=("step", "members"))
    assert got["step"] == STEPS_PER_EPOCH
    assert rel_diff(got, reference) < 1e-6
