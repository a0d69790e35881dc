"""The pipeline schedule and the migration's transfers, as pure logic (no processes)."""

import random

import pytest

from chameleon_ft.engine.cluster import homogeneous
from chameleon_ft.engine.perf import Coefficients
from chameleon_ft.engine.plan import Pipeline, Plan
from chameleon_ft.engine.planner import SearchSpace, plan_search
from chameleon_ft.engine.migration import held_state, migrate, transfers_to
from chameleon_ft.engine.schedule import ScheduleError, Task, check, routes, worker_orders
from chameleon_ft.engine.workload import Layer, Workload

TWO_BY_FOUR = Plan((Pipeline((0, 1, 2, 3), (0, 2, 4, 6, 8), 4), Pipeline((4, 5, 6, 7), (0, 2, 4, 6, 8), 4)))


def workload(layers=8, batch=32, micro=4):
    return Workload(tuple(Layer(params=1000 + 10 * i, fwd_s=0.01, bwd_s=0.02, act_bytes=1000)
                          for i in range(layers)), batch, micro)


def covered(rs, num_layers):
    for r in rs:
        assert r.hops[0].lo == 0 and r.hops[-1].hi == num_layers
        assert all(a.hi == b.lo for a, b in zip(r.hops, r.hops[1:]))


def test_failure_free_routes_are_the_pipelines():
    rs = routes(TWO_BY_FOUR, range(8))
    assert [r.slot for r in rs] == list(range(8))
    assert [[h.worker for h in r.hops] for r in rs] == [[0, 1, 2, 3]] * 4 + [[4, 5, 6, 7]] * 4
    covered(rs, 8)


def test_reroute_sends_the_dead_stage_to_its_peer():
    rs = routes(TWO_BY_FOUR, set(range(8)) - {2})
    assert [[h.worker for h in r.hops] for r in rs] == [[0, 1, 6, 3]] * 4 + [[4, 5, 6, 7]] * 4
    orders = worker_orders(rs)
    assert 2 not in orders
    assert sum(t.kind == "F" for t in orders[6]) == 8  # its own 4 and the rerouted 4
    assert check(rs, orders)


def test_the_link_probe_pairs_are_the_hops_and_its_size_is_agreed():
    from chameleon_ft.runtime.executors.pipeline.step import link_pairs, probe_size

    assert link_pairs(routes(TWO_BY_FOUR, range(8))) == [(0, 1), (1, 2), (2, 3), (4, 5), (5, 6), (6, 7)]
    assert link_pairs(routes(TWO_BY_FOUR, set(range(8)) - {2})) == [(0, 1), (1, 6), (4, 5), (5, 6), (6, 3), (6, 7)]
    assert probe_size([10, 20]) == 64 << 10  # at least 64 KiB
    assert probe_size([100_000, 30]) == 400_000  # the largest block's parameters
    assert probe_size([10**9]) == 4 << 20  # at most 4 MiB


def test_a_stage_without_a_copy_cannot_be_routed():
    with pytest.raises(ScheduleError, match="lost all of its replicas"):
        routes(TWO_BY_FOUR, set(range(8)) - {1, 5})


def test_one_f_one_b_limits_in_flight_micro_batches():
    orders = worker_orders(routes(TWO_BY_FOUR, range(8)))
    for w, order in orders.items():
        depth_after = 3 - w % 4
        in_flight = peak = 0
        for t in order:
            in_flight += 1 if t.kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak == depth_after + 1, (w, order)


def test_inconsistent_orders_are_detected():
    rs = routes(Plan((Pipeline((0, 1), (0, 1, 2), 2),)), [0, 1])
    bad = {0: [Task("F", 0, 0), Task("B", 0, 0), Task("F", 1, 0), Task("B", 1, 0)],
           1: [Task("F", 1, 1), Task("B", 1, 1), Task("F", 0, 1), Task("B", 0, 1)]}
    assert not check(rs, bad)


