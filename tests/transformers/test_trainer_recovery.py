"""transformers_ft: a plain HuggingFace ``Trainer`` script with one line changed
(``FaultTolerantTrainer``, ``_workers/hf_train.py``) on 4 real worker processes; a worker is
SIGKILLed from outside by PID, rank 0 included.

Compared with the failure-free run of the same script: the same ``global_step``, the same
``state.log_history`` (every logged training loss, learning rate and gradient norm within the
summation-order tolerance, every evaluation over all 100 samples with the same metrics), the
same checkpoint folders left by ``save_steps`` / ``save_total_limit`` and the same best
checkpoint (``load_best_model_at_end``), the final weights within 1e-5 relative, and the
same final ``trainer.evaluate()``.  Started by ``chameleon-ft run``, by ``accelerate launch``
(which hands the job to it) and as ``python train.py`` alone (a plain single-process Trainer).
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from _helpers.recovery import ROOT, TRAINER_PRELOAD, ScriptJob, UserLaunchedJob, rel_diff  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

SCRIPT = Path(__file__).with_name("_workers") / "hf_train.py"
STEPS = 16  # 256 samples, global batch 4 workers x 4 x accumulation 2 = 32, two epochs
TRAIN_KEYS = ("loss", "learning_rate", "grad_norm")
EVAL_KEYS = ("eval_loss", "eval_accuracy")


def history(final: dict) -> tuple[list[dict], list[dict]]:
    """(training logs, evaluation logs) of ``state.log_history``, the user's keys only."""
    logs = json.loads(final["log_history"])
    train = [{k: h[k] for k in ("step", "epoch", *TRAIN_KEYS)} for h in logs if "loss" in h]
    evals = [{k: h[k] for k in ("step", "epoch", *EVAL_KEYS)} for h in logs if "eval_loss" in h]
    return train, evals


def close(a: float, b: float, tol: float = 1e-5) -> bool:
    return abs(a - b) <= tol * max(abs(a), abs(b), 1e-12)


def same_as(final: dict, ref: dict) -> None:
    same_run(final, ref, CLS)


def trainer_job(script, run_dir, *args, launch_args=(), **kwargs) -> ScriptJob:
    """``chameleon-ft run`` of a Trainer script with the Trainer's preload
    (``transformers_ft.trainer.TRAINER_PRELOAD``, as its own relaunch gives it)."""
    return ScriptJob(script, run_dir, *args, launch_args=[*TRAINER_PRELOAD, *launch_args], **kwargs)


def run_and_kill(tmp_path, args, victim: int, at: int, delay: float = 0.0, prefix=None) -> tuple:
    """Start ``hf_train.py`` (under ``chameleon-ft run`` unless ``prefix``), SIGKILL worker
    ``victim`` ``delay`` s after some worker attempted step ``at``; (job, finals of the survivors)."""
    prefix = prefix or [sys.executable, "-m", "chameleon_ft.cli.launch", "--nproc-per-node", "4",
                        *TRAINER_PRELOAD, "--run-dir", str(tmp_path)]
    job = UserLaunchedJob(SCRIPT, tmp_path, "--mb-sleep", "0.01", *args, prefix=prefix,
                          env={"HF_HOME": str(tmp_path / "hf")})
    try:
        job.start()
        job.wait_step(at)
        time.sleep(delay)
        job.kill(victim)
        assert job.wait(180) == [0], job.output()[-4000:]
        finals = job.final()
    finally:
        job.cleanup()
    assert sorted(finals) == sorted(set(range(4)) - {victim})
    failures = [e for e in job.events() if e["event"] == "failure" and e.get("kind") != "collective"]
    assert failures and failures[0]["workers"] == [victim]
    return job, finals


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    job = trainer_job(SCRIPT, tmp_path_factory.mktemp("reference"))
    finals = job.run_to_end()
    assert sorted(finals) == [0, 1, 2, 3]
    ref = finals[0]
    for f in finals.values():
        assert history(f) == history(ref) and f["checkpoints"] == ref["checkpoints"]
    tr, ev = history(ref)
    assert [h["step"] for h in tr] == list(range(2, STEPS + 1, 2)) and [h["step"] for h in ev] == [4, 8, 12, 16, 16]  # the last: trainer.evaluate() after train()
    assert ref["checkpoints"] and ref["best"] in ref["checkpoints"]
    # One process writes the checkpoints; every evaluation saw each of the 100 samples.
    assert json.loads(ref["eval"])["eval_accuracy"] * 100 == pytest.approx(round(json.loads(ref["eval"])["eval_accuracy"] * 100))
    ref["run_dir"] = job.run_dir
    return ref


