"""Run state without processes: the tensor+JSON encoding, checkpoints (and their errors), the
context's state_dict, and the engine bridge's allocations."""

from __future__ import annotations

import json

import pytest
import torch

from chameleon_ft.runtime.env import EnvError, WorkerEnv
from chameleon_ft.runtime.engine_bridge import EngineBridge
from chameleon_ft.runtime.codec import (CheckpointError, decode, encode, load_checkpoint,
                                        save_checkpoint)
from chameleon_ft.runtime.executors.dp import DataParallelExecutor
from chameleon_ft.runtime.recovery import layer_params

ENV = WorkerEnv(store="127.0.0.1:1", lighthouse="http://127.0.0.1:2", worker_id=0, rank=0,
                local_rank=0, world_size=1, local_world_size=1, node_rank=0)


def _trained(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    for _ in range(3):
        model(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def test_encode_round_trips_optimizer_state_exactly():
    model, opt, sched = _trained()
    tree = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
            "misc": (1, 2.5, None, "x", [True]), "bf16": torch.ones(3, dtype=torch.bfloat16)}
    skeleton, tensors = encode(tree)
    json.dumps(skeleton)  # plain JSON, no pickle
    assert _equal(decode(json.loads(json.dumps(skeleton)), tensors), tree)


def test_encode_rejects_arbitrary_objects():
    with pytest.raises(TypeError, match="object at"):
        encode({"a": [object()]})


def test_checkpoint_round_trip_and_clear_errors(tmp_path):
    model, opt, _ = _trained()
    path = tmp_path / "ck.pt"
    save_checkpoint(path, {"model": model.state_dict(), "opt": opt.state_dict()})
    back = load_checkpoint(path)
    assert _equal(back["opt"], opt.state_dict())
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(path)
    torch.save({"something": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="not a chameleon-ft"):
        load_checkpoint(tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt")


def test_context_state_dict_moves_the_whole_run(tmp_path):
    model, opt, sched = _trained(0)
    ctx = DataParallelExecutor(model, opt, 64, 16, 4, scheduler=sched, env=ENV)
    ctx.step, ctx.sampler.cursor = 3, 3
    ctx.policy.start([0, 1])
    save_checkpoint(tmp_path / "run.pt", ctx.state_dict())
    model2, opt2, sched2 = _trained(1)
    other = DataParallelExecutor(model2, opt2, 64, 16, 4, scheduler=sched2, env=ENV)
    other.load_checkpoint(str(tmp_path / "run.pt"))
    assert other.step == 3 and other.sampler.cursor == 3
    assert _equal(model2.state_dict(), model.state_dict())
    assert _equal(opt2.state_dict(), opt.state_dict())
    assert sched2.state_dict() == sched.state_dict()
    assert other.policy.plan is None  # the plan starts over on whoever is there


def test_layer_params_one_per_parameterised_child():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    assert layer_params(model) == [40, 18]


def test_env_contract_errors_clearly():
    with pytest.raises(EnvError, match="chameleon-ft run"):
        WorkerEnv.from_env({})
    with pytest.raises(EnvError, match="not a valid"):
        WorkerEnv.from_env({"CHAMELEON_FT_STORE": "a:1", "CHAMELEON_FT_LIGHTHOUSE": "b",
                            "CHAMELEON_FT_WORKER_ID": "x"})


def test_policy_reroutes_keeps_the_global_batch_and_round_trips():
    p = EngineBridge([100, 50], global_batch=32, micro_batch=4, per_node=2)
    assert p.start([0, 1, 2, 3]) == {0: 2, 1: 2, 2: 2, 3: 2}
    for s in range(4):
        p.observe_step({w: (0.02, 2, 0.001, 0.03) for w in range(4)}, s)
    [d] = p.on_membership([0, 1, 3], hang=False, step=4)
    assert d.chosen == "reroute" and sum(p.allocation.values()) == 8
    assert set(p.allocation) == {0, 1, 3}
    [d] = p.on_membership([0, 1], hang=False, step=5)
    assert d.event.kind.value == "fail_stop" and p.allocation == {0: 4, 1: 4}
    q = EngineBridge([100, 50], 32, 4, per_node=2)
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))
    assert q.allocation == p.allocation and q.alive == p.alive


def test_policy_names_a_lost_node():
    p = EngineBridge([10], global_batch=16, micro_batch=4, per_node=2)
    p.start([0, 1, 2, 3])
    [d] = p.on_membership([0, 1], hang=False, step=1)
    assert d.event.kind.value == "node_loss"
    [d] = p.on_membership([1], hang=True, step=2)
    assert d.event.kind.value == "hang"
