"""The performance model against hand-computed examples (issue 2: 1F1B time, ring all-reduce,
FSDP, memory per device, rerouting)."""

from __future__ import annotations

import math

import pytest

from chameleon_ft.engine.cluster import Cluster, Device, Link
from chameleon_ft.engine.perf import Coefficients, estimate, ring_allgather_s, ring_allreduce_s, unit_times
from chameleon_ft.engine.plan import Pipeline, Plan

from .conftest import INTER, INTRA, chain, cluster

approx = lambda x: pytest.approx(x, rel=1e-9, abs=1e-12)  # noqa: E731

# Stage costs: layers 0-1 -> 2 + 4 = 6 s, layers 2-3 -> 6 + 3 = 9 s per micro-batch.
COSTS = [2.0, 4.0, 6.0, 3.0]


def one_f_one_b(c: list[float], hop: float, m: int) -> float:
    """1F1B by hand: the first micro-batch's round trip (every stage, 2 (p - 1) hops), then m - 1
    periods; stage s keeps p - s micro-batches in flight, so the period is the slowest stage or
    the round trip from stage s on, shared by p - s micro-batches, whichever is longer."""
    p = len(c)
    period = max(c)
    for s in range(p):
        period = max(period, (sum(c[s:]) + 2 * (p - 1 - s) * hop) / (p - s))
    return sum(c) + 2 * (p - 1) * hop + (m - 1) * period


# -- collectives -----------------------------------------------------------------------
def test_ring_allreduce_hand_computed():
    link = Link(0.001, 1e9)
    # 2(n-1)α + 2(n-1)/n · bytes/β = 6 ms + 1.5 · 8 ms
    assert ring_allreduce_s(4, 8e6, link) == approx(0.006 + 0.012)
    assert ring_allreduce_s(2, 1e9, link) == approx(0.002 + 1.0)
    assert ring_allreduce_s(1, 8e6, link) == 0.0
    assert ring_allreduce_s(4, 0, link) == 0.0


def test_ring_allgather_hand_computed():
    link = Link(0.001, 1e9)
    # (n-1)α + (n-1)/n · bytes/β
    assert ring_allgather_s(4, 8e6, link) == approx(0.003 + 0.006)
    assert ring_allgather_s(1, 8e6, link) == 0.0


# -- 1F1B pipeline time ----------------------------------------------------------------
def test_single_pipeline_1f1b_with_breakdown():
    w = chain(COSTS, outs=[0, 100_000, 0, 0], microbatches=4)
    c = cluster(2)  # one node: intra link 1 ms, 1 GB/s
    plan = Plan((Pipeline((0, 1), (0, 2, 4), 4),))
    est = estimate(plan, w, c)
    h = 0.001 + 100_000 / 1e9  # one hop: the activation out (or the gradient back)
    # round trip 6 + 9 + 2h, then 3 periods of the slower stage (its hops hidden by stage 0's slack)
    assert est.step_time == approx(6 + 9 + 2 * h + 3 * 9) and est.step_time == approx(one_f_one_b([6, 9], h, 4))
    assert est.compute == approx(4 * 9)
    assert est.bubble == approx(6)
    assert est.p2p == approx(2 * h)
    assert est.allreduce == 0.0 and est.fsdp == 0.0 and est.overhead == 0.0
    assert sum(est.breakdown().values()) == approx(est.step_time)
    assert est.pipeline_times == (approx(est.step_time),)
    assert unit_times(plan.pipelines, w, c)[0] == approx(9)


def test_balanced_stages_expose_their_hops_every_period():
    # Equal stages leave no slack: stage 0's round trip (both stages + 2 hops) shared by its 2
    # micro-batches in flight is longer than a stage's work, and sets the period.
    w = chain([3.0, 3.0, 3.0, 3.0], outs=[0, 1_000_000, 0, 0], microbatches=6)
    c = cluster(2)
    plan = Plan((Pipeline((0, 1), (0, 2, 4), 6),))
    h = 0.001 + 1_000_000 / 1e9
    est = estimate(plan, w, c)
    assert est.step_time == approx(12 + 2 * h + 5 * (6 + h)) and est.step_time == approx(one_f_one_b([6, 6], h, 6))
    assert unit_times(plan.pipelines, w, c)[0] == approx(6 + h)