ACCELERATE = shutil.which("accelerate") or "accelerate"


@pytest.mark.parametrize("how,victim", [
    ("chameleon-ft run", 0), pytest.param("chameleon-ft run", 2, marks=pytest.mark.chaos),
    pytest.param("accelerate launch", 2, marks=pytest.mark.chaos),
    pytest.param("accelerate launch", 0, marks=pytest.mark.chaos)])
def test_a_trainer_script_survives_a_kill(tmp_path, reference, how, victim):
    # Under our launcher, worker 1's commit at step 10 is also reported failed after its peers
    # committed it (a ``drop`` fault: gloo's partial completion): it adopts the step and must
    # log that step's loss and gradient norm as its peers did (it once logged stale ones).
    prefix = ([sys.executable, "-m", "chameleon_ft.cli.launch", "--nproc-per-node", "4", "--run-dir", str(tmp_path),
               "--faults", "drop:rank=1:step=10:phase=commit"]
              if how == "chameleon-ft run" else
              [ACCELERATE, "launch", "--multi_gpu", "--num_processes", "4", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0"])
    job, finals = run_and_kill(tmp_path, (), victim, random.randrange(1, 4), prefix=prefix)  # before the first save
    for f in finals.values():
        same_as(f, reference)
        assert f["world_size"] == 3
    evs = job.events()
    if how == "chameleon-ft run":
        ends = {e["worker"]: e for e in evs if e["event"] == "run_end" and "worker" in e}
        assert ends[1]["adopted_steps"] == 1, ends
    # The recovery reached the user's log history (ft/* metrics) and the console, once.
    logs = json.loads(next(iter(finals.values()))["log_history"])
    assert any("ft/mttr_s" in h for h in logs) and logs[-3].get("ft/world_size", 3.0) == 3.0
    assert any(k.startswith("ft/policy/") for h in logs for k in h)
    out = job.output()
    assert sum("accelerate_ft: recovered at step" in ln and f"lost worker(s) [{victim}]" in ln
               for ln in out.splitlines()) == 1, out[-3000:]
    # One process printed the logs (the live rank 0), not every survivor.
    assert out.count("'eval_loss'") == len(history(reference)[1])


# ---------------------------------------------------------------- kills drawn over the whole run
# The causal LM (``hf_train.py --model lm``): 2 epochs of 16 steps, evaluations and checkpoints
# at global steps 10, 20, 30, padded batches.  Runtime step s commits global step s + 1; the
# runtime writes step s's record while its gradients are in flight, so a kill ``delay`` seconds
# after the record of step s lands in the end of that step, or in the logging, evaluation and
# checkpoint of global step s + 1 when one is due, or in the first micro-batches of s + 1.
LM = {"steps": 32, "eval_keys": ("eval_loss",), "args": ("--model", "lm"),
      "boundaries": (2, 9, 14, 15, 16, 19, 28, 29, 30)}  # eval/save at 9, 19, 29; epoch at 15/16
CLS = {"steps": STEPS, "eval_keys": EVAL_KEYS, "args": (),
       "boundaries": (3, 6, 7, 8, 11, 13, 14)}  # eval/save at 3, 7, 11; the epoch ends at step 7


def _moments(seed: int = 47, per_model: int = 12) -> list:
    """Seeded (model, runtime step, delay, victim) draws; the classifier's first runs in CI (the
    causal LM's kills are chaos runs: its token weighting and a kill are in CI through
    ``test_a_causal_lm_update_is_the_global_batchs_token_mean`` and tests/recipes/)."""
    rng, out = random.Random(seed), []
    for name, spec in (("lm", LM), ("cls", CLS)):
        for i in range(per_model):
            moment = (name, rng.choice(spec["boundaries"]), rng.choice((0.0, 0.03, 0.08, 0.15)), rng.randrange(4))
            out.append(moment if i == 0 and name == "cls" else pytest.param(*moment, marks=pytest.mark.chaos))
    return out


def _degenerate(name: str, value) -> bool:
    """GPT-2's key bias: its gradient is zero in exact arithmetic (softmax ignores a shift shared
    by every key), so AdamW turns summation-order noise into updates of the learning rate's
    size -- it differs between two failure-free runs whose reductions add in another order."""
    return name.endswith("attn.c_attn.bias")


def weights_close(final: dict, ref: dict) -> float:
    """``rel_diff`` over every parameter, the key third of GPT-2's ``c_attn.bias`` left out."""
    worst = 0.0
    for name, x, y in zip(ref.get("names", [""] * len(ref["params"])), final["params"], ref["params"]):
        if _degenerate(name, y):
            n = y.numel() // 3
            x, y = torch.cat([x[:n], x[2 * n:]]), torch.cat([y[:n], y[2 * n:]])
        worst = max(worst, float((x - y).norm() / y.norm()))
    return worst


def same_run(final: dict, ref: dict, spec: dict) -> None:
    """``same_as`` for either model: global step, every log, folders, weights, last evaluation."""
    def logs(f):
        h = json.loads(f["log_history"])
        return ([{k: x[k] for k in ("step", "epoch", *TRAIN_KEYS)} for x in h if "loss" in x],
                [{k: x[k] for k in ("step", "epoch", *spec["eval_keys"])} for x in h if "eval_loss" in x])
    assert final["global_step"] == ref["global_step"] == spec["steps"]
    (tr, ev), (rtr, rev) = logs(final), logs(ref)
    assert [(h["step"], h["epoch"]) for h in tr] == [(h["step"], h["epoch"]) for h in rtr]
    for h, r in zip(tr, rtr):
        assert all(close(h[k], r[k]) for k in TRAIN_KEYS), (h, r)
    assert [(h["step"], h["epoch"]) for h in ev] == [(h["step"], h["epoch"]) for h in rev]
    for h, r in zip(ev, rev):
        assert all(close(h[k], r[k]) for k in spec["eval_keys"]), (h, r)
    assert final["checkpoints"] == ref["checkpoints"] and final["best"] == ref["best"]
    assert weights_close(final, ref) < 1e-5
    m, rm = json.loads(final["eval"]), json.loads(ref["eval"])
    assert all(close(m[k], rm[k]) for k in spec["eval_keys"])
    assert close(final["train_loss"], ref["train_loss"])


@pytest.fixture(scope="module")
def references(tmp_path_factory, reference):
    """The failure-free final state by model, the causal LM's run when first asked for."""
    refs = {"cls": reference}

    def get(model: str) -> dict:
        if model not in refs:
            job = trainer_job(SCRIPT, tmp_path_factory.mktemp("reference-lm"), *LM["args"])
            lm = job.run_to_end()
            assert sorted(lm) == [0, 1, 2, 3]
            for f in lm.values():
                same_run(f, lm[0], LM)
            refs[model] = lm[0]
        return refs[model]
    return get


@pytest.mark.parametrize("model,at,delay,victim", _moments())
def test_a_kill_anywhere_keeps_the_failure_free_run(tmp_path, references, model, at, delay, victim):
    """SIGKILL of one worker (rank 0 included) at a seeded moment: before, during or after an
    evaluation and a checkpoint, at an epoch boundary, in the last steps.  Every survivor ends
    with the failure-free run's logs (losses, learning rates, gradient norms, evaluations),
    checkpoint folders, best checkpoint and weights (1e-5)."""
    spec = LM if model == "lm" else CLS
    _, finals = run_and_kill(tmp_path, spec["args"], victim, at, delay)
    for f in finals.values():
        same_run(f, references(model), spec)
        assert f["world_size"] == 3


def test_a_causal_lm_update_is_the_global_batchs_token_mean(tmp_path):
    """The ``Trainer``'s token-weighted loss (``num_items_in_batch``) on padded sequences of
    6-24 tokens: one step of 4 workers (2 micro-batches of 4 each), plain SGD, no dropout.  The
    update equals the plain ``Trainer``'s on the step's 32 samples (their ids from the event log)
    computed here in one process: the loss summed over the global batch's tokens divided by
    their number as the ``Trainer`` counts them (``_get_num_items_in_batch``), within 1e-6; the
    sample-weighted update (the mean of the micro-batches' token means) differs by far more."""
    sys.path.insert(0, str(SCRIPT.parent))
    from hf_train import Tokens, pad
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from _helpers.recovery import committed_ids

    job = trainer_job(SCRIPT, tmp_path, "--model", "lm", "--step-lr", "--no-dropout", "--max-steps", "1",
                    env={"HF_HOME": str(tmp_path / "hf")})
    finals = job.run_to_end()
    ids = committed_ids(job.events())[0]
    assert sorted(finals) == [0, 1, 2, 3] and len(ids) == 32 and finals[0]["global_step"] == 1
    data = Tokens(512, 1)

    def updated(token_mean: bool) -> dict:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=48, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                           bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                           attn_pdrop=0.0))
        plain = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / "plain"), use_cpu=True,
                                                            report_to="none"))
        if token_mean:  # the plain Trainer's loss of the whole global batch in one micro-batch
            batch = pad([data[i] for i in ids])
            count = plain._get_num_items_in_batch([batch], torch.device("cpu"))
            assert count is not None  # the Trainer weights this model's loss by tokens
            model(**batch, num_items_in_batch=count).loss.backward()
        else:
            for k in range(0, 32, 4):
                (model(**pad([data[i] for i in ids[k:k + 4]])).loss / 8).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with torch.no_grad():
            for p in model.parameters():
                p -= 3e-2 * p.grad
        return {"params": list(model.state_dict().values())}

    want, by_samples = updated(True), updated(False)
    for f in finals.values():
        assert rel_diff(f, want) < 1e-6
    assert rel_diff(by_samples, want) > 1e-3


