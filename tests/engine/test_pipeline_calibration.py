"""Pipeline calibration recovers known terms from synthetic, noisy per-(device, block) timings
(the issue's acceptance: "calibration recovers injected per-stage slowdowns ... within 10 %"),
fits point-to-point and migration links, and survives a JSON state round trip."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from chameleon_ft.engine.calibrate import CollectiveSample, PipelineCalibrator, PipelineFit, fit_migration, fit_p2p
from chameleon_ft.engine.cluster import Link

# 8 blocks; forward seconds per micro-batch at speed 1.0 (backward = 2x forward, plus a bit).
FWD = [0.010, 0.012, 0.008, 0.020, 0.015, 0.011, 0.009, 0.014]
BWD = [2 * f + 0.001 for f in FWD]
STAGES, PIPELINES, M = 4, 2, 4  # 2 x PP4 over devices 0-7, 2 blocks per stage, 4 micro-batches each


def blocks_of(device: int) -> tuple[int, int]:
    s = device % STAGES
    return 2 * s, 2 * s + 1


def step_times(rng, speeds: dict[int, float], noise: float = 0.05) -> dict:
    """One step's measurements: per (device, block) forward s, backward s, micro-batches."""
    out = {}
    for d in range(STAGES * PIPELINES):
        v = speeds.get(d, 1.0)
        for b in blocks_of(d):
            f = M * FWD[b] / v * (1 + rng.normal(0, noise))
            bw = M * BWD[b] / v * (1 + rng.normal(0, noise))
            out[(d, b)] = (f, bw, M)
    return out


def feed(cal: PipelineCalibrator, rng, speeds, steps: int = 20) -> None:
    for _ in range(steps):
        cal.observe_step(step_times(rng, speeds), {b: 1000 * (b + 1) for b in range(8)})


# -- per-block costs and per-device speeds --------------------------------------------------
def test_recovers_block_costs_and_an_injected_slowdown_within_10_percent():
    cal = PipelineCalibrator(window=20)
    feed(cal, np.random.default_rng(0), {2: 0.5})
    fit = cal.fit(8)
    assert fit is not None
    for b in range(8):
        assert fit.fwd_s[b] == pytest.approx(FWD[b], rel=0.10)
        assert fit.bwd_s[b] == pytest.approx(BWD[b], rel=0.10)
    assert set(fit.speeds) == set(range(8))
    assert fit.speeds[2] == pytest.approx(0.5, rel=0.10)
    for d in set(range(8)) - {2}:
        assert fit.speeds[d] == pytest.approx(1.0, rel=0.10)
    # The slow device's blocks (4, 5) are costed from its healthy peer (device 6), not from it.
    assert fit.fwd_s[4] < 0.75 * 2 * FWD[4]
    assert fit.out_bytes == tuple(1000 * (b + 1) for b in range(8))


@pytest.mark.parametrize("slow,speed", [(0, 0.25), (5, 0.5), (7, 0.8)])
def test_recovers_slowdowns_of_any_stage(slow, speed):
    cal = PipelineCalibrator(window=20)
    feed(cal, np.random.default_rng(slow), {slow: speed})
    fit = cal.fit(8)
    assert fit.speeds[slow] == pytest.approx(speed, rel=0.10)
    assert min(v for d, v in fit.speeds.items() if d != slow) > 0.9
    assert all(v <= 1.0 for v in fit.speeds.values())


def test_window_forgets_a_slowdown_that_moved():
    cal = PipelineCalibrator(window=20)
    rng = np.random.default_rng(1)
    feed(cal, rng, {2: 0.5})
    assert cal.fit(8).speeds[2] == pytest.approx(0.5, rel=0.10)
    # Device 2 recovers; device 5 (pipeline 1, stage 1) slows down. After a full window only
    # the new regime counts.
    feed(cal, rng, {5: 0.5})
    fit = cal.fit(8)
    assert len(cal.blocks) == 20
    assert fit.speeds[2] == pytest.approx(1.0, rel=0.10)
    assert fit.speeds[5] == pytest.approx(0.5, rel=0.10)
    for b in range(8):
        assert fit.fwd_s[b] == pytest.approx(FWD[b], rel=0.10)


def test_a_slowdown_of_every_holder_reads_as_block_cost():
    """Stated limit: when both replicas of a stage are slow, the blocks look expensive."""
    cal = PipelineCalibrator()
    feed(cal, np.random.default_rng(2), {1: 0.5, 5: 0.5}, steps=5)
    fit = cal.fit(8)
    assert fit.fwd_s[2] == pytest.approx(2 * FWD[2], rel=0.10)
    assert fit.speeds[1] == pytest.approx(1.0, rel=0.10) and fit.speeds[5] == pytest.approx(1.0, rel=0.10)


