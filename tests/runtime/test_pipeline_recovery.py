"""DP x PP jobs survive worker failures in place: 8 real workers as 2 pipelines x 4 stages over
gloo, killed from outside by PID (or, for the kill during a migration, by a fault at that
phase), rerouted or re-planned with the blocks migrated point to point.

Every run must train each sample exactly once per epoch, end with bitwise-equal replicas of
every block (weights and optimizer state) and within 1e-5 (relative) of the failure-free run.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch

from _helpers import recovery  # noqa: E402

from chameleon_ft.runtime.eventlog import read_events as _read  # noqa: E402
from chameleon_ft.runtime.executors.pipeline.checkpoint import model_state_dict  # noqa: E402

WORKER = Path(__file__).with_name("_workers") / "pipe_worker.py"
EPOCHS, DATASET, BATCH, STEPS = 2, 256, 32, 8
ARGS = ("--epochs", str(EPOCHS), "--block-sleep", "0.003")

pytestmark = pytest.mark.slow


def read_events(run_dir: Path) -> list[dict]:
    return _read(run_dir / "events.jsonl")


def job(run_dir: Path, *args: str, launch_args=(), **kw) -> recovery.ScriptJob:
    # Every kill here is a SIGKILL the launcher reports at once; the heartbeat timeout only
    # decides when a live worker whose beats stall is left out.  8 workers on 2 loaded cores
    # stalled one past the default 1 s in a CI run (left out, then back: a fourth Decision).
    return recovery.ScriptJob(WORKER, run_dir, *ARGS, *args, nproc=8,
                              launch_args=("--heartbeat-timeout", "3", *launch_args), **kw)


def blocks(finals: dict[int, dict]) -> dict[int, list[tuple[int, dict]]]:
    """Block index -> [(worker, its copy)] over the workers that hold it at the end."""
    out: dict[int, list] = {}
    for w, f in sorted(finals.items()):
        for b, st in f["blocks"].items():
            out.setdefault(int(b), []).append((w, st))
    return out


def check_run(run_dir: Path, finals: dict[int, dict], reference: dict[int, list]) -> dict[int, list]:
    """Exactly once, bitwise-equal replicas, within 1e-5 of the failure-free run."""
    recovery.assert_exactly_once(read_events(run_dir), dataset=DATASET, steps_per_epoch=STEPS,
                                 epochs=EPOCHS, global_batch=BATCH)
    got = blocks(finals)
    assert sorted(got) == sorted(reference), f"blocks held at the end: {sorted(got)}"
    for b, copies in got.items():
        (w0, first), rest = copies[0], copies[1:]
        for w, c in rest:
            for x, y in zip(first["params"] + first["optim"], c["params"] + c["optim"]):
                assert torch.equal(x, y), f"block {b}: worker {w}'s copy differs from worker {w0}'s"
        ref = reference[b][0][1]
        for x, y in zip(first["params"], ref["params"]):
            diff = float((x - y).norm() / y.norm())
            assert diff < 1e-5, f"block {b} is {diff:.2e} from the failure-free run"
    return got


def decisions(run_dir: Path) -> list[dict]:
    return [e["decision"] for e in read_events(run_dir) if e["event"] == "decision"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, list]:
    run = tmp_path_factory.mktemp("pp-reference")
    finals = job(run).run_to_end(240)
    assert len(finals) == 8
    # Failure-free: the initial layout, each block on one worker per pipeline.
    got = blocks(finals)
    assert all(len(c) == 2 for c in got.values())
    recovery.assert_exactly_once(read_events(run), dataset=DATASET, steps_per_epoch=STEPS,
                                 epochs=EPOCHS, global_batch=BATCH)
    return got


def kill_run(run_dir: Path, victims, *args: str, at_step=None, rng=None, then=None, **kw):
    """Start the job, SIGKILL ``victims`` from outside at a random step and phase, optionally
    ``then(job)``; wait for a clean end.  Returns the final states."""
    rng = rng or random.Random()
    j = job(run_dir, *args, **kw)
    try:
        j.start()
        j.wait_step(at_step if at_step is not None else rng.randrange(3, 10), 180)
        time.sleep(rng.uniform(0.0, 0.15))  # somewhere inside the step: forward, backward, all-reduce
        for v in victims:
            j.kill(v)
        if then is not None:
            then(j)
        codes = j.wait(240)
        return codes, j
    finally:
        j.cleanup()


# adaptive: the engine's own choice between the two, on a live pipeline job in CI by
# test_pipeline_calibration_live.py::test_crossover_short_d_reroutes_long_d_replans (tests/README.md).
# The blocks given three ways (blocks.py): the reference run's built model, a meta-device model
# here for reroute, per-block factories for replan; all three train the same model.
@pytest.mark.parametrize("policy,build", [("reroute", "meta"), ("replan", "factories"),
                                          pytest.param("adaptive", "modules", marks=pytest.mark.chaos)])
def test_kill_a_middle_stage_worker(tmp_path, reference, policy, build):
    rng = random.Random()
    victim = rng.choice([1, 2, 5, 6])
    allowed = {"reroute": "reroute", "replan": "replan", "adaptive": "reroute,replan"}[policy]
    codes, j = kill_run(tmp_path, [victim], "--allowed", allowed, "--build", build, rng=rng)
    assert codes == [0], j.output()[-4000:]
    finals = j.final()
    assert sorted(finals) == sorted(set(range(8)) - {victim})
    check_run(tmp_path, finals, reference)
    if build != "modules":  # nothing but its slot's blocks was materialised before the first step
        for w in finals:
            first = json.loads((tmp_path / f"result_{w}.json").read_text())["first_step"]
            assert first["made"] == first["materialised"] == first["slot"], (w, first)
    ds = decisions(tmp_path)
    assert [d["event"]["devices"] for d in ds] == [[victim]]
    chosen = ds[0]["chosen"]
    assert chosen == policy if policy != "adaptive" else chosen in ("reroute", "replan")
    options = {o["policy"]: o for o in ds[0]["candidates"]}
    if policy == "adaptive":  # the engine's choice is the better-scored feasible one
        best = max((o for o in options.values() if o["feasible"]), key=lambda o: o["score"])
        assert chosen == best["policy"]
    migrations = [e for e in read_events(tmp_path) if e["event"] == "migration" and e["step"] > 0
                  and e.get("phase") == "end"]
    if chosen == "reroute":
        assert all(e["transfers"] == 0 for e in migrations)
        result = json.loads((tmp_path / f"result_{min(finals)}.json").read_text())
        assert victim in [d for p in result["plan"]["pipelines"] for d in p["devices"]]  # kept, rerouted around
    else:
        # Only what is missing moves, exactly the migration plan's bytes, in its rounds.
        predicted = options["replan"]["migration"]["bytes"]
        moved = sum(e["bytes"] for e in migrations)
        assert moved == predicted, (moved, predicted)
        # Never a whole-state send: less than every new slot's blocks (weights + 2 Adam moments).
        plan = json.loads((tmp_path / f"result_{min(finals)}.json").read_text())["plan"]
        state = {b: sum(p.numel() * 12 for p in c[0][1]["params"]) for b, c in reference.items()}
        resend = sum(state[b] for pipe in plan["pipelines"] for d, lo, hi in
                     zip(pipe["devices"], pipe["bounds"], pipe["bounds"][1:]) if d in finals
                     for b in range(lo, hi))
        assert 0 < moved < resend, (moved, resend)
        starts = [e for e in read_events(tmp_path) if e["event"] == "migration" and e["step"] > 0
                  and e.get("phase") == "start"]
        for rnd in starts[0]["rounds"]:  # the migration plan's rounds: no worker in two transfers
            names = [w for t in rnd for w in t[:2]]
            assert len(names) == len(set(names)), rnd


def test_same_stage_lost_in_both_pipelines_replans_or_restarts(tmp_path, reference):
    """Both copies of blocks 2-3 die: reroute and replan are infeasible (no survivor holds
    that state), nothing in place is left, so the workers exit for a checkpoint-restart by
    the launcher (exit code 75) -- never a hang.  (``restart`` is never *chosen* in a pipeline
    job: without pipeline checkpoints it would start over; it is only the fallback.)"""
    codes, j = kill_run(tmp_path, [1, 5], "--allowed", "reroute,replan,restart", at_step=4)
    ds = decisions(tmp_path)
    assert ds and ds[-1]["chosen"] is None, ds
    options = {o["policy"]: o for o in ds[-1]["candidates"]}
    assert not options["reroute"]["feasible"] and "replica" in options["reroute"]["reason"]
    assert codes != [0] and "checkpoint-restart" in j.output()


def test_same_stage_lost_with_checkpoints_restarts_from_them(tmp_path, reference):
    """With checkpoints (every 2 steps: one file per block, written by its holders) restart is a
    real choice: both copies of blocks 2-3 die, the engine chooses checkpoint-restart, the
    launcher relaunches every worker (``--max-restarts 1``), each loads its slot's blocks of the
    newest checkpoint and trains on -- the same model as the failure-free run.  The checkpoint
    holds the trained model: its blocks assemble into a plain ``state_dict``."""
    ck = tmp_path / "ckpt.pt"
    codes, j = kill_run(tmp_path, [1, 5], "--allowed", "reroute,replan,restart", "--checkpoint", str(ck),
                        "--checkpoint-every", "2", at_step=5, launch_args=("--max-restarts", "1"))
    assert codes == [0], j.output()[-4000:]
    ds = decisions(tmp_path)
    assert ds and ds[0]["chosen"] == "restart", [d["chosen"] for d in ds]
    finals = j.final()
    assert sorted(finals) == list(range(8))
    got = check_run(tmp_path, finals, reference)
    whole = model_state_dict(str(ck))  # torch.load(weights_only=True) of each block file
    for b, copies in got.items():
        saved = [t for k, t in whole.items() if k.split(".", 1)[0] == str(b)]
        assert len(saved) == len(copies[0][1]["params"])
        assert all(torch.equal(x, y) for x, y in zip(saved, copies[0][1]["params"])), f"block {b}"


def test_kill_during_migration_and_a_second_kill(tmp_path, reference):
    """Worker 2 is killed (re-plan); the migration is stretched (a ``slow`` fault at the
    ``migrate`` phase after step 0) and a worker taking part in it is killed from outside
    while it runs; the survivors plan again from what they hold now.  Then, once that
    re-plan runs, one more worker is killed."""
    killed = [2]

    def during_migration(j):
        evs = j.wait_for(lambda evs: any(e["event"] == "migration" and e.get("phase") == "start"
                                         and e["step"] > 0 for e in evs), 120, "a migration")
        start = next(e for e in evs if e["event"] == "migration" and e.get("phase") == "start" and e["step"] > 0)
        busy = sorted({w for rnd in start["rounds"][1:] or start["rounds"] for t in rnd for w in t[:2]} - {0})
        time.sleep(0.3)
        killed.append(busy[0])
        j.kill(busy[0])
        # One recovery record covers both failures: the first recovery ends at its first step.
        j.wait_for(lambda evs: any(e["event"] == "recovery" for e in evs), 120, "the recovery")
        j.wait_step(max(e["step"] for e in j.events() if e["event"] == "step") + 2, 60)
        third = min(set(range(8)) - set(killed) - {0})
        killed.append(third)
        j.kill(third)

    # Each transfer stretched to ~0.2-1 s (20x its nominal time at 1 MB/s); the watchdog is
    # raised above the longest wait a stretched round can cause, so only the kill ends a
    # generation.
    codes, j = kill_run(tmp_path, [2], "--allowed", "replan", at_step=4, then=during_migration,
                        hang_timeout=20.0,
                        launch_args=("--faults", "slow:rank=0,1,3,4,5,6,7:phase=migrate:factor=20:from=1"))
    assert codes == [0], j.output()[-4000:]
    finals = j.final()
    assert sorted(finals) == sorted(set(range(8)) - set(killed))
    check_run(tmp_path, finals, reference)
    ds = decisions(tmp_path)
    assert all(d["chosen"] == "replan" for d in ds) and len(ds) == 3, [d["chosen"] for d in ds]
    # The interrupted re-plan was undone and decided again, for both lost workers, from what the
    # survivors held (not dropped, leaving the job on the old layout while the engine priced the new).
    assert [d["event"]["devices"] for d in ds] == [[2], sorted(killed[:2]), [killed[2]]], ds
    interrupted = [e for e in read_events(tmp_path) if e["event"] == "migration" and e.get("phase") == "interrupted"]
    assert interrupted and all(e["reason"] for e in interrupted), interrupted


def test_commit_lost_on_one_member_rolls_it_forward(tmp_path, reference):
    """gloo completed the step's commit all-reduce for every member but reported it failed on
    worker 5 (a ``drop`` fault: the partial completion a kill during the all-reduce can leave).
    Its peers committed the step; worker 5 applies its own blocks' reduced gradients of that
    step (the per-stage groups left them with it) and nobody redoes or loses the step."""
    finals = job(tmp_path, launch_args=("--faults", "drop:rank=5:step=4:phase=commit")).run_to_end(240)
    assert sorted(finals) == list(range(8))
    check_run(tmp_path, finals, reference)
    # Worker 5 rolls forward; so may members that had not yet seen the sum when its abort
    # reached them (rank 0 waits for its sends): each with its own blocks, to the same step.
    rolled = {e["worker"]: e for e in read_events(tmp_path) if e["event"] == "roll_forward"}
    assert 5 in rolled and {e["step"] for e in rolled.values()} == {5}, rolled
    assert rolled[5]["blocks"] == [2, 3]


def test_a_slow_stage_worker_gets_fewer_microbatches_on_the_same_trajectory(tmp_path, reference):
    """Issue 27 (4): worker 5 (stage 1 of the second pipeline) runs its emulated compute 4x
    slower from the start; nobody fails.  The engine flags it from the step timings every member
    shares and rebalances: the same pipelines, the same blocks on the same workers (nothing
    migrated, no recovery), fewer of each step's micro-batches through the slow worker's
    pipeline.  Every sample once, bitwise-equal replicas, within 1e-5 of the failure-free run."""
    # Emulated compute that outweighs the CPU work of 8 workers on 2 cores (10 ms per block
    # forward and backward), so that moving micro-batches off the slow worker really pays and
    # the runtime's check keeps the rebalance (it undoes one whose measured step does not improve).
    finals = job(tmp_path, "--block-sleep", "0.01", "--bwd-sleep", "0.01", "--slow", "5:4",
                 "--straggler-window", "3").run_to_end(240)
    assert sorted(finals) == list(range(8))
    check_run(tmp_path, finals, reference)
    evs = read_events(tmp_path)
    assert not [e for e in evs if e["event"] in ("failure", "recovery")]
    ds = [d for d in decisions(tmp_path) if d["event"]["kind"] == "straggler"]
    assert ds and ds[0]["event"]["devices"] == [5] and ds[0]["chosen"] == "rebalance", ds[:1]
    before = next(c for c in ds[0]["candidates"] if c["policy"] == "keep")["plan"]["pipelines"]
    after = next(c for c in ds[0]["candidates"] if c["policy"] == "rebalance")["plan"]["pipelines"]
    assert [(p["devices"], p["bounds"]) for p in after] == [(p["devices"], p["bounds"]) for p in before]
    slow = next(i for i, p in enumerate(after) if 5 in p["devices"])
    assert after[slow]["microbatches"] < before[slow]["microbatches"]
    assert sum(p["microbatches"] for p in after) == BATCH // 4
    assert not [d for d in ds if "undone" in d["event"]["detail"]], ds  # it paid
    # What ran at the end is that plan, with no migration.
    plan = json.loads((tmp_path / "result_0.json").read_text())["plan"]["pipelines"]
    assert [p["microbatches"] for p in plan] == [p["microbatches"] for p in after], plan
    assert not [e for e in evs if e["event"] == "migration" and e.get("step", 0) > 0 and e.get("transfers")]
    # The first stage of the slow worker's pipeline trained fewer samples per step from then on.
    at = min(e["step"] for e in evs if e["event"] == "decision")
    firsts = [p["devices"][0] for p in after]
    per = {w: [len(e["ids"]) for e in evs if e["event"] == "step" and e.get("worker") == w and e["step"] > at + 1]
           for w in firsts}
    assert set(per[firsts[slow]]) == {after[slow]["microbatches"] * 4}, per


@pytest.mark.chaos  # flaky on 2 cores: the launcher kills a replacement not admitted within 7 s
@pytest.mark.parametrize("overlap", [False, True])
def test_replacement_gets_its_blocks_from_peers(tmp_path, reference, overlap):
    """A killed worker's replacement is healed from a peer.  ``overlap`` (``overlap_migration``):
    in the background -- the job keeps training rerouted around its slot while the blocks
    (snapshot + the reduced gradients since) reach it, stretched by a ``slow`` fault -- and it
    takes its slot at one step boundary."""
    # Slower steps (30 ms per block forward): the replacement needs seconds to start and join.
    faults = ("--faults", "slow:rank=0,1,3,4,5,6,7:phase=migrate:factor=30:from=1") if overlap else ()
    codes, j = kill_run(tmp_path, [2], "--allowed", "reroute,wait,heal", "--block-sleep", "0.03",
                        *(("--overlap",) if overlap else ()), at_step=3, hang_timeout=20.0,
                        launch_args=("--max-replacements", "1", *faults))
    assert codes == [0], j.output()[-4000:]
    finals = j.final()
    assert sorted(finals) == list(range(8))
    got = check_run(tmp_path, finals, reference)
    assert any(w == 2 for copies in got.values() for w, _ in copies), "the replacement holds no block"
    joined = [d for d in decisions(tmp_path) if d["event"]["kind"] == "join"]
    assert joined and joined[0]["chosen"] == "heal"
    ends = [e for e in read_events(tmp_path) if e["event"] == "migration" and e.get("phase") == "end"
            and e["step"] > 0]
    assert [e for e in ends if e.get("transfers")], "no peer sent blocks to the replacement"
    if overlap:
        assert not [e for e in ends if e.get("transfers") and not e.get("overlapped")], ends  # nothing paused
        healed = [e for e in ends if e.get("overlapped")]
        assert {e["worker"] for e in healed} == set(range(8)) and len({e["step"] for e in healed}) == 1, healed
        assert min(e["steps_overlapped"] for e in healed) >= 1, healed


def test_replan_migration_overlapped_with_rerouted_steps(tmp_path, reference):
    """Issue 27 (3): with ``overlap_migration`` a worker killed from outside is re-planned
    *without pausing*: the job trains rerouted while the blocks move (each transfer stretched by
    a ``slow`` fault at the ``migrate`` phase), the receivers keep their copies current from
    the blocks' reduced gradients, and every member switches to the new layout at one step
    boundary -- exactly once, bitwise-equal replicas, within 1e-5 of the failure-free run."""
    victim = random.choice([1, 2, 5, 6])
    codes, j = kill_run(tmp_path, [victim], "--allowed", "replan", "--overlap", at_step=3, hang_timeout=20.0,
                        launch_args=("--faults", "slow:rank=0,1,2,3,4,5,6,7:phase=migrate:factor=4:from=1"))
    assert codes == [0], j.output()[-4000:]
    finals = j.final()
    assert sorted(finals) == sorted(set(range(8)) - {victim})
    check_run(tmp_path, finals, reference)
    ds = decisions(tmp_path)
    assert [d["chosen"] for d in ds] == ["replan"] and ds[0]["event"]["devices"] == [victim], ds
    replan = next(o for o in ds[0]["candidates"] if o["policy"] == "replan")
    # Priced overlapped: the transition is the un-overlapped part, the migration a rerouted phase.
    assert replan["phases"][0]["until_s"] - replan["phases"][0]["from_s"] == pytest.approx(
        replan["migration"]["seconds"], rel=1e-6)
    assert replan["transition_s"] == replan["phases"][0]["from_s"]
    assert replan["breakdown"]["overlapped_s"] == replan["migration"]["seconds"]
    evs = read_events(tmp_path)
    start = [e for e in evs if e["event"] == "migration" and e.get("phase") == "start" and e["step"] > 0]
    ends = [e for e in evs if e["event"] == "migration" and e.get("phase") == "end" and e["step"] > 0]
    assert len(start) == 1 and start[0]["overlapped"], start
    assert ends and all(e["overlapped"] for e in ends), ends
    # Steps were committed while the state moved, and every member switched after the same one.
    assert {e["step"] for e in ends} == {ends[0]["step"]} and ends[0]["step"] > start[0]["step"], ends
    assert min(e["steps_overlapped"] for e in ends) >= 1, ends
    steps = {e["step"] for e in evs if e["event"] == "step" and start[0]["step"] <= e["step"] < ends[0]["step"]}
    assert steps, "no step ran during the migration"
    # Only what is missing moved, exactly the migration plan's bytes; the job ends on its plan.
    assert sum(e["bytes"] for e in ends) == replan["migration"]["bytes"]
    result = json.loads((tmp_path / f"result_{min(finals)}.json").read_text())
    assert result["plan"] == replan["plan"], (result["plan"], replan["plan"])


def test_a_kill_during_an_overlapped_migration_ends_it_and_the_engine_decides_again(tmp_path, reference):
    """A worker taking part in an overlapped migration (stretched by a ``slow`` fault) is killed
    while the job trains rerouted: the recovery ends the overlap (the receivers' shadow copies are
    not agreed state, the old holders still hold everything), the engine decides again for both
    lost workers, and the run ends exactly as every kill must."""
    killed = [2]

    def during_overlap(j):
        evs = j.wait_for(lambda evs: any(e["event"] == "migration" and e.get("phase") == "start"
                                         and e.get("overlapped") for e in evs), 120, "an overlapped migration")
        start = next(e for e in evs if e["event"] == "migration" and e.get("overlapped"))
        j.wait_step(start["step"] + 1, 60)  # the job trains while the state moves
        # Not worker 6: it holds the only live copy of worker 2's blocks (its stage peer).
        busy = sorted({w for rnd in start["rounds"] for t in rnd for w in t[:2]} - {0, 2, 6})
        killed.append(busy[-1])
        j.kill(busy[-1])

    codes, j = kill_run(tmp_path, [2], "--allowed", "replan", "--overlap", at_step=3, then=during_overlap,
                        hang_timeout=20.0,  # the first overlap's transfers stretched, until step 6
                        launch_args=("--faults", "slow:rank=0,1,3,4,5,6,7:phase=migrate:factor=30:from=1:to=6"))
    assert codes == [0], j.output()[-4000:]
    finals = j.final()
    assert sorted(finals) == sorted(set(range(8)) - set(killed))
    check_run(tmp_path, finals, reference)
    ds = decisions(tmp_path)
    assert [d["event"]["devices"] for d in ds][:2] == [[2], [killed[1]]], ds
    assert all(d["chosen"] == "replan" for d in ds), [d["chosen"] for d in ds]
    evs = read_events(tmp_path)
    starts = [e for e in evs if e["event"] == "migration" and e.get("phase") == "start" and e["step"] > 0]
    assert len(starts) >= 2 and starts[0]["overlapped"], starts
    # The second re-plan's migration (not stretched: the fault ends at step 6) switched on every
    # survivor at one step, to the plan the last Decision chose.
    ends = [e for e in evs if e["event"] == "migration" and e.get("phase") == "end" and e["step"] > 0]
    assert {e["worker"] for e in ends} == set(finals) and len({e["step"] for e in ends}) == 1, ends
    result = json.loads((tmp_path / f"result_{min(finals)}.json").read_text())
    assert result["plan"] == next(o for o in ds[-1]["candidates"] if o["policy"] == "replan")["plan"]
