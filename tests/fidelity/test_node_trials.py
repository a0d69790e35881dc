"""The chaos trials on namespace nodes (``tests/fidelity/node_trials.py``): the harness's own
checks, and the CI's bounded, seeded share of its node-level faults.  Needs root, iproute2 and
etcd; skipped with the reason otherwise."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest

from _helpers import netns
from tests.fidelity import node_trials

NODE_CHAOS_SEED = int(os.environ.get("NODE_CHAOS_SEED", "3"))


def test_draws_cover_every_kind_and_node_and_stay_in_the_run():
    rng = random.Random(0)
    drawn = [node_trials.draw(rng, i) for i in range(200)]
    assert {t.kind for t in drawn} == set(node_trials.KINDS)
    assert {t.node for t in drawn} == set(range(node_trials.NODES))
    for t in drawn:
        last = t.epochs * 8
        assert 2 <= t.step <= last - 8, t
        assert (t.kind == "partition") == (t.down_s > 0)


def test_a_kinds_wrong_exit_codes_are_problems():
    t = node_trials.NodeTrial(0, "node_term", 1, 5)
    assert node_trials._exit_problems(t, [0, 143, 0], "") == []
    assert node_trials._exit_problems(t, [0, 1, 0], "boom")
    p = node_trials.NodeTrial(0, "partition", 2, 5, down_s=1.0)
    assert node_trials._exit_problems(p, [0, 0, [3, 0]], "") == []
    assert node_trials._exit_problems(p, [0, 0, [3, "timeout"]], "")


@pytest.mark.chaos  # tests/README.md: the node-level faults' CI cover is in tests/cluster/
@pytest.mark.serial
@pytest.mark.timeout(400)
def test_a_bounded_node_chaos_set_keeps_each_kinds_promise(tmp_path):
    """One seeded trial (``NODE_CHAOS_SEED``) of a fault that takes a whole node (its launcher,
    workers and etcd member) or announces its preemption; the partition and the etcd member lost
    have their own tests (tests/cluster/) and the full run (docs/reliability.md)."""
    why = netns.available() or (None if shutil.which("etcd") else "needs etcd")
    if why:
        pytest.skip(why)
    records = node_trials.run_trials(1, NODE_CHAOS_SEED, tmp_path, kinds=("node_lost", "node_term"))
    print(json.dumps(records, indent=1)[:3000])
    bad = [r for r in records if not r["ok"]]
    assert not bad, f"seed {NODE_CHAOS_SEED}: " + "\n".join(
        f"trial {r['trial']} ({r['kind']} node {r['node']} @{r['step']}): {r['problems']}" for r in bad)