@pytest.mark.chaos  # the adoption's hyperparameters under Lightning: test_lightning_recovery.py (tests/README.md)
def test_an_adopted_step_keeps_a_users_step_lr_on_the_failure_free_schedule(tmp_path):
    """The user's own SGD + StepLR (``optimizers=``), which the ``Trainer`` steps after each
    update.  Worker 1's commit of step 4 -- after which StepLR halves the LR -- is reported failed
    after its peers committed it (``drop``): it adopts the step from a peer whose ``Trainer`` has
    stepped the scheduler already, and must take the LR as it was at the commit (before
    2026-12-04 it halved it twice: 0.00075 logged where the failure-free run has 0.0015)."""
    runs = {}
    for name, extra in (("ref", ()), ("drop", ("--faults", "drop:rank=1:step=4:phase=commit"))):
        job = trainer_job(SCRIPT, tmp_path / name, "--step-lr", launch_args=extra)
        runs[name] = (job, job.run_to_end())
    (ref_job, ref), (job, finals) = runs["ref"], runs["drop"]
    ends = {e["worker"]: e for e in job.events() if e["event"] == "run_end" and "worker" in e}
    assert ends[1]["adopted_steps"] == 1, ends
    for f in finals.values():
        same_as(f, ref[0])


def test_python_train_py_alone_is_the_plain_trainer(tmp_path):
    """Without a launcher the class is the ``Trainer``: one process trains the same 16 steps."""
    env = {"PYTHONPATH": str(ROOT), "HF_HOME": str(tmp_path / "hf"), "CHAMELEON_FT_NO_RELAUNCH": "1"}
    import os
    p = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], env={**os.environ, **env},
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    import torch
    f = torch.load(tmp_path / "final_0.pt", weights_only=True)
    assert f["global_step"] == 64 and f["world_size"] == 1  # 256 samples / (4 x 2) per step, 2 epochs


