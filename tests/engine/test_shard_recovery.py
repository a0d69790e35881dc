"""The engine's choice for sharded state (pure logic)."""

import math

import pytest

from chameleon_ft.engine.rehab import LossTrend
from chameleon_ft.engine.shard_recovery import (ShardFacts, choose_recovery, common_snapshot, describe,
                                         loss_trend, snapshot_interval)


def facts(**kw):
    base = dict(step=20, rows=4, current=frozenset({0, 1, 3}), snapshots={0: [10, 15], 1: [10, 15], 2: [10, 15], 3: [10, 15]},
                step_s=1.0, transfer_s=0.2, lost_fraction=0.25,
                trend=LossTrend(slope=-0.01, loss_now=1.0, loss_at_snapshot=1.05))
    base.update(kw)
    return ShardFacts(**base)


def test_heal_when_every_row_has_a_current_copy():
    d = choose_recovery(facts(current=frozenset(range(4))))
    assert d.chosen == "heal" and d.lost_rows == ()
    assert d.candidates["heal"]["lost_s"] == pytest.approx(0.2)


def test_nothing_lost_goes_on_in_place_even_where_heal_is_not_a_configured_path():
    """A failed collective that lost no worker (a commit one member missed) under Lightning's
    sharded adapter, whose paths are rehabilitate and restart: every row goes on from its live
    holder; it used to stop the whole job for a restart (exit 75, found with a ``drop`` fault)."""
    d = choose_recovery(facts(current=frozenset(range(4)), allowed=frozenset({"rehabilitate", "restart"})))
    assert d.chosen == "heal" and d.lost_rows == ()
    assert "nothing was lost" in d.candidates["heal"]["reason"]
    lost = choose_recovery(facts(allowed=frozenset({"rehabilitate", "restart"})))  # row 2 lost
    assert not lost.candidates["heal"]["feasible"]


def test_recompute_rolls_back_to_the_common_snapshot():
    # row 2 lost; its buddy holds only step 10: everybody goes back to 10
    d = choose_recovery(facts(snapshots={0: [10, 15], 1: [10, 15], 2: [10], 3: [10, 15]},
                              allowed=frozenset({"recompute", "restart"})))
    assert d.chosen == "recompute" and d.rollback_to == 10
    assert d.candidates["recompute"]["lost_s"] == pytest.approx(0.2 + 10 * 1.0)
    assert not d.candidates["rehabilitate"]["feasible"]  # not allowed


def _mean(xs):
    return sum(xs) / len(xs)


def test_rehabilitate_wins_late_in_the_interval_and_recompute_early():
    # late: 5 steps to redo; a quarter of the state 5 steps stale lags 1.25 steps at first,
    # healed by a tenth per step: the mean over the 16-step horizon (x 1.5 safety)
    late = choose_recovery(facts())
    assert late.chosen == "rehabilitate" and late.snapshot_step == 15
    point = _mean([1.25 * 0.9 ** t for t in range(1, 17)])
    assert late.predicted_heal_steps == pytest.approx(point)  # the point estimate
    assert late.candidates["rehabilitate"]["lost_s"] == pytest.approx(0.2 + 1.5 * point)  # with safety
    assert len(late.heal_path) == 16 and late.to_json()["heal_horizon"] == 16
    # early: one step since the snapshot; with Adam's first moment reset and ramping up again
    # (0.25 x 9 steps of shortfall), cheaper to redo than to heal
    early = choose_recovery(facts(step=16, momentum=0.9))
    assert early.chosen == "recompute" and early.rollback_to == 15
    lag = 0.25
    path = []
    for k in range(1, 17):
        lag = 0.9 * lag + 0.25 * 0.9 ** k
        path.append(lag)
    assert early.candidates["rehabilitate"]["steps"] == pytest.approx(1.5 * _mean(path))