def test_p2p_across_nodes_uses_the_inter_link():
    w = chain(COSTS, outs=[0, 100_000, 0, 0], microbatches=4)
    c = cluster(2, per_node=1)
    est = estimate(Plan((Pipeline((0, 1), (0, 2, 4), 4),)), w, c)
    h = INTER.latency_s + 100_000 / INTER.bandwidth_Bps
    assert est.step_time == approx(one_f_one_b([6, 9], h, 4))
    assert est.p2p == approx(2 * h)


def test_heterogeneous_speed_device_slows_its_stage():
    w = chain(COSTS, microbatches=4)
    c = cluster(2, speeds=[1.0, 0.5])  # stage 1 runs at half speed: 9 s -> 18 s
    est = estimate(Plan((Pipeline((0, 1), (0, 2, 4), 4),)), w, c)
    assert est.step_time == approx(6 + 18 + 3 * 18)
    c = cluster(2, speeds=[0.25, 1.0])  # stage 0: 6 s -> 24 s
    est = estimate(Plan((Pipeline((0, 1), (0, 2, 4), 4),)), w, c)
    assert est.step_time == approx(24 + 9 + 3 * 24)


def test_coefficients_scale_compute_comm_and_add_overhead():
    w = chain(COSTS, outs=[0, 100_000, 0, 0], microbatches=4)
    c = cluster(2)
    plan = Plan((Pipeline((0, 1), (0, 2, 4), 4),))
    est = estimate(plan, w, c, Coefficients(compute_scale=2.0, comm_scale=3.0, step_overhead_s=0.5))
    h = 3 * (0.001 + 100_000 / 1e9)
    assert est.step_time == approx(one_f_one_b([12, 18], h, 4) + 0.5)
    assert est.p2p == approx(2 * h)
    assert est.overhead == 0.5


# -- data-parallel all-reduce ----------------------------------------------------------
def test_dp_times_pp_step_is_slowest_pipeline_plus_allreduce():
    params = [1_000_000, 2_000_000, 500_000, 500_000]
    w = chain(COSTS, params=params, microbatches=8)
    c = cluster(4)
    plan = Plan((Pipeline((0, 1), (0, 2, 4), 4), Pipeline((2, 3), (0, 2, 4), 4)))
    est = estimate(plan, w, c)
    # each stage's gradients are all-reduced between its 2 holders; the slowest stage counts
    ar = max(ring_allreduce_s(2, 3_000_000 * 4, INTRA), ring_allreduce_s(2, 1_000_000 * 4, INTRA))
    assert est.allreduce == approx(ar)
    assert est.step_time == approx(one_f_one_b([6, 9], 0.0, 4) + ar)


def test_pure_dp_allreduce_over_nodes_uses_inter_link():
    w = chain([3.0], params=[10_000_000], microbatches=8)
    c = cluster(4, per_node=2)
    est = estimate(Plan.data_parallel(range(4), w), w, c)
    ar = ring_allreduce_s(4, 10_000_000 * 4, INTER)
    assert est.allreduce == approx(ar)
    assert est.step_time == approx(2 * 3.0 + ar)


def test_unequal_pipelines_step_is_the_slowest():
    w = chain(COSTS, microbatches=6)
    c = cluster(3)
    plan = Plan((Pipeline((0, 1), (0, 2, 4), 4), Pipeline((2,), (0, 4), 2)))
    est = estimate(plan, w, c)
    # PP2: 6 + 9 + 3·9 = 42; PP1: 2·15 = 30
    assert est.pipeline_times[0] == approx(42) and est.pipeline_times[1] == approx(30)
    assert est.step_time == approx(42 + est.allreduce)


# -- FSDP / HSDP -----------------------------------------------------------------------
def test_fsdp_terms_hand_computed():
    P = 4_000_000
    w = chain([3.0], params=[P], acts=[1000], microbatches=4)
    c = cluster(2)
    plan = Plan((Pipeline((0,), (0, 1), 2), Pipeline((1,), (0, 1), 2)), shard_degree=2)
    est = estimate(plan, w, c)
    # all-gather weights for forward and backward, reduce-scatter gradients
    fsdp = 2 * ring_allgather_s(2, P * 4, INTRA) + ring_allgather_s(2, P * 4, INTRA)
    assert est.fsdp == approx(fsdp)
    assert est.allreduce == 0.0  # one replica: nothing to all-reduce across replicas
    assert est.step_time == approx(2 * 3.0 + fsdp)
    # memory: (w+g+o)/k per parameter + one gathered layer of full weights + activations
    assert est.memory[0] == approx(P * 16 / 2 + P * 4 + 1 * 1000)


