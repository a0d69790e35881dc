"""EngineBridge's pipeline calibration, without processes: synthetic per-(device, block)
timings, messages, all-reduces and migrations go in; the workload, cluster and coefficients
the engine decides with come out, and survive the state a joiner receives."""

from __future__ import annotations

import json

import pytest

from chameleon_ft.engine.cluster import Link
from chameleon_ft.engine.perf import ring_allreduce_s
from chameleon_ft.runtime.engine_bridge import EngineBridge

PARAMS = [1000, 2000, 1000, 3000, 1000, 1000, 2000, 1000]
FWD = [0.010, 0.012, 0.008, 0.020, 0.015, 0.011, 0.009, 0.014]
BWD = [2 * f for f in FWD]
OUT = [4096 * (b + 1) for b in range(8)]
P2P = Link(1e-4, 1e9)  # the wire the synthetic messages ran at
TASK_S, OPT_S_PER_PARAM = 1e-3, 1e-5
ALLREDUCE_S = 0.05
STEP_S = 2.0


def make_policy() -> EngineBridge:
    return EngineBridge(PARAMS, global_batch=16, micro_batch=2, stages=4, per_node=4, mttf_s=3600.0)


def feed_step(pol: EngineBridge, step: int, speeds: dict[int, float], step_s: float = STEP_S) -> None:
    """One committed step as the pipeline runtime reports it (every member's share)."""
    times = {}
    for pipe in pol.plan.pipelines:
        for s, d in enumerate(pipe.devices):
            v = speeds.get(d, 1.0)
            for b in range(pipe.bounds[s], pipe.bounds[s + 1]):
                times[(d, b)] = (pipe.microbatches * FWD[b] / v, pipe.microbatches * BWD[b] / v, pipe.microbatches)
    p2p = [(x, P2P.transfer_s(x)) for x in (1e4, 1e7, 4096.0)]
    tasks = 64
    pol.observe_pipeline(times, {b: OUT[b] for b in range(8)}, p2p, (TASK_S * tasks, tasks),
                         (OPT_S_PER_PARAM * sum(PARAMS), float(sum(PARAMS))))
    # per member: compute s, micro-batches, previous all-reduce s, previous step s
    pol.observe_step({d: (0.1, 4, ALLREDUCE_S, step_s) for d in sorted(pol.alive)}, step)


def calibrated_policy() -> EngineBridge:
    pol = make_policy()
    pol.start(range(8))
    for step in range(1, 9):  # refits at step 3 (first fit) and step 8 (with the residuals)
        feed_step(pol, step, {2: 0.5})
    return pol


@pytest.fixture(scope="module")
def calibrated() -> EngineBridge:
    return calibrated_policy()  # read-only: tests that change a policy build their own


def test_start_is_two_pipelines_of_four_stages():
    pol = make_policy()
    pol.start(range(8))
    assert pol.plan.describe() == "2x PP4 on 8 devices"
    assert pol.fit is None and pol.coefficients().task_overhead_s == 0.0
    feed_step(pol, 1, {})
    feed_step(pol, 2, {})
    assert pol.fit is None  # below min_steps: nothing fitted yet
    feed_step(pol, 3, {})
    assert pol.fit is not None


def test_workload_uses_the_measured_block_costs_and_model_sync(calibrated):
    w = calibrated.workload()
    assert w.grad_sync == "model"
    assert [l.params for l in w.layers] == PARAMS
    assert [l.fwd_s for l in w.layers] == pytest.approx(FWD, rel=1e-9)
    assert [l.bwd_s for l in w.layers] == pytest.approx(BWD, rel=1e-9)
    assert [l.out_bytes for l in w.layers] == OUT
    assert (w.weight_bytes, w.optim_bytes) == (4, 8)


