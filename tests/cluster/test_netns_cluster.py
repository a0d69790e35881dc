"""Three nodes on a real network (issue 24): Linux network namespaces joined by veth pairs and a
bridge (``_helpers/netns.py``), one ``chameleon-ft run --nnodes 3 --node-rank i
--rdzv-endpoint <node 0's address>`` per namespace with 2 workers each (``mlp_worker.py``,
``ElasticTrainer``), the endpoints on the namespace addresses only.  Faults from outside: a whole
node killed (launcher and workers, every process in its namespace), its link taken down (a
partition) and brought back, packet loss, SIGTERM to a launcher.  Needs root and iproute2 (CI
runs as root); skipped with the reason otherwise.  Namespaces and processes are removed even
when a test fails (``python tests/_helpers/netns.py clean`` after a crash)."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime" / "_workers"))
from elastic_job import Job, assert_exactly_once, assert_replicas_equal, max_relative_diff, reference  # noqa: E402
from _helpers import netns  # noqa: E402
from chameleon_ft.runtime.eventlog import resumed_after  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow, pytest.mark.serial]

EPOCHS = 4  # 32 steps
PORT = 29511


@pytest.fixture
def ref(tmp_path_factory):
    """The failure-free run's final state, made in the set-up (beside other tests)."""
    return reference(tmp_path_factory.mktemp("ref"), EPOCHS)


@pytest.fixture
def net():
    why = netns.available()
    if why:
        pytest.skip(why)
    with netns.Net(3) as n:
        yield n


def _start(job: Job, net, nodes=(0, 1, 2), extra=()) -> None:
    ep = f"{net.addr(0)}:{PORT}"
    for i in nodes:
        job.start(extra=["--nnodes", "3", "--node-rank", str(i), "--rdzv-endpoint", ep, *extra], wrap=net.wrap(i))


def _tail(job: Job, n: int = 6000) -> str:
    """The job's output without C++ stack frames (a failed assertion's message)."""
    return "\n".join(ln for ln in job.output().splitlines() if "frame #" not in ln)[-n:]


def _events(evs, kind):
    return [e for e in evs if e["event"] == kind]


def test_a_lost_node_is_survived_in_place_and_a_sigterm_is_forwarded(net, tmp_path, ref):
    """Node 1 (its launcher and both workers) is killed at step 5: the four survivors recover
    in place and end on the failure-free trajectory; gloo found its interface by itself (the
    hostname resolves to loopback in a namespace).  At step 18 node 2's launcher gets SIGTERM (a
    preemption notice): it forwards it, its workers leave at a step boundary, announced
    (``runtime/preemption.py``: a ``preemption`` record, no step redone), it exits 143 within
    seconds; node 0 trains on alone."""
    job = Job(tmp_path, nproc=2, epochs=EPOCHS, mb_sleep=0.02, hang_timeout=10)
    try:
        _start(job, net)
        job.wait_step(5, 180)
        t_kill = net.kill_node(1)
        job.wait_step(18, 120)
        t_term = time.time()
        job.launchers[2].send_signal(signal.SIGTERM)
        assert job.launchers[2].wait(10) == 128 + signal.SIGTERM
        ended = time.time() - t_term
        assert job.launchers[0].wait(120) == 0, job.output()[-4000:]
        evs, out, finals = job.events(), job.output(), job.final()
    finally:
        job.cleanup()
    assert "gloo on eth0" in out
    assert ended < 6.0, ended
    lost = [e for e in _events(evs, "failure") if sorted(e["workers"]) == [2, 3]]
    assert lost and lost[0]["kind"] == "node_loss", _events(evs, "failure")
    left = [e for e in _events(evs, "failure") if e["kind"] == "preemption"]
    assert sorted(w for e in left for w in e["workers"]) == [4, 5], _events(evs, "failure")
    attempts = [(e["worker"], e["step"]) for e in _events(evs, "step") if e["step"] >= 15]
    assert len(attempts) == len(set(attempts)), "a step was redone after the SIGTERM"
    mttr = resumed_after(evs, t_kill)
    print(f"node loss over the namespace network: first step {mttr:.3f} s after the kill")
    assert sorted(finals) == [0, 1]
    assert_replicas_equal(finals, [0, 1])
    assert_exactly_once(evs, EPOCHS)
    assert max_relative_diff(finals[0], ref) < 1e-5


