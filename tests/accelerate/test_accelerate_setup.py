"""accelerate_ft in-process (no workers): launcher detection, options, evaluation shards."""

import os

import pytest
import torch

from accelerate_ft import NOT_LAUNCHED, FaultTolerantAccelerator, LauncherError, wrap
from chameleon_ft.runtime.adapter_kit import eval_batches, shard_indices


@pytest.fixture(autouse=True)
def no_launcher_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("CHAMELEON_FT_") or k in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
            monkeypatch.delenv(k)


def test_other_launchers_get_a_plain_accelerator_and_the_checkpoint_restart_message(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    acc = FaultTolerantAccelerator(cpu=True)
    assert acc.ft_context is None and acc.ft_metrics == {}
    model, opt = acc.prepare(torch.nn.Linear(2, 1), torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1))
    assert wrap(acc) is acc
    with pytest.raises(LauncherError, match="chameleon-ft run.*max_restarts"):
        FaultTolerantAccelerator(cpu=True, require_launcher=True)
    assert "accelerate launch --max_restarts" in NOT_LAUNCHED


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="shrink"):
        FaultTolerantAccelerator(allowed_policies=["reroute", "shrink"])
    with pytest.raises(ValueError):
        FaultTolerantAccelerator(hang_timeout_s=0)


@pytest.mark.parametrize("n,b,world", [(100, 8, 3), (5, 4, 4), (3, 2, 4), (64, 8, 4), (0, 4, 2), (17, 1, 5)])
def test_eval_batches_every_sample_once_in_order_same_count(n, b, world):
    per_rank = [eval_batches(n, b, r, world) for r in range(world)]
    assert len({len(p) for p in per_rank}) == 1  # one collective per batch on every member
    gathered = [i for k in range(len(per_rank[0])) for r in range(world)
                for i in per_rank[r][k][0][:per_rank[r][k][1]]]
    assert gathered == list(range(n))
    assert all(len(idx) <= b for p in per_rank for idx, _ in p)
    assert sorted(i for r in range(world) for i in shard_indices(n, r, world)) == list(range(n))


def test_each_worker_is_put_on_its_gpu_and_other_devices_are_refused_clearly(monkeypatch):
    """CUDA: worker ``local_rank`` goes to ``cuda:<local_rank mod GPUs>`` before Accelerate
    picks its device (the current one); XPU / MPS are refused, never replaced by the CPU."""
    from types import SimpleNamespace

    import accelerate_ft.accelerator as acc_mod
    import accelerate_ft.setups as setups
    picked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", picked.append)
    for lr in range(4):
        setups.place_on_device(False, SimpleNamespace(local_rank=lr))
    assert picked == [0, 1, 0, 1]
    setups.place_on_device(True, SimpleNamespace(local_rank=1))  # cpu=True: no device chosen
    assert picked == [0, 1, 0, 1]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(acc_mod, "launch_env", lambda: SimpleNamespace(local_rank=0))  # under chameleon-ft run
    with pytest.raises(LauncherError, match="CUDA GPUs or the CPU.*MPS.*cpu=True"):
        FaultTolerantAccelerator()
    with pytest.raises(LauncherError, match="MPS"):
        FaultTolerantAccelerator(None, False, None, 1, False)  # cpu given positionally


def test_fp16_mixed_precision_is_refused_clearly(monkeypatch):
    from types import SimpleNamespace

    import accelerate_ft.accelerator as acc_mod
    from chameleon_ft.runtime.errors import ConfigError
    monkeypatch.setattr(acc_mod, "launch_env", lambda: SimpleNamespace(local_rank=0))
    with pytest.raises(ConfigError, match="fp16.*GradScaler.*bf16"):
        FaultTolerantAccelerator(cpu=True, mixed_precision="fp16")
    with pytest.raises(ConfigError, match="fp16"):
        FaultTolerantAccelerator(True, False, "fp16", 1, True)


