"""The job token (issue 24, docs/security.md): a launcher or worker whose token is not the job's
is refused by the embedded coordinator and by etcd with a clear message, and never sees the
job's keys.  Real launchers; etcd is Debian's, one member on loopback (skipped without it)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

WORKER = str(Path(__file__).resolve().parent / "_workers" / "mlp_worker.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp, rank: int, token: str, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    return subprocess.Popen([sys.executable, "-m", "chameleon_ft.cli.launch", "--nproc-per-node", "1",
                             "--nnodes", "2", "--node-rank", str(rank), "--job-token", token,
                             "--run-dir", str(tmp / f"run{rank}"), "--rdzv-timeout", "10", *extra, WORKER,
                             "--out", str(tmp), "--epochs", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


def _refused(tmp, first_extra, second_extra) -> str:
    first = _launch(tmp, 0, "alpha", *first_extra)
    try:
        time.sleep(3.0)  # the coordinator is up (or the job's token is in etcd)
        ep = first_extra[first_extra.index("--rdzv-endpoint") + 1]
        if not ep.startswith("etcd"):  # (a loaded machine: the launcher's start can take longer)
            deadline = time.time() + 60
            while time.time() < deadline:
                try:
                    socket.create_connection(tuple(ep.rsplit(":", 1)), timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.2)
        second = _launch(tmp, 1, "beta", *second_extra)
        out, _ = second.communicate(timeout=60)
        assert second.returncode == 1, out  # as for an unreachable coordinator
        return out
    finally:
        for p in (first,):
            os.killpg(p.pid, 9)
            p.wait()


def test_a_launcher_with_another_token_is_refused_by_the_coordinator(tmp_path):
    ep = f"127.0.0.1:{_port()}"
    out = _refused(tmp_path, ["--rdzv-endpoint", ep], ["--rdzv-endpoint", ep])
    assert "refused by the coordinator at" in out and "job token" in out and "--job-token" in out, out
    assert "started worker" not in out


def test_a_worker_with_another_token_is_refused(monkeypatch):
    from chameleon_ft.runtime.coordination import CoordinatorServer
    from chameleon_ft.runtime.membership import Membership, MembershipError

    coord = CoordinatorServer(token="alpha")
    try:
        monkeypatch.setenv("CHAMELEON_FT_JOB_TOKEN", "beta")
        with pytest.raises(MembershipError, match="refused by the coordinator"):
            Membership(0, coord.store_addr, coord.lighthouse_addr, connect_timeout_s=2)
        monkeypatch.setenv("CHAMELEON_FT_JOB_TOKEN", "alpha")
        m = Membership(0, coord.store_addr, coord.lighthouse_addr, connect_timeout_s=2)
        m.store.set("x", "1")
        assert not coord._raw.check(["x"]) and coord.store.check(["x"])  # under the job's namespace
        m.close()
    finally:
        coord.shutdown()


@pytest.fixture
def etcd(tmp_path):
    if shutil.which("etcd") is None:
        pytest.skip("needs etcd (apt-get install etcd-server)")
    client, peer = _port(), _port()
    p = subprocess.Popen(["etcd", "--name", "t", "--data-dir", str(tmp_path / "etcd"),
                          "--listen-client-urls", f"http://127.0.0.1:{client}",
                          "--advertise-client-urls", f"http://127.0.0.1:{client}",
                          "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                          "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                          "--initial-cluster", f"t=http://127.0.0.1:{peer}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        yield f"127.0.0.1:{client}"
    finally:
        os.killpg(p.pid, 9)
        p.wait()


def test_a_launcher_with_another_token_is_refused_by_etcd(tmp_path, etcd):
    flags = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd, "--rdzv-id", "tokjob"]
    out = _refused(tmp_path, flags, flags)
    assert "refused by etcd at" in out and "job token" in out, out
    assert "started worker" not in out