# Chaos since 2026-12-02: in 2 of 25 runs here node 2's two restarted workers were never admitted:
# each one's admission request ended the generation the other had just been admitted to, and the
# other re-asked later than the Lighthouse's 50 ms join window (768 rounds of 5 of 6 in 120 s, read
# in the Lighthouse's log with RUST_LOG=info).  Fixed by the admission back-off (membership.py;
# test_membership.py reproduces it in process); after it 45 of 46 runs passed, the other with a
# store client timing out after 30 s connecting to node 0 (cause not found).  The partition's
# detection and the minority's stop are measured by benchmarks/cluster_bench.py.
@pytest.mark.chaos
def test_a_partitioned_node_stops_by_itself_and_rejoins_once_healed(net, tmp_path, tmp_path_factory):
    """Node 2's link goes down at step 5 (no reset reaches anyone).  The majority detects it by
    heartbeats (~1 s, not the 10 s watchdog), recovers and trains on; the minority's workers get
    no answer from the coordinator and stop on their own (exit 3) within the cut-off, its
    launcher exits non-zero, nothing of theirs is written.  The link comes back and node 2's
    launcher is started again: its workers join the running job and heal from a peer."""
    epochs = 20  # 160 steps of ~0.1 s: long enough for a launcher to start again and join
    job = Job(tmp_path, nproc=2, epochs=epochs, mb_sleep=0.05, hang_timeout=10)
    try:
        _start(job, net)
        job.wait_step(5, 180)
        t_cut = net.partition(2)
        assert job.launchers[2].wait(30) == 3, job.output()[-3000:]
        minority_s = time.time() - t_cut
        assert not net.pids(2), "a process of the stopped node outlived its launcher"
        net.heal(2)
        _start(job, net, nodes=(2,))
        codes = [job.launchers[i].wait(180) for i in (0, 1, 3)]
        assert codes == [0, 0, 0], (codes, _tail(job))
        evs, out, finals = job.events(), job.output(), job.final()
    finally:
        job.cleanup()
    fail = [e for e in _events(evs, "failure") if sorted(e["workers"]) == [4, 5]]
    assert fail and fail[0]["kind"] == "hang", _events(evs, "failure")
    rec = next(e for e in _events(evs, "recovery") if e["ts"] > t_cut)
    print(f"partition: detected in {rec['mttr']['detect']:.3f} s, recovered in {rec['mttr']['total']:.3f} s; "
          f"the minority's launcher exited {minority_s:.1f} s after the cut")
    assert rec["mttr"]["detect"] < 2.0 and rec["mttr"]["total"] < 3.0, rec["mttr"]
    assert minority_s < 10.0
    assert out.count("lost the coordinator at") == 2  # each minority worker says why it stopped
    # Nothing the minority committed after the cut: every step once, on the majority's record.
    assert_exactly_once(evs, epochs)
    assert sorted(finals) == [0, 1, 2, 3, 4, 5], sorted(finals)  # 4 and 5: the rejoined workers
    assert_replicas_equal(finals, [0, 1, 2, 3, 4, 5])
    joined = [m for m in _events(evs, "membership") if m["members"] == [0, 1, 2, 3, 4, 5] and m["ts"] > t_cut]
    assert joined, "node 2 never rejoined"
    ref = reference(tmp_path_factory.mktemp("ref"), epochs)
    assert max_relative_diff(finals[0], ref) < 1e-5


def test_delay_and_loss_slow_the_job_but_declare_no_failure(net, tmp_path):
    """From step 3 on, 50 ms of delay and 1 % loss on every packet's way: TCP retransmits, the
    job trains to the end (slower), and no heartbeat timeout or collective watchdog fires.  (The
    job starts before the network is impaired: the embedded coordinator's quorum gathers its
    members for ``--join-timeout-ms`` after the first asks, so a start-up over a link this slow
    needs a longer window; docs/cluster.md.)  The heartbeat timeout is 3 s, as a job on such a
    link needs: TCP's retransmission back-off (at least 200 ms, doubling) holds a beat that lost
    two frames in a row for about a second on a 100 ms round trip -- the default 1 s would call
    that silence, rightly by its own rule."""
    print("before:", net.impair(0, 0))
    job = Job(tmp_path, nproc=2, epochs=1, mb_sleep=0.02, hang_timeout=10)  # ~2 s a step once impaired
    try:
        _start(job, net, extra=["--heartbeat-timeout", "3"])
        job.wait_step(3, 180)
        t0 = time.time()
        print("from step 3:", net.impair(delay_ms=50, loss_pct=1.0))
        assert [p.wait(240) for p in job.launchers] == [0, 0, 0], job.output()[-4000:]
        evs = job.events()
    finally:
        job.cleanup()
    assert not _events(evs, "failure") and not _events(evs, "recovery"), _events(evs, "failure")
    assert_exactly_once(evs, 1)
    ts = sorted(e["ts"] for e in _events(evs, "step") if e["worker"] == 0)
    gaps = lambda pick: sorted(b - a for a, b in zip(ts, ts[1:]) if pick(a))  # noqa: E731
    fast, slow = gaps(lambda a: a < t0), gaps(lambda a: a > t0 + 1)
    print(f"seconds per step before {fast[len(fast) // 2]:.3f}, with the impairment {slow[len(slow) // 2]:.3f}")
    assert slow[len(slow) // 2] > fast[len(fast) // 2] + 0.05  # the delay is really on the path
