"""Event log: concurrent appends, crash tolerance, and the run summary."""

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chameleon_ft.runtime.eventlog import (
    MTTR_PHASES,
    EventLog,
    EventTail,
    RecoveryTimer,
    read_events,
    summarize,
)

REPO = Path(__file__).resolve().parents[2]
PAYLOAD = "x" * 3000  # lines longer than a pipe buffer's atomic size make interleaving visible


def _append_many(path, writer, n):
    with EventLog(path, writer=writer) as log:
        for i in range(n):
            log.step(step=i, world_size=4, samples=8, step_time=0.01, pad=PAYLOAD)


def test_concurrent_appends_from_four_processes_give_whole_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    n = 300
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_append_many, args=(path, w, n)) for w in range(4)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join()
    events = read_events(path, strict=True)
    assert len(events) == 4 * n
    for w in range(4):
        assert [e["step"] for e in events if e["writer"] == w] == list(range(n))
    assert all(e["pad"] == PAYLOAD for e in events)


def test_writer_killed_mid_run_leaves_whole_lines_and_at_most_a_torn_last_one(tmp_path):
    """A SIGKILL between two writes leaves whole lines only; one that lands inside a write of a
    line longer than a page can cut it (Linux stops a regular-file write at a page boundary
    once a fatal signal is pending: seen once in ~50 runs of this test on a loaded machine).
    So: every line but the last is whole, the last is whole or a torn prefix, and the
    readers skip a torn last line -- strict reading included (it is not corruption)."""
    path = tmp_path / "events.jsonl"
    code = (
        "import sys\n"
        "from chameleon_ft.runtime.eventlog import EventLog\n"
        "log = EventLog(sys.argv[1])\n"
        "i = 0\n"
        "while True:\n"
        "    log.step(step=i, world_size=1, samples=1, step_time=0.0, pad='y' * 5000)\n"
        "    i += 1\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)],
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (not path.exists() or path.stat().st_size < 500_000):
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    whole, tail = lines[:-1], lines[-1]  # tail: b"" when the file ends with a newline
    for line in whole:
        json.loads(line)  # every line but the last is whole
    assert tail == b"" or b"\n" not in tail  # at most a torn prefix of one line
    events = read_events(path, strict=True)
    assert len(events) == len(whole) >= 50
    assert [e["step"] for e in events] == list(range(len(events)))


def test_truncated_last_line_is_ignored(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        log.run_start(world_size=2)
        log.membership(1, [0, 1], "start")
    with open(path, "ab") as f:
        f.write(b'{"ts": 1.0, "event": "fail')
    assert [e["event"] for e in read_events(path)] == ["run_start", "membership"]
    assert len(read_events(path, strict=True)) == 2


def test_tail_reads_only_what_was_appended_and_agrees_with_read_events(tmp_path):
    path = tmp_path / "events.jsonl"
    tail = EventTail(path)
    assert tail.read() == []  # no file yet
    with EventLog(path) as log:
        log.run_start(world_size=2)
    with open(path, "ab") as f:
        f.write(b'{"ts": 1.0, "event": "fail')  # a line still being written
    assert [e["event"] for e in tail.read()] == ["run_start"]
    with open(path, "ab") as f:
        f.write(b'ure", "workers": [1]}\n[1, 2]\n')  # finished, then a bad line
    with EventLog(path) as log:
        log.run_end()
    assert [e["event"] for e in tail.read()] == ["run_start", "failure", "run_end"]
    assert tail.read() == read_events(path)
    path.write_bytes(b'{"ts": 2.0, "event": "run_start"}\n')  # rewritten shorter
    assert tail.read() == read_events(path) == [{"ts": 2.0, "event": "run_start"}]


def test_corrupt_middle_line_skipped_or_strict_error(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        log.run_start()
    with open(path, "ab") as f:
        f.write(b'{"ts": 1.0, "eve\n[1, 2]\n')
    with EventLog(path) as log:
        log.run_end()
    assert [e["event"] for e in read_events(path)] == ["run_start", "run_end"]
    with pytest.raises(ValueError, match=":2: bad event line"):
        read_events(path, strict=True)


def test_record_shapes_and_validation(tmp_path):
    path = tmp_path / "sub" / "events.jsonl"  # parent directory is created
    decision = {"action": "reroute", "candidates": [{"name": "replan", "score": 1.5}], "why": None}
    with EventLog(path, rank=0) as log:
        rec = log.failure([2], "hang", detected_by="heartbeat", step=10, phase="backward")
        log.failure([3], "fail_stop", detected_by="collective", step=11)
        log.decision(decision)
        with pytest.raises(ValueError, match="unknown failure kind"):
            log.failure([1], "gremlins", "x", 1)
        with pytest.raises(ValueError, match="unknown event type"):
            log.write("party")
        with pytest.raises(ValueError):
            log.step(1, 1, 1, float("nan"))
    with pytest.raises(ValueError, match="closed"):
        log.run_end()
    events = read_events(path, strict=True)
    assert events[0] == rec
    assert events[0]["phase"] == "backward" and events[0]["rank"] == 0
    assert "phase" not in events[1]
    assert events[2]["decision"] == decision
    assert len(events) == 3
    assert isinstance(events[0]["ts"], float) and abs(events[0]["ts"] - time.time()) < 60


def test_recovery_timer_breakdown_with_fake_clock():
    now = [100.0]
    timer = RecoveryTimer(clock=lambda: now[0])
    for phase, dt in [("detect", 1.5), ("membership", 0.5), ("rebuild", 2.0),
                      ("state_transfer", 3.0), ("first_step", 1.0), ("rebuild", 0.25)]:
        now[0] += dt
        timer.mark(phase)
    b = timer.breakdown()
    assert b == {"detect": 1.5, "membership": 0.5, "rebuild": 2.25, "state_transfer": 3.0,
                 "first_step": 1.0, "total": 8.25}
    partial = RecoveryTimer(start=0.0, clock=lambda: 2.0)
    partial.mark("detect")
    assert partial.breakdown() == {**{p: 0.0 for p in MTTR_PHASES}, "detect": 2.0, "total": 2.0}


def test_recovery_event_accepts_timer_or_dict(tmp_path):
    path = tmp_path / "e.jsonl"
    t = RecoveryTimer(start=0.0, clock=lambda: 4.0)
    t.mark("detect")
    with EventLog(path) as log:
        log.recovery(t, decision="reroute")
        log.recovery({"detect": 1.0, "rebuild": 2.0})
    a, b = read_events(path)
    assert a["mttr"]["total"] == 4.0 and a["decision"] == "reroute"
    assert b["mttr"] == {"detect": 1.0, "rebuild": 2.0, "total": 3.0}


def synthetic_log():
    """A run of 4 workers: 3 logged steps, worker 3 dies, a first recovery, 2 steps on 3
    workers, worker 2 hangs, a second recovery, 1 step on 2 workers."""
    ev = []

    def add(ts, event, **f):
        ev.append({"ts": ts, "event": event, **f})

    add(0.0, "run_start", world_size=4)
    add(0.1, "membership", generation=0, members=[0, 1, 2, 3], reason="start")
    add(1.0, "step", step=0, world_size=4, samples=16, step_time=1.0)
    add(2.0, "step", step=1, world_size=4, samples=16, step_time=1.0)
    add(4.0, "step", step=2, world_size=4, samples=16, step_time=2.0)
    add(5.0, "failure", workers=[3], kind="fail_stop", detected_by="collective", step=3)
    add(5.2, "decision", decision={"action": "reroute"})
    add(5.3, "membership", generation=1, members=[0, 1, 2], reason="failure")
    add(9.0, "recovery", mttr={"detect": 1.0, "membership": 0.5, "rebuild": 1.0,
                               "state_transfer": 0.0, "first_step": 1.5, "total": 4.0})
    add(11.0, "step", step=3, world_size=3, samples=16, step_time=2.0)
    add(13.0, "step", step=4, world_size=3, samples=16, step_time=2.0)
    add(14.0, "failure", workers=[2], kind="hang", detected_by="heartbeat", step=5, phase="allreduce")
    add(14.5, "membership", generation=2, members=[0, 1], reason="failure")
    # Logged out of order on purpose: a second writer appended this a bit late.
    add(24.0, "recovery", mttr={"detect": 3.0, "membership": 1.5, "rebuild": 2.0,
                                "state_transfer": 2.0, "first_step": 1.5, "total": 10.0})
    add(26.0, "step", step=5, world_size=2, samples=16, step_time=4.0)
    add(27.0, "run_end")
    ev[-3], ev[-4] = ev[-4], ev[-3]
    return ev


def test_summary_on_a_synthetic_log_matches_hand_figures():
    s = summarize(synthetic_log())
    assert s["failures"] == 2
    assert s["failure_kinds"] == {"fail_stop": 1, "hang": 1}
    assert s["recoveries"] == 2
    assert s["mttr_median"] == 7.0  # median of 4 and 10
    assert s["mttr_max"] == 10.0
    assert s["mttr_breakdown_median"] == {"detect": 2.0, "membership": 1.0, "rebuild": 1.5,
                                          "state_transfer": 1.0, "first_step": 1.5}
    assert s["decisions"] == 1 and s["membership_changes"] == 3
    assert s["final_world_size"] == 2
    assert s["steps"] == 6 and s["last_step"] == 5
    assert s["total_samples"] == 96
    assert s["throughput"] == pytest.approx(96 / 12.0)
    assert s["throughput_before_failure"] == pytest.approx(48 / 4.0)
    assert s["throughput_after_failure"] == pytest.approx(48 / 8.0)
    assert s["wall_time"] == 27.0


def test_summary_of_failure_free_and_empty_runs():
    s = summarize([e for e in synthetic_log() if e["ts"] < 5.0])
    assert s["failures"] == 0 and s["recoveries"] == 0
    assert s["mttr_median"] is None and s["mttr_breakdown_median"] == {}
    assert s["throughput_before_failure"] == pytest.approx(12.0)
    assert s["throughput_after_failure"] is None
    assert s["final_world_size"] == 4 and s["wall_time"] is None
    empty = summarize([])
    assert empty["steps"] == 0 and empty["throughput"] is None and empty["last_step"] is None


def test_summary_round_trips_through_the_file(tmp_path):
    path = tmp_path / "e.jsonl"
    with open(path, "w") as f:
        for e in synthetic_log():
            f.write(json.dumps(e) + "\n")
    assert summarize(read_events(path)) == summarize(synthetic_log())


def test_resumed_after_counts_from_the_fault_to_the_new_generations_first_step():
    from chameleon_ft.runtime.eventlog import resumed_after

    evs = [{"event": "step", "ts": 10.0}, {"event": "step", "ts": 10.2},  # the failed generation's
           {"event": "membership", "ts": 10.5, "reason": "failure"}, {"event": "step", "ts": 10.6}]
    assert resumed_after(evs, 10.1) == pytest.approx(0.5)
    assert resumed_after(evs, 11.0) is None


def test_each_death_is_recorded_once_whichever_source_writes_it(tmp_path):
    """``EventLog.deaths`` with ``coordination.first_to_record`` on a real TCPStore: a recovery's
    source writes the failure record before its state broadcast; a next source (the first killed
    after writing it, or before) counts the same death again -- it is recorded once.  A new
    incarnation of the same worker id (a replacement that dies too) is recorded again."""
    from datetime import timedelta

    import torch.distributed as dist

    from chameleon_ft.runtime.coordination import _incarnation_key, first_to_record
    from chameleon_ft.runtime.eventlog import EventLog, read_events

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    claim = lambda w: first_to_record(store, w)  # noqa: E731
    path = tmp_path / "events.jsonl"
    log = EventLog(str(path), worker=0)
    info = {"kind": "aborted", "hang": False, "reason": "peer_error"}
    log.deaths([3], info, [], worker_id=0, step=5, claim=claim)  # the first source, then killed
    log.deaths([0, 3], info, [], worker_id=1, step=5, claim=claim)  # the next one's engine: 0 and 3
    log.deaths([], info, [], worker_id=1, step=6, claim=claim)
    log.deaths([2], None, [], worker_id=1, step=6, claim=claim)  # no failure (a join): nothing
    store.add(_incarnation_key(3), 1)  # worker 3 replaced, and the replacement lost too
    log.deaths([3], {**info, "hang": True}, [], worker_id=1, step=9, claim=claim)
    log.close()
    got = [(e["workers"], e["kind"]) for e in read_events(str(path)) if e["event"] == "failure"]
    assert got == [([3], "fail_stop"), ([0], "fail_stop"), ([3], "hang")]
    assert first_to_record(store, 2)  # never recorded: the one with no failure info claimed nothing
