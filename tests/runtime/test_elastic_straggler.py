"""Stragglers for real: worker 1 runs every micro-batch 4x slower (``--faults slow``); the
detector flags it from the all-reduced timings, the engine weighs keep against rebalance, and
the job carries on with fewer micro-batches on the slow worker — same samples, same trajectory.
When the slowdown ends (``slow:...:to=S``) the flag clears and the even split comes back; noise
(``--faults jitter``: random 4x spikes on every worker's ~1 ms micro-batches) never rebalances.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).with_name("_workers")))
from elastic_job import (Job, assert_exactly_once, assert_replicas_equal,  # noqa: E402
                         max_relative_diff, reference)

from chameleon_ft.runtime.eventlog import committed_attempts  # noqa: E402

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]


def straggler_decisions(evs):
    """The straggler decisions (taken by every member alike, logged by the first)."""
    return [e for e in evs if e["event"] == "decision" and e["decision"]["event"]["kind"] == "straggler"]


def samples_per_worker(evs, step):
    return {r["worker"]: len(r["ids"]) for r in committed_attempts(evs)[step]}


def run_with_faults(tmp_path, faults: str, epochs: int, mb_sleep: float = 0.02):
    """Run the job to its end under ``--faults``; the job (for its final states) and its events."""
    job = Job(tmp_path, mb_sleep=mb_sleep, epochs=epochs, launch_args=["--faults", faults])
    try:
        job.start()
        assert job.wait(120) == [0], job.output()
        return job, job.events()
    finally:
        job.cleanup()


def test_slow_worker_is_flagged_and_gets_fewer_microbatches(tmp_path, tmp_path_factory):
    job, evs = run_with_faults(tmp_path, "slow:rank=1:factor=4", epochs=2)
    stragglers = [e["decision"] for e in straggler_decisions(evs)]
    assert stragglers, "the slow worker was never flagged"
    first = stragglers[0]
    assert first["event"]["devices"] == [1] and first["event"]["slowdown"] > 2
    assert first["chosen"] == "rebalance", first
    # After the rebalance worker 1 processes fewer samples per step than the others.
    last = committed_attempts(evs)[max(committed_attempts(evs))]
    per_worker = {r["worker"]: len(r["ids"]) for r in last}
    assert per_worker[1] < min(n for w, n in per_worker.items() if w != 1), per_worker
    assert_exactly_once(evs, 2)
    finals = job.final()
    assert_replicas_equal(finals, [0, 1, 2, 3])
    assert max_relative_diff(finals[0], reference(tmp_path_factory.mktemp("ref"), 2)) < 1e-5


@pytest.mark.chaos  # tests/README.md
def test_a_recovered_straggler_gets_the_even_split_back(tmp_path):
    """Worker 1 is 4x slow for steps 0-16 only: rebalanced while slow, then its flag clears and
    every worker runs two micro-batches again (and a rebalance that pays is not undone)."""
    job, evs = run_with_faults(tmp_path, "slow:rank=1:factor=4:to=16", epochs=5)
    decisions = [(e["step"], e["decision"]) for e in straggler_decisions(evs)]
    flags = [(s, d) for s, d in decisions if d["event"]["slowdown"] > 1]
    assert flags and flags[0][1]["event"]["devices"] == [1] and flags[0][1]["chosen"] == "rebalance", decisions
    assert flags[0][0] <= 16, "flagged only after the slowdown ended"
    assert samples_per_worker(evs, flags[0][0])[1] < 8  # the step after the rebalance
    clears = [(s, d) for s, d in decisions if "cleared" in d["event"].get("detail", "")]
    assert clears and clears[-1][1]["event"]["devices"] == [1] and clears[-1][1]["chosen"] == "rebalance", decisions
    assert not any("undone" in d["event"].get("detail", "") for _, d in decisions), decisions
    last = max(committed_attempts(evs))
    assert clears[-1][0] < last
    assert samples_per_worker(evs, last) == {0: 8, 1: 8, 2: 8, 3: 8}
    assert_exactly_once(evs, 5)
    assert_replicas_equal(job.final(), [0, 1, 2, 3])


def test_jitter_on_1ms_microbatches_never_rebalances(tmp_path):
    """Every worker's ~1 ms micro-batches get random 4x spikes (a fifth of them) on top of the
    machine's own noise: no worker is flagged, every step splits the batch evenly."""
    job, evs = run_with_faults(tmp_path, "jitter:rank=0,1,2,3:factor=4:prob=0.2", epochs=5, mb_sleep=0.001)
    attempts = committed_attempts(evs)
    compute = sorted(r["step_time"] for recs in attempts.values() for r in recs)
    assert compute[-len(compute) // 20] > 2 * compute[len(compute) // 2], "no spikes were injected"
    assert straggler_decisions(evs) == []
    assert len(attempts) == 40
    for step in attempts:
        assert samples_per_worker(evs, step) == {0: 8, 1: 8, 2: 8, 3: 8}, step
    assert_exactly_once(evs, 5)