def test_a_sharded_trainer_survives_a_kill_and_saves_what_from_pretrained_loads(tmp_path):
    """``fsdp="full_shard"`` (FSDP2, one unit per GPT-2 block and the root) under ``chameleon-ft
    run``: worker 2 SIGKILLed after the first checkpoint and snapshot; the survivors recover in
    place on the engine's choice (said in one console line and the event log), finish both
    epochs with every step logged, hold the same whole weights, and ``save_model``'s folder
    loads with ``from_pretrained`` into exactly those weights."""
    from transformers import GPT2LMHeadModel

    job, finals = run_and_kill(tmp_path, ["--model", "lm", "--fsdp"], victim=2, at=14, delay=0.05)
    out = job.output()
    decisions = [e for e in job.events() if e["event"] == "shard_recovery"]
    assert decisions and decisions[0]["chosen"] in ("rehabilitate", "restart"), decisions
    assert "shard rows" in out or "rows" in out
    ref = finals[min(finals)]
    for f in finals.values():  # the gathered weights are the same tensors everywhere
        assert all(torch.equal(a, b) for a, b in zip(f["params"], ref["params"]))
    assert ref["global_step"] == 2 * STEPS
    logs = json.loads(ref["log_history"])
    train, evals = [h for h in logs if "loss" in h], [h for h in logs if "eval_loss" in h]
    assert [h["step"] for h in train] == list(range(2, 2 * STEPS + 1, 2))
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in train)
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]  # it kept learning after the kill
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "model").state_dict()
    mine = dict(zip(ref["names"], ref["params"]))
    assert set(loaded) <= set(mine) and len(loaded) >= len(mine) - 1
    assert all(torch.equal(loaded[n], mine[n]) for n in loaded)


