"""Set-up of the Lightning integration, in-process (no workers started): the callback makes
strategy="ddp" fault-tolerant, refuses what it cannot carry out, and under Lightning's own
launcher stops at once with the way out instead of hanging."""

import os

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_ft import FaultToleranceCallback, FaultTolerantDDPStrategy, LauncherError
from chameleon_ft.engine.planner import at_least_one_each


@pytest.fixture(autouse=True)
def no_launcher_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("CHAMELEON_FT_") or k in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
            monkeypatch.delenv(k)


def test_callback_makes_ddp_fault_tolerant_and_ddp_ft_is_registered(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")  # processes started by a launcher
    monkeypatch.setenv("CHAMELEON_FT_WORKER_ID", "0")  # a worker of chameleon-ft run
    cb = FaultToleranceCallback()
    for name in ("ddp", "ddp_ft"):
        t = Trainer(accelerator="cpu", devices=1, strategy=name, callbacks=[cb], logger=False)
        assert isinstance(t.strategy, FaultTolerantDDPStrategy)


def test_lightnings_own_launcher_becomes_chameleon_ft_run(monkeypatch, capsys):
    # ``python train.py`` with devices=2: this process becomes the launcher (exec captured here;
    # the real-process tests in test_lightning_recovery.py run it for real).
    calls = []

    def execve(path, argv, env):
        calls.append((path, argv, env))
        raise SystemExit(0)

    monkeypatch.setattr(os, "execve", execve)
    monkeypatch.setenv("MASTER_PORT", "12345")  # a per-process variable the workers must not inherit
    with pytest.raises(SystemExit):
        Trainer(accelerator="cpu", devices=2, strategy="ddp", callbacks=[FaultToleranceCallback()])
    (path, argv, env), = calls
    assert argv[1:5] == ["-m", "chameleon_ft.cli.launch", "--nproc-per-node", "2"]
    assert "--preload" in argv and "MASTER_PORT" not in env
    assert "Lightning would start the workers itself" in capsys.readouterr().err


def test_lightnings_own_launcher_gives_a_clear_message_when_relaunching_is_off(monkeypatch):
    monkeypatch.setenv("CHAMELEON_FT_NO_RELAUNCH", "1")
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


def _evaluation_harness(monkeypatch, peer_activity):
    """A strategy whose evaluation loop fails once with a CollectiveFailure, and whose
    recovery reports ``peer_activity(tag)`` as what every member was doing (no processes:
    this checks the decision the strategy takes, the real-process test checks the rest)."""
    from types import SimpleNamespace

    from chameleon_ft.runtime.groups import CollectiveFailure
    from chameleon_ft.runtime.recovery import RecoveryCore

    s = FaultTolerantDDPStrategy()
    module = torch.nn.Linear(2, 2)
    connector = SimpleNamespace(_callback_metrics={})
    trainer = SimpleNamespace(sanity_checking=False, _logger_connector=connector,
                              state=SimpleNamespace(stage=SimpleNamespace(value="validate")))
    monkeypatch.setattr(FaultTolerantDDPStrategy, "lightning_module",
                        property(lambda self: SimpleNamespace(trainer=trainer, modules=module.modules)))
    monkeypatch.setattr(s, "_after_reconfiguration", lambda: None)
    monkeypatch.setattr(s, "_reset_evaluation", lambda *a: None)
    ctx = SimpleNamespace(activity=0, peer_activity=[], worker_id=1, view=SimpleNamespace(world_size=3), gm=None)
    ctx.recover = lambda failure: setattr(ctx, "peer_activity", peer_activity(ctx.activity))
    # The core's own off-step protocol, on this stand-in (its recover is the fake above).
    ctx.recover_off_step = lambda failure, activity=0: RecoveryCore.recover_off_step(ctx, failure, activity)
    s.ctx = ctx
    runs = []

    def run():
        runs.append((ctx.activity, s._coll.reraise, s._coll.catch_up,
                     float(connector._callback_metrics["ft/eval_complete"])))
        if len(runs) == 1:
            raise CollectiveFailure("peer died", kind="peer_error", token="t", generation=1)
        return ["metrics"]

    return s, SimpleNamespace(_cft_run=run), runs, ctx


def test_evaluation_reruns_when_every_member_recovered_from_it(monkeypatch):
    s, loop, runs, ctx = _evaluation_harness(monkeypatch, lambda tag: [tag, tag, tag])
    assert s._run_evaluation(loop) == ["metrics"]
    # Both attempts live (failures raise), the second one complete; the tag is cleared after.
    assert runs == [(1, True, False, 1.0), (1, True, False, 1.0)]
    assert (s.eval_reruns, s.eval_partial, ctx.activity, s._coll.reraise) == (1, 0, 0, False)


def test_evaluation_is_flagged_when_a_member_was_elsewhere(monkeypatch):
    s, loop, runs, ctx = _evaluation_harness(monkeypatch, lambda tag: [tag, 0, tag])
    with pytest.warns(UserWarning, match="partial"):
        assert s._run_evaluation(loop) == ["metrics"]
    # The second attempt runs with local collectives and ft/eval_complete = 0.
    assert runs == [(1, True, False, 1.0), (0, False, True, 0.0)]
    assert (s.eval_reruns, s.eval_partial, ctx.activity) == (0, 1, 0)


def test_fsdp1_and_an_unadopted_model_parallel_strategy_are_refused_with_the_way_that_works():
    """FSDPStrategy (FSDP1, refused on CPU by Lightning) and a ModelParallelStrategy the callback
    could not turn into the fault-tolerant one (a subclass with its own set-up): clear errors
    that name the way that works, instead of the generic "needs strategy='ddp'"."""
    import types

    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    from chameleon_ft.runtime.errors import ConfigError
    for st, match in ((FSDPStrategy(), "ModelParallelStrategy.*tensor_parallel_size=1.*fully_shard"),
                      (ModelParallelStrategy(), "FaultTolerantModelParallelStrategy")):
        trainer = types.SimpleNamespace(strategy=st, callbacks=[], limit_train_batches=1.0)
        with pytest.raises(ConfigError, match=match):
            FaultToleranceCallback().setup(trainer, None, "fit")


def test_one_device_under_a_launcher_of_several_workers_says_to_pass_devices(monkeypatch):
    """Lightning's own transformer example as a user runs it under ``chameleon-ft run
    --nproc-per-node 4`` (devices="auto", strategy="auto"): on a CPU Lightning counts one device
    and picks SingleDeviceStrategy (under torchrun it trains 4 separate copies).  The error names
    the fix, devices=<workers per node>, beside the generic "needs strategy='ddp'"."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("CHAMELEON_FT_WORKER_ID", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    cb = FaultToleranceCallback()
    t = Trainer(callbacks=[cb], logger=False)
    with pytest.raises(LauncherError, match="one device, but 4 workers were started: pass devices="):
        cb.setup(t, None, "fit")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(LauncherError) as err:
        cb.setup(t, None, "fit")
    assert "devices=" not in str(err.value).split("callbacks=[FaultToleranceCallback()])")[1]


def test_a_model_parallel_strategy_object_becomes_the_fault_tolerant_one_in_place():
    """The Trainer holds the user's ModelParallelStrategy object; the callback's hook turns that
    same object into FaultTolerantModelParallelStrategy with what Lightning set on it (its
    collectives bound to it, not to a copy), and refuses tensor parallelism clearly."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from chameleon_ft.runtime.errors import ConfigError
    from lightning_ft import FaultTolerantModelParallelStrategy

    st = ModelParallelStrategy(data_parallel_size=4, tensor_parallel_size=1)
    st.parallel_devices = [torch.device("cpu")] * 4
    same = FaultTolerantModelParallelStrategy.adopt(st)
    assert same is st and type(st) is FaultTolerantModelParallelStrategy
    assert st.parallel_devices == [torch.device("cpu")] * 4 and st._data_parallel_size == 4
    assert st._coll.gm_fn.__self__ is st  # the live collectives read this object's membership
    tp = FaultTolerantModelParallelStrategy.adopt(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2))
    with pytest.raises(ConfigError, match="tensor_parallel_size=1"):
        tp.setup_environment()