def test_fit_is_none_before_min_steps():
    cal = PipelineCalibrator(min_steps=3)
    rng = np.random.default_rng(3)
    assert cal.fit(8) is None
    feed(cal, rng, {}, steps=2)
    cal.observe_step({})  # nothing measured: not a step of evidence
    cal.observe_step({(0, 0): (1.0, 1.0, 0)})  # zero micro-batches: ignored
    assert not cal.ready and cal.fit(8) is None
    feed(cal, rng, {}, steps=1)
    assert cal.ready and isinstance(cal.fit(8), PipelineFit)


# -- point-to-point link -------------------------------------------------------------------
@pytest.mark.parametrize("alpha,beta", [(1e-4, 1e9), (2e-5, 10e9)])
def test_fit_p2p_two_sizes_recovers_alpha_beta(alpha, beta):
    rng = np.random.default_rng(4)
    sizes, secs = [], []
    for x in (1e4, 1e7):
        for _ in range(20):
            sizes.append(x)
            secs.append((alpha + x / beta) * (1 + rng.normal(0, 0.05)))
    got = fit_p2p(sizes, secs)
    assert got.latency_s == pytest.approx(alpha, rel=0.10)
    assert got.bandwidth_Bps == pytest.approx(beta, rel=0.10)


@pytest.mark.parametrize("prior", [
    None,
    Link(1e-5, 1e9),
    pytest.param(Link(1.0, 1e9), id="prior-latency-above-measured"),
])
def test_fit_p2p_one_size_predicts_that_size(prior):
    rng = np.random.default_rng(5)
    secs = list(3e-4 * (1 + rng.normal(0, 0.05, 9)))
    got = fit_p2p([2e6] * 9, secs, prior=prior)
    assert got.transfer_s(2e6) == pytest.approx(float(np.median(secs)), rel=1e-6)
    # the prior's latency is kept when it fits under the measured time, none otherwise
    if prior is not None and prior.latency_s < np.median(secs):
        assert got.latency_s == prior.latency_s
    elif prior is None:
        assert got.latency_s == 0.0


@pytest.mark.parametrize("sizes,secs", [
    ([1e6, float("nan")], [1e-3, 2e-3]),
    ([1e6, 2e6], [1e-3, float("nan")]),
    ([1e6, 2e6], [1e-3, float("inf")]),
    ([-1e6, 2e6], [1e-3, 2e-3]),
    ([1e6, 2e6], [1e-3, -2e-3]),
])
def test_fit_p2p_rejects_bad_input(sizes, secs):
    with pytest.raises(ValueError):
        fit_p2p(sizes, secs)


def test_fit_p2p_without_samples_needs_a_prior():
    with pytest.raises(ValueError):
        fit_p2p([], [])
    prior = Link(1e-5, 1e10)
    assert fit_p2p([], [], prior=prior) == prior


def test_calibrator_fits_p2p_from_observed_messages():
    cal = PipelineCalibrator()
    feed(cal, np.random.default_rng(6), {}, steps=3)
    assert cal.fit(8).p2p is None  # nothing observed
    for x in (1e4, 1e7, 1e4, 1e7):
        cal.observe_p2p(x, 5e-5 + x / 2e9)
    cal.observe_p2p(1e4, float("nan"))  # dropped
    cal.observe_p2p(1e4, -1.0)  # dropped
    p2p = cal.fit(8).p2p
    assert p2p.latency_s == pytest.approx(5e-5, rel=1e-6)
    assert p2p.bandwidth_Bps == pytest.approx(2e9, rel=1e-6)


def test_a_rare_message_size_is_kept_and_the_fit_goes_through_each_sizes_median():
    """The steps send one size (1 KiB) hundreds of times, heavy-tailed; the link probe sends
    64 KiB once.  The probe's sample outlives the window of the common size, and the fit goes
    through both sizes' medians (3 ms + bytes / 200 kB/s), not through their means."""
    cal = PipelineCalibrator(window=20)
    feed(cal, np.random.default_rng(8), {}, steps=3)
    lat, bw = 3e-3, 2e5
    cal.observe_p2p(65536, lat + 65536 / bw)
    rng = np.random.default_rng(9)
    for i in range(1000):  # far more than the window keeps; one in five is 10x late
        late = 10.0 if i % 5 == 0 else 1.0
        cal.observe_p2p(1024, (lat + 1024 / bw) * late * rng.uniform(0.98, 1.02))
    assert len(cal.p2p) == 8 * 20 + 1
    p2p = cal.fit(8).p2p
    assert p2p.latency_s == pytest.approx(lat, rel=0.05)
    assert p2p.bandwidth_Bps == pytest.approx(bw, rel=0.05)
    restored = PipelineCalibrator(window=20)
    restored.load_state_dict(json.loads(json.dumps(cal.state_dict())))
    assert restored.p2p == cal.p2p


