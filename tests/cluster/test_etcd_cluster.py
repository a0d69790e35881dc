"""No single point of failure (issue 24): membership, generations, abort keys and group set-up
in a 3-member etcd cluster, one member per node (``--rdzv-backend etcd --rdzv-endpoint
n0:2379,n1:2379,n2:2379``; Debian's ``etcd``), three nodes as network namespaces
(``_helpers/netns.py``) with 2 workers each.  Node 0 -- its launcher, its workers, its etcd
member -- is lost and the job trains on; one etcd member is lost and nothing happens; the
cluster loses its quorum and the job pauses (nothing committed), then goes on when the quorum
is back.  The node-0 test runs etcd as docs/security.md advises (TLS with client certificates,
etcd's user/role authentication: ``_helpers/etcd_tls.py``), and a test of its own shows that a
client without the certificate, or without the role, is refused.  The jobs' tests are
``serial`` (their calls run with no other test beside them).  Needs root, iproute2, etcd and
openssl; skipped with the reason otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime" / "_workers"))
from elastic_job import Job, assert_exactly_once, assert_replicas_equal, max_relative_diff, reference  # noqa: E402
from _helpers import etcd_tls, netns  # noqa: E402
from chameleon_ft.runtime.eventlog import resumed_after  # noqa: E402

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
EPOCHS = 3  # 24 steps: the faults land at steps 5 and 15


def _cluster(tmp_path, tls: bool):
    why = netns.available() or etcd_tls.available()
    if why:
        pytest.skip(why)
    with netns.Net(3) as net:
        eps = net.etcd_up(str(tmp_path / "etcd"), tls=tls)
        yield net, eps


@pytest.fixture
def cluster(tmp_path):
    yield from _cluster(tmp_path, tls=False)


@pytest.fixture
def secured_cluster(tmp_path):
    yield from _cluster(tmp_path, tls=True)


@pytest.fixture
def ref(tmp_path_factory):
    """The failure-free run's final state, made in the set-up, beside other tests."""
    return reference(tmp_path_factory.mktemp("ref"), EPOCHS)


def _tls_flags(net) -> list[str]:
    c = net.etcd_certs
    return ["--etcd-cacert", c["ca"], "--etcd-cert", c["client_cert"], "--etcd-key", c["client_key"]] if c else []


def _start(job: Job, net, eps, nodes=(0, 1, 2)) -> None:
    for i in nodes:
        job.start(extra=["--nnodes", "3", "--node-rank", str(i), "--rdzv-backend", "etcd", *_tls_flags(net),
                         "--rdzv-endpoint", ",".join(eps), "--rdzv-id", f"job{os.getpid()}"], wrap=net.wrap(i))


_PROBE = """
import sys
from chameleon_ft.runtime.etcd import EtcdRefused, EtcdSecurity, EtcdStore
eps, ca, cert, key, user, password = sys.argv[1].split(","), *[a or None for a in sys.argv[2:]]
try:
    EtcdStore(eps, "/cft/probe/", security=EtcdSecurity(ca, cert, key, user, password)).set("k", "v")
    print("ACCEPTED")
except EtcdRefused as exc:
    print("REFUSED", exc)
"""


