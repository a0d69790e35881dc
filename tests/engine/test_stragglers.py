"""Straggler detection, the min-one-micro-batch allocation, and the runtime policy's straggler
path (flag, rebalance, measured-gain check, undo, clear) on simulated step timings.

The policy tests drive ``EngineBridge`` with the timings a data-parallel job would report for
its current allocation: each member's compute is its micro-batches times its per-micro-batch
seconds (times its slowdown), plus any fixed per-step delay.
"""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, strategies as st

from chameleon_ft.engine.failures import EventKind
from chameleon_ft.engine.planner import allocate_microbatches
from chameleon_ft.runtime.engine_bridge import EngineBridge
from chameleon_ft.engine.stragglers import StragglerDetector

from .conftest import ENGINE
from hypothesis import settings


# -- detector --------------------------------------------------------------------------
def feed(det, steps, slow=None, factor=3.0, ranks=4, noise=0.0, rng=None, start=0, unit=1.0, **kw):
    events = []
    for i in range(steps):
        t = {r: unit * (1 + (rng.uniform(-noise, noise) if rng else 0.0)) for r in range(ranks)}
        if slow is not None:
            t[slow] *= factor
        events.extend((start + i, e) for e in det.observe(t, time_s=float(start + i), **kw))
    return events


def jitter(det, steps, rng, *, spike_p, share=None, ranks=4, unit=1e-3, noise=0.3, factor=4.0):
    """~1 ms micro-batches, +-30 % noise, and single-step 4x spikes on random ranks.  Without
    ``share`` the detector is called as a caller that knows nothing of the batch would."""
    events = []
    for i in range(steps):
        t = {r: unit * (1 + rng.uniform(-noise, noise)) for r in range(ranks)}
        for r in t:
            if rng.random() < spike_p:
                t[r] *= factor
        if share is None:
            events.extend(det.observe(t, float(i)))
        else:
            step_s = max(t.values()) * share + 2e-3
            events.extend(det.observe(t, float(i), share=share, step_s=step_s))
    return events


def test_flags_a_sustained_3x_slow_rank_after_two_full_windows():
    det = StragglerDetector(window=5, windows=2)
    events = feed(det, 20, slow=2, unit=1.0)  # 3x of 1 s: the 2 s of evidence come at once
    assert len(events) == 1, "flagged once, not every step"
    step, ev = events[0]
    assert step == 2 * 5 - 1  # first full window at step 4, then above for 6 scores in a row
    assert ev.kind is EventKind.STRAGGLER and ev.devices == (2,)
    assert ev.slowdown == pytest.approx(3.0)
    assert set(det.flagged) == {2}


def test_a_sustained_3x_slowdown_at_1ms_is_flagged_when_it_costs_enough():
    # 3x of 1 ms with 4 micro-batches per rank: 8 ms a step, above the 5 ms floor; flagged once
    # the 12 ms steps add up to 1 s of evidence.
    det = StragglerDetector()
    got = feed(det, 150, slow=1, unit=1e-3, share=4.0)
    assert [e.devices for _, e in got] == [(1,)]
    assert got[0][0] == 4 + 83  # the first full window's step, then 83 more of 12 ms
    # The same slowdown with one micro-batch per rank costs 2 ms a step: not worth acting on.
    det = StragglerDetector()
    assert feed(det, 50, slow=1, unit=1e-3, share=1.0) == []


def test_floor_follows_the_step_time():
    det = StragglerDetector(min_cost_s=0.005, min_cost_frac=0.2)
    assert det.floor_s(0.001) == 0.005 and det.floor_s(1.0) == pytest.approx(0.2)
    # 3x of 10 ms costs 20 ms a step; a 200 ms step needs 40 ms.
    assert feed(det, 100, slow=0, unit=0.01, step_s=0.2) == []
    assert len(feed(StragglerDetector(), 100, slow=0, unit=0.01, step_s=0.05)) == 1