def test_the_lag_rises_through_the_warm_up_then_heals_and_the_horizon_is_the_runs_at_most():
    """The measured shape (issue 23's matrix): the restored part's warmed-up updates fall
    behind for the warm-up's steps, then training closes the gap."""
    from chameleon_ft.engine.rehab import lag_path, repair_shortfall
    short = repair_shortfall(0.25, 0.9, warmup_steps=10, restart_bias_correction=True)
    assert short == pytest.approx([0.25 * (1 - k / 10) for k in range(1, 10)])
    path = lag_path(0.125, short, 0.1, 16)
    peak = path.index(max(path))
    assert 3 <= peak <= 9 and path[-1] < path[peak] / 2
    assert lag_path(1.0, [], 0.0, 4) == [1.0] * 4  # no healing, no repair: the lag stays
    with pytest.raises(ValueError):
        lag_path(1.0, [], 1.0, 4)
    repair = dict(momentum=0.9, warmup_steps=10, restart_bias_correction=True)
    d = choose_recovery(facts(remaining_steps=30, **repair))
    assert len(d.heal_path) == 16 and "over 16 steps" in d.candidates["rehabilitate"]["reason"]
    d = choose_recovery(facts(remaining_steps=6, **repair))  # priced over the run's 6 steps, not healed by then
    assert "over 6 steps" in d.candidates["rehabilitate"]["reason"] and d.chosen == "recompute"


def test_a_loss_falling_fast_prices_a_lag_that_does_not_heal():
    """Issue 23's CNN: with its log loss falling 7-18 % a step the lag stayed level over the 16
    steps measured (the prior's healing put every early CNN cell at half the lag measured)."""
    from chameleon_ft.engine.rehab import FAST_PROGRESS, heal_rate_at
    from chameleon_ft.engine.shard_recovery import progress_rate
    fast = [(s, 2.0 * math.exp(-0.12 * s)) for s in range(1, 12)]
    slow = [(s, 2.0 * math.exp(-0.03 * s)) for s in range(1, 12)]
    assert progress_rate(fast) == pytest.approx(-0.12) and progress_rate(slow) == pytest.approx(-0.03)
    assert progress_rate(fast[:2]) is None and progress_rate([(1, 1.0), (2, -0.5), (3, 0.2)]) is None
    assert heal_rate_at(0.1, -0.03) == (0.1, "") and heal_rate_at(0.1, None) == (0.1, "")
    rate, why = heal_rate_at(0.1, -0.12)
    assert rate == 0.0 and "falls 11% a step" in why and FAST_PROGRESS == 0.05
    repair = dict(momentum=0.9, warmup_steps=10, restart_bias_correction=True)
    healing = choose_recovery(facts(trend=loss_trend(slow), **repair))
    level = choose_recovery(facts(trend=loss_trend(fast), **repair))
    assert healing.chosen == level.chosen == "rehabilitate"
    # no healing: the lag only grows by the warm-up's shortfall and then stays
    assert level.heal_path[-1] == pytest.approx(max(level.heal_path))
    assert level.heal_path[-1] == pytest.approx(1.25 + 0.25 * 4.5)
    assert level.predicted_heal_steps > 1.5 * healing.predicted_heal_steps
    assert "no healing priced: the loss falls 11% a step" in level.candidates["rehabilitate"]["reason"]
    assert "no healing" not in healing.candidates["rehabilitate"]["reason"]


def test_a_flat_loss_prices_rehabilitation_by_the_lost_fraction():
    # a plateau: no slope to divide by, the lag is still a quarter of the steps since the snapshot
    d = choose_recovery(facts(trend=LossTrend(slope=0.01, loss_now=1.0, loss_at_snapshot=0.9)))
    flat = d.candidates["rehabilitate"]
    steep = choose_recovery(facts()).candidates["rehabilitate"]
    assert flat["feasible"] and flat["steps"] == pytest.approx(steep["steps"])
    d = choose_recovery(facts(trend=LossTrend(slope=float("inf"), loss_now=1.0)))
    assert d.chosen == "recompute" and "not a finite number" in d.candidates["rehabilitate"]["reason"]


