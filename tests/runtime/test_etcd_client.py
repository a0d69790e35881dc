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
from _helpers.abort_watch import reads_a_few_times_a_second_and_sees_an_end_at_once
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


def _count_requests(monkeypatch) -> list:
    """Every request of every ``EtcdClient`` of this process, counted in ``[n]``."""
    calls = [0]
    real = EtcdClient.call

    def counted(self, path, body):
        calls[0] += 1
        return real(self, path, body)
    monkeypatch.setattr(EtcdClient, "call", counted)
    return calls


def _timed(fn) -> float:
    t = time.monotonic()
    fn()
    return time.monotonic() - t


def test_a_silent_member_costs_one_timeout_per_process_then_is_passed_by(member, silent, monkeypatch):
    monkeypatch.setattr(etcd, "_suspect", {})
    monkeypatch.setattr(etcd, "_answered", {})
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
    # Once the suspicion has expired, and no member answered lately, the member is tried again
    # (it may have come back).
    monkeypatch.setattr(etcd, "SUSPECT_S", 0.0)
    etcd._suspect[silent] = time.monotonic()
    etcd._answered.clear()
    third = EtcdStore([silent, member], "/cft/t1/", timeout=timedelta(seconds=5), request_timeout_s=0.5)
    assert _timed(lambda: third.get("k")) >= 0.5


def test_a_thread_connected_to_a_member_another_thread_found_silent_moves_before_its_request(member, silent,
                                                                                              monkeypatch):
    monkeypatch.setattr(etcd, "_suspect", {})
    monkeypatch.setattr(etcd, "_answered", {})
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
    monkeypatch.setattr(etcd, "_answered", {})
    store = EtcdStore([member], "/cft/t3/", timeout=timedelta(seconds=5), request_timeout_s=2.0)
    q = EtcdQuorum(store, heartbeat_timeout_s=1.0)
    q.heartbeat("7")
    q._beats.endpoints = [silent, member]  # from now on its first choice stops answering
    q._beats._local.conn = None
    q._beats._next = 0
    q._renewed_at = 0.0  # a keep-alive is due
    took = _timed(lambda: q.heartbeat("7"))
    assert took < 0.6, took  # a third of the lease, then the member that answers
    assert "7" in q.alive()


def test_a_worker_heartbeating_every_100_ms_renews_its_lease_a_few_times_a_second(member, monkeypatch):
    """A worker heartbeats every 0.1 s; its lease (1 s) gets a keep-alive when the last one is a
    quarter of the lease old -- about 4 requests a second, not 10 -- and stays alive."""
    from chameleon_ft.runtime.etcd import EtcdQuorum

    monkeypatch.setattr(etcd, "_suspect", {})
    calls = _count_requests(monkeypatch)
    q = EtcdQuorum(EtcdStore([member], "/cft/tka/", timeout=timedelta(seconds=5)), heartbeat_timeout_s=1.0)
    q.heartbeat("3")  # the grant and the key
    c0 = calls[0]
    for _ in range(20):  # 2 s of heartbeats
        time.sleep(0.1)
        q.heartbeat("3")
    assert 4 <= calls[0] - c0 <= 9, calls[0] - c0
    assert "3" in q.alive()


def test_a_member_whose_host_takes_no_connection_is_left_without_waiting_out_the_request(member, monkeypatch):
    """A request the member does not answer makes the client try a new connection to it (after
    ``PROBE_AFTER_S``): a member cut off by a partition (here: its listener gone after it took
    the request's connection) is left at once for the next one, not after the request timeout,
    and new connections of the process go to the member that answered last."""
    monkeypatch.setattr(etcd, "_suspect", {})
    monkeypatch.setattr(etcd, "_answered", {})
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    gone = f"127.0.0.1:{srv.getsockname()[1]}"
    client = EtcdClient([gone, member], 2.0)
    conn = client._conn()
    client._connect(conn)  # the member takes this connection ...
    held = srv.accept()[0]
    srv.close()  # ... and then its host no more: what a partition looks like to a new connection
    try:
        took = _timed(lambda: client.put(b"/cft/t4/k", b"v"))
        assert etcd.PROBE_AFTER_S <= took < etcd.PROBE_AFTER_S + 0.5, took
        assert client._endpoint() == member and not etcd._trusted(gone)
        # Another client of the process (a store clone) starts on the member that answered.
        monkeypatch.setattr(etcd, "_suspect", {})
        other = EtcdClient([gone, member], 2.0)
        assert _timed(lambda: other.get(b"/cft/t4/k")) < 0.2
        assert other._endpoint() == member
    finally:
        held.close()