def test_evidence_must_span_min_evidence_s():
    """A 10-step episode of 40 ms steps (what a loaded 2-core machine does to a process) is
    0.4 s of evidence: not a straggler; the same slowdown held for 1 s is."""
    det = StragglerDetector()
    assert feed(det, 14, slow=1, unit=0.01, step_s=0.04) == []
    assert feed(det, 20, unit=0.01, step_s=0.04, start=14) == []
    got = feed(det, 80, slow=1, unit=0.01, step_s=0.04, start=34)
    # the window turns at its 3rd slow step (36), then 25 steps of 40 ms in a row
    assert [s for s, _ in got] == [36 + 24]
    assert len(feed(StragglerDetector(min_evidence_s=0), 10, slow=1, unit=0.01, step_s=0.04)) == 1


def test_injected_jitter_never_flags():
    """4x single-step spikes on random ranks (each rank spiked in 5 % of steps).  At two
    micro-batches per rank a spike costs 6 ms (over the floor): only sustained evidence may
    flag, and there is none."""
    for seed in range(5):
        for share in (None, 2.0):
            det = StragglerDetector()
            assert jitter(det, 3000, random.Random(seed), spike_p=0.05, share=share) == [], (seed, share)
            assert det.flagged == {}


@settings(ENGINE, max_examples=60)
@given(st.integers(0, 10_000), st.floats(0.0, 0.6), st.integers(2, 8), st.floats(0.25, 1.2))
def test_jitter_below_the_floor_never_flags(seed, spike_p, ranks, share):
    """However often ranks spike, a 4x slowdown of ~1 ms that costs less than 5 ms a step
    (at most 1.2 micro-batches per rank) is never a straggler."""
    det = StragglerDetector()
    assert jitter(det, 200, random.Random(seed), spike_p=spike_p, ranks=ranks, share=share) == []


@settings(ENGINE, max_examples=40)
@given(st.integers(0, 10_000), st.integers(2, 8), st.sampled_from([2.0, 3.0, 5.0]))
def test_a_sustained_slowdown_among_jitter_is_flagged(seed, ranks, factor):
    rng = random.Random(seed)
    det = StragglerDetector()
    slow = rng.randrange(ranks)
    flagged = []
    for i in range(150):  # 8 micro-batches of 2-6 ms: 1 s of evidence within ~65 steps
        t = {r: 1e-3 * (1 + rng.uniform(-0.2, 0.2)) for r in range(ranks)}
        t[slow] *= factor
        flagged += [e.devices for e in det.observe(t, float(i), share=8.0)]
    assert flagged == [(slow,)]


def test_noise_does_not_flap():
    det = StragglerDetector()
    assert feed(det, 500, noise=0.10, rng=random.Random(0)) == []
    assert det.flagged == {}


def test_hysteresis_holds_then_clears():
    det = StragglerDetector(window=4, enter=1.5, leave=1.2, windows=2)
    assert len(feed(det, 10, slow=1, factor=3.0)) == 1
    # 1.35x: below enter, above leave -> stays flagged, no new event
    assert feed(det, 20, slow=1, factor=1.35, start=10) == []
    assert 1 in det.flagged
    # back to normal: the window's median turns after 2 steps, then `window` scores below leave
    for i in range(4):
        feed(det, 1, start=30 + i)
        assert 1 in det.flagged and det.cleared == [], i
    feed(det, 1, start=34)
    assert 1 not in det.flagged and det.cleared == [1]
    # and it can be flagged again
    assert len(feed(det, 10, slow=1, start=35)) == 1


def test_a_rank_between_leave_and_enter_is_never_flagged():
    det = StragglerDetector()
    assert feed(det, 50, slow=3, factor=1.4) == []


def test_flags_a_3x_slow_rank_among_two():
    det = StragglerDetector()
    assert len(feed(det, 12, slow=1, ranks=2)) == 1


def test_an_idle_flagged_rank_is_cleared_not_flagged_for_ever():
    det = StragglerDetector(window=3)
    feed(det, 10, slow=1)
    assert 1 in det.flagged
    for i in range(2):
        det.observe({0: 1.0, 2: 1.0, 3: 1.0}, float(10 + i))  # rank 1 ran nothing
        assert 1 in det.flagged
    det.observe({0: 1.0, 2: 1.0, 3: 1.0}, 12.0)
    assert det.cleared == [1] and 1 not in det.flagged


