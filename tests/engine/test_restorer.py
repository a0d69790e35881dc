"""Restorer: optimal assignment (brute force), rounds without conflicts, honest sources, lost
state, transition time."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chameleon_ft.engine.cluster import Cluster, Device
from chameleon_ft.engine.plan import Pipeline, Plan
from chameleon_ft.engine.migration import Transfer, critical_path, migrate, schedule_rounds
from chameleon_ft.engine.workload import Layer, Workload

from .conftest import ENGINE, INTER, INTRA, held_layers, usable


# -- an independent cost oracle --------------------------------------------------------
def bytes_missing(old: Plan | None, new: Plan, w: Workload, alive: set[int], empty=frozenset()) -> float:
    """Bytes of weights + optimizer state each device of ``new`` lacks, summed."""
    k = new.shard_degree
    total = 0.0
    for j, pipe in enumerate(new.pipelines):
        for s, d in enumerate(pipe.devices):
            need = set(range(pipe.bounds[s], pipe.bounds[s + 1]))
            held = held_layers(old, d) if (d in alive and d not in empty) else None
            have = usable(held, j % k, k)
            total += sum(w.layers[i].params for i in need - have) * w.state_bytes_per_param / k
    return total


def lost_bytes(mig, w: Workload) -> float:
    return sum(w.params_in(a, b) * w.state_bytes_per_param / k for a, b, _, k in mig.lost)


def permuted(plan: Plan, mapping: dict[int, int]) -> Plan:
    return Plan(tuple(Pipeline(tuple(mapping.get(d, d) for d in p.devices), p.bounds, p.microbatches)
                      for p in plan.pipelines), plan.shard_degree)


def brute_force_min(old, new, w, c: Cluster, alive, empty=frozenset()) -> float:
    """Min bytes over every placement of the new plan's devices that only swaps devices of the
    same class (speed, memory, node)."""
    devs = list(new.devices)
    classes: dict = {}
    for d in devs:
        classes.setdefault((c[d].speed, c[d].memory_bytes, c[d].node), []).append(d)
    groups = list(classes.values())
    best = None
    for perms in itertools.product(*(itertools.permutations(g) for g in groups)):
        mapping = {a: b for g, p in zip(groups, perms) for a, b in zip(g, p)}
        cost = bytes_missing(old, permuted(new, mapping), w, alive, empty)
        best = cost if best is None else min(best, cost)
    return best


# -- strategies ------------------------------------------------------------------------
@st.composite
def random_plan(draw, devices: list[int], n_layers: int, allow_shard=True):
    """A random plan over a random subset of ``devices`` (in random order)."""
    devices = draw(st.permutations(devices))
    k = draw(st.sampled_from([1, 2])) if allow_shard else 1
    pipes = []
    at = 0
    while at < len(devices):
        depth = draw(st.integers(1, min(n_layers, len(devices) - at)))
        cuts = sorted(draw(st.sets(st.integers(1, n_layers - 1), min_size=depth - 1, max_size=depth - 1))) \
            if depth > 1 else []
        bounds = (0, *cuts, n_layers)
        reps = k if at + k * depth <= len(devices) else 1
        if reps == 1 and k == 2:
            break
        for _ in range(reps):
            pipes.append(Pipeline(tuple(devices[at:at + depth]), bounds, 1))
            at += depth
        if draw(st.booleans()) and pipes and (len(pipes) % k == 0):
            break
    if not pipes or len(pipes) % k:
        pipes = [Pipeline((devices[0],), (0, n_layers), 1)]
        k = 1
    return Plan(tuple(pipes), k)


@st.composite
def migrations(draw, max_devices=6):
    n = draw(st.integers(1, max_devices))
    n_layers = draw(st.integers(1, 5))
    w = Workload(tuple(Layer(draw(st.integers(1, 9)) * 1000, 1.0, 2.0, 0) for _ in range(n_layers)),
                 global_batch=8, micro_batch=1)
    per_node = draw(st.sampled_from([2, n]))
    speeds = draw(st.lists(st.sampled_from([1.0, 1.0, 2.0]), min_size=n, max_size=n))
    c = Cluster(tuple(Device(i, i // max(per_node, 1), speeds[i], 1e12) for i in range(n)), intra=INTRA, inter=INTER)
    old = draw(random_plan(list(range(n)), n_layers))
    alive = draw(st.sets(st.sampled_from(range(n)), min_size=1, max_size=n))
    new = draw(random_plan(sorted(alive), n_layers))
    empty = draw(st.sets(st.sampled_from(sorted(alive)), max_size=1)) if draw(st.booleans()) else set()
    with_old = draw(st.sampled_from([True, True, True, False]))
    return w, c, (old if with_old else None), new, alive, empty


# -- properties ------------------------------------------------------------------------
@settings(ENGINE, max_examples=200)
@given(migrations())
def test_assignment_is_optimal_by_brute_force(case):
    w, c, old, new, alive, empty = case
    mig = migrate(old, new, w, c, alive, empty=empty)
    # the result is the new plan with devices swapped only within a class
    assert sorted(mig.plan.devices) == sorted(new.devices)
    for a, b in zip(mig.plan.devices, new.devices):
        assert (c[a].speed, c[a].memory_bytes, c[a].node) == (c[b].speed, c[b].memory_bytes, c[b].node)
        assert mig.plan.slot(a).layers == new.slot(b).layers
    got = bytes_missing(old, mig.plan, w, alive, empty)
    assert got == pytest.approx(brute_force_min(old, new, w, c, alive, empty), rel=1e-12, abs=1e-9)
    # what is not lost is moved, exactly once
    assert mig.total_bytes + lost_bytes(mig, w) == pytest.approx(got, rel=1e-12, abs=1e-9)


@settings(ENGINE, max_examples=200)
@given(migrations())
def test_transfers_come_from_real_holders_and_rounds_do_not_conflict(case):
    w, c, old, new, alive, empty = case
    mig = migrate(old, new, w, c, alive, empty=empty)
    k = mig.plan.shard_degree
    for t in mig.transfers:
        assert t.src != t.dst
        assert t.src in alive and t.src not in empty
        j, s = mig.plan.locate(t.dst)
        held = usable(held_layers(old, t.src), j % k, k)
        assert set(range(*t.layers)) <= held, f"device {t.src} never held layers {t.layers}"
        need = set(range(*mig.plan.slot(t.dst).layers))
        assert set(range(*t.layers)) <= need
        assert t.nbytes == pytest.approx(w.params_in(*t.layers) * w.state_bytes_per_param / k)
        assert t.seconds == pytest.approx(c.link(t.src, t.dst).transfer_s(t.nbytes))
    # every transfer is in exactly one round; no device twice in a round
    scheduled = [t for r in mig.rounds for t in r]
    assert sorted(map(id, scheduled)) == sorted(map(id, mig.transfers))
    for r in mig.rounds:
        used = [d for t in r for d in (t.src, t.dst)]
        assert len(used) == len(set(used)), f"a device appears twice in round {r}"
    # transition = the critical path of the rounds' order: no shorter than any device's own
    # transfers back to back, no longer than the rounds taken as barriers
    busy: dict = {}
    for t in mig.transfers:
        for d in (t.src, t.dst):
            busy[d] = busy.get(d, 0.0) + t.seconds
    assert max(busy.values(), default=0.0) - 1e-9 <= mig.seconds
    assert mig.seconds <= sum(max(t.seconds for t in r) for r in mig.rounds) + 1e-9
    # lost state has no surviving holder
    for a, b, q, kk in mig.lost:
        for d in alive - set(empty):
            assert not (set(range(a, b)) & usable(held_layers(old, d), q, kk)), (d, (a, b, q, kk))


@settings(ENGINE, max_examples=200)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)), max_size=25))
def test_schedule_rounds_never_puts_a_device_twice_in_a_round(pairs):
    transfers = [Transfer(a, b, (0, 1), 1.0, 1.0) for a, b in pairs if a != b]
    rounds = schedule_rounds(transfers)
    assert sum(len(r) for r in rounds) == len(transfers)
    for r in rounds:
        used = [d for t in r for d in (t.src, t.dst)]
        assert len(used) == len(set(used))
    # DSATUR is a heuristic, but never worse than one round per transfer and never better than
    # the busiest device allows
    busiest = max((sum(d in (t.src, t.dst) for t in transfers) for d in range(8)), default=0)
    assert busiest <= len(rounds) <= max(len(transfers), 0)


# -- worked examples -------------------------------------------------------------------
W = Workload(tuple(Layer(1000 * (i + 1), 1.0, 2.0, 0) for i in range(4)), global_batch=8, micro_batch=1)


def test_identical_plan_moves_nothing():
    c = Cluster(tuple(Device(i, 0) for i in range(4)), intra=INTRA, inter=INTER)
    plan = Plan((Pipeline((0, 1), (0, 2, 4), 4), Pipeline((2, 3), (0, 2, 4), 4)))
    mig = migrate(plan, plan, W, c)
    assert mig.transfers == [] and mig.rounds == [] and mig.seconds == 0 and mig.lost == []


def test_swap_to_the_device_that_already_holds_the_layers():
    c = Cluster(tuple(Device(i, 0) for i in range(4)), intra=INTRA, inter=INTER)
    old = Plan((Pipeline((0, 1), (0, 2, 4), 4), Pipeline((2, 3), (0, 2, 4), 4)))
    # device 3 died; the planner laid out PP3 as (1, 2, 0) with a split that 0/1/2 partly hold
    new = Plan((Pipeline((1, 2, 0), (0, 1, 2, 4), 8),))
    mig = migrate(old, new, W, c, alive={0, 1, 2})
    # 0 and 2 hold layers 0-1 (stages 0 and 1 of the new split), 1 holds 2-3 (stage 2): free
    assert brute_force_min(old, new, W, c, {0, 1, 2}) == 0
    assert mig.total_bytes == 0 and mig.transfers == []
    assert mig.plan.pipelines[0].devices[2] == 1  # device 1 holds layers 2-3 already: it keeps them
    assert all(t.dst != 1 for t in mig.transfers)


def test_lost_state_with_no_surviving_replica():
    c = Cluster(tuple(Device(i, 0) for i in range(4)), intra=INTRA, inter=INTER)
    old = Plan((Pipeline((0, 1), (0, 2, 4), 4), Pipeline((2, 3), (0, 2, 4), 4)))
    new = Plan((Pipeline((1, 3), (0, 2, 4), 8),))
    mig = migrate(old, new, W, c, alive={1, 3})  # both holders of layers 0-1 are gone
    assert mig.lost == [(0, 2, 0, 1)]
    assert mig.transfers == []
    # one holder left: fetched, nothing lost
    mig = migrate(old, new, W, c, alive={1, 2, 3})
    assert mig.lost == []
    assert [(t.src, t.layers) for t in mig.transfers] == [(2, (0, 2))]


def test_fsdp_shard_served_by_same_shard_index_only():
    c = Cluster(tuple(Device(i, 0) for i in range(4)), intra=INTRA, inter=INTER)
    old = Plan(tuple(Pipeline((d,), (0, 4), 2) for d in range(4)), shard_degree=2)  # shards: 0,1,0,1
    new = Plan(tuple(Pipeline((d,), (0, 4), 4) for d in (1, 3)), shard_degree=2)
    mig = migrate(old, new, W, c, alive={1, 3})  # both copies of shard 0 died
    assert mig.lost == [(0, 4, 0, 2)]
    mig = migrate(old, new, W, c, alive={1, 2, 3})
    assert mig.lost == []
    assert len(mig.transfers) == 1 and mig.transfers[0].src == 2


def test_transition_is_the_slowest_link_of_one_round():
    c = Cluster((Device(0, 0), Device(1, 0), Device(2, 1), Device(3, 1)), intra=INTRA, inter=INTER)
    old = Plan((Pipeline((0,), (0, 4), 2), Pipeline((1,), (0, 4), 2)))
    new = Plan(tuple(Pipeline((d,), (0, 4), 1) for d in range(4)))
    mig = migrate(old, new, W, c, alive=set(range(4)), empty={2, 3})
    assert len(mig.transfers) == 2 and {t.dst for t in mig.transfers} == {2, 3}
    nbytes = W.total_params * W.state_bytes_per_param
    assert all(t.seconds == pytest.approx(INTER.transfer_s(nbytes)) for t in mig.transfers)
    assert mig.seconds == pytest.approx(INTER.transfer_s(nbytes))
    assert len(mig.rounds) == 1  # two different senders, two receivers: one round
    assert mig.summary()["bytes"] == pytest.approx(2 * nbytes)


def test_critical_path_rounds_are_an_order_not_barriers():
    # (src, dst, seconds): round 1 has a slow 0->1 and a fast 2->3; round 2's 3->4 needs only
    # worker 3, free after 1 s, so it ends at 2 s; 1->5 waits for the slow transfer (3 + 1 s).
    rounds = [[(0, 1, 3.0), (2, 3, 1.0)], [(3, 4, 1.0), (1, 5, 1.0)]]
    seconds, path = critical_path(rounds, lambda t: t)
    assert seconds == pytest.approx(4.0)
    assert path == [(0, 1, 3.0), (1, 5, 1.0)]
    # the rounds taken as barriers would add round 2's slow transfer after round 1's: 5.5 s
    rounds = [[(0, 1, 3.0), (2, 3, 1.0)], [(3, 4, 2.5), (1, 5, 1.0)]]
    seconds, path = critical_path(rounds, lambda t: t)
    assert seconds == pytest.approx(4.0) and path == [(0, 1, 3.0), (1, 5, 1.0)]
    assert sum(max(t[2] for t in r) for r in rounds) == pytest.approx(5.5)
    assert critical_path([], lambda t: t) == (0.0, [])
