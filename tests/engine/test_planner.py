"""Plan search, layer balancing, micro-batch allocation and plan validation.

Property tests draw small random clusters, workloads, survivor sets and search spaces and check
what issue 2 promises of every plan the search returns; the two pieces of arithmetic inside the
search are checked against brute force."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chameleon_ft.engine.cluster import Cluster, Device
from chameleon_ft.engine.perf import estimate
from chameleon_ft.engine.plan import Pipeline, Plan, PlanError, even_split, validate
from chameleon_ft.engine.planner import SearchSpace, allocate_microbatches, balance_layers, plan_search
from chameleon_ft.engine.workload import Layer, Workload

from .conftest import ENGINE, INTER, INTRA, chain, cluster


# -- strategies ------------------------------------------------------------------------
@st.composite
def workloads(draw, max_layers=6):
    n = draw(st.integers(1, max_layers))
    layers = tuple(
        Layer(
            params=draw(st.integers(1, 50)) * 100_000,
            fwd_s=(f := draw(st.floats(0.05, 2.0))),
            bwd_s=2 * f,
            act_bytes=draw(st.integers(0, 20)) * 100_000,
            out_bytes=draw(st.sampled_from([0, 10_000, 1_000_000])),
        )
        for _ in range(n)
    )
    mb = draw(st.integers(1, 12))
    micro = draw(st.sampled_from([1, 2]))
    return Workload(layers, global_batch=mb * micro, micro_batch=micro)


@st.composite
def scenarios(draw):
    w = draw(workloads())
    n = draw(st.integers(1, 8))
    per_node = draw(st.sampled_from([1, 2, 4, 8]))
    state = w.total_params * (w.weight_bytes + w.grad_bytes + w.optim_bytes)
    # from "one device cannot hold the model" to "anything fits"
    mem_factor = draw(st.sampled_from([0.3, 0.6, 1.2, 3.0, 1e6, 1e6]))
    speeds = draw(st.lists(st.sampled_from([0.5, 1.0, 1.0, 2.0]), min_size=n, max_size=n))
    mems = draw(st.lists(st.sampled_from([1.0, 1.0, 0.5]), min_size=n, max_size=n))
    c = Cluster(tuple(Device(i, i // per_node, speeds[i], state * mem_factor * mems[i]) for i in range(n)),
                intra=INTRA, inter=INTER)
    if draw(st.integers(0, 4)):  # mostly: a few devices failed
        survivors = set(range(n)) - draw(st.sets(st.sampled_from(range(n)), max_size=min(2, n)))
    else:
        survivors = draw(st.sets(st.sampled_from(range(n)), max_size=n))
    pp_min = draw(st.sampled_from([1, 1, 2, 3]))
    pp_max = draw(st.one_of(st.none(), st.integers(pp_min, 6)))
    dp_min = draw(st.sampled_from([1, 1, 2]))
    dp_max = draw(st.one_of(st.none(), st.integers(dp_min, 6)))
    shard = draw(st.sampled_from([1, 1, 2]))
    space = SearchSpace(pp_min, pp_max, dp_min, dp_max, shard_degree=shard)
    with_base = draw(st.sampled_from([True, True, False]))
    return w, c, survivors, space, with_base


def check_plan(plan: Plan, w: Workload, c: Cluster, survivors: set[int], total: int) -> None:
    devices = plan.devices
    assert len(devices) == len(set(devices)), f"a device is used twice: {devices}"
    assert set(devices) <= survivors, f"uses non-survivors {set(devices) - survivors}"
    assert sum(p.microbatches for p in plan.pipelines) == total, "global batch not conserved"
    assert all(p.microbatches >= 0 for p in plan.pipelines)
    validate(plan, w, survivors, total)
    est = estimate(plan, w, c)
    assert est.fits, f"devices {est.over_memory} are over memory"
    for d, mem in est.memory.items():
        assert mem <= c[d].memory_bytes


# -- plan search properties ------------------------------------------------------------
@settings(ENGINE, max_examples=300)
@given(scenarios())
def test_every_plan_is_valid_uses_survivors_once_conserves_batch_and_fits(scn):
    w, c, survivors, space, with_base = scn
    base = None
    if with_base:
        full = plan_search(w, c, space=space)
        base = full.candidates[0].plan if full.candidates else None
    live = c.without(set(c.ids) - survivors)
    result = plan_search(w, live, space=space, survivors=survivors, base=base)
    total = w.num_microbatches
    times = [cand.estimate.step_time for cand in result.candidates]
    assert times == sorted(times), "candidates are not fastest first"
    for cand in result.candidates:
        plan = cand.plan
        check_plan(plan, w, live, survivors, total)
        assert cand.estimate.fits
        assert cand.estimate.step_time == pytest.approx(estimate(plan, w, live).step_time)
        assert plan.shard_degree == space.shard_degree
        assert all(space.pp_min <= p.depth <= (space.pp_max or w.num_layers) for p in plan.pipelines)
        if cand.kind == "global":
            assert len(plan.pipelines) <= (space.dp_max or len(plan.pipelines))
    if not result.candidates:
        with pytest.raises(PlanError, match="no feasible plan"):
            result.best


@settings(ENGINE, max_examples=60)
@given(workloads(), st.integers(1, 8), st.integers(0, 40))
def test_batch_is_conserved_for_a_changed_microbatch_count(w, n, want):
    c = cluster(n)
    result = plan_search(w, c, num_microbatches=want)
    for cand in result.candidates:
        check_plan(cand.plan, w, c, set(c.ids), want)


def test_search_prefers_the_fast_layout_and_gives_slow_devices_less():
    w = chain([1.0] * 4, microbatches=12)
    c = cluster(4, speeds=[1.0, 1.0, 1.0, 0.25], memory=1e15)
    best = plan_search(w, c, space=SearchSpace(pp_max=1)).best.plan
    share = {p.devices[0]: p.microbatches for p in best.pipelines}
    assert sum(share.values()) == 12
    assert share.get(3, 0) < share[0], share


def test_no_feasible_plan_names_why():
    w = chain([1.0] * 2, params=[10_000_000] * 2, microbatches=4)
    tiny = cluster(2, memory=1e6)
    with pytest.raises(PlanError, match="no feasible plan.*(memory|split)"):
        plan_search(w, tiny).best
    with pytest.raises(PlanError, match="no feasible plan.*no layout"):
        plan_search(w, cluster(2), survivors=[]).best
    with pytest.raises(PlanError, match="no feasible plan"):
        plan_search(w, cluster(3), space=SearchSpace(pp_min=3)).best  # 2 layers cannot make 3 stages


def test_local_replan_respects_dp_max():
    w = chain([1.0, 1.0], microbatches=8)
    c = cluster(4)
    base = Plan.data_parallel(range(4), w)
    result = plan_search(w, c.without({0}), space=SearchSpace(dp_max=2), survivors={1, 2, 3}, base=base)
    for cand in result.candidates:
        assert len(cand.plan.pipelines) <= 2, (cand.kind, cand.plan.describe())


def test_search_with_base_returns_global_plans_after_a_pipeline_breaks():
    w = chain([1.0] * 4, microbatches=4)
    c = cluster(4)
    base = Plan((Pipeline((0, 1, 2, 3), (0, 1, 2, 3, 4), 4),))  # pure pipeline parallelism
    result = plan_search(w, c.without({0}), survivors={1, 2, 3}, base=base)
    assert result.candidates
    check_plan(result.best.plan, w, c, {1, 2, 3}, 4)


def test_search_with_an_intact_base_keeps_it_as_a_candidate():
    w = chain([1.0] * 4, microbatches=8)
    c = cluster(4)
    base = Plan((Pipeline((0, 1), (0, 2, 4), 4), Pipeline((2, 3), (0, 2, 4), 4)))
    result = plan_search(w, c, base=base)
    plans = {tuple((p.devices, p.bounds) for p in cand.plan.pipelines) for cand in result.candidates}
    assert tuple((p.devices, p.bounds) for p in base.pipelines) in plans
    for cand in result.candidates:
        check_plan(cand.plan, w, c, set(c.ids), 8)


# -- layer balancing -------------------------------------------------------------------
def brute_force_split(w: Workload, speeds, memory=None):
    """Best bottleneck over every split of the chain into len(speeds) non-empty stages."""
    p, n = len(speeds), w.num_layers
    per_param = w.weight_bytes + w.grad_bytes + w.optim_bytes
    best = None
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0, *cuts, n)
        ok = True
        t = 0.0
        for s in range(p):
            lo, hi = bounds[s], bounds[s + 1]
            t = max(t, w.compute_s(lo, hi) / speeds[s])
            if memory is not None and w.params_in(lo, hi) * per_param + (p - s) * w.act_bytes_in(lo, hi) > memory[s]:
                ok = False
        if ok and (best is None or t < best):
            best = t
    return best


def bottleneck(w, speeds, bounds):
    return max(w.compute_s(bounds[s], bounds[s + 1]) / speeds[s] for s in range(len(speeds)))


@settings(ENGINE, max_examples=200)
@given(workloads(max_layers=8), st.integers(1, 5), st.sampled_from([0.5, 1.0, 3.0]))
def test_balance_layers_is_optimal_with_equal_speeds(w, p, speed):
    speeds = [speed] * p
    got = balance_layers(w, speeds)
    want = brute_force_split(w, speeds)
    if want is None:
        assert got is None
        return
    assert got is not None and len(got) == p + 1 and got[0] == 0 and got[-1] == w.num_layers
    assert all(a < b for a, b in zip(got, got[1:]))
    assert bottleneck(w, speeds, got) == pytest.approx(want, rel=1e-6)


@settings(ENGINE, max_examples=200)
@given(st.integers(1, 8), st.integers(1, 5), st.lists(st.sampled_from([0.25, 0.5, 1.0, 2.0]), min_size=5, max_size=5))
def test_balance_layers_is_optimal_for_uniform_layers_and_any_speeds(n, p, speeds):
    w = chain([1.5] * n)
    speeds = speeds[:p]
    got = balance_layers(w, speeds)
    want = brute_force_split(w, speeds)
    if want is None:
        assert got is None
    else:
        assert bottleneck(w, speeds, got) == pytest.approx(want, rel=1e-6)


@settings(ENGINE, max_examples=150)
@given(workloads(max_layers=6), st.integers(1, 4), st.sampled_from([0.2, 0.4, 0.7, 1.5]))
def test_balance_layers_respects_memory_and_finds_a_split_when_one_fits(w, p, frac):
    state = w.total_params * (w.weight_bytes + w.grad_bytes + w.optim_bytes)
    memory = [state * frac + p * sum(l.act_bytes for l in w.layers) * frac] * p
    speeds = [1.0] * p
    got = balance_layers(w, speeds, memory=memory)
    want = brute_force_split(w, speeds, memory)
    if got is not None:
        per_param = w.weight_bytes + w.grad_bytes + w.optim_bytes
        for s in range(p):
            lo, hi = got[s], got[s + 1]
            assert w.params_in(lo, hi) * per_param + (p - s) * w.act_bytes_in(lo, hi) <= memory[s]
        assert want is not None
        assert bottleneck(w, speeds, got) == pytest.approx(want, rel=1e-6)
    else:
        assert want is None, "a split fits memory but balance_layers found none"


def test_balance_layers_is_optimal_with_mixed_speeds_and_layers():
    w = chain([1.0, 1.0, 5.0, 1.0])
    speeds = [10.0, 1.0, 10.0]
    # best split: (0,1,2,4) -> max(0.1, 1, 0.6) = 1; the greedy answer (0,2,3,4) costs 5
    got = balance_layers(w, speeds)
    assert bottleneck(w, speeds, got) == pytest.approx(brute_force_split(w, speeds))


# -- micro-batch allocation ------------------------------------------------------------
def finish(alloc, units, depths):
    return max(((m + d - 1) * u for m, u, d in zip(alloc, units, depths) if m > 0), default=0.0)


def compositions(total, parts):
    if parts == 1:
        yield (total,)
        return
    for first in range(total + 1):
        for rest in compositions(total - first, parts - 1):
            yield (first, *rest)


@settings(ENGINE, max_examples=300)
@given(
    st.lists(st.tuples(st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0, 0.7]), st.integers(1, 4)), min_size=1, max_size=4),
    st.integers(0, 9),
)
def test_allocate_microbatches_is_optimal(pipes, total):
    units = [u for u, _ in pipes]
    depths = [d for _, d in pipes]
    got = allocate_microbatches(units, depths, total)
    assert len(got) == len(pipes) and sum(got) == total and all(m >= 0 for m in got)
    best = min(finish(a, units, depths) for a in compositions(total, len(pipes)))
    assert finish(got, units, depths) == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_allocate_microbatches_proportional_to_throughput():
    assert allocate_microbatches([1.0, 2.0], [1, 1], 9) == [6, 3]
    assert allocate_microbatches([1.0, 1.0], [1, 1], 0) == [0, 0]
    with pytest.raises(PlanError):
        allocate_microbatches([], [], 3)
    with pytest.raises(PlanError):
        allocate_microbatches([0.0, 1.0], [1, 1], 3)


def test_even_split():
    assert even_split(7, 3) == [3, 2, 2]
    assert sum(even_split(100, 7)) == 100
    with pytest.raises(PlanError):
        even_split(3, 0)


# -- validation ------------------------------------------------------------------------
W = chain([1.0] * 4, microbatches=4)
GOOD = Plan((Pipeline((0, 1), (0, 2, 4), 2), Pipeline((2, 3), (0, 2, 4), 2)))


def test_validate_accepts_a_good_plan():
    validate(GOOD, W, range(4))


@pytest.mark.parametrize(
    "plan,available,match",
    [
        (Plan(()), None, "no pipelines"),
        (Plan((Pipeline((0, 1), (0, 2, 4), 2), Pipeline((1, 3), (0, 2, 4), 2))), None, "device 1 is used more than once"),
        (Plan((Pipeline((0, 1), (0, 4), 4),)), None, "need 3 layer bounds"),
        (Plan((Pipeline((0, 1), (0, 2, 3), 4),)), None, "cover 0..4"),
        (Plan((Pipeline((0, 1), (1, 2, 4), 4),)), None, "cover 0..4"),
        (Plan((Pipeline((0, 1, 2), (0, 2, 2, 4), 4),)), None, "at least one layer"),
        (Plan((Pipeline((0, 1), (0, 2, 4), 2), Pipeline((2, 3), (0, 2, 4), 1))), None, "runs 3 micro-batches.*needs 4"),
        (Plan((Pipeline((0, 1), (0, 2, 4), 6), Pipeline((2, 3), (0, 2, 4), -2))), None, "negative"),
        (GOOD, [0, 1, 2], r"not available: \[3\]"),
        (Plan((Pipeline((0, 1), (0, 2, 4), 2), Pipeline((2, 3), (0, 1, 4), 2)), shard_degree=2), None,
         "same layer split"),
        (Plan((Pipeline((0, 1), (0, 2, 4), 2), Pipeline((2, 3), (0, 2, 4), 2)), shard_degree=3), None,
         "shard degree 3 must divide"),
        (Plan((Pipeline((0, 1), (0, 2, 4), 2), Pipeline((2, 3), (0, 2, 4), 2)), shard_degree=0), None,
         "shard degree 0"),
    ],
)
def test_validate_rejects_with_a_clear_message(plan, available, match):
    with pytest.raises(PlanError, match=match):
        validate(plan, W, available)


def test_validate_with_explicit_microbatch_count():
    validate(GOOD.with_microbatches([1, 1]), W, num_microbatches=2)
    with pytest.raises(PlanError):
        validate(GOOD.with_microbatches([1, 1]), W)


def test_plan_json_round_trip():
    plan = Plan((Pipeline((0, 1), (0, 2, 4), 2), Pipeline((2, 3), (0, 2, 4), 2)), shard_degree=2)
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.slot(3).layers == (2, 4) and plan.slot(3).shard == 1
    assert plan.locate(9) is None