def test_clear_with_hold_ignores_the_rank_then_needs_fresh_evidence():
    det = StragglerDetector(window=3, windows=2)
    feed(det, 10, slow=1)
    det.clear(1, hold=5)
    assert 1 not in det.flagged
    ev = feed(det, 30, slow=1, start=10)
    # 5 held steps (the hold counts down before it is checked), then a full window, then 4 more
    assert [s for s, _ in ev] == [10 + 4 + 2 + 3]


def test_detector_validation_forget_and_state():
    with pytest.raises(ValueError):
        StragglerDetector(enter=1.2, leave=1.5)
    with pytest.raises(ValueError):
        StragglerDetector(windows=0)
    with pytest.raises(ValueError):
        StragglerDetector(min_cost_frac=1.5)
    det = StragglerDetector()
    with pytest.raises(ValueError):
        det.observe({0: float("nan")})
    with pytest.raises(ValueError):
        det.observe({0: -1.0})
    feed(det, 12, slow=3)
    det.clear(2, hold=4)
    other = StragglerDetector()
    other.load_state_dict(det.state_dict())
    assert other.flagged == det.flagged and other.scores() == pytest.approx(det.scores())
    # the counters travel too: both flag/clear at the same step from here on
    for i in range(20):
        t = {0: 1.0, 1: 1.0, 2: 3.0, 3: 1.0}
        assert det.observe(t, float(i)) == other.observe(t, float(i))
        assert det.cleared == other.cleared and det.flagged == other.flagged
    det.forget([3])
    assert 3 not in det.flagged and 3 not in det.scores()


# -- allocation --------------------------------------------------------------------------
def finish(alloc, units):
    return max((m * u for m, u in zip(alloc, units) if m), default=0.0)


@settings(ENGINE, max_examples=200)
@given(st.lists(st.sampled_from([0.5, 1.0, 1.5, 2.0, 4.0, 10.0]), min_size=1, max_size=5), st.integers(0, 12))
def test_allocate_min_one_is_optimal_under_the_constraint(units, total):
    got = allocate_microbatches(units, [1] * len(units), total, min_each=1)
    assert sum(got) == total
    if total >= len(units):
        assert min(got) >= 1
        best = min(finish(a, units) for a in itertools.product(range(1, total + 1), repeat=len(units))
                   if sum(a) == total)
        assert finish(got, units) == pytest.approx(best)
    else:  # cannot give everyone one: the unconstrained optimum
        assert got == allocate_microbatches(units, [1] * len(units), total)


def test_allocate_min_one_keeps_a_slow_device_measurable():
    assert allocate_microbatches([1.0, 4.0, 1.0, 1.0], [1] * 4, 8) == [2, 0, 3, 3]
    assert allocate_microbatches([1.0, 4.0, 1.0, 1.0], [1] * 4, 8, min_each=1)[1] == 1


# -- runtime policy ----------------------------------------------------------------------
class SimJob:
    """Timings a data-parallel job reports for the policy's allocation."""

    def __init__(self, workers=4, global_batch=32, micro_batch=4, mb_s=0.1, comm_s=0.02, **kw):
        self.policy = EngineBridge([1000, 1000], global_batch, micro_batch, mttf_s=86400.0, **kw)
        self.policy.start(list(range(workers)))
        self.mb_s, self.comm_s = mb_s, comm_s
        self.step, self.prev = 0, 0.0
        self.decisions = []

    def run(self, steps, slow=None, fixed=None, check=None):
        """``slow``: {worker: per-micro-batch factor}; ``fixed``: {worker: seconds per step}."""
        for _ in range(steps):
            alloc = self.policy.allocation
            comp = {w: n * self.mb_s * (slow or {}).get(w, 1.0) + (fixed or {}).get(w, 0.0)
                    for w, n in alloc.items()}
            timings = {w: (comp[w], n, self.comm_s, self.prev) for w, n in alloc.items()}
            self.prev = max(comp.values()) + self.comm_s
            self.step += 1
            d = self.policy.observe_step(timings, self.step)
            if d is not None:
                self.decisions.append((self.step, d))
            if check:
                check(self)

    def kill(self, *workers):
        members = sorted(set(self.policy.alive) - set(workers))
        self.decisions += [(self.step, d) for d in self.policy.on_membership(members, False, self.step)]


