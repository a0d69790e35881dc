"""Set-up of the Lightning integration, in-process (no workers started): the callback makes
strategy="ddp" fault-tolerant, refuses what it cannot carry out, and under Lightning's own
launcher stops at once with the way out instead of hanging."""

import os

import pytest
from lightning.pytorch import Trainer

from lightning_ft import FaultToleranceCallback, FaultTolerantDDPStrategy, LauncherError
from lightning_ft.strategy import at_least_one_each


@pytest.fixture(autouse=True)
def no_launcher_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("CHAMELEON_FT_") or k in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
            monkeypatch.delenv(k)


def test_callback_makes_ddp_fault_tolerant_and_ddp_ft_is_registered(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")  # processes started by a launcher
    cb = FaultToleranceCallback()
    for name in ("ddp", "ddp_ft"):
        t = Trainer(accelerator="cpu", devices=1, strategy=name, callbacks=[cb], logger=False)
        assert isinstance(t.strategy, FaultTolerantDDPStrategy)


def test_lightnings_own_launcher_gives_a_clear_message():
    with pytest.raises(LauncherError, match="chameleon-ft run.*rank 0.*ckpt_path"):
        Trainer(accelerator="cpu", devices=2, strategy="ddp", callbacks=[FaultToleranceCallback()])


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="shrink"):
        FaultToleranceCallback(allowed_policies=["reroute", "shrink"])
    with pytest.raises(ValueError):
        FaultToleranceCallback(hang_timeout_s=0)
    with pytest.warns(UserWarning, match="global batch fixed"):
        FaultToleranceCallback(allow_batch_change=True)
    cfg = FaultToleranceCallback(allowed_policies=["reroute"], hang_timeout_s=3).elastic_config()
    assert cfg.allowed_policies == frozenset({"reroute"}) and cfg.hang_timeout_s == 3


def test_every_member_keeps_a_microbatch_after_a_rebalance():
    # The engine may give a straggler nothing; Lightning needs a training_step per member.
    assert at_least_one_each([3, 3, 2, 0], [0, 1, 2, 3]) == [3, 2, 2, 1]
    assert at_least_one_each([0, 4, 4, 0], [0, 1, 2, 3]) == [1, 3, 3, 1]
    assert at_least_one_each([2, 2, 2, 2], [0, 1, 2, 3]) == [2, 2, 2, 2]
    assert at_least_one_each([2, 0, 0], [5, 6, 7]) == [2, 0, 0]  # fewer micro-batches than members
    assert sum(at_least_one_each([8, 0, 0, 0], [0, 1, 2, 3])) == 8
