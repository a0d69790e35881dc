"""``shrink`` carried out for real: the user allows the global batch to change, a worker is
SIGKILLed from outside, the survivors drop its micro-batches (global batch 32 -> 24), the
learning rate follows the linear scaling rule, and every epoch still sees each sample once.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).with_name("_workers")))
from elastic_job import DATASET, Job, assert_replicas_equal, reference  # noqa: E402

from chameleon_ft.runtime.eventlog import committed_attempts  # noqa: E402

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]


def test_shrink_drops_the_dead_workers_share_and_scales_the_lr(tmp_path, tmp_path_factory):
    job = Job(tmp_path, mb_sleep=0.01, epochs=2,
              worker_args=["--no-stragglers", "--allowed", "shrink,reroute", "--allow-batch-change"])
    try:
        job.start()
        job.wait_step(4)
        job.kill(1)
        assert job.wait(120) == [0], job.output()
        evs = job.events()
        chosen = [e["decision"]["chosen"] for e in evs if e["event"] == "decision"]
        assert chosen and chosen[0] == "shrink", chosen
        steps = committed_attempts(evs)
        sizes = [sum(len(r["ids"]) for r in steps[s]) for s in sorted(steps)]
        # Full batches of 32 before the kill, of 24 after it (each epoch's last one may be partial).
        first_small = next(i for i, n in enumerate(sizes) if n < 32)
        assert first_small >= 4 and all(n == 32 for n in sizes[:first_small]), sizes
        assert sizes.count(24) >= 6 and all(n <= 24 for n in sizes[first_small:]), sizes
        by_epoch: dict[int, list[int]] = {}
        for recs in steps.values():
            for r in recs:
                by_epoch.setdefault(r["epoch"], []).extend(r["ids"])
        assert sorted(by_epoch) == [0, 1]
        for epoch, ids in by_epoch.items():
            assert sorted(ids) == list(range(DATASET)), f"epoch {epoch}: not exactly once"
        finals = job.final()
        assert sorted(finals) == [0, 2, 3]
        assert_replicas_equal(finals, [0, 2, 3])
        ref = reference(tmp_path_factory.mktemp("ref"), 2)
        # StepLR's decays depend on the step count, which shrink changes: compare base LRs.
        assert abs(finals[0]["base_lr"][0] - 0.75 * ref["base_lr"][0]) < 1e-12
    finally:
        job.cleanup()
