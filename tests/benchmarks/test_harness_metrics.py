"""The harness's figures from synthetic progress logs (pure logic: no processes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "baselines"))

from harness import metrics  # noqa: E402
from harness.scenarios import SCENARIOS, victim_ranks  # noqa: E402


def steps(seq, dt=0.1, t0=100.0):
    """``seq``: (step, world, samples, restart[, batch]) per execution, one every ``dt``: one
    worker's commit record and an attempt that trained the step's first ``samples`` ids."""
    out = []
    for i, s in enumerate(seq):
        step, world, samples, restart, *batch = s
        b = batch[0] if batch else 64
        key = f"{restart}.1"
        lo = sum(x[4] if len(x) > 4 else 64 for x in seq[:i] if x[0] < step and x[3] == restart) % 4096 \
            if batch else step * 64 % 4096
        out.append({"kind": "attempt", "step": step, "key": key, "ids": list(range(lo, lo + samples)),
                    "ts": t0 + i * dt - 0.01, "pid": 1})
        out.append({"kind": "step", "step": step, "key": key, "world": world, "samples": samples, "restart": restart,
                    "batch": b, "epoch": 0, "ts": t0 + i * dt, "pid": 1, "rss_kb": 1024})
    return out


def commit(step, key, pid, ts, world=4, **kw):
    return {"kind": "step", "step": step, "key": key, "world": world, "samples": 64, "batch": 64, "restart": 0,
            "epoch": step * 64 // 4096, "ts": ts, "pid": pid, "rss_kb": 1024, **kw}


def attempt(step, key, pid, ids, ts):
    return {"kind": "attempt", "step": step, "key": key, "ids": list(ids), "ts": ts, "pid": pid}


def shard(step, rank, nproc=4):
    """The ids of ``rank``'s contiguous share of global step ``step`` (64 a step)."""
    per = 64 // nproc
    lo = step * 64 % 4096 + rank * per
    return range(lo, lo + per)


def four_workers(steps_, *, dead=None, dead_from=None, t0=100.0):
    """Attempts and commits of 4 workers (pids 0-3) for ``steps_``; worker ``dead`` neither
    attempts nor commits from step ``dead_from`` on."""
    out = []
    for i, s in enumerate(steps_):
        for w in range(4):
            if dead == w and s >= dead_from:
                continue
            out += [attempt(s, "0.1", w, shard(s, w), t0 + i * 0.1), commit(s, "0.1", w, t0 + i * 0.1 + 0.05)]
    return out


def run(recs, **kw):
    args = dict(nproc=4, steps=10, global_batch=64, t_faults=[], exit_codes=[0], wall_s=1.0)
    args.update(kw)
    return metrics.run_metrics(recs, **args)


def test_reroute_kill_mttr_survivors_nothing_lost():
    recs = steps([(s, 4, 64, 0) for s in range(5)] + [(s, 3, 64, 0) for s in range(5, 10)])
    m = run(recs, t_faults=[100.45])
    assert m["mttr_s"] == pytest.approx(0.05)
    assert m["survivors"] == 3 and m["samples_lost"] == 0 and m["samples_duplicated"] == 0
    assert m["fault_offset_s"] == pytest.approx(0.05) and not m["crashed"]


def test_restart_counts_duplicates_and_mttr_from_the_new_round():
    recs = steps([(s, 4, 64, 0) for s in range(6)] + [(s, 4, 64, 1) for s in range(4, 10)])
    m = run(recs, t_faults=[100.55])
    assert m["mttr_s"] == pytest.approx(0.05)          # the first step of restart round 1
    assert m["samples_duplicated"] == 2 * 64           # steps 4 and 5 ran twice
    assert m["samples_lost"] == 0 and m["survivors"] == 4


def test_dropped_shard_counts_as_lost_and_two_faults_each_get_an_mttr():
    recs = steps([(s, 4, 64, 0) for s in range(4)] + [(s, 3, 48, 0) for s in range(4, 7)]
                 + [(s, 2, 32, 0) for s in range(7, 10)])
    m = run(recs, t_faults=[100.35, 100.65])
    assert m["samples_lost"] == 3 * 16 + 3 * 32
    assert m["mttrs_s"] == [pytest.approx(0.05), pytest.approx(0.05)]
    assert m["survivors"] == 2   # the world after the last recovery


def test_shrunk_batch_is_not_lost():
    recs = steps([(s, 4, 64, 0) for s in range(5)] + [(s, 3, 48, 0, 48) for s in range(5, 10)])
    assert run(recs, t_faults=[100.45])["samples_lost"] == 0


