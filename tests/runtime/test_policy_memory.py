"""``ElasticConfig.device_memory_bytes`` reaches the engine: a re-plan never picks a layout whose
stages would not fit (without the limit the engine would fold the stages into fewer, fuller
devices); a limit that is not a positive number is a clear configuration error."""

from __future__ import annotations

import pytest

from chameleon_ft.engine.perf import estimate
from chameleon_ft.runtime.errors import ConfigError
from chameleon_ft.runtime.engine_bridge import EngineBridge

from test_policy_calibration import PARAMS, feed_step

STATE = 12  # bytes per parameter the engine counts: fp32 weights + Adam's two moments


def policy(memory=None, **kw) -> EngineBridge:
    pol = EngineBridge(PARAMS, global_batch=16, micro_batch=2, stages=4, per_node=4, mttf_s=3600.0,
                       memory_bytes=memory, allowed={"replan"}, **kw)
    pol.start(range(8))
    for step in range(1, 9):
        feed_step(pol, step, {})
    return pol


def replan_after_losing_worker_1(pol: EngineBridge):
    (d,) = pol.on_membership([m for m in range(8) if m != 1], hang=False, step=9)
    assert d.chosen == "replan"
    return pol.plan


def test_device_memory_must_be_positive():
    with pytest.raises(ConfigError, match="positive"):
        EngineBridge(PARAMS, 16, 2, stages=4, memory_bytes=0)


def _biggest_stage(plan) -> int:
    return max(sum(PARAMS[lo:hi]) for p in plan.pipelines for lo, hi in (p.layers_of_stage(s) for s in range(len(p.devices))))


def test_replan_keeps_every_stage_within_the_device_memory():
    free = policy()
    first = free.plan
    # the limit: what the first plan's fullest device needs (its 4 stages fit, by construction)
    limit = estimate(first, free.workload(), free.cluster(), free.coefficients()).peak_memory
    unlimited = replan_after_losing_worker_1(free)
    assert _biggest_stage(unlimited) * STATE > limit, "without the limit the re-plan uses fuller devices"
    capped = policy(memory=limit)
    plan = replan_after_losing_worker_1(capped)
    assert _biggest_stage(plan) <= _biggest_stage(first)
    assert estimate(plan, capped.workload(), capped.cluster(), capped.coefficients()).peak_memory <= limit
