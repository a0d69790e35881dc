"""The etcd client's choice of member (``runtime/etcd.py``): a member that does not answer --
partitioned away: a connection it accepts, a request it never answers -- costs this process one
request timeout, not one per thread or per store clone.  A real etcd on loopback (Debian's
``etcd``) and a silent listener in the place of a partitioned member."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest

from _helpers import etcd_tls
from chameleon_ft.runtime import etcd
from chameleon_ft.runtime.etcd import EtcdClient, EtcdStore

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def member(tmp_path_factory):
    why = etcd_tls.available()
    if why:
        pytest.skip(why)
    with etcd_tls.one_member(str(tmp_path_factory.mktemp("etcd"))) as (ep, _):
        yield ep


@pytest.fixture
def silent():
    """A member partitioned away: it takes the connection and never answers."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held, stop = [], threading.Event()

    def accept():
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                pass
    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join(2)
    for c in held:
        c.close()
    srv.close()


def _timed(fn) -> float:
    t = time.monotonic()
    fn()
    return time.monotonic() - t


def test_a_silent_member_costs_one_timeout_per_process_then_is_passed_by(member, silent, monkeypatch):
    monkeypatch.setattr(etcd, "_suspect", {})
    eps = [silent, member]
    first = EtcdStore(eps, "/cft/t1/", timeout=timedelta(seconds=5), request_timeout_s=0.5)
    assert 0.5 <= _timed(lambda: first.set("k", "v")) < 2.0  # met the silent member, then the other
    # Another store (a group set-up's clone), other threads: straight to the member that answers.
    second = EtcdStore(eps, "/cft/t1/", timeout=timedelta(seconds=5), request_timeout_s=0.5)
    took = []
    threads = [threading.Thread(target=lambda s=s: took.append(_timed(lambda: s.get("k")))) for s in (first, second) * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(took) == 6 and max(took) < 0.4, took
    # Once the suspicion has expired the member is tried again (it may have come back).
    monkeypatch.setattr(etcd, "SUSPECT_S", 0.0)
    etcd._suspect[silent] = time.monotonic()
    third = EtcdStore([silent, member], "/cft/t1/", timeout=timedelta(seconds=5), request_timeout_s=0.5)
    assert _timed(lambda: third.get("k")) >= 0.5


def test_a_thread_connected_to_a_member_another_thread_found_silent_moves_before_its_request(member, silent,
                                                                                              monkeypatch):
    monkeypatch.setattr(etcd, "_suspect", {})
    client = EtcdClient([silent, member], 0.5)
    client._conn()  # this thread is connected to the silent member (the first endpoint)
    assert client._endpoint() == silent
    other = threading.Thread(target=lambda: EtcdClient([silent, member], 0.5).put(b"/cft/t2/k", b"v"))
    other.start()
    other.join(10)  # it met the silent member and marked it
    assert _timed(lambda: client.get(b"/cft/t2/k")) < 0.4
    assert client._endpoint() == member


def test_a_heartbeat_stuck_on_a_silent_member_moves_on_before_its_lease_runs_out(member, silent, monkeypatch):
    """The lease of a worker's liveness key lasts the heartbeat timeout (1 s); a keep-alive sent
    to a member that stopped answering must reach another member within it, or the worker drops
    out of the live set its peers count when they decide a quorum (seen in the node trials: every
    worker's beat went to the partitioned member; one worker counted itself alone and formed a
    generation of one beside its peers')."""
    from chameleon_ft.runtime.etcd import EtcdQuorum

    monkeypatch.setattr(etcd, "_suspect", {})
    store = EtcdStore([member], "/cft/t3/", timeout=timedelta(seconds=5), request_timeout_s=2.0)
    q = EtcdQuorum(store, heartbeat_timeout_s=1.0)
    q.heartbeat("7")
    q._beats.endpoints = [silent, member]  # from now on its first choice stops answering
    q._beats._local.conn = None
    q._beats._next = 0
    took = _timed(lambda: q.heartbeat("7"))
    assert took < 0.6, took  # a third of the lease, then the member that answers
    assert "7" in q.alive()