# -- task, optimizer, residual, collective and migration terms ------------------------------
def test_task_optimizer_and_residual_are_window_medians():
    cal = PipelineCalibrator()
    rng = np.random.default_rng(7)
    tasks = [(0.8, 400), (1.2, 400), (4.0, 400)]  # per task: 2 ms, 3 ms, 10 ms -> median 3 ms
    opts = [(0.5, 1e6), (0.7, 1e6), (0.6, 1e6)]  # per parameter: median 6e-7
    for t, o in zip(tasks, opts):
        cal.observe_step(step_times(rng, {}), tasks=t, optimizer=o)
    cal.observe_step(step_times(rng, {}), tasks=(1.0, 0), optimizer=(0.0, 1e6))  # no tasks, no time: ignored
    for r in (0.02, 0.05, 0.03, -0.5):
        cal.observe_residual(r)
    cal.observe_residual(float("nan"))  # dropped
    fit = cal.fit(8)
    assert fit.task_overhead_s == pytest.approx(3e-3, rel=1e-9)
    assert fit.optimizer_s_per_param == pytest.approx(6e-7, rel=1e-9)
    assert fit.step_overhead_s == pytest.approx(0.025, rel=1e-9)  # median of 4 values


def test_a_negative_residual_median_gives_no_overhead():
    cal = PipelineCalibrator()
    feed(cal, np.random.default_rng(8), {}, steps=3)
    for r in (-0.1, -0.2, 0.05):
        cal.observe_residual(r)
    assert cal.fit(8).step_overhead_s == 0.0


def test_migration_link_from_rounds_bytes_seconds():
    alpha, beta = 0.05, 2e9  # a round's fixed cost, effective bytes/s
    cal = PipelineCalibrator()
    feed(cal, np.random.default_rng(9), {}, steps=3)
    assert cal.fit(8).migration is None
    for rounds, nbytes in [(1, 1e8), (2, 3e8), (3, 2e8), (1, 5e8)]:
        cal.observe_migration(rounds, nbytes, rounds * alpha + nbytes / beta)
    cal.observe_migration(0, 1e8, 1.0)  # no rounds: ignored
    cal.observe_migration(2, 1e8, 0.0)  # no time: ignored
    mig = cal.fit(8).migration
    assert mig.latency_s == pytest.approx(alpha, rel=1e-6)
    assert mig.bandwidth_Bps == pytest.approx(beta, rel=1e-6)


def test_one_migration_keeps_the_p2p_latency_and_fits_bandwidth():
    """One heal (1 transfer, 1 MB, 5.27 s on a 3 ms + 200 kB/s link) cannot tell latency from
    bandwidth: the point-to-point link's latency is kept and the rest is bandwidth -- not 5.27 s
    of latency per transfer, which priced a 10-transfer re-plan at ~50 s (slowlink, 2026-12-03)."""
    p2p = Link(0.003, 2e5)
    one = fit_migration([(1, 1_052_672.0, 0.003 + 1_052_672 / 2e5)], p2p)
    assert one.latency_s == pytest.approx(0.003) and one.bandwidth_Bps == pytest.approx(2e5, rel=1e-6)
    # Alike samples (hops per byte within 2x) still cannot: the same rule.
    alike = fit_migration([(1, 1e6, 0.003 + 1e6 / 2e5), (4, 3e6, 4 * 0.003 + 3e6 / 2e5)], p2p)
    assert alike.bandwidth_Bps == pytest.approx(2e5, rel=1e-3)
    # Samples that differ do: both fitted (the p2p latency is not imposed).
    apart = fit_migration([(1, 1e6, 0.5 + 1e6 / 2e5), (20, 1e6, 20 * 0.5 + 1e6 / 2e5)], p2p)
    assert apart.latency_s == pytest.approx(0.5, rel=1e-6) and apart.bandwidth_Bps == pytest.approx(2e5, rel=1e-6)


