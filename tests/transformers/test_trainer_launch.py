"""Which launcher a ``FaultTolerantTrainer`` finds itself under (pure routing, no job).

Started by ``accelerate launch`` / torchrun (their variables set, no ``chameleon-ft run``
environment), the Trainer hands the job to our launcher with the same function as
``FaultTolerantAccelerator`` (``accelerate_ft.accelerator.relaunch_torchrun``), before
``Trainer.__init__`` touches torch.distributed.  That function itself is proven end to end by
``tests/accelerate/test_accelerate_recovery.py::test_started_with_accelerate_launchs_flags_survives_a_kill``
(``accelerate launch``, a SIGKILL); the Trainer under ``accelerate launch`` with a kill is the
chaos test ``test_trainer_recovery.py::test_a_trainer_script_survives_a_kill[accelerate launch-2]``."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import transformers_ft.trainer as tt  # noqa: E402


class Handed(Exception):
    pass


def _refuse(*a, **k):
    raise Handed


@pytest.fixture
def no_chameleon_env(monkeypatch):
    for k in list(__import__("os").environ):
        if k.startswith("CHAMELEON_FT_") or k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
            monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(tt, "relaunch_torchrun", _refuse)
    return monkeypatch


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "2"},  # torchrun
                                 {"LOCAL_RANK": "0"}])
def test_under_torchrun_the_trainer_hands_the_job_to_chameleon_ft_run(no_chameleon_env, env):
    for k, v in env.items():
        no_chameleon_env.setenv(k, v)
    with pytest.raises(Handed):
        tt.FaultTolerantTrainer(model=None)


def test_plain_python_is_not_handed_over(no_chameleon_env):
    # No launcher variables: the plain Trainer path (it fails later, on model=None, not by handing over).
    with pytest.raises(Exception) as got:
        tt.FaultTolerantTrainer(model=None)
    assert not isinstance(got.value, Handed)


def test_the_handover_preloads_the_trainer_and_the_tests_do_the_same(no_chameleon_env):
    """The relaunch asks ``chameleon-ft run`` to preload ``transformers.trainer``
    (``TRAINER_PRELOAD``), and the tests' Trainer jobs are started with that same flag."""
    from _helpers.recovery import TRAINER_PRELOAD

    seen = {}
    no_chameleon_env.setattr(tt, "relaunch_torchrun", lambda **kw: seen.update(kw) or _refuse())
    no_chameleon_env.setenv("LOCAL_RANK", "0")
    with pytest.raises(Handed):
        tt.FaultTolerantTrainer(model=None)
    assert seen["extra"] == tt.TRAINER_PRELOAD == TRAINER_PRELOAD