def test_cluster_carries_the_fitted_speeds_and_links(calibrated):
    c = calibrated.cluster()
    assert c[2].speed == pytest.approx(0.5, rel=1e-9)
    assert all(c[d].speed == pytest.approx(1.0) for d in range(8) if d != 2)
    for link in (c.intra, c.inter):
        assert link.latency_s == pytest.approx(P2P.latency_s, rel=1e-6)
        assert link.bandwidth_Bps == pytest.approx(P2P.bandwidth_Bps, rel=1e-6)
    # the all-reduce link predicts the measured all-reduce of the whole model over 8 members
    assert c.collective is not None and c.collective == calibrated.fit.collective
    assert ring_allreduce_s(8, sum(PARAMS) * 4, c.collective) == pytest.approx(ALLREDUCE_S, rel=1e-6)
    # no migration measured yet: migrations are priced on the point-to-point link
    assert c.migration == c.intra
    assert [d.node for d in c.devices] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_coefficients_have_task_optimizer_and_overhead_terms(calibrated):
    co = calibrated.coefficients()
    assert co.task_overhead_s == pytest.approx(2 * TASK_S, rel=1e-9)  # forward + backward task
    assert co.optimizer_s_per_param == pytest.approx(OPT_S_PER_PARAM, rel=1e-9)
    assert co.compute_scale == 1.0 and co.comm_scale == 1.0
    # The running plan has multi-stage pipelines: the unexplained part is read per 1F1B slot.
    assert co.hop_overhead_s > 0 and co.step_overhead_s == 0


def test_predicted_step_matches_the_formula_and_the_measured_step(calibrated):
    # Hand-computed 1F1B step of pipeline 0 (device 2 at half speed), without the overhead.
    pipe = calibrated.plan.pipelines[0]
    m, p = pipe.microbatches, pipe.depth
    stage = [sum(FWD[b] + BWD[b] for b in range(pipe.bounds[s], pipe.bounds[s + 1])) for s in range(p)]
    c = [stage[s] / (0.5 if pipe.devices[s] == 2 else 1.0) + 2 * TASK_S for s in range(p)]
    hop = max(P2P.transfer_s(OUT[pipe.bounds[s + 1] - 1]) for s in range(p - 1))
    # 1F1B: the first micro-batch's round trip, then m - 1 periods (the slowest stage, or the
    # round trip from stage s on shared by its p - s micro-batches in flight)
    period = max([max(c)] + [(sum(c[s:]) + 2 * (p - 1 - s) * hop) / (p - s) for s in range(p)])
    busiest = max(sum(PARAMS[pipe.bounds[s]:pipe.bounds[s + 1]]) for s in range(p))
    expected = sum(c) + 2 * (p - 1) * hop + (m - 1) * period + ALLREDUCE_S + busiest * OPT_S_PER_PARAM
    assert calibrated.predicted_step(overhead=False) == pytest.approx(expected, rel=1e-6)
    # the residual median, per 1F1B slot of the pipeline, closes the gap to what the job measured
    assert calibrated.coefficients().hop_overhead_s == pytest.approx((STEP_S - expected) / (m + p - 1), rel=1e-6)
    assert calibrated.predicted_step() == pytest.approx(STEP_S, rel=1e-6)


def test_migration_link_follows_observed_migrations():
    pol = make_policy()
    pol.start(range(8))
    for step in range(1, 4):
        feed_step(pol, step, {})
    alpha, beta = 0.05, 2e9
    for rounds, nbytes in [(1, 1e8), (2, 3e8), (3, 2e8)]:
        pol.observe_migration(rounds, nbytes, rounds * alpha + nbytes / beta)
    mig = pol.cluster().migration
    assert mig.latency_s == pytest.approx(alpha, rel=1e-6)
    assert mig.bandwidth_Bps == pytest.approx(beta, rel=1e-6)
    assert pol.cluster().intra.bandwidth_Bps == pytest.approx(P2P.bandwidth_Bps, rel=1e-6)