def _probe(net, eps, node: int, cert: bool, user: str, password: str) -> str:
    """A client of the cluster from ``node``: what etcd said to it."""
    c = net.etcd_certs
    args = [",".join(eps), c["ca"], c["client_cert"] if cert else "", c["client_key"] if cert else "", user, password]
    p = net.run(node, [sys.executable, "-c", _PROBE, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return p.communicate(timeout=60)[0].strip()


def _events(evs, kind):
    return [e for e in evs if e["event"] == kind]


def test_the_secured_cluster_lets_in_the_jobs_certificate_and_role_only(secured_cluster):
    """From another node: the job's certificate and role are accepted; without the
    certificate the TLS handshake is refused, without the role etcd denies the write."""
    net, eps = secured_cluster
    assert _probe(net, eps, 1, True, etcd_tls.JOB_USER, etcd_tls.JOB_PASSWORD) == "ACCEPTED"
    said = _probe(net, eps, 1, False, etcd_tls.JOB_USER, etcd_tls.JOB_PASSWORD)
    assert said.startswith("REFUSED") and "TLS handshake" in said, said
    said = _probe(net, eps, 1, True, etcd_tls.NO_ROLE_USER, etcd_tls.NO_ROLE_PASSWORD)
    assert said.startswith("REFUSED") and "permission denied" in said, said


@pytest.mark.serial
def test_losing_node_0_and_its_etcd_member_leaves_the_job_training(secured_cluster, tmp_path, ref):
    """Node 0 -- its launcher, both workers and its etcd member (the cluster secured as
    docs/security.md advises) -- is killed at step 5: the four survivors train on, on the
    failure-free trajectory."""
    net, eps = secured_cluster
    (tmp_path / "run").mkdir()
    # Liveness judged after 2 s of silence (1 s by default): node 0's loss is found from its
    # workers' presence connections, not from beats, and on a loaded 2-core CI run a survivor
    # was missing from the finals (why was not recorded; a beat a second late would do it).
    job = Job(tmp_path / "run", nproc=2, epochs=EPOCHS, mb_sleep=0.02, hang_timeout=10,
              launch_args=("--heartbeat-timeout", "2"),
              env={"CHAMELEON_FT_ETCD_USER": etcd_tls.JOB_USER, "CHAMELEON_FT_ETCD_PASSWORD": etcd_tls.JOB_PASSWORD})
    try:
        _start(job, net, eps)
        job.wait_step(5, 180)
        t_kill = net.kill_node(0)  # the launcher, the workers and the etcd member of node 0
        net.etcd_procs.pop(0, None)
        codes = [job.launchers[i].wait(180) for i in (1, 2)]
        assert codes == [0, 0], job.output()[-4000:]
        evs, finals = job.events(), job.final()
    finally:
        job.cleanup()
    lost = [e for e in _events(evs, "failure") if sorted(e["workers"]) == [0, 1]]
    # (What happened from the kill on: each failure, decision, membership, recovery and end.)
    said = [(e["event"], e.get("worker"), e.get("step"), round(e["ts"] - t_kill, 3), e.get("workers") or e.get("members"),
             e.get("kind") or (e.get("decision") or {}).get("event"), e.get("detected_by"), e.get("reason"),
             e.get("exits") or e.get("left_behind"))
            for e in evs if e["event"] in ("failure", "decision", "membership", "recovery", "run_end") and e["ts"] >= t_kill - 1]
    assert lost and lost[0]["kind"] == "node_loss", said
    print(f"node 0 lost with etcd: first step {resumed_after(evs, t_kill):.3f} s after the kill")
    assert sorted(finals) == [2, 3, 4, 5], (said, job.output()[-3000:])
    assert_replicas_equal(finals, [2, 3, 4, 5])
    assert_exactly_once(evs, EPOCHS)
    assert max_relative_diff(finals[2], ref) < 1e-5


@pytest.mark.serial
def test_one_etcd_member_lost_changes_nothing_and_a_lost_quorum_pauses_the_job(cluster, tmp_path, ref):
    """Node 1's etcd member is killed at step 5: no failure, no pause.  Node 2's is killed at
    step 15: one member of three left, no quorum -- every worker pauses before its next
    collective (nothing is committed) and says so.  It is started again 4 s later: the quorum
    is back and the job finishes on the failure-free trajectory, with no worker lost."""
    net, eps = cluster
    (tmp_path / "run").mkdir()
    job = Job(tmp_path / "run", nproc=2, epochs=EPOCHS, mb_sleep=0.02, hang_timeout=10)
    try:
        _start(job, net, eps)
        job.wait_step(5, 180)
        net.etcd_kill(1)
        job.wait_step(15, 120)
        t_lost = net.etcd_kill(2)
        time.sleep(4.0)
        t_back = time.time()
        net.etcd_start(2)
        codes = [p.wait(180) for p in job.launchers]
        assert codes == [0, 0, 0], job.output()[-4000:]
        evs, out, finals = job.events(), job.output(), job.final()
    finally:
        job.cleanup()
    assert not _events(evs, "failure") and not _events(evs, "recovery"), _events(evs, "failure")
    # A worker starts no collective once the store has not answered for 0.5 s (``paused``).  The
    # step whose commit began before that still ends, but its record can come late: the wait for
    # that commit reads the abort key between polls, and that read blocks for the etcd request
    # timeout (2 s) without a quorum -- on a loaded CI machine a record came 2.0 s after the kill
    # (CI, 2026-12-03).  So: after the first second of the outage at most that one step is
    # recorded (by any of the workers); a job that did not pause records a new step every
    # ~0.2 s all through the outage.
    during = [e for e in _events(evs, "step") if t_lost + 1.0 < e["ts"] < t_back]
    assert len({(e["epoch"], e["step"]) for e in during}) <= 1, \
        f"steps {sorted({e['step'] for e in during})} recorded while etcd had no quorum"
    assert "paused, nothing is committed" in out and "answers again" in out
    assert sorted(finals) == [0, 1, 2, 3, 4, 5]
    assert_replicas_equal(finals, [0, 1, 2, 3, 4, 5])
    assert_exactly_once(evs, EPOCHS)
    assert max_relative_diff(finals[0], ref) < 1e-5