def test_the_quorum_over_etcd_does_not_wait_for_suspects_or_the_dead_while_their_leases_last(member, monkeypatch):
    """Workers 3 and 4 still hold live liveness leases (etcd extends every lease when its leader
    changes), but an asker names 3 as a suspect of the failed generation and 4's launcher
    reported it dead: the survivors 1 and 2 agree as soon as both asked, not after the join
    window (5 s here); with nobody named, two askers of four live workers never make a quorum."""
    from chameleon_ft.runtime.coordination import dead_workers, report_dead
    from chameleon_ft.runtime.etcd import EtcdQuorum

    monkeypatch.setattr(etcd, "_suspect", {})

    def agree(prefix: str, suspects: list, dead: tuple) -> tuple[dict, float]:
        store = EtcdStore([member], prefix, timeout=timedelta(seconds=5))
        for w in dead:
            report_dead(store, w)
        qs = {w: EtcdQuorum(store, join_timeout_s=5.0, heartbeat_timeout_s=5.0, gone=lambda: dead_workers(store))
              for w in "1234"}  # (leases of 5 s: they outlast the test)
        for w in "1234":  # (every worker beats before it asks: its join's first heartbeat)
            qs[w].heartbeat(w)
        got, t0 = {}, time.monotonic()

        def ask(w):
            try:
                got[w] = qs[w].quorum(w, timedelta(seconds=1.5), {"worker_id": int(w), "suspects": suspects})
            except TimeoutError as exc:
                got[w] = exc
        threads = [threading.Thread(target=ask, args=(w,)) for w in "12"]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        return got, time.monotonic() - t0

    got, took = agree("/cft/t5/", [3], (4,))
    assert all(not isinstance(q, Exception) for q in got.values()), got
    assert {tuple(p.replica_id for p in q.participants) for q in got.values()} == {("1", "2")}
    assert took < 1.0, took
    got, _ = agree("/cft/t6/", [], ())
    assert all(isinstance(q, TimeoutError) for q in got.values()), got


def test_a_watch_brings_every_key_written_and_resumes_after_its_stream_or_member_is_lost(member, monkeypatch):
    """``EtcdWatch``: the keys put under its prefix, none other; a lost stream is opened again from
    the revision after the last one seen (a write meanwhile is not missed); a member that takes
    no connection is passed for the next one."""
    from chameleon_ft.runtime.etcd import EtcdWatch

    monkeypatch.setattr(etcd, "_suspect", {})
    c = EtcdClient([member], 2.0)
    w = EtcdWatch(c, b"/cft/tw/abort/")
    assert w.keys(0.05) == [] and w.streaming
    for k in (b"/cft/tw/abort/g1", b"/cft/tw/other", b"/cft/tw/abort/g2"):
        c.put(k, b"1")
    got, deadline = [], time.monotonic() + 5
    while len(got) < 2 and time.monotonic() < deadline:
        got += w.keys(0.5)
    assert got == [b"g1", b"g2"]
    t0 = time.monotonic()
    assert w.keys(0.3) == [] and time.monotonic() - t0 >= 0.29  # waits, quietly
    threading.Timer(0.2, lambda: c.put(b"/cft/tw/abort/g3", b"1")).start()
    assert w.keys(5.0) == [b"g3"]
    w.close()  # the stream lost; a write meanwhile
    c.put(b"/cft/tw/abort/g4", b"1")
    assert w.keys(2.0) == [b"g4"]

    with socket.socket() as s:  # a closed port: a member whose host takes no connection
        s.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setattr(etcd, "_answered", {})  # (no member known to answer: the first is tried)
    w2 = EtcdWatch(EtcdClient([gone, member], 2.0), b"/cft/tw/abort/")
    with pytest.raises(etcd.EtcdError, match="cannot open a watch"):
        w2.keys(0.1)
    assert w2.keys(0.1) == [] and w2.streaming
    c.put(b"/cft/tw/abort/g5", b"1")
    assert w2.keys(5.0) == [b"g5"]
    w2.close()


