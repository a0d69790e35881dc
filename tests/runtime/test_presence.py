"""A worker's death told by its kernel (``runtime/presence.py``): the embedded coordinator reports
a worker dead the moment its connection ends without a goodbye -- the report its launcher would
make, here with no launcher (it was lost with the node).  Real processes, SIGKILLed from outside.
The whole-node loss that this makes as fast as a worker's is measured by
``benchmarks/cluster_bench.py`` (docs/benchmarks-cluster.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from chameleon_ft.runtime.coordination import (CoordinatorServer, _dead_key, _incarnation_key, abort_key,
                                               read_latest)
from chameleon_ft.runtime.presence import PRESENCE_KEY, PresenceClient

from _helpers.abort_watch import reads_a_few_times_a_second_and_sees_an_end_at_once
from _helpers.counting import CountingStore

pytestmark = [pytest.mark.timeout(60)]

# A worker's side: register (id 3, the store's incarnation), say so, then wait to be killed, to
# exit normally (a goodbye at interpreter exit) or to fork a child that outlives it.
_WORKER = """
import os, sys, time
from chameleon_ft.runtime.presence import PresenceClient
address, token, incarnation, how = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
c = PresenceClient()
c.connect(address, token, 3, incarnation)
if how == "fork" and os.fork() == 0:
    time.sleep(30)   # a DataLoader worker: its copy of the connection is closed at the fork
    os._exit(0)
print("registered", flush=True)
if how == "exit":
    sys.exit(0)
