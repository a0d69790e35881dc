"""``ShardedExecutor``'s repair of rehabilitated elements, in-process (the optimizer's real step;
the live recovery paths are in ``test_sharded_recovery.py``)."""

import pytest
import torch

from chameleon_ft.runtime.executors.sharded.executor import ShardedExecutor


def _ctx(p: torch.nn.Parameter, opt, warm: dict) -> ShardedExecutor:
    ctx = object.__new__(ShardedExecutor)
    ctx.optimizer, ctx.shard_params, ctx.step, ctx.dtype = opt, [p], warm["from"], torch.float32
    ctx._locals = lambda: [p.data]
    ctx._warm = warm
    return ctx


@pytest.mark.parametrize("restart", [True, False])
def test_only_the_restored_elements_update_is_warmed_up_and_bias_corrected(restart):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(6))
    ref = torch.nn.Parameter(p.detach().clone())
    opts = [torch.optim.Adam([q], lr=0.1, betas=(0.9, 0.999)) for q in (p, ref)]
    mask = torch.tensor([True, True, False, False, True, False])
    for step in range(3):  # some history: Adam's step counter is 3 before the repair
        g = torch.randn(6)
        for q, o in zip((p, ref), opts):
            q.grad = g.clone()
            o.step()
    ctx = _ctx(p, opts[0], {"from": 3, "mask": mask, "beta": 0.9, "restart": restart, "w": 4})
    for k in (1, 2):
        g = torch.randn(6)
        before, ref_before = p.detach().clone(), ref.detach().clone()
        p.grad, ref.grad = g.clone(), g.clone()
        saved = ctx._restored_values()
        opts[0].step()
        ctx._repair_update(saved)
        opts[1].step()
        ctx.step += 1
        t = 3 + k
        s = (k / 4) * ((1 - 0.9 ** t) / (1 - 0.9 ** k) if restart else 1.0)
        delta, ref_delta = p.detach() - before, ref.detach() - ref_before
        assert torch.allclose(delta[mask], s * ref_delta[mask], atol=1e-7)
        assert torch.equal(delta[~mask], ref_delta[~mask])  # the current elements: untouched
    assert ctx._warm is not None  # 2 of 4 warm-up steps done


def test_the_repair_ends_after_the_warm_up_once_the_correction_is_spent():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1)
    ctx = _ctx(p, opt, {"from": 0, "mask": torch.tensor([True, False]), "beta": 0.0, "restart": False, "w": 3})
    for _ in range(3):
        p.grad = torch.ones(2)
        saved = ctx._restored_values()
        opt.step()
        ctx._repair_update(saved)
        ctx.step += 1
    assert ctx._warm is None
    # SGD without momentum: the restored element moved 1/3 + 2/3 + 1 of the others' 3 steps
    assert p.detach().tolist() == pytest.approx([-0.2, -0.3])


@pytest.mark.parametrize("old,new", [((4, 1), (3, 1)), ((4, 2), (3, 1)), ((3, 1), (4, 1)), ((1, 1), (4, 2)),
                                     ((4, 1), (1, 1)), ((2, 2), (2, 1))])
def test_a_new_row_is_made_of_exactly_the_old_rows_overlaps(old, new):
    """The re-shard streams each new row from the old rows' overlaps with it (no full copy):
    for parameters of every kind of shape (fewer dim-0 slices than rows, 1-D, uneven), every
    new row comes out as the slice of the flat state it stands for."""
    from chameleon_ft.runtime.executors.sharded.layout import _Layout, _overlaps
    shapes = [torch.Size([7, 3]), torch.Size([5]), torch.Size([1, 4]), torch.Size([9, 2]), torch.Size([])]
    a, b = _Layout(shapes, *old), _Layout(shapes, *new)
    flat = torch.arange(a.total, dtype=torch.float) + 1
    rows = {k: torch.cat([flat[s:e] for s, e in a.segments(k)]) for k in range(a.shards)}
    for r in range(b.shards):
        got = torch.zeros(b.numel(r))
        for k, vec in rows.items():
            for so, do, n in _overlaps(a.segments(k), b.segments(r)):
                got[do:do + n] = vec[so:so + n]
        assert torch.equal(got, torch.cat([flat[s:e] for s, e in b.segments(r)]))
    assert sum(b.numel(r) for r in range(b.shards)) == b.total