def test_an_fsdp_plugin_is_read_into_the_sharded_setup_or_refused_by_name(monkeypatch):
    """FSDP2 (the plugin, or ``accelerate launch --use_fsdp``'s variables) becomes the sharded
    executor's setup and Accelerate is not given it; what the runtime does not carry is
    refused by name (Accelerate would drop an FSDP plugin on the CPU without a word)."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    from accelerate_ft.setups import FsdpSetup, fsdp_setup, unit_names
    from chameleon_ft.runtime.errors import ConfigError
    kw = {"fsdp_plugin": FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap="Linear",
        reshard_after_forward=False)}
    setup = fsdp_setup(kw)
    assert "fsdp_plugin" not in kw and setup == FsdpSetup(False, "transformer", ("Linear",), 0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Linear(8, 2)))
    assert unit_names(net, setup) == ["0", "2.0"]
    assert unit_names(net, FsdpSetup(policy="size", min_num_params=20)) == ["0"]  # 40 parameters; "2" has 18
    assert unit_names(net, FsdpSetup()) == []  # no policy: the root only
    with pytest.raises(ConfigError, match="no module of the model is a GPT2Block"):
        unit_names(net, FsdpSetup(policy="transformer", class_names=("GPT2Block",)))
    with pytest.raises(ConfigError, match="FSDP2 only.*fsdp_version=2"):
        fsdp_setup({"fsdp_plugin": FullyShardedDataParallelPlugin(fsdp_version=1)})
    with pytest.raises(ConfigError, match="cpu_offload"):
        fsdp_setup({"fsdp_plugin": FullyShardedDataParallelPlugin(fsdp_version=2, cpu_offload=CPUOffloadPolicy())})
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert fsdp_setup({}) == FsdpSetup()
    assert fsdp_setup({}) is not None and "ACCELERATE_USE_FSDP" in __import__("os").environ
    # wrap(Accelerator()) under accelerate launch --use_fsdp: the plugin is already gone; say so
    import accelerate_ft.accelerator as acc_mod
    from accelerate_ft import wrap
    monkeypatch.setattr(acc_mod, "launch_env", lambda: object())
    with pytest.raises(ConfigError, match="wrap.. cannot carry FSDP.*FaultTolerantAccelerator"):
        wrap(object())


@pytest.mark.parametrize("stage,fsdp2", [("3", "reshard_after_forward=True .FULL_SHARD"),
                                          ("2", "reshard_after_forward=False .SHARD_GRAD_OP"),
                                          ("0", "plain data parallelism")])
def test_a_deepspeed_setup_is_refused_naming_its_fsdp2_equivalent(monkeypatch, stage, fsdp2):
    """``accelerate launch`` with a DeepSpeed config sets these variables (the plugin itself needs
    deepspeed installed); the refusal names the user's ZeRO stage in FSDP2 terms."""
    from chameleon_ft.runtime.errors import ConfigError
    import accelerate_ft.accelerator as acc_mod
    monkeypatch.setattr(acc_mod, "launch_env", lambda: object())
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", stage)
    with pytest.raises(ConfigError, match=f"DeepSpeed.*ZeRO stage {stage} is, in FSDP2 terms, [^;]*{fsdp2}"):
        FaultTolerantAccelerator(cpu=True)


def _eval_runtime(catch_up: bool):
    """An ``StepProtocol`` as member 1 of 3 (no job joined): the real evaluation loader and
    the real ``LiveCollectives`` over a stand-in group whose collectives record what they gather."""
    import types

    from accelerate_ft.data import ElasticEvalLoader
    from accelerate_ft.step_protocol import StepProtocol
    from chameleon_ft.runtime.adapter_kit import LiveCollectives

    view = types.SimpleNamespace(rank=1, world_size=3)
    rt = object.__new__(StepProtocol)
    rt.ctx, rt.joined = None, types.SimpleNamespace(view=view, gm=types.SimpleNamespace(realigning=None))
    rt.acc = types.SimpleNamespace(device=torch.device("cpu"))
    rt.coll = LiveCollectives(rt.gm, rt.view, lambda: 5.0, who="accelerate_ft")
    rt.coll.catch_up = catch_up
    rt.eval_runs, rt.in_eval, rt.eval_valid, rt.eval_restart, rt.eval_alone = 0, False, None, None, False
    rt.eval_alone_next = False
    ds = torch.utils.data.TensorDataset(torch.arange(50))
    return rt, ElasticEvalLoader(rt, torch.utils.data.DataLoader(ds, batch_size=4), device_placement=False)


@pytest.mark.parametrize("catch_up", [False, True])
def test_a_member_whose_collectives_are_local_evaluates_every_sample_itself(catch_up):
    """CI found it: a member that adopted the step its peers committed (their last before the
    evaluation, a worker killed then) enters the evaluation with local collectives; its gathers
    must then cover every sample itself, not its shard of three (the peers, recovered inside the
    evaluation, finish it alone too)."""
    rt, loader = _eval_runtime(catch_up)
    seen = [int(i) for (batch,) in loader for i in batch]
    if catch_up:
        assert seen == list(range(50)) and len(loader) == 13 and rt.eval_complete
    else:
        assert seen == [i for b in eval_batches(50, 4, 1, 3) for i in b[0]]  # a ghost batch included
    assert not rt.in_eval and rt.coll.local_reason is None


def test_under_accelerate_launch_the_warning_names_the_command_that_recovers(monkeypatch):
    from accelerate_ft.accelerator import not_launched_message

    monkeypatch.setattr("sys.argv", ["/home/u/train.py", "--epochs", "2"])
    env = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "29500"}
    assert ("chameleon-ft run --num_processes 8 --num_machines 2 --machine_rank 1 --main_process_ip 10.0.0.1 "
            "--main_process_port 29500 train.py --epochs 2") in not_launched_message(env)
    assert not_launched_message({}) == NOT_LAUNCHED
