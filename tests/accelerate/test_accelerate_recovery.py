"""accelerate_ft under ``chameleon-ft run``: 4 real worker processes on CPU run a plain Accelerate
loop (accumulate, backward, clip_grad_norm_, optimizer/scheduler step, dropout, gather_for_metrics
evaluation, a tracker); workers are killed or stopped from outside by PID.

Each run is checked against a failure-free run of the same script: the same committed steps and
user-visible step count, every training sample of every epoch exactly once (the workers' logged
ids), bitwise-equal survivors (parameters and momentum), final weights within 1e-5 relative under
reroute, and every evaluation sample gathered exactly once, in order, after the recovery.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import sys
from pathlib import Path

import pytest

from _helpers.recovery import (ScriptJob, UserLaunchedJob, assert_exactly_once,  # noqa: E402
                               assert_replicas_equal, committed_ids, kill_at_random_step, rel_diff,
                               stop_and_survive)

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

SCRIPT = Path(__file__).with_name("_workers") / "acc_train.py"
DATASET, GLOBAL_BATCH, STEPS_PER_EPOCH, EPOCHS, EVAL = 256, 32, 8, 2, 100


class AccJob(ScriptJob):
    def __init__(self, run_dir: Path, *args: str, **kwargs):
        super().__init__(SCRIPT, run_dir, *args, **kwargs)

    def tracker(self) -> list[dict]:
        path = self.run_dir / "tracker.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def exactly_once(events: list[dict]) -> None:
    assert_exactly_once(events, dataset=DATASET, steps_per_epoch=STEPS_PER_EPOCH, epochs=EPOCHS,
                        global_batch=GLOBAL_BATCH)


def replicas_equal(finals: dict[int, dict]) -> dict:
    ref = assert_replicas_equal(finals, same=("step", "completed", "lr", "eval_ids", "val_acc",
                                              "num_processes"))
    # process_index and is_main_process follow the live membership
    assert sorted(f["process_index"] for f in finals.values()) == list(range(len(finals)))
    assert [f["is_main"] for _, f in sorted(finals.items())] == [True] + [False] * (len(finals) - 1)
    return ref


def eval_exactly_once(final: dict) -> None:
    for ids in final["eval_ids"]:
        assert ids == list(range(EVAL)), f"{len(ids)} ids, {len(set(ids))} distinct"


def check(job: AccJob, finals: dict, survivors: list[int], reference: dict) -> dict:
    assert sorted(finals) == survivors
    evs = job.events()
    exactly_once(evs)
    got = replicas_equal(finals)
    eval_exactly_once(got)
    assert got["step"] == got["completed"] == EPOCHS * STEPS_PER_EPOCH
    assert got["num_processes"] == len(survivors)
    assert got["lr"] == reference["lr"]
    chosen = [d["decision"]["chosen"] for d in evs if d["event"] == "decision"
              if d["decision"]["event"]["kind"] != "straggler"]
    if set(chosen) <= {"reroute", "replan", "keep"}:
        assert rel_diff(got, reference) < 1e-5
        assert got["val_acc"] == reference["val_acc"]
    return got


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = AccJob(tmp_path_factory.mktemp("reference"))
    finals = job.run_to_end()
    assert sorted(finals) == [0, 1, 2, 3]
    exactly_once(job.events())
    ref = replicas_equal(finals)
    eval_exactly_once(ref)
    assert ref["step"] == ref["completed"] == EPOCHS * STEPS_PER_EPOCH
    assert any("ft/world_size" in r for r in job.tracker())
    return ref


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """One worker SIGKILLed from outside at a random step of epoch 0; saves state at step 10.
    At step 12 the commit of the next worker is reported failed after its peers committed it (a
    ``drop`` fault: gloo's partial completion, which a SIGKILL inside the all-reduce can
    leave): it adopts the step and, in the redone next one, gets fewer micro-batches than the
    loop's items (each whole, with its own seed, and ghosts: a cut micro-batch ran its halves
    with one seed and drifted 0.5 % from the failure-free run)."""
    seed = random.randrange(1 << 30)
    victim = random.Random(seed).randrange(4)  # kill_at_random_step's first draw
    dropped = (victim + 1) % 4
    job = AccJob(tmp_path_factory.mktemp("killed"), "--mb-sleep", "0.01", "--save-at", "10",
                 launch_args=("--faults", f"drop:rank={dropped}:step=12:phase=commit"))
    got, finals = kill_at_random_step(job, rng=random.Random(seed))
    assert got == victim
    return job, victim, finals


def test_sigkill_at_random_step_exactly_once_bitwise_replicas_same_trajectory(killed_run, reference):
    job, victim, finals = killed_run
    check(job, finals, sorted(set(range(4)) - {victim}), reference)
    evs = job.events()
    failures = [e for e in evs if e["event"] == "failure" and e.get("kind") != "collective"]
    assert failures and failures[0]["workers"] == [victim]
    ends = {e["worker"]: e for e in evs if e["event"] == "run_end" and "worker" in e}
    # The dropped commit (killed_run) is adopted by its worker; a SIGKILL inside the commit's
    # all-reduce can leave any survivor one step more to adopt (gloo's partial completion, the
    # drop's real counterpart: seen in CI, the victim killed at step 7, workers 1 and 3 adopted it).
    adopted = {w: e["adopted_steps"] for w, e in ends.items()}
    dropped = (victim + 1) % 4
    assert 1 <= adopted[dropped] <= 2 and all(a <= 1 + (w == dropped) for w, a in adopted.items()), ends
    assert any("injected drop" in (e.get("reason") or "") for e in evs if e["event"] == "recovery"), evs
    # The trackers got the fault-tolerance metrics, including the recovery (from the live rank 0).
    rows = job.tracker()
    assert any("ft/mttr_s" in r for r in rows) and any(k.startswith("ft/policy/") for r in rows for k in r)
    assert rows[-1]["ft/world_size"] == 3.0


def test_state_saved_after_recovery_resumes_on_two_workers(killed_run, reference, tmp_path):
    job, _, _ = killed_run
    ckpt = job.run_dir / "ckpt"
    assert (ckpt / "chameleon_ft_state.pt").exists()
    resumed = AccJob(tmp_path, "--resume", str(ckpt), nproc=2)
    finals = resumed.run_to_end()
    ids = committed_ids(resumed.events())
    assert sorted(ids) == list(range(10, EPOCHS * STEPS_PER_EPOCH))
    rest = [i for s in ids for i in ids[s]]
    assert len(rest) == len(set(rest)) == 6 * 32  # the rest of epoch 1, each sample once
    got = replicas_equal(finals)
    assert got["step"] == EPOCHS * STEPS_PER_EPOCH and got["num_processes"] == 2
    assert rel_diff(got, reference) < 1e-5
    assert got["eval_ids"][-1] == list(range(EVAL))


def test_two_failures_including_rank0_and_wrapped_accelerator(tmp_path, reference):
    """wrap(Accelerator(...)) given ``DistributedDataParallelKwargs(gradient_as_bucket_view=True)``
    (each gradient released into its bucket: a failed reduction leaves the survivors nothing to
    keep, they recompute the step); worker 0 (the tracker's rank 0) and worker 2 die in turn."""
    job = AccJob(tmp_path, "--mb-sleep", "0.01", "--wrap", "--gav")
    try:
        job.start()
        job.wait_step(3)
        job.kill(0)
        job.wait_for(lambda evs: any(e["event"] == "recovery" for e in evs), 30, "first recovery")
        first = max(e["step"] for e in job.events() if e["event"] == "step")
        job.wait_step(first + 2)
        job.kill(2)
        assert job.wait(90) == [0], job.output()[-4000:]
        finals = job.final()
    finally:
        job.cleanup()
    check(job, finals, [1, 3], reference)
    assert all(f["released"] is True for f in finals.values())  # the DDP setting reached the buckets
    rows = job.tracker()
    assert {r["worker"] for r in rows} >= {0, 1}  # worker 1 took the trackers over
    assert rows[-1]["ft/world_size"] == 2.0


@pytest.mark.chaos  # the runtime's watchdog: test_elastic_recovery.py in CI (tests/README.md)
def test_sigstop_hang_detected_and_survived(tmp_path, reference):
    hang_timeout = 2.0
    job = AccJob(tmp_path, "--mb-sleep", "0.01", hang_timeout=hang_timeout)
    finals = stop_and_survive(job, 1, hang_timeout)
    check(job, finals, [0, 2, 3], reference)


@pytest.mark.chaos  # fixed, out of the default run for its time: tests/README.md
def test_a_worker_stopped_past_the_hang_timeout_and_continued_leaves_the_job(tmp_path, reference):
    """Worker 1 is SIGSTOPped for longer than the liveness and hang timeouts but less than the
    launcher's kill (hang timeout + 2 s), then SIGCONTinued: its peers went on without it for
    several steps, which the user's loop cannot skip.  It must not rejoin a step it never ran
    (seen: an HF Trainer's counters and logs shifted by 4-8 steps): it leaves the job, naming
    why, with exit code 1, and its peers end on the failure-free trajectory."""
    hang_timeout = 2.0
    job = AccJob(tmp_path, "--mb-sleep", "0.03", hang_timeout=hang_timeout)
    try:
        job.start()
        job.wait_step(3)
        t_stop = job.kill(1, signal.SIGSTOP)
        # A generation formed after the stop (a start-up generation that worker 1 joined late
        # does not count: seen under CI load, it let the test continue worker 1 too early).
        job.wait_for(lambda evs: any(e["event"] == "membership" and 1 not in e["members"]
                                     and e["ts"] > t_stop for e in evs),
                     hang_timeout + 2, "a generation without worker 1")
        step_then = max(e["step"] for e in job.events() if e["event"] == "step")
        job.wait_step(step_then + 2)  # its peers committed steps without it
        job.kill(1, signal.SIGCONT)
        assert job.wait(120) == [0], job.output()[-4000:]
        finals = job.final()
    finally:
        job.cleanup()
    check(job, finals, [0, 2, 3], reference)
    evs = job.events()
    left = [e for e in evs if e["event"] == "run_end" and e.get("left_behind")]
    assert [e["worker"] for e in left] == [1] and left[0]["peers_step"] > left[0]["step"] + 1, left
    exits = dict(next(e for e in evs if e["event"] == "run_end" and e.get("role") == "launcher")["exits"])
    assert exits[1] == 1, exits
    assert "worker 1 was left out of the job" in job.output()


ACCELERATE = shutil.which("accelerate") or "accelerate"


@pytest.mark.parametrize("how,victim", [
    ("accelerate launch", 0),
    pytest.param("chameleon-ft run", 2, marks=pytest.mark.chaos),
    pytest.param("accelerate launch", 2, marks=pytest.mark.chaos),
    pytest.param("chameleon-ft run", 0, marks=pytest.mark.chaos)])
def test_started_with_accelerate_launchs_flags_survives_a_kill(tmp_path, reference, how, victim):
    """Issue 26: the script started with ``accelerate launch --multi_gpu --num_processes 4``
    (torchrun underneath: its local rank 0 becomes our launcher, ranks 1-3 leave with 0, so
    torchrun's agent has no worker whose death would make it stop the rest), or with
    ``chameleon-ft run`` and ``accelerate launch``'s own flags (the command name swapped).
    Worker ``victim`` (rank 0 included) is SIGKILLed from outside mid-epoch: every started
    process ends with 0, the terminal has the recovery line, and the survivors end on the
    failure-free trajectory."""
    hf = tmp_path / "hf"  # no user Accelerate config of this machine is read
    env = {"HF_HOME": str(hf)}
    if how == "accelerate launch":
        prefix = [ACCELERATE, "launch", "--multi_gpu", "--num_processes", "4", "--num_machines", "1",
                  "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0"]
    else:
        prefix = [sys.executable, "-m", "chameleon_ft.cli.launch", "--num_processes", "4", "--cpu",
                  "--run-dir", str(tmp_path)]
    job = UserLaunchedJob(SCRIPT, tmp_path, "--mb-sleep", "0.01", prefix=prefix, env=env)
    try:
        job.start()
        job.wait_step(random.randrange(2, 6))
        job.kill(victim)
        assert job.wait(180) == [0], job.output()[-4000:]
        finals = job.final()
    finally:
        job.cleanup()
    got = check(job, finals, sorted(set(range(4)) - {victim}), reference)
    assert rel_diff(got, reference) < 1e-5
    evs = job.events()
    failures = [e for e in evs if e["event"] == "failure" and e.get("kind") != "collective"]
    assert failures and failures[0]["workers"] == [victim]
    out = job.output()
    assert any("accelerate_ft: recovered at step" in ln and f"lost worker(s) [{victim}]" in ln
               for ln in out.splitlines()), out[-3000:]
    if how == "accelerate launch":
        assert "running this job under `chameleon-ft run`" in out
        assert out.count("leaves its place to a worker") == 3


def test_an_fsdp2_plugin_trains_as_data_parallel_and_survives_a_kill(tmp_path, reference):
    """``FaultTolerantAccelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2,
    transformer_based_wrap over every Linear))``: failure-free, the sharded job is the
    data-parallel one (same samples, dropout masks and updates: within 1e-5, the same
    evaluations), and so is its resume from ``save_state`` on 2 workers; a worker SIGKILLed after the first snapshot is recovered in place by the
    engine's choice for the lost shard rows (event log, console line), every sample is still
    trained once, every evaluation sample gathered once, the survivors' whole weights equal."""
    free = AccJob(tmp_path / "free", "--fsdp", "--save-at", "10")
    finals = free.run_to_end()
    got = replicas_equal(finals)
    exactly_once(free.events())
    eval_exactly_once(got)
    assert got["step"] == got["completed"] == EPOCHS * STEPS_PER_EPOCH
    assert rel_diff(got, reference) < 1e-5 and got["val_acc"] == reference["val_acc"]
    # save_state writes the whole state; resumed on 2 workers (each with twice the micro-batches,
    # the surplus computed inside optimizer.step, seeds kept) it ends where the reference does.
    resumed = AccJob(tmp_path / "resumed", "--fsdp", "--resume", str(free.run_dir / "ckpt"), nproc=2)
    got = replicas_equal(resumed.run_to_end())
    assert sorted(committed_ids(resumed.events())) == list(range(10, EPOCHS * STEPS_PER_EPOCH))
    assert got["step"] == EPOCHS * STEPS_PER_EPOCH and rel_diff(got, reference) < 1e-5

    job = AccJob(tmp_path / "killed", "--fsdp", "--mb-sleep", "0.01")
    victim, finals = kill_at_random_step(job, steps=(4, 9), rng=random.Random(5))
    assert sorted(finals) == sorted(set(range(4)) - {victim})
    got = replicas_equal(finals)
    exactly_once(job.events())
    eval_exactly_once(got)
    assert got["step"] == got["completed"] == EPOCHS * STEPS_PER_EPOCH
    decisions = [e for e in job.events() if e["event"] == "shard_recovery"]
    assert decisions and decisions[0]["chosen"] == "rehabilitate", decisions
    assert "chameleon-ft: worker" in job.output() and "rehabilitate" in job.output()
    # Rehabilitated rows restart from their stale snapshot: near the trajectory, not on it (on this
    # toy the weights end ~0.35 apart), and the training goes on learning as the reference did.
    assert abs(got["val_acc"][-1] - reference["val_acc"][-1]) <= 0.1


def test_an_fsdp2_member_that_adopted_a_step_runs_the_next_with_the_passes_its_peers_redo(tmp_path, reference):
    """Worker 1's commit of step 5 is reported failed after its peers committed it (a ``drop``
    fault: gloo's partial completion, as a SIGKILL inside the commit can leave):
    it adopts step 5 and runs step 6 from the loop while its peers redo step 6 inside their
    ``optimizer.step()``.  Every member must run the same forward/backward passes (FSDP's
    collectives pair up by order; a surplus pass meeting the commit's header aborted a worker
    in gloo, ``op.preamble.length <= op.nbytes``): with a loss recipe and an uneven allocation
    (worker 1 holds three micro-batches: the surplus spilled into ``optimizer.step()``), and
    without a recipe (the redo runs through the loop's items).  All four workers finish, on the
    failure-free trajectory of the even allocation: from the first step, whose first item
    teaches the recipe, each surplus micro-batch runs with its own seed."""
    drop = ("--faults", "drop:rank=1:step=5:phase=commit")
    runs = {"recipe": AccJob(tmp_path / "recipe", "--fsdp", "--force-alloc", "uneven:0", launch_args=drop),
            "no_recipe": AccJob(tmp_path / "no_recipe", "--fsdp", "--loss", "external", launch_args=drop)}
    for name, job in runs.items():
        finals = job.run_to_end()
        assert sorted(finals) == [0, 1, 2, 3], (name, job.output()[-4000:])
        assert "EnforceNotMet" not in job.output(), name
        evs = job.events()
        exactly_once(evs)
        got = replicas_equal(finals)
        eval_exactly_once(got)
        assert got["step"] == got["completed"] == EPOCHS * STEPS_PER_EPOCH
        ends = {e["worker"]: e for e in evs if e["event"] == "run_end" and "worker" in e}
        # Worker 1 adopts step 5; a peer whose own side of that commit had not completed when
        # worker 1 ended the generation (a busy machine can leave it so) adopts it too, and then
        # has no step 6 to redo: each peer redid step 6 or adopted step 5, once.
        assert ends[1]["adopted_steps"] == 1, (name, ends)
        assert all(ends[w]["redone_steps"] + ends[w]["adopted_steps"] == 1 for w in (0, 2, 3)), (name, ends)
        assert sum(ends[w]["redone_steps"] for w in (0, 2, 3)) >= 1, (name, ends)  # someone redid step 6
        assert rel_diff(got, reference) < 1e-5, name


def test_a_sigterm_leaves_at_a_step_boundary_announced(tmp_path, reference):
    """Worker 2 gets SIGTERM (a preemption notice) from outside mid-epoch: it leaves inside the
    user's ``optimizer.step()`` after that step's commit (exit 143), its peers reconfigure after
    the same commit and redo nothing, and the run ends as the failure-free one
    (``runtime/preemption.py``)."""
    job = AccJob(tmp_path, "--mb-sleep", "0.01")
    try:
        job.start()
        job.wait_step(5)
        job.kill(2, signal.SIGTERM)
        assert job.wait(120) == [0], job.output()[-4000:]
        finals, evs = job.final(), job.events()
    finally:
        job.cleanup()
    check(job, finals, [0, 1, 3], reference)
    assert [(f["workers"], f["kind"]) for f in evs if f["event"] == "failure"] == [([2], "preemption")]
    ends = {e["worker"]: e for e in evs if e["event"] == "run_end" and "worker" in e}
    assert ends[2].get("left") == "preempted"
    assert all(ends[w].get("redone_steps") == 0 for w in (0, 1, 3)), ends
    assert "worker 2 (pid" in job.output() and "left the job on SIGTERM" in job.output()


def test_a_trigger_checked_apart_after_a_kill_stops_everyone_after_the_next_commit(tmp_path):
    """Worker 1 calls ``set_trigger()`` after step 3; worker 2 is SIGKILLed while every worker
    sleeps before its ``check_trigger()``, so the survivors meet the failure in that check's
    reduction and hold only their own trigger: worker 1 alone would leave the loop.  The check is
    deferred to the next commit (``runtime/steering.py``): every survivor trains step 4 and stops
    after it, at the same step, with equal replicas (without a failure all stop after step 3)."""
    job = AccJob(tmp_path, "--trigger-at", "3", "--window-sleep", "1.0")
    finals = job.kill_on_marker(2, "window_w2", delay=(0.0, 0.3))
    assert sorted(finals) == [0, 1, 3]
    got = assert_replicas_equal(finals, same=("step", "completed", "lr", "eval_ids", "val_acc"))
    assert got["step"] == got["completed"] == 4
    assert got["eval_ids"] == [list(range(EVAL))]  # the loop's one evaluation, over the survivors
    steering = [(e["step"], e["stop_voters"]) for e in job.events() if e["event"] == "steering"]
    assert steering == [(4, [1])], steering