def test_the_abort_watcher_over_etcd_sees_an_end_at_once_and_reads_only_a_few_times_a_second(member, monkeypatch):
    """Over etcd the abort watcher waits on a watch stream: a generation's end reaches it as soon
    as etcd has it, and meanwhile it makes about ``READ_EVERY_S``'s reads a second (it polled 50
    times a second)."""
    from types import SimpleNamespace

    from chameleon_ft.runtime import abort_watch
    from chameleon_ft.runtime.coordination import abort_key

    monkeypatch.setattr(etcd, "_suspect", {})
    calls = _count_requests(monkeypatch)
    store = EtcdStore([member], "/cft/taw/", timeout=timedelta(seconds=5))
    view = SimpleNamespace(token="g7")
    seen, stop = [], threading.Event()
    w = abort_watch.AbortWatcher(0, "etcd://unused/x", 2.0, view=lambda: view,
                                 on_ended=lambda v: seen.append((v.token, time.monotonic())) or True,
                                 stop=stop, cut_off_s=None, quorum_wait_s=60.0)
    monkeypatch.setattr(w, "_store", lambda: store.clone())
    w.start()
    try:
        reads_a_few_times_a_second_and_sees_an_end_at_once(
            w, seen, lambda: calls[0], lambda: store.set(abort_key("g7"), "1"), "g7", 2 / abort_watch.READ_EVERY_S,
            settle_s=1.0)
    finally:
        stop.set()
        w.join(2.0)


def test_a_counter_only_this_client_writes_takes_one_request_and_a_few_keys_are_read_in_one(member, monkeypatch):
    """``EtcdStore.add`` tries the value and revision it last wrote (a liveness counter: one
    compare-and-swap, no read first) and falls back to a read when another client wrote since;
    ``add(key, 0)`` of an existing counter is one read; ``multi_get`` of keys under different
    parents is one transaction."""
    calls = _count_requests(monkeypatch)
    a = EtcdStore([member], "/cft/tadd/", timeout=timedelta(seconds=2))
    b = a.clone()
    assert a.add("c", 1) == 1 and a.add("c", 1) == 2
    c0 = calls[0]
    assert a.add("c", 5) == 7 and calls[0] - c0 == 1
    assert b.add("c", 10) == 17  # another writer: a's remembered revision is stale
    c0 = calls[0]
    assert a.add("c", 1) == 18 and calls[0] - c0 == 3  # the failed swap, a read, the swap
    assert b.compare_set("c", "18", "x") == b"x"  # b's remembered "17" is stale: it reads, then sets
    assert a.compare_set("c", "18", "y") == b"x"  # a declines on the value there now, not on its own
    for k, v in (("cft/beat/0", "3"), ("cft/beat/2", "4"), ("cft/liveness", "{}")):
        a.set(k, v)
    c0 = calls[0]
    assert a.multi_get(["cft/beat/0", "cft/beat/2", "cft/liveness"]) == [b"3", b"4", b"{}"]
    assert calls[0] - c0 == 1
    c0 = calls[0]
    assert b.add("cft/beat/2", 0) == 4 and calls[0] - c0 == 1  # reading a counter: one read, no write
    assert a.add("cft/beat/9", 0) == 0 and a.get("cft/beat/9") == b"0"  # a missing one is made, as TCPStore's


def test_which_members_were_reported_dead_is_read_in_a_few_requests_over_etcd(member, monkeypatch):
    """``coordination.reported_dead_among`` over etcd: the dead marks' log in one request, the
    marked workers' incarnations in one transaction (test_membership has the TCPStore side)."""
    from _helpers.dead_marks import dead_marks_are_read_in_a_few_requests

    calls = _count_requests(monkeypatch)
    dead_marks_are_read_in_a_few_requests(EtcdStore([member], "/cft/tdead/", timeout=timedelta(seconds=2)),
                                           lambda: calls[0])


