"""The replacement ETA the engine decides with follows what the job observed: the prior (a
worker's own start-up) until a replacement joins, then the median loss -> join delay; the
figures travel in the engine state a joiner receives."""

from __future__ import annotations

import pytest

import chameleon_ft.runtime.engine_bridge as policy_mod
from chameleon_ft.runtime.engine_bridge import EngineBridge

from test_policy_calibration import PARAMS, feed_step


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(policy_mod.time, "time", lambda: now[0])
    return now


def make(eta=13.0) -> EngineBridge:
    pol = EngineBridge(PARAMS, global_batch=16, micro_batch=2, stages=4, per_node=8, mttf_s=3600.0,
                       replacement_eta_s=eta, max_replacements=3)
    pol.start(range(8))
    for step in range(1, 9):
        feed_step(pol, step, {})
    return pol


def wait_reason(decision) -> str:
    return next(o.reason for o in decision.options if o.policy == "wait")


def test_eta_is_the_prior_until_a_replacement_joined_then_the_observed_delay(clock):
    pol = make()
    (d,) = pol.on_membership([m for m in range(8) if m != 1], hang=False, step=9)
    assert "arrives (in 13 s)" in wait_reason(d)
    clock[0] += 3.0
    pol.on_membership(range(8), hang=False, step=12)  # worker 1's replacement joins
    assert pol.replacement_eta_s == pytest.approx(3.0) and pol.replacement_delays == [pytest.approx(3.0)]
    clock[0] += 20.0
    (d,) = pol.on_membership([m for m in range(8) if m != 6], hang=False, step=30)
    assert "arrives (in 3 s)" in wait_reason(d)
    clock[0] += 5.0
    pol.on_membership(range(8), hang=False, step=40)
    assert pol.replacement_eta_s == pytest.approx(4.0)  # median of 3 and 5


def test_no_eta_stays_none_and_state_round_trips(clock):
    pol = make(eta=None)
    pol.on_membership([m for m in range(8) if m != 1], hang=False, step=9)
    clock[0] += 2.0
    state = pol.state_dict()
    pol.on_membership(range(8), hang=False, step=12)
    assert pol.replacement_eta_s is None and pol.replacement_delays == [pytest.approx(2.0)]
    joiner = make(eta=7.0)
    joiner.load_state_dict(state)  # a member that joined before the replacement did
    assert joiner.replacement_eta_s is None and joiner._lost_at == {1: pytest.approx(1000.0)}
    other = make()
    other.load_state_dict(pol.state_dict())
    assert other.replacement_delays == pol.replacement_delays


def test_keep_after_a_join_leaves_the_joiners_idle_instead_of_restarting():
    """Workers that join where the engine keeps the rerouted plan (more workers would not be
    faster) become members with no micro-batch: before, the allocation over the joiners did
    not add up and the job restarted (found with a node that rejoined after a partition)."""
    pol = EngineBridge([1000] * 4, global_batch=24, micro_batch=2, per_node=2, mttf_s=3600.0,
                       allowed=frozenset({"reroute", "keep"}))
    pol.start(range(6))
    (d,) = pol.on_membership([0, 1, 2, 3], hang=True, step=5)
    assert d.chosen == "reroute" and sum(pol.allocation.values()) == 12
    (d,) = pol.on_membership(range(6), hang=False, step=9)
    assert d.chosen == "keep"
    assert pol.allocation[4] == pol.allocation[5] == 0 and sum(pol.allocation.values()) == 12
    assert pol.alive == frozenset(range(6))