def test_a_grad_scaler_is_refused_clearly_and_the_gpu_is_the_local_ranks():
    """precision="16-mixed" on a GPU comes with a GradScaler (Lightning makes it bf16 on the
    CPU, so the plugin is stood in for); each worker's root device is its local rank's GPU."""
    from types import SimpleNamespace

    from chameleon_ft.runtime.errors import ConfigError
    from lightning_ft.strategy import check_precision

    with pytest.raises(ConfigError, match="16-mixed.*GradScaler.*bf16"):
        check_precision(SimpleNamespace(scaler=object(), precision="16-mixed"))
    check_precision(SimpleNamespace(scaler=None, precision="bf16-mixed"))
    s = FaultTolerantDDPStrategy()
    s.parallel_devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    for lr, want in ((0, 0), (1, 1), (3, 1)):
        s.cluster_environment = SimpleNamespace(local_rank=lambda lr=lr: lr)
        assert s.root_device == torch.device("cuda", want)
    s.parallel_devices = [torch.device("cpu")] * 4
    assert s.root_device == torch.device("cpu")


def test_the_callback_leaves_out_the_per_batch_hooks_it_does_not_use_and_a_subclass_keeps_its_own():
    """Lightning runs every callback's every hook inside its profiler's context and skips an
    attribute that is not callable: the empty per-batch hooks are None on the instance, the
    hook the callback uses and a subclass's override are still called."""
    from lightning.pytorch.trainer import call

    seen = []

    class Mine(FaultToleranceCallback):
        def on_before_backward(self, trainer, pl_module, loss):
            seen.append("before_backward")

    plain, mine = FaultToleranceCallback(), Mine()
    assert plain.on_before_backward is None and plain.on_train_batch_start is None
    assert callable(plain.on_train_batch_end) and callable(mine.on_before_backward)
    t = Trainer(accelerator="cpu", devices=1, callbacks=[plain, mine], logger=False)
    call._call_callback_hooks(t, "on_before_backward", torch.zeros(()))  # as the precision plugin calls it
    call._call_callback_hooks(t, "on_train_batch_start", None, 0)
    assert seen == ["before_backward"]