def no_idle_worker(job):
    alloc, flagged = job.policy.allocation, job.policy.detector.flagged
    assert set(alloc) == set(job.policy.alive)
    assert sum(alloc.values()) == job.policy.current_batch // job.policy.micro_batch
    assert all(n >= 1 for n in alloc.values()), (job.step, alloc, flagged)


def test_a_flagged_worker_keeps_a_microbatch():
    job = SimJob()
    job.run(30, slow={1: 4.0}, check=no_idle_worker)
    flags = [d for _, d in job.decisions if d.event.slowdown > 1]
    assert [d.event.devices for d in flags] == [(1,)] and flags[0].chosen == "rebalance"
    alloc = job.policy.allocation
    assert alloc[1] == 1 and sum(alloc.values()) == 8, alloc
    assert job.policy.detector.flagged.keys() == {1}  # still measured: still slow


def test_steps_of_a_millisecond_are_observed_in_a_sample_and_a_costly_straggler_at_every_step():
    """Steps shorter than the detector's min_cost_s are observed once per min_cost_s of them
    (the failure-rate estimator still counts every second); a slowdown that costs min_cost_s
    makes every step that long, so it is flagged at the step it would be were every step
    observed (forced here by a full span before each)."""
    calls = []

    def counting(job):
        real = job.policy.detector.observe
        job.policy.detector.observe = lambda *a, **k: calls.append(job.step) or real(*a, **k)

    fast = SimJob(mb_s=0.0002, comm_s=0.0002)  # 2 micro-batches a worker: 0.6 ms steps
    counting(fast)
    fast.run(600)
    ran_s = 599 * 0.0006  # every step's seconds after the first
    assert 3 <= len(calls) < 600 * 0.0006 / 0.005 + 10, len(calls)  # (the first three: warm-up)
    assert fast.policy.estimator.device_s == pytest.approx(4 * ran_s, abs=4 * 0.005)

    def flagged_at(force: bool):
        job = SimJob(mb_s=0.0002, comm_s=0.0002)
        job.run(20)
        for _ in range(200):  # worker 1 takes 10 ms more a micro-batch: 20 ms a step
            if force:
                job.policy._since_s = 1.0
            job.run(1, slow={1: 50.0})
        return [(s, d.event.devices) for s, d in job.decisions]
    sampled = flagged_at(False)
    assert sampled and sampled == flagged_at(True), sampled


def test_flags_then_a_kill_leave_no_worker_idle_and_clearing_restores_the_even_split():
    """The observed failure: two workers flagged, then a third killed.  Every live worker keeps
    a micro-batch throughout; once the two are fast again their flags clear and the even split
    over the survivors comes back."""
    job = SimJob()
    job.run(14, slow={1: 4.0, 2: 4.0}, check=no_idle_worker)
    assert set(job.policy.detector.flagged) == {1, 2}
    assert any(d.chosen == "rebalance" for _, d in job.decisions)
    job.kill(3)
    no_idle_worker(job)
    job.run(5, slow={1: 4.0, 2: 4.0}, check=no_idle_worker)
    job.run(20, check=no_idle_worker)
    assert job.policy.detector.flagged == {}
    assert sorted(job.policy.allocation.values()) == [2, 3, 3]
    clears = [d for _, d in job.decisions if d.event.slowdown == 1.0]
    assert clears and "cleared" in clears[-1].event.detail and clears[-1].chosen == "rebalance"


