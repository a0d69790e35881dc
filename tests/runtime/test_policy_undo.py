"""A Decision whose migration a failure interrupts is undone and decided again (the executor's
``source_payload`` calls ``undo_migration`` when the survivors' holdings do not cover the new
plan): the same lost workers, plus any lost since, on the plan before it; the workers a grow or
heal took in join again, counted once against the launcher's replacements."""

from __future__ import annotations

from chameleon_ft.runtime.engine_bridge import EngineBridge

from test_policy_calibration import PARAMS, feed_step


def make() -> EngineBridge:
    pol = EngineBridge(PARAMS, global_batch=16, micro_batch=2, stages=4, per_node=8, mttf_s=1e6,
                       replacement_eta_s=None, max_replacements=3, allowed={"replan", "restart", "keep", "grow"})
    pol.start(range(8))
    for step in range(1, 9):
        feed_step(pol, step, {})
    return pol


def test_an_interrupted_replan_is_decided_again_for_every_lost_worker():
    pol = make()
    before_plan, before_alloc = pol.plan, dict(pol.allocation)
    before = pol.layout()
    (d,) = pol.on_membership([m for m in range(8) if m != 5], hang=False, step=9)
    assert d.chosen == "replan" and pol.plan != before_plan
    pol.begin_migration(before)
    assert pol.migrating_from["dead"] == [5]
    state = pol.state_dict()  # what every member receives with the recovery payload
    pol2 = make()
    pol2.load_state_dict(state)
    pol2.undo_migration()  # worker 2 dies during the migration; the holdings do not cover the new plan
    assert pol2.plan == before_plan and pol2.allocation == before_alloc and pol2.migrating_from is None
    (again,) = pol2.on_membership([m for m in range(8) if m not in (2, 5)], hang=False, step=9)
    assert list(again.event.devices) == [2, 5] and again.chosen == "replan"
    assert pol2.alive == frozenset(range(8)) - {2, 5}
    # The MTTF estimate counts each loss once, as if the first Decision had not been taken.
    fresh = make()
    fresh.on_membership([m for m in range(8) if m not in (2, 5)], hang=False, step=9)
    assert pol2.estimator.state_dict() == fresh.estimator.state_dict()


def test_an_interrupted_grow_lets_the_joiner_join_again():
    pol = make()
    pol.on_membership([m for m in range(8) if m != 1], hang=False, step=9)  # re-plan over 7
    pol.migrating_from = None  # that migration completed
    before = pol.layout()
    (d,) = pol.on_membership(range(8), hang=False, step=12)  # worker 1's replacement joins
    assert d.chosen in ("grow", "keep")
    used = dict(pol.replacements_used)
    pol.begin_migration(before)
    pol.undo_migration()
    assert 1 not in pol.alive and pol.replacements_used != used
    (again,) = pol.on_membership(range(8), hang=False, step=12)
    assert again.event.kind.value == "join" and list(again.event.devices) == [1]
    assert pol.replacements_used == used  # counted once
