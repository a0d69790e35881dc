"""A bounded set of the randomised fidelity trials (``tests/fidelity/trials.py``) for CI: 9
trials, 3 per framework (ElasticTrainer, Lightning, Accelerate), one set-up per framework so
the failure-free twins are shared.  Every trial must keep each sample exactly once, leave
bitwise-equal survivors with the twin's step count and learning rate, and end within
``TOLERANCE`` (1e-5 relative) of the twin's weights -- only the floating-point summation order
may differ.  The seed is fixed so a failure reproduces (``FIDELITY_SEED`` overrides it); it is
chosen so the draw covers every kill moment, rank 0, forced zero and uneven allocations, SGD
and AdamW, and a failure while a straggler is being flagged (the cause fixed for issue 10,
which makes this set fail on b79230b).  The large run: ``python -m tests.fidelity.trials
--trials 100`` (docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import random

import pytest

from tests.fidelity import trials  # noqa: E402

pytestmark = [pytest.mark.timeout(1800), pytest.mark.slow]

SEED = int(os.environ.get("FIDELITY_SEED", "70"))
N = 9


def test_drawn_trials_cover_the_dimensions():
    rng = random.Random(0)
    drawn = [trials.draw(rng, i, trials.draw_setup(rng, fw)) for i in range(300) for fw in trials.DATA_PARALLEL]
    for t in drawn:
        assert 1 <= t.step <= 2 * t.setup.steps_per_epoch - 2
        assert t.setup.dataset % t.setup.global_batch, "the last global batch must be uneven"
        if t.setup.framework == "lightning":
            assert not (t.force or "").startswith("zero")  # Lightning never leaves a member idle
    assert {t.phase for t in drawn} == set(trials.PHASES)
    assert {t.victim for t in drawn} == set(range(trials.WORKERS))
    assert {t.setup.optimizer for t in drawn} == {"sgd", "adamw"}
    assert {(t.force or "none").split(":")[0] for t in drawn} == {"none", "zero", "uneven"}
    assert any(t.straggler is not None for t in drawn)
    assert any(t.straggler is not None for t in drawn if t.setup.framework == "lightning")
    # The executors and the Trainer: their scripts' fixed data, every fault kind they can meet.
    others = [trials.draw(rng, i, trials.draw_setup(rng, fw), trials.KINDS) for i in range(300)
              for fw in ("pipeline", "sharded", "trainer")]
    for t in others:
        assert t.force is None and t.straggler is None
        assert t.phase in t.setup.phases and t.kind in t.setup.kinds
        assert 1 <= t.step <= 2 * t.setup.steps_per_epoch - 2
    assert {t.kind for t in others if t.setup.framework == "sharded"} == set(trials.KINDS) - {"nan", "kill_save"}
    assert {t.kind for t in others if t.setup.framework == "trainer"} == set(trials.KINDS) - {"kill_save"}
    # kill_save: ElasticTrainer only, rank 0 (the writer) inside a periodic save, before the last step.
    saves = [t for t in (trials.draw(rng, i, trials.draw_setup(rng, "elastic"), trials.KINDS) for i in range(300))
             if t.kind == "kill_save"]
    assert saves and all(t.victim == 0 and t.phase == "save" and t.step % trials.SAVE_EVERY == 0
                         and t.step <= 2 * t.setup.steps_per_epoch - 2 for t in saves)
    assert all("--checkpoint-every" in t.worker_args(trials.Path("/run")) for t in saves)
    assert {t.setup.variant for t in others if t.setup.framework == "sharded"} == {"full", "hybrid"}


@pytest.mark.chaos  # 12 real jobs (~12 min); default coverage: tests/README.md
def test_bounded_trials_stay_on_the_failure_free_trajectory(tmp_path):
    records = trials.run_trials(N, list(trials.FRAMEWORKS), SEED, tmp_path, setups_per_framework=1)
    summary = trials.summarise(records)
    print(json.dumps(summary, indent=1))
    bad = [r for r in records if not r["ok"]]
    assert not bad, f"seed {SEED}: " + "\n".join(
        f"trial {r['trial']} ({r['framework']}, kill w{r['victim']}@{r['kill_step']}:{r['phase']}, "
        f"force={r['force']}, straggler={r['straggler']}): {r['problems']}" for r in bad)
    assert all(r["rel_diff"] < trials.TOLERANCE for r in records)
    # Lightning workers sometimes finish (final state written) but do not exit: an open teardown
    # hang (docs/reliability.md), reported here, not a fidelity failure.
    hangs = [r for r in records if r.get("exit_hang")]
    print("exit hangs:", [(r["trial"], r["framework"]) for r in hangs])
    assert all(r["framework"] == "lightning" for r in hangs), hangs
    assert sum(r["fired"] for r in records) >= N - 2, "most drawn kills must actually fire"


CHAOS_SEED = int(os.environ.get("CHAOS_SEED", "173"))


@pytest.mark.timeout(600)
def test_a_bounded_chaos_set_keeps_each_fault_kinds_promise(tmp_path):
    """The CI share of the chaos trials (``--kinds``): one trial per set-up beyond the plain
    data-parallel ones -- a SIGKILL during the recovery from another (rank 0 the second) on
    Accelerate, SIGSTOP of rank 0 in a DP x PP pipeline job (a hang found by the heartbeats),
    SIGTERM in an FSDP job without replicas (the leaver's row handed over: nothing redone) --
    seeded (``CHAOS_SEED``).  Each must finish with every sample once, equal replicas, no
    process left, and the failure-free twin's weights within 1e-5 (or, where two kills took
    both copies of some state, stop asking for a checkpoint-restart).  The data-parallel kinds
    (SIGTERM, NaN, two kills) have their own tests (tests/runtime/test_preemption.py,
    test_nonfinite.py, the adapters' recovery tests), the ``Trainer``'s kills
    tests/transformers/."""
    kinds = ("term", "stop", "kill_recovery")
    records = trials.run_trials(3, ["accelerate", "pipeline", "sharded"], CHAOS_SEED, tmp_path,
                                setups_per_framework=1, kinds=kinds)
    print(json.dumps(trials.summarise_kinds(records), indent=1))
    assert {r["kind"] for r in records} == set(kinds)
    bad = [r for r in records if not r["ok"]]
    assert not bad, f"seed {CHAOS_SEED}: " + "\n".join(
        f"trial {r['trial']} ({r['framework']}, {r['kind']} w{r['victim']}@{r['kill_step']}): {r['problems']}" for r in bad)
    assert all(r["fired"] for r in records)


@pytest.mark.timeout(300)
def test_an_accelerate_member_without_micro_batches_from_the_first_step_stays_on_the_twin(tmp_path):
    """Accelerate, one loop item per step, dropout on, worker 2 given no micro-batch from the
    first step: its neighbour's surplus micro-batch runs inside the step with its own slot's
    seed (the first item teaches the loss recipe), not merged into the loop's item with one
    dropout stream for both -- the run ends on the failure-free twin (docs/reliability.md)."""
    setup = trials.Setup("accelerate", "sgd", 8, 1, 96, 5)
    ref = trials.twin(setup, tmp_path)
    job = trials.FidelityJob(tmp_path / "zero", setup, ["--force-alloc", "zero:2"])
    finals = job.run_to_end(timeout=180)
    trials.replicas(setup, finals)
    assert trials.distance(setup, finals, ref) < trials.TOLERANCE