def test_hsdp_allreduces_shards_across_replicas():
    P = 4_000_000
    w = chain([3.0], params=[P], microbatches=4)
    c = cluster(4)
    plan = Plan(tuple(Pipeline((d,), (0, 1), 1) for d in range(4)), shard_degree=2)
    est = estimate(plan, w, c)
    assert est.allreduce == approx(ring_allreduce_s(2, P * 4 / 2, INTRA))
    assert est.fsdp == approx(3 * ring_allgather_s(2, P * 4, INTRA))


def test_fsdp_time_is_the_slowest_shard_group():
    P = 1_000_000
    w = chain([3.0], params=[P], microbatches=4)
    c = Cluster((Device(0, 0), Device(1, 0), Device(2, 0), Device(3, 1)), intra=INTRA, inter=INTER)
    # group 0 = devices 0,1 (one node), group 1 = devices 2,3 (two nodes)
    plan = Plan(tuple(Pipeline((d,), (0, 1), 1) for d in range(4)), shard_degree=2)
    est = estimate(plan, w, c)
    assert est.fsdp == approx(3 * ring_allgather_s(2, P * 4, INTER))


# -- memory ----------------------------------------------------------------------------
def test_memory_per_stage_holds_min_m_p_minus_i_microbatches():
    params, acts = [1000, 2000, 3000], [10, 20, 30]
    for m in (1, 2, 5):
        w = chain([1.0, 1.0, 1.0], params=params, acts=acts, microbatches=m)
        est = estimate(Plan((Pipeline((0, 1, 2), (0, 1, 2, 3), m),)), w, cluster(3))
        for i in range(3):
            assert est.memory[i] == approx(params[i] * 16 + min(m, 3 - i) * acts[i])
        assert est.peak_memory == approx(max(est.memory.values()))


def test_fits_and_over_memory():
    w = chain([1.0, 1.0], params=[1000, 1000], acts=[100, 100], microbatches=4)
    plan = Plan((Pipeline((0, 1), (0, 1, 2), 4),))
    need0, need1 = 1000 * 16 + 2 * 100, 1000 * 16 + 1 * 100
    c = Cluster((Device(0, 0, 1.0, need0), Device(1, 0, 1.0, need1)))
    assert estimate(plan, w, c).fits
    c = Cluster((Device(0, 0, 1.0, need0 - 1), Device(1, 0, 1.0, need1)))
    est = estimate(plan, w, c)
    assert not est.fits and est.over_memory == (0,)
    c = Cluster((Device(0, 0, 1.0, need0 - 1), Device(1, 0, 1.0, need1 - 1)))
    assert estimate(plan, w, c).over_memory == (0, 1)


# -- rerouting -------------------------------------------------------------------------
def test_reroute_in_data_parallel():
    w = chain([3.0], params=[1_000_000], acts=[50], microbatches=6)
    c = cluster(3)
    plan = Plan.data_parallel(range(3), w)  # 2 micro-batches each
    est = estimate(plan, w, c, dead={0}, extra={1: 1, 2: 1})
    ar = ring_allreduce_s(2, 1_000_000 * 4, INTRA)  # only the two survivors all-reduce
    assert est.pipeline_times[1] == approx(2 * 3 + 1 * 3)
    assert est.step_time == approx(9 + ar)
    assert est.allreduce == approx(ar)
    assert 0 not in est.memory  # a dead device holds nothing
    assert est.memory[1] == approx(1_000_000 * 16 + 1 * 50)


def test_reroute_merged_into_loop_items_holds_more_activations():
    """accelerate_ft without a loss recipe merges a worker's share into its loop items: with one
    item per step, a survivor with 2 + 1 micro-batches holds all 3 of them at once."""
    from dataclasses import replace
    w = replace(chain([3.0], params=[1_000_000], acts=[50], microbatches=6), items_per_step=1)
    c = cluster(3)
    plan = Plan.data_parallel(range(3), w)
    est = estimate(plan, w, c, dead={0}, extra={1: 1, 2: 1})
    assert est.memory[1] == approx(1_000_000 * 16 + 3 * 50)
    w2 = replace(w, items_per_step=2)  # two items: ceil(3 / 2) micro-batches at once
    assert estimate(plan, w2, c, dead={0}, extra={1: 1}).memory[1] == approx(1_000_000 * 16 + 2 * 50)
    small = Cluster(tuple(Device(i, 0, 1.0, 1_000_000 * 16 + 2 * 50) for i in range(3)), INTRA, INTER)
    assert estimate(plan, w, small).fits  # 2 micro-batches each, failure-free
    assert estimate(plan, w, small, dead={0}, extra={1: 1, 2: 1}).over_memory == (1, 2)