def test_the_recovery_payload_scalars_never_hold_sharded_optimizer_states():
    """Before any snapshot after the optimizer's first step (a long Young/Daly interval, a kill
    at step 20) the sharded states were still unknown and went into the recovery's broadcast as
    "scalars": DTensors the state broadcast cannot pack (found by Lightning's FSDP2 docs example
    with a kill).  The keys are found when needed."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from chameleon_ft.runtime.executors.sharded.comms import no_comm_world as _fake_world
    _fake_world(0, 1)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        m = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 2, bias=False))
        fully_shard(m, mesh=init_device_mesh("cpu", (1,)))
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        ctx = object.__new__(ShardedExecutor)
        ctx.optimizer, ctx.shard_params, ctx._keys = opt, list(m.parameters()), []
        assert ctx._scalars() == {0: {}, 1: {}}  # no state before the first step
        ctx._keys = []
        m(torch.randn(3, 4)).sum().backward()
        opt.step()
        scalars = ctx._scalars()
        assert ctx._keys == ["exp_avg", "exp_avg_sq"]
        assert [sorted(s) for s in scalars.values()] == [["step"], ["step"]]
        assert all(type(v) is torch.Tensor for s in scalars.values() for v in s.values())
    finally:
        dist.destroy_process_group()


def test_the_engine_is_told_how_much_progress_the_extrapolated_restore_brings_back():
    """``_recovered``: the damped trend of a lost row's last two snapshots brings back
    ``damping x min(1, their gap / steps since the latest)`` of the progress since it; a row
    with one snapshot, or a plain restore, brings back none (the least over the lost rows)."""
    from chameleon_ft.engine.rehab import RehabRecipe

    ctx = object.__new__(ShardedExecutor)
    ctx.step, ctx.recipe = 13, RehabRecipe(extrapolate_snapshots=2, damping=0.5)
    assert ctx._recovered([2], {2: {5, 10}}) == pytest.approx(0.5)  # gap 5 >= 3 steps since
    ctx.step = 20
    assert ctx._recovered([2], {2: {5, 10}}) == pytest.approx(0.5 * 5 / 10)  # 10 since, gap 5
    assert ctx._recovered([1, 2], {1: {10}, 2: {5, 10}}) == 0.0  # row 1: one snapshot only
    ctx.recipe = RehabRecipe(extrapolate_snapshots=0)
    assert ctx._recovered([2], {2: {5, 10}}) == 0.0


def test_inside_a_users_loop_a_failed_fsdp_collective_gives_way_for_the_rest_of_the_step():
    """``FsdpComms.give_way``: the first failed collective and every later one of the step run
    locally (all-gather: zeros; reduce-scatter: this member's slice) and raise nothing, the
    failure kept for ``optimizer.step()``; without it the failure raises as before."""
    from chameleon_ft.runtime.errors import CollectiveFailure
    from chameleon_ft.runtime.executors.sharded.comms import FsdpComms

    calls = []

    class Gm:
        def collective(self, fn, timeout):
            calls.append(fn)
            raise CollectiveFailure("peer gone", kind="peer_error", token="g1", generation=1, suspects=(2,))

    comms = FsdpComms(Gm(), world=2, shards=2, rank=1, timeout_s=1.0)
    out = torch.ones(4)
    with pytest.raises(CollectiveFailure):
        comms.all_gather(out, torch.ones(2))
    comms.failure, comms.give_way = None, True
    comms.all_gather(out, torch.ones(2))
    assert torch.equal(out, torch.zeros(4)) and comms.failure is not None and len(calls) == 2
    grad = torch.arange(4.0)
    shard = torch.empty(2)
    comms.reduce_scatter(shard, grad)  # not even tried: the step already failed
    assert len(calls) == 2 and torch.equal(shard, torch.tensor([2.0, 3.0]))