def test_nothing_in_memory_falls_back_to_the_disk_checkpoint():
    d = choose_recovery(facts(snapshots={0: [15], 1: [15], 3: [15]}, checkpoint_step=12, restart_s=30.0))
    assert d.chosen == "restart"
    assert d.candidates["restart"]["lost_s"] == pytest.approx(30.0 + 8)
    # and with no checkpoint either, restart is still the answer (nothing feasible)
    d = choose_recovery(facts(snapshots={}))
    assert d.chosen == "restart" and not d.candidates["restart"]["feasible"]


def test_common_snapshot():
    assert common_snapshot(2, {0: [5, 10], 1: [10, 15]}, 20) == 10
    assert common_snapshot(2, {0: [5, 10], 1: [10, 15]}, 9) is None
    assert common_snapshot(2, {0: [5]}, 20) is None


def test_young_daly_interval():
    # C = 1 s, M = 1 h, 0.5 s steps: sqrt(2 * 3600) = 84.9 s, Daly's terms -> ~ 84 s -> 168 steps
    k = snapshot_interval(1.0, 3600.0, 0.5, hi=10_000)
    tau = math.sqrt(7200) * (1 + math.sqrt(1 / 7200) / 3 + 1 / (18 * 3600)) - 1
    assert k == round(tau / 0.5)
    assert snapshot_interval(1.0, 1e9, 0.5) == 200  # clamped
    assert snapshot_interval(0.0, 10.0, 1.0) == 1  # free snapshots: every step
    assert snapshot_interval(100.0, 10.0, 1.0) == 10  # cost above 2M: once per M
    # more failures -> more frequent snapshots
    assert snapshot_interval(0.1, 60.0, 0.1) < snapshot_interval(0.1, 600.0, 0.1)


def test_the_interval_is_bounded_by_the_run():
    # a realistic failure rate: Young/Daly alone says once in 200 steps, longer than the run
    assert snapshot_interval(0.01, 86_400.0 * 30, 0.05) == 200
    assert snapshot_interval(0.01, 86_400.0 * 30, 0.05, run_steps=64) == 8
    assert snapshot_interval(0.01, 86_400.0 * 30, 0.05, run_steps=5) == 1
    assert snapshot_interval(0.01, 60.0, 0.05, run_steps=10_000) == snapshot_interval(0.01, 60.0, 0.05)


def test_rehabilitation_never_restores_the_initial_state():
    d = choose_recovery(facts(step=7, snapshots={0: [0], 1: [0], 2: [0], 3: [0]},
                              trend=LossTrend(slope=-0.05, loss_now=1.0, loss_at_snapshot=2.0)))
    assert d.chosen == "recompute" and d.rollback_to == 0
    assert "initial state" in d.candidates["rehabilitate"]["reason"]


def test_rehabilitation_needs_the_run_to_be_long_enough_to_heal():
    # it heals in 1.5 x 1.25 steps: with 1 step left it would end the run with the gap open
    short = choose_recovery(facts(remaining_steps=1))
    assert short.chosen == "recompute"
    assert not short.candidates["rehabilitate"]["feasible"]
    assert "does not heal by the run's end" in short.candidates["rehabilitate"]["reason"]
    assert choose_recovery(facts(remaining_steps=30)).chosen == "rehabilitate"


def test_loss_trend_fits_the_recent_slope():
    hist = [(s, 2.0 - 0.01 * s) for s in range(50)]
    t = loss_trend(hist, window=20, at_snapshot=40)
    assert t.slope == pytest.approx(-0.01)
    assert t.loss_now == pytest.approx(2.0 - 0.49)
    assert t.loss_at_snapshot == pytest.approx(1.6)
    assert loss_trend(hist[:2]) is None


def test_the_first_moment_reset_is_priced():
    """Adam's beta1 = 0.9 reset on a quarter of the model: its updates ramp up again, a
    shortfall of 0.9 / 0.1 = 9 steps of that quarter = 2.25 whole-model steps."""
    d = choose_recovery(facts(momentum=0.9, heal_rate=0.0, heal_horizon=10_000))  # never heals: all of it
    assert d.candidates["rehabilitate"]["steps"] == pytest.approx(1.5 * (1.25 + 2.25), rel=0.01)
    # one step after a snapshot, redoing it is cheaper than the repair
    early = choose_recovery(facts(step=16, momentum=0.9))
    assert early.chosen == "recompute"


