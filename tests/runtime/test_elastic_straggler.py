"""A straggler for real: worker 1 runs every micro-batch 4x slower (``--faults slow``); the
detector flags it from the all-reduced timings, the engine weighs keep against rebalance, and
the job carries on with fewer micro-batches on the slow worker — same samples, same trajectory.
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


def test_slow_worker_is_flagged_and_gets_fewer_microbatches(tmp_path, tmp_path_factory):
    job = Job(tmp_path, mb_sleep=0.02, epochs=2, launch_args=["--faults", "slow:rank=1:factor=4"])
    try:
        job.start()
        assert job.wait(120) == [0], job.output()
        evs = job.events()
    finally:
        job.cleanup()
    stragglers = [e["decision"] for e in evs if e["event"] == "decision"
                  and e["decision"]["event"]["kind"] == "straggler"]
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