def test_a_cleared_flag_restores_the_even_split():
    job = SimJob()
    job.run(20, slow={2: 3.0})
    assert job.policy.allocation[2] < 2
    job.run(15, check=no_idle_worker)
    assert job.policy.detector.flagged == {}
    assert list(job.policy.allocation.values()) == [2, 2, 2, 2]
    last = job.decisions[-1][1]
    assert last.event.devices == (2,) and "flag of [2] cleared" in last.event.detail


def test_a_rebalance_without_measured_gain_is_undone():
    """Worker 1 stalls 3 s every step whatever its share (a per-step delay that micro-batches
    cannot move): its per-micro-batch time looks 16x slow, the rebalance gives it fewer, and the
    measured step gets 3 % shorter (under the 5 % a rebalance must save) -- so the rebalance is undone and the even split is back."""
    job = SimJob()
    job.run(80, fixed={1: 3.0}, check=no_idle_worker)
    chosen = [(s, d.chosen, d.event.slowdown > 1, d.event.detail) for s, d in job.decisions]
    rebalances = [c for c in chosen if c[2]]
    undos = [c for c in chosen if "undone" in c[3]]
    assert rebalances and rebalances[0][1] == "rebalance", chosen
    assert undos, chosen
    step_undo = undos[0][0]
    assert step_undo - rebalances[0][0] == job.policy.verify_steps
    assert "measured compute path" in undos[0][3] and undos[0][1] == "rebalance"
    # the hold doubles with every undo, so the flapping slows down
    gaps = [b[0] - a[0] for a, b in zip(rebalances, rebalances[1:])]
    assert len(gaps) >= 2 and all(g2 > g1 for g1, g2 in zip(gaps, gaps[1:])), gaps
    # right after an undo, the even split
    job2 = SimJob()
    job2.run(step_undo, fixed={1: 3.0})
    assert list(job2.policy.allocation.values()) == [2, 2, 2, 2]


def test_a_rebalance_that_pays_is_kept():
    job = SimJob()
    job.run(40, slow={3: 4.0})
    assert not any("undone" in d.event.detail for _, d in job.decisions)
    assert job.policy.allocation[3] == 1


def test_fewer_microbatches_than_workers():
    """8 samples in micro-batches of 4 on 4 workers: two idle workers.  A slow worker is
    moved off; its flag then goes stale (no timing) and clears, so it is not flagged for ever."""
    job = SimJob(global_batch=8)
    seen_flagged = set()

    def check(j):
        assert sum(j.policy.allocation.values()) == 2
        seen_flagged.update(j.policy.detector.flagged)

    job.run(40, slow={0: 4.0}, check=check)
    assert 0 in seen_flagged
    assert any("cleared" in d.event.detail for _, d in job.decisions)


def test_policy_state_round_trip_keeps_the_check():
    job = SimJob(straggler_options={"verify_steps": 3, "window": 4})
    job.run(9, fixed={1: 3.0})
    assert job.policy._check is not None
    other = EngineBridge([1000, 1000], 32, 4, mttf_s=86400.0,
                         straggler_options={"verify_steps": 3, "window": 4})
    other.load_state_dict(job.policy.state_dict())
    assert other.state_dict() == job.policy.state_dict()
    with pytest.raises(ValueError, match="unknown straggler options"):
        EngineBridge([1], 32, 4, straggler_options={"patience": 3})


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=1, max_size=5), min_size=2, max_size=40),
       st.booleans())
def test_scores_are_the_leave_one_out_medians_exactly(samples, ties):
    """Each rank's reference is the median of the others' medians -- the same number as the
    plain definition (taken in O(N log N) for a step's scores, not O(N^2)), ties included."""
    from statistics import median
    det = StragglerDetector(window=5)
    for rank, ts in enumerate(samples):
        for t in ts:
            det._samples.setdefault(rank, __import__("collections").deque(maxlen=5)).append(round(t) if ties else t)
    per_rank = {r: median(q) for r, q in det._samples.items()}
    for r, (score, ref, own) in det._scored().items():
        plain = median(v for k, v in per_rank.items() if k != r)
        assert ref == plain and score == (per_rank[r] / plain if plain > 0 else 1.0)
        assert own == per_rank[r]  # the detector's own median: statistics.median's number