def test_the_repair_recipe_is_priced_as_it_is_carried_out():
    """A restarted bias correction makes the reset moment's updates full-size at once; a W-step
    linear warm-up then costs (W - 1) / 2 steps of the restored part; both off: the ramp."""
    from chameleon_ft.engine.rehab import repair_steps
    assert repair_steps(0.25, 0.9, warmup_steps=10, restart_bias_correction=True) == pytest.approx(0.25 * 4.5)
    assert repair_steps(0.25, 0.9) == pytest.approx(0.25 * 9, rel=1e-6)
    assert repair_steps(0.25, 0.0, warmup_steps=1) == 0.0
    both = repair_steps(0.25, 0.9, warmup_steps=10)  # warm-up on top of the ramp: dearer than either
    assert both > repair_steps(0.25, 0.9) and both > 0.25 * 4.5
    d = choose_recovery(facts(momentum=0.9, warmup_steps=10, restart_bias_correction=True, heal_rate=0.0,
                              heal_horizon=10_000))
    assert d.predicted_heal_steps == pytest.approx(1.25 + 0.25 * 4.5, rel=0.01)


def test_an_extrapolated_restore_is_priced_by_the_progress_it_does_not_bring_back():
    # The lost row moves along its last two snapshots' trend, damped by half: half the progress
    # since the snapshot comes back, so the lag is half the plain restore's.
    plain = choose_recovery(facts())
    moved = choose_recovery(facts(recovered=0.5))
    assert moved.chosen == "rehabilitate"
    assert moved.predicted_heal_steps == pytest.approx(0.5 * plain.predicted_heal_steps)
    assert "x 0.5 not recovered by the extrapolated restore" in moved.candidates["rehabilitate"]["reason"]
    # a recovered fraction outside [0, 1] is clamped, never a negative lag
    assert choose_recovery(facts(recovered=3.0)).predicted_heal_steps == pytest.approx(0.0)


def test_the_console_line_says_what_was_restored_and_what_was_not_taken():
    line = describe(choose_recovery(facts()).to_json())
    assert line.startswith("shard rows [2] lost: rehabilitate (restore rows [2] from step 15")
    # 0.25 x 5 steps at first, healed by a tenth per step: 0.57 on average over 16 steps
    assert "restart from step 15, predicted to lag 0.6 steps behind on average over the next 16" in line
    assert "not taken: heal: rows [2] have no surviving current copy" in line and "restart: no disk checkpoint" in line
    line = describe(choose_recovery(facts(step=7, snapshots={k: [0] for k in range(4)})).to_json())
    assert "recompute (roll back to step 0, redo 7 steps)" in line and "initial state" in line


def _history(n=20, slope=-0.01, noise=0.001):
    import random
    rng = random.Random(0)
    return [(s, 2.0 + slope * s + rng.uniform(-noise, noise)) for s in range(1, n + 1)]


def _watch(hc, start, lag_of_k, steps=12, slope=-0.01):
    """Feed ``hc`` the losses of a run ``lag_of_k(k)`` steps behind the line ``2 + slope s``."""
    records = []
    for k in range(1, steps + 1):
        s = start + k
        records += hc.observe(s, 2.0 + slope * (s - lag_of_k(k)))
    return records


def test_heal_check_measures_the_lag_and_is_on_track_when_it_is_as_predicted():
    from chameleon_ft.engine.shard_recovery import heal_check

    hc = heal_check(_history(), start=20, predicted=2.0, fallback_step=16)
    assert hc.log and hc.window == 3 and hc.noise < 0.002
    assert hc.slope == pytest.approx(-0.01 / 1.9, rel=0.05)  # log-space slope of 2 - 0.01 s at s ~ 10..20
    records = _watch(hc, 20, lambda k: 2.0)
    check = next(r for r in records if r["kind"] == "check")
    end = next(r for r in records if r["kind"] == "end")
    assert check["step"] == 23 and check["on_track"] and not check["fallback"]
    assert check["lag"] == pytest.approx(2.0, abs=0.3) and check["informative"]
    assert end["step"] == 26 and end["healed"] and end["measured_heal_steps"] == pytest.approx(2.0, abs=0.3)
    assert end["ratio"] == pytest.approx(1.0, abs=0.15)
    assert hc.done and hc.observe(27, 1.0) == []


