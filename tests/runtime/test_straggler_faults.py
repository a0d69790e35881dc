"""``jitter`` faults (random spikes: scheduling noise) and ``slow`` faults that end (a
straggler that recovers), in process."""

from __future__ import annotations

import pytest

from chameleon_ft.runtime.faults import FaultInjector, FaultSpec, parse_faults


def test_jitter_parses_validates_and_round_trips():
    spec = FaultSpec.parse("jitter:rank=0,1:factor=3:prob=0.25:from=2")
    assert spec == FaultSpec("jitter", ranks=(0, 1), factor=3.0, prob=0.25, from_step=2)
    assert FaultSpec.parse(spec.to_string()) == spec
    default = FaultSpec.parse("jitter:node=0")
    assert (default.factor, default.prob) == (4.0, 0.1)
    for bad, match in [("jitter:rank=0:prob=0", "prob must be in"), ("jitter:rank=0:prob=1.5", "prob must be in"),
                       ("slow:rank=0:prob=0.5", "prob= applies to jitter"),
                       ("kill:rank=0:factor=2", "factor= applies to jitter and slow"),
                       ("jitter:rank=0:factor=0.5", "jitter factor must be >= 1")]:
        with pytest.raises(ValueError, match=match):
            parse_faults(bad)


def test_jitter_pads_a_random_share_of_phases_reproducibly():
    def run(rank):
        delays = []
        inj = FaultInjector("jitter:rank=0,1:factor=4:prob=0.2", rank=rank,
                            on_fire=lambda spec, step, phase: delays.append(step), sleep=delays.append)
        for step in range(500):
            inj.at(step, "forward", phase_time=0.001)
        return delays[0::2], delays[1::2]  # (steps spiked, delays)

    steps, delays = run(0)
    assert delays and all(d == pytest.approx(0.003) for d in delays)  # (factor - 1) x the phase
    assert 0.12 < len(steps) / 500 < 0.28
    assert run(0) == (steps, delays) and run(1)[0] != steps  # seeded by the rank


def test_slow_with_to_ends():
    delays = []
    inj = FaultInjector("slow:rank=1:factor=4:to=2", rank=1, sleep=delays.append)
    for step in range(6):
        inj.at(step, "forward", phase_time=0.01)
    assert delays == pytest.approx([0.03] * 3)
