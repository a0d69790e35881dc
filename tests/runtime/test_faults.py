"""Fault specs, their text form, and real signals on real processes."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from chameleon_ft.runtime.faults import (
    ENV_VAR,
    PHASES,
    FaultInjector,
    FaultSpec,
    faults_from_env,
    format_faults,
    kill_process,
    parse_faults,
    process_state,
)

REPO = Path(__file__).resolve().parents[2]

# A worker that walks steps and phases, printing each phase as it completes it.
WORKER = textwrap.dedent(
    """
    import sys
    from chameleon_ft.runtime.faults import FaultInjector
    inj = FaultInjector.from_env(rank=int(sys.argv[1]), nproc_per_node=2)
    for step in range(int(sys.argv[2])):
        for ph in ("step_start", "forward", "backward", "allreduce", "optimizer"):
            with inj.phase(step, ph):
                print(step, ph, flush=True)
    print("done", flush=True)
    """
)


# -- parsing ---------------------------------------------------------------------------


def test_parse_example_from_docs():
    kill, slow = parse_faults("kill:rank=2:step=10:phase=backward;slow:rank=1:factor=3:from=5")
    assert kill == FaultSpec("kill", ranks=(2,), step=10, phase="backward")
    assert slow == FaultSpec("slow", ranks=(1,), factor=3.0, from_step=5)
    assert parse_faults("") == [] and parse_faults(None) == [] and parse_faults(" ; ") == []


def test_parse_tolerates_spaces_case_and_flags():
    (s,) = parse_faults("  SLOW : rank = 0,3 : from=1 : to=4 : once ; ")
    assert s.ranks == (0, 3) and (s.from_step, s.to_step) == (1, 4) and s.once
    assert FaultSpec.parse("hang:node=1:once=0").once is False
    assert FaultSpec.parse("exit:rank=0").code == 1
    assert FaultSpec.parse("slow:rank=0").factor == 2.0


def test_env_var():
    env = {ENV_VAR: "hang:node=1:step=4:phase=allreduce"}
    assert faults_from_env(env) == [FaultSpec("hang", node=1, step=4, phase="allreduce")]
    assert faults_from_env({}) == []


@pytest.mark.parametrize(
    "text, match",
    [
        ("explode:rank=1", "unknown fault action"),
        ("kill:rank=1:phase=lunch", "unknown phase"),
        ("kill:step=3", "needs a target"),
        ("kill:rank=1:node=0", "either rank= or node="),
        ("kill:rank=1:step=-1", "step must be >= 0"),
        ("kill:rank=-1", ">= 0"),
        ("slow:rank=1:factor=0.5", "factor must be >= 1"),
        ("slow:rank=1:factor=nan", "factor must be >= 1"),
        ("slow:rank=1:from=5:to=2", "empty step range"),
        ("slow:rank=1:step=2:from=1", "not both"),
        ("kill:rank=1:factor=2", "slow faults only"),
        ("kill:rank=1:delay=2", "slow faults only"),
        ("slow:rank=1:factor=2:delay=1", "factor= or delay="),
        ("slow:rank=1:delay=-1", "delay must be"),
        ("jitter:rank=1:delay=inf", "delay must be"),
        ("kill:rank=1:from=2", "slow and nan faults only"),
        ("kill:rank=1:code=3", "exit faults only"),
        ("exit:rank=1:code=0", "exit code"),
        ("kill:rank=x", "bad number"),
        ("kill:rank=1:step", "needs a value"),
        ("kill:rank=1:colour=red", "unknown fault field"),
        ("kill:rank=1:step=1:step=2", "twice"),
        ("kill:rank=1:once=maybe", "flag"),
        (":rank=1", "empty fault spec"),
    ],
)
def test_bad_specs_raise_clear_errors(text, match):
    with pytest.raises(ValueError, match=match):
        parse_faults(text)


specs = st.one_of(
    st.builds(
        FaultSpec,
        action=st.sampled_from(["kill", "hang"]),
        ranks=st.lists(st.integers(0, 64), min_size=1, max_size=3).map(tuple),
        step=st.none() | st.integers(0, 10**6),
        phase=st.sampled_from(PHASES),
        once=st.booleans(),
    ),
    st.builds(FaultSpec, action=st.just("exit"), node=st.integers(0, 8),
              step=st.integers(0, 99), code=st.integers(1, 255)),
    st.builds(
        FaultSpec,
        action=st.just("slow"),
        ranks=st.lists(st.integers(0, 64), min_size=1, max_size=3).map(tuple),
        factor=st.floats(1, 100, allow_nan=False),
        from_step=st.none() | st.integers(0, 50),
        to_step=st.none() | st.integers(50, 100),
        phase=st.sampled_from(PHASES),
        once=st.booleans(),
    ),
)


specs = st.one_of(specs, st.builds(FaultSpec, action=st.sampled_from(["slow", "jitter"]), ranks=st.just((0,)),
                                   delay=st.floats(0, 100, allow_nan=False), step=st.none() | st.integers(0, 99)))


@given(st.lists(specs, max_size=4))
def test_to_string_round_trips(spec_list):
    assert parse_faults(format_faults(spec_list)) == spec_list


# -- matching, in process ----------------------------------------------------------------


def test_targets_by_rank_and_by_node():
    node1 = FaultSpec("kill", node=1, step=0)
    assert node1.target_ranks(4) == (4, 5, 6, 7)
    hit = [r for r in range(8) if FaultInjector([node1], rank=r, nproc_per_node=4)]
    assert hit == [4, 5, 6, 7]
    assert FaultInjector([node1], rank=0, node_rank=1)  # explicit node rank wins
    assert not FaultInjector("kill:rank=2:step=0", rank=1)
    inj = FaultInjector(None, rank=5, nproc_per_node=4)
    assert (inj.node_rank, inj.local_rank) == (1, 1)


def test_slow_applies_factor_minus_one_times_phase_time_in_range():
    delays = []
    inj = FaultInjector("slow:rank=0:factor=3:from=2:to=3:phase=backward", rank=0, sleep=delays.append)
    for step in range(6):
        for ph in ("forward", "backward"):
            inj.at(step, ph, phase_time=0.5)
    assert delays == [1.0, 1.0]
    assert inj.slept == 2.0


def test_a_slow_delay_pads_by_seconds_whatever_the_phase_took():
    delays: list[float] = []
    inj = FaultInjector("slow:rank=0:delay=1.5:step=2:phase=optimizer", rank=0, sleep=delays.append)
    inj.at(1, "optimizer", phase_time=0.01)
    inj.at(2, "optimizer", phase_time=0.01)
    inj.at(2, "backward", phase_time=9.0)
    inj.at(2, "optimizer", phase_time=7.0)  # a second call at the same step: ranged, pads again
    assert delays == [1.5, 1.5] and inj.slept == 3.0


def test_slow_once_fires_once_and_at_needs_concrete_phase():
    delays = []
    inj = FaultInjector("slow:rank=0:factor=2:once", rank=0, sleep=delays.append)
    for step in range(3):
        inj.at(step, "forward", phase_time=0.1)
    assert delays == [0.1]
    with pytest.raises(ValueError, match="phase must be"):
        inj.at(0, "any")


def test_on_fire_callback_sees_exit_before_it_happens():
    seen = []
    inj = FaultInjector("exit:rank=0:step=1:phase=optimizer:code=4", rank=0,
                        on_fire=lambda s, step, ph: seen.append((s.action, step, ph)))
    inj.at(0, "optimizer")
    inj.at(1, "forward")
    with pytest.raises(SystemExit) as e:
        inj.at(1, "optimizer")
    assert e.value.code == 4 and seen == [("exit", 1, "optimizer")]
    inj.at(1, "optimizer")  # fires once per process


def test_slow_context_manager_measurably_slows_the_phase():
    inj = FaultInjector("slow:rank=0:factor=3:phase=forward", rank=0)

    def timed(phase):
        t0 = time.perf_counter()
        with inj.phase(0, phase):
            time.sleep(0.05)
        return time.perf_counter() - t0

    assert timed("forward") / timed("backward") > 1.5


# -- real processes ----------------------------------------------------------------------


def start_worker(tmp_path, faults, rank=0, steps=6):
    out = open(tmp_path / "out.txt", "w")
    err = open(tmp_path / "err.txt", "w")
    env = {**os.environ, ENV_VAR: faults, "PYTHONPATH": str(REPO)}
    try:
        return subprocess.Popen([sys.executable, "-c", WORKER, str(rank), str(steps)],
                                stdout=out, stderr=err, env=env)
    finally:
        out.close()
        err.close()


def reap(proc):
    """Always leave no process behind: SIGKILL by PID (it ends stopped processes too)."""
    if proc.poll() is None:
        kill_process(proc.pid, "kill")
    proc.wait(timeout=10)


def lines(tmp_path, name="out.txt"):
    return (tmp_path / name).read_text().splitlines()


def wait_for_state(pid, state, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process_state(pid) == state:
            return True
        time.sleep(0.02)
    return False


def test_kill_fires_at_the_right_step_and_phase(tmp_path):
    proc = start_worker(tmp_path, "kill:rank=0:step=3:phase=backward")
    try:
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        reap(proc)
    out = lines(tmp_path)
    assert out[-2:] == ["3 step_start", "3 forward"]
    assert len(out) == 3 * 5 + 2
    assert "fault: kill rank=0" in (tmp_path / "err.txt").read_text()


def test_kill_targets_only_its_rank(tmp_path):
    proc = start_worker(tmp_path, "kill:rank=2:step=1", rank=1, steps=2)
    try:
        assert proc.wait(timeout=30) == 0
    finally:
        reap(proc)
    assert lines(tmp_path)[-1] == "done"


def test_node_fault_hits_every_local_rank_of_that_node(tmp_path):
    procs = []
    for rank in range(4):
        d = tmp_path / str(rank)
        d.mkdir()
        procs.append(start_worker(d, "exit:node=1:step=1:phase=forward:code=9", rank=rank, steps=2))
    try:
        codes = [p.wait(timeout=30) for p in procs]
    finally:
        for p in procs:
            reap(p)
    assert codes == [0, 0, 9, 9]  # nproc_per_node=2: node 1 is ranks 2 and 3


def test_hang_stops_the_process_until_killed(tmp_path):
    proc = start_worker(tmp_path, "hang:rank=0:step=2:phase=allreduce")
    try:
        assert wait_for_state(proc.pid, "T"), "worker did not stop itself"
        time.sleep(0.1)
        assert process_state(proc.pid) == "T"
        assert lines(tmp_path)[-1] == "2 backward"
        kill_process(proc.pid, "kill")
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        reap(proc)


def test_hung_process_continues_after_sigcont_and_does_not_hang_again(tmp_path):
    proc = start_worker(tmp_path, "hang:rank=0:step=1:phase=forward", steps=3)
    try:
        assert wait_for_state(proc.pid, "T")
        kill_process(proc.pid, "cont")
        assert proc.wait(timeout=30) == 0
    finally:
        reap(proc)
    assert lines(tmp_path)[-1] == "done"


def test_external_stop_and_kill(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        kill_process(proc.pid, "stop")
        assert wait_for_state(proc.pid, "T")
        kill_process(proc.pid, "resume")
        assert wait_for_state(proc.pid, "S")
        kill_process(proc.pid, "kill")
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        reap(proc)
    with pytest.raises(ValueError, match="unknown action"):
        kill_process(proc.pid, "nuke")
    with pytest.raises(ValueError, match="refusing"):
        kill_process(0, "kill")