def test_heal_check_falls_back_when_the_lag_exceeds_what_a_rollback_costs_now():
    from chameleon_ft.engine.shard_recovery import heal_check

    hc = heal_check(_history(), start=20, predicted=2.0, fallback_step=16)
    check = next(r for r in _watch(hc, 20, lambda k: 15.0) if r["kind"] == "check")
    # 15 steps behind, 4 at most expected; rolling back to 16 at step 23 redoes 7: fall back
    assert not check["on_track"] and check["fallback"] and check["fallback_step"] == 16
    assert check["lag_interval"][0] > 7


def test_heal_check_says_not_on_track_but_keeps_training_when_a_rollback_costs_more():
    from chameleon_ft.engine.shard_recovery import heal_check

    hc = heal_check(_history(), start=20, predicted=2.0, fallback_step=10)
    records = _watch(hc, 20, lambda k: 7.0)
    check = next(r for r in records if r["kind"] == "check")
    end = next(r for r in records if r["kind"] == "end")
    assert not check["on_track"] and not check["fallback"]  # 7 behind < 13 steps to redo
    assert not end["healed"] and end["ratio"] == pytest.approx(3.5, rel=0.1)
    # without a snapshot to roll back to there is never a fallback
    hc = heal_check(_history(), start=20, predicted=2.0)
    assert not any(r["fallback"] for r in _watch(hc, 20, lambda k: 30.0))


def test_heal_check_on_a_noisy_curve_is_not_informative_and_calibrates_nothing():
    from chameleon_ft.engine.shard_recovery import heal_check

    hc = heal_check(_history(noise=0.08), start=20, predicted=2.0)
    end = next(r for r in _watch(hc, 20, lambda k: 2.0) if r["kind"] == "end")
    assert not end["informative"] and end["measured_heal_steps"] is None and end["ratio"] is None
    assert end["on_track"]  # a wide interval is consistent with the prediction
    assert heal_check([(s, 1.0 + 0.01 * s) for s in range(20)], start=20, predicted=2.0) is None  # rising


def test_the_next_decision_is_scaled_by_the_measured_heal():
    base = choose_recovery(facts(remaining_steps=None))
    scaled = choose_recovery(facts(heal_scale=4.0))
    assert scaled.candidates["rehabilitate"]["steps"] == pytest.approx(4.0 * base.candidates["rehabilitate"]["steps"])
    assert "calibrated 4" in scaled.candidates["rehabilitate"]["reason"]


def test_a_current_snapshot_rehabilitates_with_nothing_to_heal_and_says_so():
    # the lost row's snapshot is of this very step: 0 steps to heal, and the line still prints
    d = choose_recovery(facts(step=15, allowed=frozenset({"rehabilitate", "restart"})))  # Lightning's
    assert d.chosen == "rehabilitate" and d.predicted_heal_steps == 0.0
    assert "predicted to catch up in 0.0 steps" in describe(d.to_json())
    assert "restart from step 15" in describe({**d.to_json(), "predicted_heal_steps": None})


