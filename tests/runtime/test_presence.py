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
