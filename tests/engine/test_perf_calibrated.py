"""The performance model's calibrated terms against hand-computed values: the whole-model
gradient all-reduce (``grad_sync="model"``) on the measured collective link, the per-task
overhead, the optimizer cost of the busiest device, and migrations on the measured link."""

from __future__ import annotations

from dataclasses import replace

import pytest

from chameleon_ft.engine.cluster import Link
from chameleon_ft.engine.perf import Coefficients, estimate, ring_allreduce_s
from chameleon_ft.engine.plan import Pipeline, Plan
from chameleon_ft.engine.migration import critical_path, migrate
from chameleon_ft.engine.selector import heal_seconds
from chameleon_ft.engine.workload import Workload

from .conftest import INTER, INTRA, chain, cluster

approx = lambda x: pytest.approx(x, rel=1e-9, abs=1e-12)  # noqa: E731

COSTS = [2.0, 4.0, 6.0, 3.0]  # stage (0-1) 6 s, stage (2-3) 9 s per micro-batch
PARAMS = [100, 200, 3000, 5000]
COLLECTIVE = Link(0.02, 5e6)
MIGRATION = Link(0.5, 1e6)


def model_sync(w: Workload) -> Workload:
    return replace(w, grad_sync="model")


def two_by_two(m: int = 4) -> Plan:
    return Plan((Pipeline((0, 1), (0, 2, 4), m), Pipeline((2, 3), (0, 2, 4), m)))


# -- grad_sync="model" -----------------------------------------------------------------------
@pytest.mark.parametrize("per_node,link", [(4, INTRA), (2, INTER)])
def test_model_allreduce_is_one_ring_over_every_alive_device(per_node, link):
    w = model_sync(chain(COSTS, params=PARAMS, microbatches=8))
    c = cluster(4, per_node=per_node)
    est = estimate(two_by_two(), w, c)
    assert est.allreduce == approx(ring_allreduce_s(4, sum(PARAMS) * w.grad_bytes, link))
    # stage sync: two all-reduces of 2 holders each, the bigger stage counts
    stage = estimate(two_by_two(), replace(w, grad_sync="stage"), c)
    assert stage.allreduce == approx(ring_allreduce_s(2, (3000 + 5000) * w.grad_bytes, link))
    assert est.allreduce > stage.allreduce
    assert est.step_time - est.allreduce == approx(stage.step_time - stage.allreduce)


def test_model_allreduce_counts_only_alive_devices_and_scales_with_comm():
    w = model_sync(chain(COSTS, params=PARAMS, microbatches=8))
    c = cluster(4)
    est = estimate(two_by_two(), w, c, Coefficients(comm_scale=1.5), dead={3})
    assert est.allreduce == approx(1.5 * ring_allreduce_s(3, sum(PARAMS) * 4, INTRA))


def test_model_allreduce_uses_the_collective_link_when_set():
    w = model_sync(chain(COSTS, params=PARAMS, microbatches=8))
    c = replace(cluster(4, per_node=2), collective=COLLECTIVE)
    est = estimate(two_by_two(), w, c)
    assert est.allreduce == approx(ring_allreduce_s(4, sum(PARAMS) * 4, COLLECTIVE))
    # the stage-wise all-reduces use it too
    stage = estimate(two_by_two(), replace(w, grad_sync="stage"), c)
    assert stage.allreduce == approx(ring_allreduce_s(2, 8000 * 4, COLLECTIVE))
    # p2p hops keep the tier links
    plain = estimate(two_by_two(), w, cluster(4, per_node=2))
    assert est.p2p == approx(plain.p2p)


# -- task overhead -----------------------------------------------------------------------------
@pytest.mark.parametrize("m,task", [(4, 0.25), (7, 1.5)])
def test_task_overhead_adds_m_plus_p_minus_1_tasks_to_a_pipeline(m, task):
    w = chain(COSTS, outs=[0, 100_000, 0, 0], microbatches=m)
    c = cluster(2)
    plan = Plan((Pipeline((0, 1), (0, 2, 4), m),))
    base = estimate(plan, w, c)
    est = estimate(plan, w, c, Coefficients(task_overhead_s=task))
    p = 2
    h = 0.001 + 100_000 / 1e9
    # every stage's task pays it: the round trip 6 + 9 + 2 tasks + 2h, then m - 1 periods of 9 s + task
    assert est.step_time == approx(6 + 9 + 2 * task + 2 * h + (m - 1) * (9 + task))
    assert est.step_time - base.step_time == approx((m + p - 1) * task)
    assert est.compute == approx(m * (9 + task))
    assert est.bubble == approx(6 + task)
    assert sum(est.breakdown().values()) == approx(est.step_time)