def test_collective_link_needs_two_samples():
    cal = PipelineCalibrator()
    feed(cal, np.random.default_rng(10), {}, steps=3)
    cal.observe_collective(CollectiveSample(8, 1e8, 2 * 7 * 1e-4 + 2 * 7 / 8 * 1e8 / 1e10))
    assert cal.fit(8).collective is None
    cal.observe_collective(CollectiveSample(4, 4e8, 2 * 3 * 1e-4 + 2 * 3 / 4 * 4e8 / 1e10))
    coll = cal.fit(8).collective
    assert coll.latency_s == pytest.approx(1e-4, rel=1e-6)
    assert coll.bandwidth_Bps == pytest.approx(1e10, rel=1e-6)


_P2P_INF = ("observe_p2p checks nbytes >= 0 but not that it is finite: an inf size is kept and "
             "fit() then raises ValueError from fit_p2p on every call while it is in the window")
_COLL_NAN = ("observe_collective checks only observed_s: a NaN nbytes is kept and fit() raises "
             "ValueError (nnls: array must not contain infs or NaNs)")
_MIG_BAD = ("observe_migration checks rounds > 0 and seconds > 0 only: a NaN size or inf seconds is "
            "kept and fit() raises ValueError (nnls) until 8 newer migrations push it out")


@pytest.mark.parametrize("observe", [
    pytest.param(lambda c: c.observe_p2p(float("inf"), 1e-3), id="p2p-inf-bytes"),
    pytest.param(lambda c: c.observe_collective(CollectiveSample(4, float("nan"), 1e-3)), id="collective-nan-bytes"),
    pytest.param(lambda c: c.observe_migration(1, float("nan"), 1.0), id="migration-nan-bytes"),
    pytest.param(lambda c: c.observe_migration(1, 1e8, float("inf")), id="migration-inf-seconds"),
    pytest.param(lambda c: c.observe_p2p(1e4, float("nan")), id="p2p-nan-seconds"),
    pytest.param(lambda c: c.observe_collective(CollectiveSample(4, 1e8, float("inf"))), id="collective-inf-seconds"),
    pytest.param(lambda c: c.observe_residual(float("nan")), id="residual-nan"),
])
def test_a_non_finite_observation_does_not_break_the_fit(observe):
    """The observe_* methods drop NaN/negative samples (p2p seconds, residuals); a non-finite
    size or migration time must not poison every later fit either."""
    cal = PipelineCalibrator()
    feed(cal, np.random.default_rng(11), {}, steps=3)
    for x in (1e4, 1e7):
        cal.observe_p2p(x, 5e-5 + x / 2e9)
    for n in (4, 8):
        cal.observe_collective(CollectiveSample(n, 1e8, 2 * (n - 1) * 1e-4 + 2 * (n - 1) / n * 1e8 / 1e10))
    cal.observe_migration(1, 1e8, 0.1)
    cal.observe_migration(2, 3e8, 0.3)
    observe(cal)
    fit = cal.fit(8)
    for link in (fit.p2p, fit.collective, fit.migration):
        assert math.isfinite(link.latency_s) and math.isfinite(link.bandwidth_Bps)


# -- state ---------------------------------------------------------------------------------
def test_state_dict_round_trip_gives_an_identical_fit():
    cal = PipelineCalibrator(window=20)
    rng = np.random.default_rng(12)
    for i in range(6):
        cal.observe_step(step_times(rng, {3: 0.4}), {b: 512 * (b + 1) for b in range(8)},
                         tasks=(0.1 + 0.01 * i, 64), optimizer=(0.2, 1e6 + i))
        cal.observe_p2p(1e4 * (1 + i % 2) * 100, 1e-4 + 1e-3 * (i % 2))
        cal.observe_collective(CollectiveSample(8 - i % 2, 1e8 * (1 + i), 0.01 * (1 + i)))
        cal.observe_residual(0.01 * i)
    cal.observe_migration(2, 3e8, 0.4)
    cal.observe_migration(1, 1e8, 0.1)
    state = json.loads(json.dumps(cal.state_dict()))
    other = PipelineCalibrator(window=20)
    other.load_state_dict(state)
    before, after = cal.fit(8), other.fit(8)
    assert before is not None and before.p2p and before.collective and before.migration
    assert after == before
    assert json.dumps(after.to_json()) == json.dumps(before.to_json())
    assert other.state_dict() == cal.state_dict()
    # loading replaces what was there (no mixing with older samples)
    third = PipelineCalibrator(window=20)
    feed(third, np.random.default_rng(13), {0: 0.1}, steps=5)
    third.observe_migration(9, 9e9, 99.0)
    third.load_state_dict(state)
    assert third.fit(8) == before