def test_heal_check_holds_the_lag_against_the_predicted_path_over_the_same_steps():
    """With the engine's path (a lag that rises through the warm-up and heals), the check comes
    at half the horizon (at most 6 steps: the trend it extrapolates is a straight line) and
    compares the lag so far with the path's mean so far; the end record, as many steps later,
    calibrates on the path's mean over the steps it watched."""
    from chameleon_ft.engine.rehab import lag_path, repair_shortfall
    from chameleon_ft.engine.shard_recovery import heal_check

    path = lag_path(2.0, repair_shortfall(0.5, 0.9, warmup_steps=10, restart_bias_correction=True), 0.1, 16)
    b = -0.005  # a loss falling by 0.5 % a step: a straight line in log space, as the check fits it
    history = [(s, 2.0 * math.exp(b * s)) for s in range(1, 21)]
    hc = heal_check(history, start=20, predicted=_mean(path), path=path)
    assert hc.window == 6 and hc.check_at == 26

    def watch(hc, lag_of_k):
        return [r for k in range(1, 17) for r in hc.observe(20 + k, 2.0 * math.exp(b * (20 + k - lag_of_k(k))))]

    records = watch(hc, lambda k: path[k - 1])
    check = next(r for r in records if r["kind"] == "check")
    end = next(r for r in records if r["kind"] == "end")
    assert check["expected_lag"] == pytest.approx(_mean(path[:6]))
    assert check["lag"] == pytest.approx(_mean(path[:6]), rel=1e-6) and check["on_track"]
    assert end["step"] == 32 and end["expected_lag"] == pytest.approx(_mean(path[:12]))
    assert end["healed"] and end["ratio"] == pytest.approx(1.0, rel=1e-6)
    # a run that does not heal at all (the lag stays at the path's peak and more) is not on track
    hc = heal_check(history, start=20, predicted=_mean(path), path=path)
    check = next(r for r in watch(hc, lambda k: 3 * max(path) + 2) if r["kind"] == "check")
    assert not check["on_track"]


def test_on_a_plateau_the_heal_is_not_checked():
    """A slope of ~0 under noise is no trend to measure steps of progress against: no check
    (the console says the heal is not checked), never a fall back on a lag of tens of steps."""
    import random

    from chameleon_ft.engine.shard_recovery import heal_check

    rng = random.Random(7)  # falling, but by less than two standard errors: -0.0017 +- 0.0010 a step
    flat = [(s, 1.0 - 1e-4 * s + rng.gauss(0.0, 0.02)) for s in range(1, 21)]
    assert loss_trend([(s, math.log(v)) for s, v in flat], 16).slope < 0
    assert heal_check(flat, start=20, predicted=0.7, fallback_step=16) is None
    assert heal_check(_history(), start=20, predicted=0.7, fallback_step=16) is not None  # a clear slope


def test_near_a_plateau_the_slopes_own_error_widens_the_lag_and_nothing_falls_back():
    """Measured (issue-23 matrix, MLP seed 14, killed at step 33, 2026-12-04): the trend's
    slope was below zero by three standard errors (-0.011 +- 0.004), so the heal was checked,
    and one noisy step's residual read as 13.7 steps behind (8.7..18.6 with the noise alone):
    "NOT on track", a fall back to recompute, 7 steps redone for a lag the harness put at 0.3.
    With the slope's and the fitted line's errors in the interval it is 0.9..26.9: on track,
    not informative, no fall back.  The losses are that run's."""
    from chameleon_ft.engine.shard_recovery import heal_check

    losses = [0.9529, 1.0604, 1.0612, 0.9597, 0.9839, 0.9333, 1.0159, 0.9924, 0.8849, 0.8163, 0.9389,
              0.8368, 0.8285, 0.9703, 0.9514, 0.9266, 0.8278,  # steps 17..33, the kill at 33
              0.9808, 0.8953, 0.893, 1.1212, 0.963, 0.954]  # 34..39, after the repair
    hist = list(zip(range(17, 40), losses))
    hc = heal_check([h for h in hist if h[0] <= 33], 33, 0.583, fallback_step=32, path=[0.6] * 16)
    assert hc is not None and hc.slope + 2 * hc.slope_se < 0 and hc.fit_n == 16 and hc.fit_center == -7.5
    recs = [r for s, v in hist if s > 33 for r in hc.observe(s, v)]
    assert len(recs) == 1 and recs[0]["step"] == 39
    lag, (lo, hi) = recs[0]["lag"], recs[0]["lag_interval"]
    assert lag > 10 and lo < recs[0]["bound"] < hi  # the same lag, an honest interval
    assert recs[0]["on_track"] and not recs[0]["fallback"] and not recs[0]["informative"]
    # the noise alone (the check before): the same residuals fell back
    from dataclasses import replace
    old = replace(hc, slope_se=0.0, fit_n=0, residuals=[], check=None, done=False)
    recs = [r for s, v in hist if s > 33 for r in old.observe(s, v)]
    assert recs[0]["fallback"] and not recs[0]["on_track"]