def test_task_overhead_is_not_scaled_by_compute_scale():
    w = chain(COSTS, microbatches=4)
    plan = Plan((Pipeline((0, 1), (0, 2, 4), 4),))
    est = estimate(plan, w, cluster(2), Coefficients(compute_scale=2.0, task_overhead_s=0.5))
    # stages 2 · 6 + 0.5 and 2 · 9 + 0.5: the round trip, then 3 periods of the slower
    assert est.step_time == approx(12.5 + 18.5 + 3 * 18.5)


# -- optimizer seconds per parameter ------------------------------------------------------------
def uneven_plan() -> Plan:
    # device 0: layers 0-2 (3300 params), 1: layer 3 (5000), 2: layer 0 (100), 3: layers 1-3 (8200)
    return Plan((Pipeline((0, 1), (0, 3, 4), 2), Pipeline((2, 3), (0, 1, 4), 2)))


@pytest.mark.parametrize("dead,busiest", [((), 8200), ((3,), 5000), ((1, 3), 3300)])
def test_optimizer_term_is_the_busiest_alive_device(dead, busiest):
    w = chain(COSTS, params=PARAMS, microbatches=4)
    c = cluster(4)
    coeffs = Coefficients(step_overhead_s=0.1, optimizer_s_per_param=1e-4)
    base = estimate(uneven_plan(), w, c, Coefficients(step_overhead_s=0.1), dead=set(dead))
    est = estimate(uneven_plan(), w, c, coeffs, dead=set(dead))
    assert est.overhead == approx(0.1 + busiest * 1e-4)
    assert est.step_time - base.step_time == approx(busiest * 1e-4)
    assert est.breakdown()["overhead"] == est.overhead


def test_optimizer_term_divides_by_the_shard_degree():
    w = chain(COSTS, params=PARAMS, microbatches=4)
    plan = Plan((Pipeline((0,), (0, 4), 2), Pipeline((1,), (0, 4), 2)), shard_degree=2)
    est = estimate(plan, w, cluster(2), Coefficients(optimizer_s_per_param=1e-3))
    assert est.overhead == approx(sum(PARAMS) / 2 * 1e-3)


# -- migration link ----------------------------------------------------------------------------
def test_migrate_prices_transfers_on_the_migration_link_when_set():
    w = chain(COSTS, params=PARAMS, microbatches=4)
    old = two_by_two()
    new = Plan((Pipeline((0, 1), (0, 3, 4), 2), Pipeline((2,), (0, 4), 2)))  # device 3 lost
    plain_cluster = cluster(4, per_node=2)
    measured = replace(plain_cluster, migration=MIGRATION)
    plain = migrate(old, new, w, plain_cluster, alive={0, 1, 2})
    mig = migrate(old, new, w, measured, alive={0, 1, 2})
    assert plain.transfers, "the new plan must move state"
    key = lambda t: (t.src, t.dst, t.layers, t.nbytes)  # noqa: E731
    assert sorted(map(key, mig.transfers)) == sorted(map(key, plain.transfers))
    for t in plain.transfers:
        assert t.seconds == approx(plain_cluster.link(t.src, t.dst).transfer_s(t.nbytes))
    for t in mig.transfers:
        assert t.seconds == approx(MIGRATION.transfer_s(t.nbytes))
    assert mig.seconds == approx(critical_path(mig.rounds, lambda t: (t.src, t.dst, MIGRATION.transfer_s(t.nbytes)))[0])
    assert mig.seconds > plain.seconds


def test_heal_seconds_uses_the_migration_link_when_set():
    w = chain(COSTS, params=PARAMS, microbatches=4)
    nbytes = (3000 + 5000) * w.state_bytes_per_param
    c = cluster(4, per_node=2)
    assert heal_seconds(two_by_two(), {3}, w, c) == approx(INTER.transfer_s(nbytes))
    assert heal_seconds(two_by_two(), {3}, w, replace(c, migration=MIGRATION)) == approx(MIGRATION.transfer_s(nbytes))


# -- Workload.grad_sync ------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["layer", "", "MODEL", None])
def test_workload_rejects_an_unknown_grad_sync(bad):
    with pytest.raises(ValueError):
        replace(chain(COSTS), grad_sync=bad)


def test_grad_sync_is_part_of_hash_and_equality():
    a = chain(COSTS)
    b = replace(a, grad_sync="model")
    assert a.grad_sync == "stage"
    assert a != b and hash(a) != hash(b)
    assert b == replace(chain(COSTS), grad_sync="model") and hash(b) == hash(replace(chain(COSTS), grad_sync="model"))
    assert len({a, b, chain(COSTS)}) == 2