def test_a_worker_that_asks_after_its_peers_round_was_decided_without_it_is_told_at_once(member):
    """Workers 1 and 2 agree without 3 (it had not asked within the join window); 3, whose last
    generation is older than that round, learns it at its next ask (``LeftOut``: it ends that
    round to be admitted) instead of waiting in the next round for peers that wait for it."""
    from chameleon_ft.runtime.etcd import EtcdQuorum, LeftOut

    store = EtcdStore([member], "/cft/tleft/", timeout=timedelta(seconds=5))
    qs = {w: EtcdQuorum(store, join_timeout_s=0.05, heartbeat_timeout_s=5.0) for w in "123"}
    for w in "123":
        qs[w].heartbeat(w)
    got = {}
    threads = [threading.Thread(target=lambda w=w: got.setdefault(w, qs[w].quorum(w, timedelta(seconds=5))))
               for w in "12"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert {tuple(p.replica_id for p in q.participants) for q in got.values()} == {("1", "2")}
    round_ = got["1"].quorum_id
    t0 = time.monotonic()
    with pytest.raises(LeftOut) as left:
        qs["3"].quorum("3", timedelta(seconds=5), after=round_ - 1)
    assert left.value.quorum.quorum_id == round_ and time.monotonic() - t0 < 1.0
    with pytest.raises(TimeoutError):  # once it ended that round (after=round_), it asks in the next
        qs["3"].quorum("3", timedelta(seconds=0.5), after=round_)


def test_a_gloo_group_over_etcd_reads_each_peers_address_once(member, monkeypatch):
    """gloo's rendezvous waits for each peer's address and then gets it: the get takes the
    value the wait read (no second request), and a later write through the client is seen.
    Four ranks set up a real gloo group over one ``EtcdStore`` client each; per rank one write
    and one read per peer key (more where a key is polled before it exists), no read in a get."""
    import torch
    import torch.distributed as dist

    calls = _count_requests(monkeypatch)
    in_get = [0]  # requests made inside EtcdStore.get
    real_get = EtcdStore.get

    def get(self, key):
        c0 = calls[0]
        try:
            return real_get(self, key)
        finally:
            in_get[0] += calls[0] - c0  # (threads may add theirs: an upper bound)
    monkeypatch.setattr(EtcdStore, "get", get)
    n, out, errors = 4, {}, []

    def rank(r: int) -> None:
        try:
            s = EtcdStore([member], "/cft/tgloo/", timeout=timedelta(seconds=20))
            pg = dist.ProcessGroupGloo(dist.PrefixStore("pg", s), r, n, timedelta(seconds=20))
            t = torch.tensor([float(r)])
            pg.allreduce([t]).wait()
            out[r] = float(t)
        except Exception as exc:  # shown below
            errors.append(exc)
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and out == {r: 6.0 for r in range(n)}
    # Each rank waited for every address and then got it: the gets took no request of their
    # own (they took one each, n * n, before).
    assert in_get[0] < n
    s = EtcdStore([member], "/cft/tgloo2/", timeout=timedelta(seconds=2))
    s.set("k", "1")
    s.wait(["k"])
    c0 = calls[0]
    assert s.get("k") == b"1" and calls[0] == c0  # the value the wait read
    assert s.get("k") == b"1" and calls[0] == c0 + 1  # once only: then the store again
    s.wait(["k"])
    s.set("k", "2")
    assert s.get("k") == b"2"  # this client's own write after the wait is seen


def test_an_answer_carries_etcds_raft_term_and_makes_its_member_trusted_again(member):
    """Every answer's header names etcd's raft term (``EtcdClient.raft_term``, what tells the
    liveness monitor that a stall was an election); a member suspected after failed requests
    (an election makes every member fail some) is trusted again once it answers, so the
    process's next new connection goes to it rather than round to a member that is cut off."""
    store = EtcdStore([member], "/cft-test-term/", request_timeout_s=1.0)
    assert store.raft_term == 0
    store.set("k", "v")
    assert store.raft_term >= 1 and store.get("k") == b"v"
    etcd._suspect[member] = time.monotonic() + etcd.SUSPECT_S
    try:
        assert not etcd._trusted(member)
        assert store.get("k") == b"v"  # (the only member: asked although suspected)
        assert etcd._trusted(member)
    finally:
        etcd._suspect.pop(member, None)


def test_a_request_still_waiting_when_another_answer_brings_a_newer_raft_term_is_asked_again(member, silent,
                                                                                             monkeypatch):
    """A request forwarded to a leader that was cut off is never answered; once another thread
    of the process hears of the next term (an answer's header), the waiting request is asked of
    the next member at once instead of after its whole timeout.  The silent listener stands for
    the member whose forwarded proposal was lost (it takes connections, so the probe passes)."""
    monkeypatch.setattr(etcd, "_suspect", {})
    monkeypatch.setattr(etcd, "_answered", {})
    monkeypatch.setattr(etcd, "_term", [0])
    EtcdClient([member], 1.0).put(b"/cft/t9/k", b"v")
    term = etcd._term[0]
    assert term >= 1
    etcd._answered.clear()  # (else new connections go to the member that answered last)
    waited = EtcdClient([silent, member], 1.0)  # its first request goes to the silent one
    assert 1.0 <= _timed(lambda: waited.get(b"/cft/t9/k")) < 1.6  # no new term: the timeout
    etcd._suspect.clear()
    etcd._answered.clear()
    bumped = EtcdClient([silent, member], 1.0)
    threading.Timer(0.3, lambda: etcd._term.__setitem__(0, term + 1)).start()  # another answer, a term on
    took, got = [], []
    took.append(_timed(lambda: got.append(bumped.get(b"/cft/t9/k"))))
    assert 0.3 <= took[0] < 0.6 and got[0][0] == b"v", took