def test_rerouted_pipelines_are_timed_on_the_runtimes_schedule():
    w = chain(COSTS, params=[1000] * 4, microbatches=8)  # stage 0: 2 s forward + 4 s backward, stage 1: 3 + 6
    c = cluster(4)
    plan = Plan((Pipeline((0, 1), (0, 2, 4), 4), Pipeline((2, 3), (0, 2, 4), 4)))
    base = estimate(plan, w, c)
    est = estimate(plan, w, c, dead={0}, extra={2: 4})
    # device 2 takes pipeline 0's 4 micro-batches at stage 0 (the runtime's routes and 1F1B
    # orders, timed task by task): 75 s, 3 s under the per-pipeline form's 4 more periods
    # (42 + 4 x 9) -- part of the extra work hides in the bubbles; pipeline 0's own micro-batches,
    # first in device 2's order, are done at 42 s
    assert base.pipeline_times == approx((42.0, 42.0))
    assert est.pipeline_times == approx((42.0, 75.0))
    assert est.compute == approx(8 * 6)  # the busiest stage's work: device 2's 8 micro-batches
    assert est.bubble == approx(75.0 - 8 * 6) and est.p2p == 0.0  # no hop costs here
    # stage 0 now has one holder (nothing to all-reduce), stage 1 still two
    assert est.allreduce == approx(ring_allreduce_s(2, 2000 * 4, INTRA))
    # a dead stage on each side: every micro-batch passes device 2 (stage 0) then device 1
    # (stage 1, the slower): the first forward (2 s), device 1's 8 x 9 s, the last backward (4 s)
    est = estimate(plan, w, c, dead={0, 3}, extra={2: 4, 1: 4})
    assert max(est.pipeline_times) == approx(2 + 8 * 9 + 4)


def test_a_slow_stage_in_the_rerouted_pipeline_queues_behind_the_peers_doubled_stage():
    """What the per-pipeline form missed (the quick trace's always-reroute: 0.57 s predicted,
    0.68 s measured): pipeline 1's stage 0 is rerouted to device 0, which also runs pipeline 0's
    own, and pipeline 1's stage 1 is 2x slow.  Each bottleneck alone is 8 x 6 s of work; together
    the rerouted micro-batches wait at both."""
    w = chain([2.0, 4.0, 2.0, 4.0], params=[1000] * 4, microbatches=8)  # two stages of 6 s
    c = cluster(4, speeds=[1.0, 1.0, 1.0, 0.5])
    plan = Plan((Pipeline((0, 1), (0, 2, 4), 4), Pipeline((2, 3), (0, 2, 4), 4)))
    est = estimate(plan, w, c, dead={2}, extra={0: 4})
    per_pipeline = max(6 * 8, 6 + 12 + 3 * 12)  # device 0's 8 micro-batches; pipeline 1 alone at the slow pace
    assert max(est.pipeline_times) > per_pipeline + 6


def test_rerouting_too_large_to_time_falls_back_to_the_per_pipeline_form(monkeypatch):
    import chameleon_ft.engine.perf as perf
    w = chain([2.0, 4.0, 2.0, 4.0], params=[1000] * 4, microbatches=8)
    c = cluster(4, speeds=[1.0, 1.0, 1.0, 0.5])
    plan = Plan((Pipeline((0, 1), (0, 2, 4), 4), Pipeline((2, 3), (0, 2, 4), 4)))
    monkeypatch.setattr(perf, "COUPLED_TASKS", 0)
    assert estimate(plan, w, c, dead={2}, extra={0: 4}).pipeline_times == approx((54.0, 48.0))


def test_dead_device_absent_from_the_cluster_holds_nothing():
    w = chain([3.0], microbatches=8)
    c = cluster(4).without({1})
    est = estimate(Plan.data_parallel(range(4), w), w, c, dead={1}, extra={0: 1, 2: 1})
    assert 1 not in est.memory


def test_estimate_is_not_nan_for_idle_pipeline():
    w = chain([3.0], microbatches=2)
    plan = Plan((Pipeline((0,), (0, 1), 2), Pipeline((1,), (0, 1), 0)))
    est = estimate(plan, w, cluster(2))
    assert est.pipeline_times[1] == 0.0 and math.isfinite(est.step_time)