time.sleep(60)
"""


@pytest.fixture
def coordinator():
    server = CoordinatorServer(token="secret")
    store = server.store
    store.set("cft/latest", json.dumps({"generation": 4, "members": [0, 3], "token": "gen4"}))
    yield server, store
    server.shutdown()


def _worker(server, store, how: str, token: str = "secret") -> subprocess.Popen:
    incarnation = store.add(_incarnation_key(3), 1)
    p = subprocess.Popen([sys.executable, "-c", _WORKER, store.get(PRESENCE_KEY).decode(), token, str(incarnation),
                          how], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    return p


def _wait_registered(p: subprocess.Popen) -> None:
    line = p.stdout.readline()
    assert line.strip() == "registered", p.stderr.read()


def _dead(store) -> bool:
    return store.check([_dead_key(3)])


def test_a_killed_worker_is_reported_dead_at_once(coordinator):
    server, store = coordinator
    p = _worker(server, store, "kill")
    _wait_registered(p)
    time.sleep(0.1)
    assert server._presence.registered == {3: 1} and not _dead(store)
    t = time.monotonic()
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    while not _dead(store):
        assert time.monotonic() - t < 2.0, "not reported"
        time.sleep(0.005)
    assert store.get(_dead_key(3)).decode() == "1"  # its incarnation
    record = json.loads(store.get(abort_key("gen4")).decode())  # the generation it was in is ended
    assert record["suspects"] == [3] and "connection to the coordinator ended" in record["reason"]
    assert read_latest(store)["token"] == "gen4"


def test_a_normal_exit_and_a_forked_child_are_no_death(coordinator):
    server, store = coordinator
    p = _worker(server, store, "exit")
    _wait_registered(p)
    assert p.wait(10) == 0
    time.sleep(0.3)
    assert not _dead(store)  # it said goodbye at exit
    p = _worker(server, store, "fork")
    _wait_registered(p)
    os.kill(p.pid, signal.SIGKILL)  # the child lives on with (a closed copy of) the connection
    p.wait(10)
    t = time.monotonic()
    while not _dead(store):
        assert time.monotonic() - t < 2.0, "the forked child held the connection open"
        time.sleep(0.005)
    assert store.get(_dead_key(3)).decode() == "2"


def test_a_replacement_is_not_reported_for_its_predecessor(coordinator):
    server, store = coordinator
    p = _worker(server, store, "kill")
    _wait_registered(p)
    store.add(_incarnation_key(3), 1)  # a replacement took the id meanwhile
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    time.sleep(0.5)
    assert not _dead(store) and not store.check([abort_key("gen4")])


def test_only_a_holder_of_the_job_token_registers(coordinator):
    server, store = coordinator
    with pytest.raises(ValueError, match="refused"):
        PresenceClient().connect(store.get(PRESENCE_KEY).decode(), "not-the-token", 3, 1)
    # What the store holds (its address, the digest) and a replayed answer are not enough.
    import socket

    host, _, port = store.get(PRESENCE_KEY).decode().rpartition(":")
    s = socket.create_connection((host, int(port)), timeout=2)
    f = s.makefile("rb")
    f.readline()
    s.sendall(json.dumps({"worker": 3, "incarnation": 1, "proof": "00" * 32}).encode() + b"\n")
    assert f.readline() == b""  # closed
    s.close()
    time.sleep(0.3)
    assert server._presence.registered == {} and not _dead(store)


def test_the_coordinator_writes_each_end_once_and_the_watcher_reads_a_few_times_a_second(coordinator, monkeypatch):
    """Over the embedded coordinator the abort watcher learns a generation's end from the line the
    coordinator writes on its presence connection (``GenerationEnds``: one reader of the newest
    generations' abort keys for the whole job): it sees the end within the coordinator's tick and
    meanwhile reads its key ``1 / READ_EVERY_S`` times a second (it polled 50 times a second)."""
    import threading
    from types import SimpleNamespace

    from chameleon_ft.runtime import abort_watch
    from chameleon_ft.runtime.coordination import TOKEN_ENV, GenerationEnds, connect_store

    monkeypatch.setenv(TOKEN_ENV, "secret")
    server, store = coordinator
    ends = GenerationEnds(store)  # its reads of the store, by hand: an end is told once
    assert ends() == [] and ends.watched == ["gen4"]
    store.set(abort_key("gen4"), "{}")
    assert ends() == ["gen4"] and ends() == [] and ends.watched == []
    store.set("cft/latest", json.dumps({"generation": 5, "members": [0, 3], "token": "gen5"}))
    assert ends() == [] and ends.watched == ["gen5"]

    client = PresenceClient()
    client.connect(store.get(PRESENCE_KEY).decode(), "secret", 3, store.add(_incarnation_key(3), 1))
    assert client.streaming
    counting = CountingStore(connect_store(server.store_addr, 5.0))
    view = SimpleNamespace(token="gen5")
    seen, stop = [], threading.Event()
    w = abort_watch.AbortWatcher(3, server.store_addr, 5.0, view=lambda: view,
                                 on_ended=lambda v: seen.append((v.token, time.monotonic())) or True,
                                 stop=stop, cut_off_s=None, quorum_wait_s=60.0, presence=lambda: client)
    w._store = lambda: counting
    w.start()
    try:
        # the coordinator's tick (20 ms) and the line, not the watcher's own read (250 ms)
        reads_a_few_times_a_second_and_sees_an_end_at_once(
            w, seen, lambda: counting.n, lambda: store.set(abort_key("gen5"), "{}"), "gen5",
            1.5 / abort_watch.READ_EVERY_S)
    finally:
        stop.set()
        w.join(2.0)
        client.close()


def test_a_presence_socket_that_carries_no_ends_leaves_the_watcher_polling():
    """An etcd node launcher's presence socket writes no ends (etcd's watch brings them): the
    client says so, and ``keys`` raises (the watcher then reads its key every ``poll_s``)."""
    from chameleon_ft.runtime.presence import PresenceServer

    server = PresenceServer("127.0.0.1", "secret", lambda w, inc: None)
    client = PresenceClient()
    try:
        client.connect(server.address, "secret", 1, 1)
        assert not client.streaming
        with pytest.raises(OSError):
            client.keys(0.01)
    finally:
        client.close()
        server.close()


def test_the_watcher_polls_again_when_the_coordinator_closes_the_presence_connection():
    """The coordinator's process gone: the client's stream ends (``keys`` raises, ``streaming``
    false), and the watcher falls back to reading its key."""
    from chameleon_ft.runtime.presence import PresenceServer

    server = PresenceServer("127.0.0.1", "secret", lambda w, inc: None, ended=lambda: ["g1"], tick_s=0.05)
    client = PresenceClient()
    try:
        client.connect(server.address, "secret", 1, 1)
        assert client.streaming and b"g1" in client.keys(1.0)
        server.close()
        with pytest.raises(OSError, match="closed the presence connection"):
            for _ in range(100):
                client.keys(0.05)
        assert not client.streaming
    finally:
        client.close()


def test_a_worker_whose_connection_ends_is_stood_in_for_at_the_lighthouse():
    """A whole node's loss (no launcher left to report it): the coordinator stands in for the
    dead worker at its Lighthouse as the launcher's agent would, so the survivor's round forms
    as soon as it asks -- here under a join window of 20 s and a heartbeat timeout of 60 s,
    where only a complete set of askers forms a quorum in time."""
    import threading
    from datetime import timedelta

    from torchft._torchft import LighthouseClient

    from chameleon_ft.runtime.coordination import join_proof
    from chameleon_ft.runtime.membership import Membership

    server = CoordinatorServer(token="secret", join_timeout_ms=20_000, heartbeat_timeout_ms=60_000)
    store = server.store
    got: dict = {}
    beating = threading.Barrier(2)

    def ask(w, first_round=False):
        c = LighthouseClient(server.lighthouse_addr, timedelta(seconds=5))
        c.heartbeat(str(w))
        if first_round:
            beating.wait(10)
        t0 = time.monotonic()
        q = c.quorum(replica_id=str(w), timeout=timedelta(seconds=15),
                     data={"worker_id": w, "incarnation": 1, "proof": join_proof(w, 1)})
        got[w] = (time.monotonic() - t0, q)

    try:
        ts = [threading.Thread(target=ask, args=(w, True)) for w in (0, 3)]
        [t.start() for t in ts]
        [t.join(20) for t in ts]
        assert sorted(got) == [0, 3]
        got.clear()
        p = _worker(server, store, "kill")  # worker 3's process: its presence connection
        _wait_registered(p)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        ask(0)
        seconds, quorum = got[0]
        assert seconds < 5.0, f"the round waited {seconds:.1f} s: nobody stood in for worker 3"
        view = Membership._to_view(type("M", (), {"worker_id": 0, "_refused": lambda self, w: None})(), quorum)
        assert view.members == (0,)
    finally:
        server.shutdown()
