"""Regression: after a recovery every member must hold the *same* engine state.

Straggler Decisions are taken by every member on its own, from the all-reduced timings and its
engine state; they only agree if the states agree.  Before the fix the recovery's source kept
its own ``EngineBridge`` while the others loaded its ``state_dict()`` -- which does not carry
everything (the straggler detector's hysteresis counters, the policy's prediction cache).  So a
straggler that was one or two slow steps from being flagged when a worker died was flagged by
the source a step or two before the others: for those steps the source ran one allocation and
the others another, some micro-batches were computed twice and some never, and the run left the
failure-free trajectory while its replicas stayed bitwise equal (they all-reduce the same sum).
This is the cause found for the off-trajectory Accelerate runs of issue 10 (item 10): it fits
what was seen there (replicas equal, weights 1e-2 off, a survivor idle for the rest of the run,
in a few runs where noise flags were in progress at the kill).  It sits in the shared runtime,
so the ElasticTrainer reproduces it (fastest to start).

Set-up, deterministic: worker 1 is 4x slow from the first step (``slow`` fault, 20 ms emulated
compute per micro-batch) -- the detector needs 3 slow scores in a row to flag it; worker 3 kills
itself on entering step 1's all-reduce, after one slow score.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime" / "_workers"))
from elastic_job import (Job, assert_exactly_once, assert_replicas_equal,  # noqa: E402
                         max_relative_diff, reference)

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


def test_straggler_flagged_after_recovery_keeps_members_agreed_and_on_trajectory(tmp_path, tmp_path_factory):
    faults = "slow:rank=1:factor=4;kill:rank=3:step=1:phase=allreduce"
    # A 200 ms join window (default 50): seen on a slower machine, worker 2 had not asked within
    # 50 ms of the kill and the quorum left it out too (the failure then named [2, 3]); what is
    # tested here is the straggler flagged after the recovery, not the window.
    job = Job(tmp_path, mb_sleep=0.02, epochs=2, launch_args=["--faults", faults, "--join-timeout-ms", "200"])
    try:
        job.start()
        assert job.wait(150) == [0], job.output()[-4000:]
        evs = job.events()
    finally:
        job.cleanup()
    failures = [e for e in evs if e["event"] == "failure" and e.get("kind") == "fail_stop"]
    assert failures and failures[0]["workers"] == [3]
    stragglers = [e["decision"] for e in evs if e["event"] == "decision"
                  and e["decision"]["event"]["kind"] == "straggler"]
    assert stragglers and stragglers[0]["event"]["devices"] == [1], "the slow worker was never flagged"
    assert stragglers[0]["chosen"] == "rebalance", stragglers[0]
    # Every member ran the same allocation in every step: each sample once per epoch ...
    assert_exactly_once(evs, 2)
    finals = job.final()
    assert_replicas_equal(finals, [0, 1, 2])
    # ... and the update is the failure-free one (up to floating-point summation order).
    assert max_relative_diff(finals[0], reference(tmp_path_factory.mktemp("ref"), 2)) < 1e-5