# The FSDP resume runs with the chaos set: CI keeps the data-parallel one, the sharded Trainer's
# kill and Accelerate's FSDP2 resume on 2 workers (tests/accelerate/), the path this one takes.
@pytest.mark.parametrize("sharded", [False, pytest.param(True, marks=pytest.mark.chaos)], ids=["data-parallel", "fsdp"])
def test_resume_from_checkpoint_on_fewer_workers_ends_as_the_uninterrupted_run(tmp_path, sharded):
    """``trainer.train(resume_from_checkpoint=<checkpoint-30>)`` of the causal LM (mid-epoch 2)
    on 2 workers instead of 4: the checkpoint carries the runtime's sampler cursor and global
    batch, the Trainer's skipped items are the ones the checkpoint holds, and the resumed steps
    log the losses and write the checkpoint-32 weights of the uninterrupted run (1e-5)."""
    from safetensors.torch import load_file

    extra = ("--fsdp",) if sharded else ()
    full = trainer_job(SCRIPT, tmp_path / "full", "--model", "lm", *extra)
    ref = full.run_to_end()[0]
    ckpt = full.run_dir / "ckpt" / "checkpoint-30"
    assert (ckpt / "chameleon_ft_state.pt").exists()
    resumed = trainer_job(SCRIPT, tmp_path / "resumed", "--model", "lm", *extra, "--resume", str(ckpt), nproc=2)
    got = resumed.run_to_end()[0]
    assert got["global_step"] == ref["global_step"] == 32 and got["world_size"] == 2
    losses = lambda f: {h["step"]: h["loss"] for h in json.loads(f["log_history"]) if "loss" in h}  # noqa: E731
    assert max(losses(got)) == 32 and close(losses(got)[32], losses(ref)[32])
    a = load_file(str(resumed.run_dir / "ckpt" / "checkpoint-32" / "model.safetensors"))
    b = load_file(str(full.run_dir / "ckpt" / "checkpoint-32" / "model.safetensors"))
    assert max(float((a[k] - b[k]).norm() / b[k].norm()) for k in b) < 1e-5