def test_replacement_back_to_full_strength_and_crash_when_steps_missing():
    recs = steps([(s, 4, 64, 0) for s in range(3)] + [(s, 3, 64, 0) for s in range(3, 6)]
                 + [(s, 4, 64, 0) for s in range(6, 10)])
    m = run(recs, t_faults=[100.25])
    assert m["full_strength_s"] == pytest.approx(0.35) and m["survivors"] == 4
    m = run(recs[:7], t_faults=[100.25])
    assert m["crashed"] and not m["completed"] and m["samples_lost"] is None


def test_straggler_split_by_step():
    recs = steps([(s, 4, 64, 0) for s in range(10)])
    m = run(recs, split_step=6)
    assert m["throughput_before"] and m["throughput_after"] and m["survivors"] == 4


def test_scenarios_victims_and_slow_knob(monkeypatch):
    assert victim_ranks("half", 4) == [2, 3] and victim_ranks("half", 8) == [4, 5, 6, 7]
    assert victim_ranks((-1,), 8) == [7]
    assert SCENARIOS["straggler"].slow_env(4) == {"BENCH_SLOW": "3:3:15"}
    import common

    monkeypatch.setenv("BENCH_SLOW", "3:3:15")
    assert common.compute_s(3, 15, 0.02) == pytest.approx(0.06)
    assert common.compute_s(3, 14, 0.02) == pytest.approx(0.02)
    assert common.compute_s(2, 20, 0.02) == pytest.approx(0.02)


# --- samples lost / duplicated, from the ids the workers trained (hand-computed) -------------------

def accounting(recs, steps_=10, **kw):
    return run(recs, steps=steps_, **kw)


def test_declared_samples_are_not_trusted_ids_are():
    """The commit records claim 64 samples a step, but worker 3 trained nothing from step 5 on
    (its shard dropped, as TorchFT does): 5 steps x 16 ids lost, whatever the records say."""
    m = accounting(four_workers(range(10), dead=3, dead_from=5))
    assert m["samples_lost"] == 5 * 16 and m["samples_duplicated"] == 0


def test_an_attempt_counts_when_its_key_was_committed():
    """Worker 3 attempted step 5 under the key the others committed, then died before logging
    its commit: its 16 ids went into the update and are not lost (4 later steps' shards are).
    Had it died inside the all-reduce (key 0.1 never committed; the survivors redo step 5 under
    0.2 and worker 0 takes over its shard), its attempt would not count, and nothing is lost."""
    recs = four_workers(range(10), dead=3, dead_from=5) + [attempt(5, "0.1", 3, shard(5, 3), 100.5)]
    assert accounting(recs)["samples_lost"] == 4 * 16
    recs = four_workers(range(5)) + [attempt(5, "0.1", 3, shard(5, 3), 100.5)]
    for i, s in enumerate(range(5, 10)):
        key = "0.2" if s == 5 else "0.1"
        for w in range(3):
            ids = list(shard(s, w)) + (list(shard(s, 3)) if w == 0 else [])
            recs += [attempt(s, key, w, ids, 100.6 + i * 0.1), commit(s, key, w, 100.65 + i * 0.1, world=3)]
    m = accounting(recs)
    assert m["samples_lost"] == 0 and m["samples_duplicated"] == 0


def test_a_group_sitting_the_quorum_out_drops_its_own_ids():
    """TorchFT: a healing replica group logs ``trained: false``; its attempt's ids are not in
    the update."""
    recs = four_workers(range(10))
    for r in recs:
        if r["kind"] == "step" and r["pid"] == 2 and r["step"] in (3, 4):
            r["trained"] = False
    assert accounting(recs)["samples_lost"] == 2 * 16


def test_redone_steps_and_an_epoch_boundary():
    """70 steps: epoch 0 is the dataset's 64 steps, epoch 1 has 6.  A restart (key 1.1) redoes
    steps 60-63 after the first round committed them: 4 x 64 ids trained twice in epoch 0.
    Worker 1's shard of step 66 is missing: 16 lost in the partial epoch 1 (expected: 6 x 64)."""
    recs = four_workers(range(64))
    for i, s in enumerate(range(60, 70)):
        for w in range(4):
            if s == 66 and w == 1:
                recs.append(commit(s, "1.1", w, 200 + i * 0.1, restart=1))
                continue
            recs += [attempt(s, "1.1", w, shard(s, w), 200 + i * 0.1),
                     commit(s, "1.1", w, 200 + i * 0.1 + 0.05, restart=1)]
    m = accounting(recs, steps_=70)
    assert m["samples_duplicated"] == 4 * 64
    assert m["samples_lost"] == 16


def test_throughput_counts_trained_ids_not_declared_samples():
    recs = four_workers(range(10), dead=3, dead_from=0)   # 48 ids a step, every record says 64
    m = accounting(recs)
    assert m["throughput"] == pytest.approx(48 * 6 / 0.6)   # steps 4-9 after the warm-up step 3