def test_calibration_json_is_json_and_has_the_predicted_step(calibrated):
    out = json.loads(json.dumps(calibrated.calibration_json()))
    assert out["predicted_step_s"] == pytest.approx(calibrated.predicted_step(), rel=1e-12)
    assert out["plan"] == "2x PP4 on 8 devices"
    assert out["speeds"]["2"] == pytest.approx(0.5)
    assert [b[0] for b in out["blocks"]] == pytest.approx(FWD)
    assert out["task_overhead_s"] == pytest.approx(TASK_S)
    assert out["migration"] is None and out["collective"]["bandwidth_Bps"] > 0
    assert out["agree_s"] == 0.0 and out["rebuild_s"] == calibrated.rebuild_s


def roundtrip(pol: EngineBridge) -> EngineBridge:
    other = make_policy()
    other.load_state_dict(json.loads(json.dumps(pol.state_dict())))
    return other


def test_state_round_trip_reproduces_workload_cluster_and_prediction():
    calibrated = calibrated_policy()
    calibrated.agree_s = 0.25
    other = roundtrip(calibrated)
    assert other.state_dict()["pipeline_calibration"] == calibrated.state_dict()["pipeline_calibration"]
    assert other.agree_s == 0.25
    assert other.fit == calibrated.fit
    assert other.workload() == calibrated.workload()
    assert other.cluster() == calibrated.cluster()
    assert other.coefficients() == calibrated.coefficients()
    assert other.predicted_step() == calibrated.predicted_step()
    assert other.plan == calibrated.plan and other.alive == calibrated.alive


def test_state_loaded_between_refits_reproduces_the_prediction():
    pol = make_policy()
    pol.start(range(8))
    for step in range(1, 6):  # fitted at step 3; device 2 slows down from step 3 on
        feed_step(pol, step, {2: 0.5} if step >= 3 else {})
    other = roundtrip(pol)
    assert other.cluster() == pol.cluster()
    assert other.predicted_step() == pol.predicted_step()


def test_members_stay_identical_after_a_state_round_trip():
    pol = calibrated_policy()  # loaded right after the step-8 refit
    other = roundtrip(pol)
    for step, step_s in zip(range(9, 14), (3.0, 3.1, 2.9, 3.0, 3.2)):
        for member in (pol, other):
            feed_step(member, step, {2: 0.5}, step_s)
    assert other.pipe_cal.state_dict() == pol.pipe_cal.state_dict()
    assert other.coefficients() == pol.coefficients()


def test_a_worker_alone_in_its_stage_is_compared_with_the_fitted_block_costs():
    """After a re-plan into unequal pipelines no two workers may hold the same blocks: a slow one
    is then read against the fit's nominal seconds of its blocks (seen live: a 4x slow worker
    alone in its stage was never flagged, the straggler detector saw every worker as its own
    stage's fastest)."""
    from chameleon_ft.engine.plan import Pipeline, Plan
    pol = calibrated_policy()
    total = sum(PARAMS)
    pol.plan = Plan((Pipeline((4, 5, 6, 7), (0, 2, 4, 6, 8), 8), Pipeline((0, 2, 3), (0, 3, 5, 8), 8)))
    pol.alive = frozenset(pol.plan.devices)

    def compute(d, lo, hi, slow=1.0):  # what the runtime reports: per whole-model micro-batch
        share = sum(PARAMS[lo:hi]) / total
        return (8 * slow * sum(FWD[lo:hi] + BWD[lo:hi]) / share, 8, 0.0, 1.0)
    timings = {}
    for p in pol.plan.pipelines:
        for s, d in enumerate(p.devices):
            lo, hi = p.layers_of_stage(s)
            timings[d] = compute(d, lo, hi, 4.0 if d == 6 else 1.0)
    per_mb = pol._per_mb(timings)
    others = [v for d, v in per_mb.items() if d != 6]
    assert max(others) / min(others) == pytest.approx(1.0, rel=1e-6)  # nobody else reads slow
    assert per_mb[6] / min(others) == pytest.approx(4.0, rel=1e-6)