def test_the_decision_says_how_far_behind_the_run_ends_and_never_leaves_it_over_half_a_step_behind():
    """Issue 23's matrix: the LM's late kills ended with a larger final loss (90 of its 100
    rehabilitated runs above their seed's; late kills +0.20 % median) because the run ended
    before the lag healed (predicted +0.26 % from that lag).  The Decision names that lag --
    quality lost, not time -- from the same path it prices, and rules rehabilitation out where
    it is over ``HEALED_LAG`` (half a step)."""
    from chameleon_ft.engine.rehab import lag_at, lag_path
    from chameleon_ft.engine.shard_recovery import HEALED_LAG
    repair = dict(momentum=0.9, warmup_steps=10, restart_bias_correction=True)
    slow = loss_trend([(s, 2.0 * math.exp(-0.03 * s)) for s in range(1, 21)])
    late = choose_recovery(facts(trend=slow, remaining_steps=9, **repair))
    early = choose_recovery(facts(trend=slow, remaining_steps=44, **repair))
    unknown = choose_recovery(facts(trend=slow, **repair))
    assert early.chosen == unknown.chosen == "rehabilitate" and HEALED_LAG == 0.5
    assert len(early.heal_path) == 16 and early.end_lag == pytest.approx(early.heal_path[-1] * 0.9 ** 28)
    assert early.end_lag < 0.05 and unknown.end_lag is None
    assert "the run ends 0.0" in early.candidates["rehabilitate"]["reason"]
    assert "the run ends" not in unknown.candidates["rehabilitate"]["reason"]
    assert early.to_json()["end_lag"] == early.end_lag and "the run ends" in describe(early.to_json())
    # 9 steps left: the lag after the 9th step of the path is over half a step -> recompute, saying why
    assert late.chosen == "recompute" and late.end_lag is None
    why = late.candidates["rehabilitate"]["reason"]
    assert not late.candidates["rehabilitate"]["feasible"]
    assert "does not heal by the run's end: over 0.5 steps" in why and "(9 steps after the repair)" in why
    ended = float(why.split("the run ends ")[1].split(" steps")[0])
    assert ended > HEALED_LAG and "; rehabilitate: restoring rows [2] from step 15 leaves" in describe(late.to_json())
    # without recompute (Lightning's adapter) the lag is said and rehabilitation stays the way
    # back: restart would redo the whole run since its checkpoint
    lit = choose_recovery(facts(trend=slow, remaining_steps=9, allowed=frozenset({"rehabilitate", "restart"}), **repair))
    assert lit.chosen == "rehabilitate" and lit.end_lag == pytest.approx(lit.heal_path[8]) and lit.end_lag > HEALED_LAG
    assert "the run ends" in describe(lit.to_json())
    # past the path: continued as lag_path does, shortfall included
    full = lag_path(1.0, [0.1, 0.2, 0.3], 0.2, 6)
    assert lag_at(full[:2], 6, 0.2, [0.1, 0.2, 0.3]) == pytest.approx(full[-1])
    assert lag_at((), 5, 0.1) is None and lag_at(full, 0, 0.2) == full[0]
    # where the lag does not heal (the loss falls over 5 % a step) the run would end the whole
    # lag behind, however long it still runs
    fast = choose_recovery(facts(trend=loss_trend([(s, 2.0 * math.exp(-0.12 * s)) for s in range(1, 21)]),
                                 remaining_steps=44, **repair))
    assert fast.chosen == "recompute" and "does not heal by the run's end" in fast.candidates["rehabilitate"]["reason"]
