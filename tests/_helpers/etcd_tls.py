"""An etcd secured as ``docs/security.md`` tells users to run it: TLS with client certificates
and etcd's user/role authentication.

``make_certs(dir, ips)`` issues, with ``openssl``, a CA, a server certificate for ``ips``, the
workers' client certificate (no Common Name: etcd's JSON gateway refuses one with it), a client
certificate with the Common Name ``root`` (what ``etcdctl`` uses to set etcd up) and a
certificate from another CA (a client etcd must refuse).  ``server_flags`` are etcd's flags for
them; ``enable_auth(etcdctl)`` creates the job's user with read-write on ``/cft/``, a user
without a role, and turns authentication on.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from typing import Callable, Iterator, Optional, Sequence

__all__ = ["available", "one_member", "make_certs", "server_flags", "etcdctl_flags", "enable_auth", "JOB_USER", "JOB_PASSWORD",
           "NO_ROLE_USER", "NO_ROLE_PASSWORD"]

JOB_USER, JOB_PASSWORD = "cft-job", "job-secret"
NO_ROLE_USER, NO_ROLE_PASSWORD = "cft-nobody", "nobody-secret"


def available() -> str | None:
    """Why these tests cannot run here, or None."""
    for tool in ("etcd", "etcdctl", "openssl"):
        if shutil.which(tool) is None:
            return f"needs {tool} (apt-get install etcd-server etcd-client openssl)"
    return None


def _openssl(*args: str, cwd: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _issue(d: str, name: str, subject: str, san: str, ca: str = "ca") -> None:
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", subject, cwd=d)
    with open(os.path.join(d, f"{name}.ext"), "w") as f:
        f.write(f"subjectAltName={san}\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


def make_certs(d: str, ips: Sequence[str]) -> dict[str, str]:
    """Paths by role: ca, server_cert/key, client_cert/key, root_cert/key, stranger_cert/key."""
    os.makedirs(d, exist_ok=True)
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.crt",
                 "-days", "2", "-subj", f"/CN=chameleon-ft test {ca}", cwd=d)
    san = ",".join(f"IP:{ip}" for ip in ips)
    _issue(d, "server", "/CN=etcd", san)
    _issue(d, "client", "/O=chameleon-ft workers", san)
    _issue(d, "root", "/CN=root", san)
    _issue(d, "stranger", "/O=not this job", san, ca="other-ca")
    p = lambda f: os.path.join(d, f)  # noqa: E731
    return {"ca": p("ca.crt"), "server_cert": p("server.crt"), "server_key": p("server.key"),
            "client_cert": p("client.crt"), "client_key": p("client.key"), "root_cert": p("root.crt"),
            "root_key": p("root.key"), "stranger_cert": p("stranger.crt"), "stranger_key": p("stranger.key")}


def server_flags(certs: dict[str, str]) -> list[str]:
    return ["--cert-file", certs["server_cert"], "--key-file", certs["server_key"],
            "--trusted-ca-file", certs["ca"], "--client-cert-auth"]


def etcdctl_flags(certs: dict[str, str]) -> list[str]:
    """etcdctl as etcd's root user (its certificate's Common Name)."""
    return ["--cacert", certs["ca"], "--cert", certs["root_cert"], "--key", certs["root_key"]]


def enable_auth(etcdctl: Callable[..., subprocess.CompletedProcess]) -> None:
    """``etcdctl(*args)`` runs one etcdctl command against the cluster (as root)."""
    for args in (("user", "add", "root", "--new-user-password=root-secret"),
                 ("user", "grant-role", "root", "root"),
                 ("role", "add", "cft"),
                 ("role", "grant-permission", "cft", "--prefix=true", "readwrite", "/cft/"),
                 ("user", "add", JOB_USER, f"--new-user-password={JOB_PASSWORD}"),
                 ("user", "grant-role", JOB_USER, "cft"),
                 ("user", "add", NO_ROLE_USER, f"--new-user-password={NO_ROLE_PASSWORD}"),
                 ("auth", "enable")):
        r = etcdctl(*args)
        if r.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)}: {r.stdout} {r.stderr}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_member(d: str, certs: Optional[dict[str, str]] = None) -> Iterator[tuple[str, Callable]]:
    """A one-member etcd on loopback (TLS with ``certs``), healthy: ``(host:port, etcdctl)``,
    ``etcdctl(*args)`` run against it; killed at the end."""
    client, peer = _free_port(), _free_port()
    url = f"{'https' if certs else 'http'}://127.0.0.1:{client}"
    log = open(os.path.join(d, "etcd.log"), "wb")
    proc = subprocess.Popen(
        ["etcd", "--name", "s0", "--data-dir", os.path.join(d, "data"), "--listen-client-urls", url,
         "--advertise-client-urls", url, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", f"s0=http://127.0.0.1:{peer}", *(server_flags(certs) if certs else [])],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def etcdctl(*args):
        return subprocess.run(["etcdctl", "--endpoints", url, *(etcdctl_flags(certs) if certs else []), *args],
                              capture_output=True, text=True, env=dict(os.environ, ETCDCTL_API="3"))
    try:
        deadline = time.monotonic() + 30
        while etcdctl("endpoint", "health").returncode != 0:
            if time.monotonic() > deadline:
                with open(os.path.join(d, "etcd.log")) as f:
                    raise RuntimeError(f"etcd did not come up: {f.read()[-2000:]}")
            time.sleep(0.2)
        yield f"127.0.0.1:{client}", etcdctl
    finally:
        proc.kill()
        proc.wait(10)
        log.close()
