"""The etcd client against an etcd run as ``docs/security.md`` advises: TLS with client
certificates (``--client-cert-auth``) and etcd's user/role authentication.  One real etcd on
loopback (Debian's ``etcd``), certificates issued by ``openssl`` (``_helpers/etcd_tls.py``).

What must hold: a client with the CA, the job's client certificate and a user whose role may
read and write ``/cft/`` works (a store, its clone, an expired token replaced); every other
client is refused at once with a message that names what to fix -- no certificate, one from
another CA, a certificate with a Common Name, a wrong password, a user without the role, no
user, plain HTTP -- and ``chameleon-ft run`` stops on such a refusal instead of retrying.  The
job over TLS and authentication, losing node 0 with its etcd member, is in
``tests/cluster/test_etcd_cluster.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from _helpers import etcd_tls
from chameleon_ft.runtime.etcd import EtcdError, EtcdRefused, EtcdSecurity, EtcdStore

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    why = etcd_tls.available()
    if why:
        pytest.skip(why)
    d = tmp_path_factory.mktemp("etcd-tls")
    certs = etcd_tls.make_certs(str(d / "certs"), ["127.0.0.1"])
    with etcd_tls.one_member(str(d), certs) as (ep, etcdctl):
        etcd_tls.enable_auth(etcdctl)
        yield ep, certs


def _security(certs, cert="client", user=etcd_tls.JOB_USER, password=etcd_tls.JOB_PASSWORD, ca=True):
    return EtcdSecurity(certs["ca"] if ca else None, certs.get(f"{cert}_cert"), certs.get(f"{cert}_key"),
                        user, password)


def _store(ep, security) -> EtcdStore:
    return EtcdStore([ep], "/cft/test/", timeout=timedelta(seconds=3), request_timeout_s=2.0, security=security)


def test_a_client_with_the_ca_its_certificate_and_the_role_works(secured):
    ep, certs = secured
    store = _store(ep, _security(certs))
    store.set("a", "1")
    assert store.get("a") == b"1"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.clone().get("a") == b"1"  # gloo's clones carry the same security
    store.client._token = "expired"  # what etcd answers after --auth-token-ttl of idleness
    assert store.get("a") == b"1"
    assert store.client._token != "expired"


def test_a_watch_stream_speaks_tls_and_sends_the_token(secured, monkeypatch):
    """The abort watcher's stream (``EtcdWatch``) over TLS with etcd's authentication on: the
    keys come, also after the token expired (a new one is fetched; the member is not suspected)."""
    from chameleon_ft.runtime import etcd as etcd_mod
    from chameleon_ft.runtime.etcd import EtcdWatch

    monkeypatch.setattr(etcd_mod, "_suspect", {})
    ep, certs = secured
    store = _store(ep, _security(certs))
    w = EtcdWatch(store.client, store._k("cft/abort/"))
    assert w.keys(0.05) == [] and w.streaming
    store.set("cft/abort/g1", "x")
    assert w.keys(5.0) == [b"g1"]
    w.close()
    store.client._token = "expired"
    store.set("cft/abort/g2", "x")  # (the store's request fetches a new token first)
    store.client._token = "expired"
    with pytest.raises(etcd_mod.EtcdError, match="auth token"):
        w.keys(0.05)
    assert etcd_mod._suspect == {} and store.client._token is None
    assert w.keys(5.0) == [b"g2"]  # resumed after g1: nothing missed
    w.close()


@pytest.mark.parametrize("case, security, said", [
    ("no certificate", dict(cert="none"), "refused the TLS handshake"),
    ("another CA's certificate", dict(cert="stranger"), "refused the TLS handshake"),
    ("a certificate with a Common Name", dict(cert="root"), "issue --etcd-cert without one"),
    ("a wrong password", dict(password="guess"), "refused user 'cft-job'"),
    ("a user without the role", dict(user=etcd_tls.NO_ROLE_USER, password=etcd_tls.NO_ROLE_PASSWORD),
     "permission denied for user 'cft-nobody'"),
    ("no user", dict(user=None, password=None), "etcd has authentication on"),
])
def test_every_other_client_is_refused_at_once_saying_why(secured, case, security, said):
    ep, certs = secured
    t0 = time.monotonic()
    with pytest.raises(EtcdRefused, match=None) as err:
        _store(ep, _security(certs, **security)).set("a", "2")
    assert said in str(err.value), (case, str(err.value))
    assert time.monotonic() - t0 < 2.0, case  # not retried as an unreachable member
    assert _store(ep, _security(certs)).get("a") == b"1"  # nothing written


def test_plain_http_against_a_tls_etcd_says_so(secured):
    ep, _ = secured
    with pytest.raises(EtcdError) as err:
        _store(ep, EtcdSecurity()).set("a", "3")
    assert not isinstance(err.value, EtcdRefused)  # (a member going down looks the same)
    assert "pass --etcd-cacert" in str(err.value)


def test_security_settings_are_checked_before_any_request(tmp_path):
    from chameleon_ft.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="--etcd-cacert '/no/such.pem': no such file"):
        EtcdSecurity.from_env({"CHAMELEON_FT_ETCD_CACERT": "/no/such.pem"})
    (tmp_path / "c.pem").write_text("x")
    with pytest.raises(ConfigError, match="--etcd-cert and --etcd-key go together"):
        EtcdSecurity.from_env({"CHAMELEON_FT_ETCD_CERT": str(tmp_path / "c.pem")})
    with pytest.raises(ConfigError, match="CHAMELEON_FT_ETCD_PASSWORD go together"):
        EtcdSecurity.from_env({"CHAMELEON_FT_ETCD_USER": "u"})
    assert not EtcdSecurity.from_env({}).tls


def test_chameleon_ft_run_stops_on_a_refusal(secured, tmp_path):
    ep, certs = secured
    worker = str(Path(__file__).with_name("_workers") / "mlp_worker.py")
    common = ["--rdzv-backend", "etcd", "--rdzv-endpoint", ep, "--rdzv-timeout", "60", "--job-token", "t"]
    cases = {
        "password": (common + ["--etcd-cacert", certs["ca"], "--etcd-cert", certs["client_cert"],
                               "--etcd-key", certs["client_key"]], {"CHAMELEON_FT_ETCD_PASSWORD": "guess"}),
        "no cert": (common + ["--etcd-cacert", certs["ca"]], {}),
        "c10d": (["--etcd-cacert", certs["ca"]], {}),
        "missing": (common + ["--etcd-cacert", str(tmp_path / "nope.pem")], {}),
    }
    env = dict(os.environ, CHAMELEON_FT_ETCD_USER=etcd_tls.JOB_USER, CHAMELEON_FT_ETCD_PASSWORD=etcd_tls.JOB_PASSWORD)
    procs = {k: subprocess.Popen([sys.executable, "-m", "chameleon_ft.cli.launch", *a, "--run-dir",
                                  str(tmp_path / k.replace(" ", "_")), worker, "--out", str(tmp_path)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env, **e})
             for k, (a, e) in cases.items()}
    t0 = time.monotonic()
    res = {k: (p.wait(90), p.communicate()[1]) for k, p in procs.items()}
    assert time.monotonic() - t0 < 40, res  # a refusal is not waited out for --rdzv-timeout (60 s)
    code, err = res["password"]
    assert code != 0 and "refused user 'cft-job'" in err and "started worker" not in err, err
    code, err = res["no cert"]
    assert code != 0 and "refused the TLS handshake" in err, err
    code, err = res["c10d"]
    assert code == 2 and "go with --rdzv-backend etcd" in err, err
    code, err = res["missing"]
    assert code == 2 and "nope.pem': no such file" in err, err
    assert all("Traceback" not in err for _, err in res.values()), res