@pytest.mark.parametrize("seed", range(6))
def test_planner_plans_over_survivors_have_consistent_schedules(seed):
    """Every plan the planner proposes over random survivors (unequal pipelines, different
    splits), with further random deaths rerouted, has a consistent schedule covering every
    micro-batch once."""
    rng = random.Random(seed)
    w = workload(layers=rng.choice([6, 8, 10]), batch=rng.choice([32, 48]))
    cluster = homogeneous(12, per_node=4)
    alive = sorted(rng.sample(range(12), rng.randint(5, 11)))
    for cand in plan_search(w, cluster, Coefficients(), SearchSpace(min_microbatches=1),
                            survivors=alive).candidates:
        plan = cand.plan
        dead = set()
        if len(plan.pipelines) > 1:  # kill one device whose stage has a peer
            d = rng.choice(plan.devices)
            j, s = plan.locate(d)
            if any(p.bounds == plan.pipelines[j].bounds for i, p in enumerate(plan.pipelines) if i != j):
                dead = {d}
        rs = routes(plan, set(plan.devices) - dead)
        assert sorted(r.slot for r in rs) == list(range(w.num_microbatches))
        covered(rs, w.num_layers)
        assert all(h.worker not in dead for r in rs for h in r.hops)
        assert check(rs, worker_orders(rs))


def test_transfers_to_matches_the_restorers_migration():
    """From the old plan's holdings, the runtime's transfers move what the migration plan priced."""
    w, cluster = workload(), homogeneous(8, per_node=8)
    alive = set(range(8)) - {2}
    best = plan_search(w, cluster.without({2}), Coefficients(), SearchSpace(min_microbatches=1),
                       survivors=alive, base=TWO_BY_FOUR).candidates[0]
    mig = migrate(TWO_BY_FOUR, best.plan, w, cluster, alive)
    holdings = {d: [(a, b)] for d, (a, b, _, _) in held_state(TWO_BY_FOUR, alive).items()}
    again = transfers_to(mig.plan, holdings, w, cluster)
    assert again.total_bytes == mig.total_bytes
    assert not again.lost
    for rnd in again.rounds:
        names = [d for t in rnd for d in (t.src, t.dst)]
        assert len(names) == len(set(names)), "a worker appears twice in one round"
    for t in again.transfers:  # the sender holds what it sends; the receiver lacked it
        a, b = holdings[t.src][0]
        assert a <= t.layers[0] and t.layers[1] <= b


def test_transfers_to_repairs_an_interrupted_migration_and_reports_lost_state():
    w, cluster = workload(), homogeneous(8, per_node=8)
    plan = Plan((Pipeline((0, 1, 3), (0, 3, 6, 8), 8),))
    # Worker 1 already received blocks 4-6 and still holds 2-4; 0 holds 0-2 only.
    holdings = {0: [(0, 2)], 1: [(2, 4), (4, 6)], 3: [(6, 8)], 4: [(0, 2)], 5: [(2, 4)]}
    mig = transfers_to(plan, holdings, w, cluster)
    assert [(t.dst, t.layers) for t in mig.transfers] == [(0, (2, 3))]  # 1 already has 3-6
    assert not mig.lost
    lost = transfers_to(plan, {0: [(0, 2)], 1: [(3, 6)], 3: [(6, 8)]}, w, cluster)
    assert lost.lost == [(2, 3, 0, 1)]


def test_shadow_holders_join_the_reductions_of_the_blocks_they_receive():
    """An overlapped migration's receivers (overlap.py) take part in the reduction of the blocks
    they will hold: the sets every member derives include them, in the same order everywhere."""
    from chameleon_ft.engine.plan import Pipeline, Plan
    from chameleon_ft.runtime.executors.pipeline.reduce import holder_sets
    plan = Plan((Pipeline((0, 1, 2, 3), (0, 2, 4, 6, 8), 8), Pipeline((4, 5, 6, 7), (0, 2, 4, 6, 8), 8)))
    alive = set(range(8)) - {5}
    plain = holder_sets(plan, alive, 8)
    assert plain == [((0, 4), (0, 1)), ((1,), (2, 3)), ((2, 6), (4, 5)), ((3, 7), (6, 7))]
    shadow = holder_sets(plan, alive, 8, {2: {6}, 3: {6}, 4: {1}})
    # Block 4 gains holder 1, block 5 does not: they split.
    assert shadow == [((0, 4), (0, 1)), ((1, 6), (2, 3)), ((1, 2, 6), (4,)), ((2, 6), (5,)), ((3, 7), (6, 7))]
    # A member the running layout leaves out (a replacement being healed: not alive in the plan)
    # still takes part as a shadow of the blocks it receives.
    healing = holder_sets(plan, alive, 8, {2: {5}, 3: {5}})
    assert healing[1] == ((1, 5), (2, 3))
