"""Nodes with real network paths on one machine: Linux network namespaces joined by veth pairs
to a bridge that lives in a namespace of its own (the host's network is never touched), with
addresses only inside them.  Needs root and iproute2.

    net = Net(3).up()                  # namespaces <prefix>-n0..n2 at 10.<k>.0.1..3/24, eth0
    net.run(i, cmd)                    # a process inside node i
    net.kill_node(i)                   # SIGKILL every process in node i's namespace
    net.partition(i) / net.heal(i)     # node i's link down / up (at the bridge)
    net.impair(delay_ms, loss)         # tc netem, or a userspace switch where the kernel has none
    net.limit("1gbit")                 # each node's egress rate-limited (tc tbf)
    net.down()                         # every process killed, every namespace deleted

``python tests/_helpers/netns.py clean`` removes what a crashed test left (every namespace whose
name starts with ``cftnet``), as ``Net.down`` does.

Limits: IPv4 only; without ``sch_netem`` (this project's CI kernel) ``impair`` replaces the
bridge by a Python switch process (every frame to every other port, a hub): fine for the
tests' few MB/s, not a model of a real switch's throughput.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Optional, Sequence

PREFIX = "cftnet"


def available() -> Optional[str]:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    probe = f"{PREFIX}probe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None if r.returncode == 0 else f"ip netns add failed: {r.stderr.strip()}"


def _ip(*args: str, ns: Optional[str] = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip"] + (["-n", ns] if ns else []) + list(args)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r


class Net:
    def __init__(self, nodes: int, prefix: Optional[str] = None):
        self.n = nodes
        tag = prefix or f"{os.getpid() % 100000}"
        self.prefix = f"{PREFIX}{tag}"
        self.subnet = 10 + (os.getpid() % 200)  # 10.<k>.0.0/24: unlikely to clash with a real one
        self.switch = f"{self.prefix}-sw"
        self.procs: list[subprocess.Popen] = []
        self._switch_ctl: Optional[str] = None  # the userspace switch's control file
        self._netem: Optional[bool] = None
        self._why = ""

    def ns(self, i: int) -> str:
        return f"{self.prefix}-n{i}"

    def addr(self, i: int) -> str:
        return f"10.{self.subnet}.0.{i + 1}"

    def _port(self, i: int) -> str:
        return f"{self.prefix[-6:]}p{i}"  # interface names: 15 characters at most

    def up(self) -> "Net":
        try:
            _ip("netns", "add", self.switch)
            _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
            _ip("link", "set", "br0", "up", ns=self.switch)
            for i in range(self.n):
                ns, port = self.ns(i), self._port(i)
                _ip("netns", "add", ns)
                _ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", port, "netns", self.switch)
                _ip("link", "set", port, "master", "br0", "up", ns=self.switch)
                _ip("addr", "add", f"{self.addr(i)}/24", "dev", "eth0", ns=ns)
                _ip("link", "set", "eth0", "up", ns=ns)
                _ip("link", "set", "lo", "up", ns=ns)
        except Exception:
            self.down()
            raise
        return self

    # ------------------------------------------------------------ processes
    def wrap(self, i: int) -> list[str]:
        """The command prefix that runs something inside node ``i``."""
        return ["ip", "netns", "exec", self.ns(i)]

    def run(self, i: int, cmd: Sequence[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(self.wrap(i) + list(cmd), start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def pids(self, i: int) -> list[int]:
        r = _ip("netns", "pids", self.ns(i), check=False)
        return [int(x) for x in r.stdout.split()]

    def kill_node(self, i: int) -> float:
        """SIGKILL every process of node ``i`` (a machine lost); the time it was done."""
        t = time.time()
        for _ in range(3):  # a process may fork while we kill
            for pid in self.pids(i):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        return t

    # ------------------------------------------------------------ etcd
    def etcd_up(self, data_root: str, nodes: Optional[Sequence[int]] = None, tls: bool = False,
                election_ms: int = 500) -> list[str]:
        """One etcd member per node (Debian's ``etcd``), clients on ``<addr>:2379``, peers on
        ``:2380``, a quick election (``election_ms`` election timeout, heartbeats a tenth of it,
        as etcd's tuning guide pairs them); returns the client endpoints once the cluster has a
        leader.  ``tls``: clients over TLS with client certificates and etcd's authentication on
        (``_helpers/etcd_tls.py``; the certificates in ``self.etcd_certs``)."""
        from _helpers import etcd_tls

        nodes = list(range(self.n)) if nodes is None else list(nodes)
        self.etcd_nodes, self.etcd_root, self.etcd_procs = nodes, data_root, {}
        self.etcd_election_ms = int(election_ms)
        os.makedirs(data_root, exist_ok=True)
        self.etcd_certs = (etcd_tls.make_certs(os.path.join(data_root, "certs"), [self.addr(i) for i in nodes])
                           if tls else None)
        for i in nodes:
            self.etcd_start(i, new=True)
        eps = [f"{self.addr(i)}:2379" for i in nodes]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            r = self.etcdctl("endpoint", "health", endpoints=eps)
            if r.returncode == 0:
                if tls:
                    etcd_tls.enable_auth(lambda *a: self.etcdctl(*a, endpoints=eps))
                return eps
            time.sleep(0.2)
        raise RuntimeError(f"etcd did not come up: {r.stdout} {r.stderr}")

    def etcdctl(self, *args: str, endpoints: Sequence[str]) -> subprocess.CompletedProcess:
        """``etcdctl`` from the first etcd node (as etcd's root user when the cluster speaks TLS)."""
        from _helpers import etcd_tls

        scheme = "https" if self.etcd_certs else "http"
        flags = etcd_tls.etcdctl_flags(self.etcd_certs) if self.etcd_certs else []
        return subprocess.run(self.wrap(self.etcd_nodes[0]) + [
            "etcdctl", "--endpoints", ",".join(f"{scheme}://{e}" for e in endpoints), *flags, *args],
            capture_output=True, text=True, env=dict(os.environ, ETCDCTL_API="3"))

    def etcd_start(self, i: int, new: bool = False) -> None:
        from _helpers import etcd_tls

        peers = ",".join(f"e{j}=http://{self.addr(j)}:2380" for j in self.etcd_nodes)
        a = self.addr(i)
        client = "https" if self.etcd_certs else "http"
        cmd = ["etcd", "--name", f"e{i}", "--data-dir", os.path.join(self.etcd_root, f"e{i}"),
               "--listen-client-urls", f"{client}://{a}:2379", "--advertise-client-urls", f"{client}://{a}:2379",
               "--listen-peer-urls", f"http://{a}:2380", "--initial-advertise-peer-urls", f"http://{a}:2380",
               "--initial-cluster", peers, "--initial-cluster-state", "new" if new else "existing",
               "--heartbeat-interval", str(max(1, self.etcd_election_ms // 10)),
               "--election-timeout", str(self.etcd_election_ms), "--pre-vote"]
        if self.etcd_certs:
            cmd += etcd_tls.server_flags(self.etcd_certs)
        log = open(os.path.join(self.etcd_root, f"e{i}.log"), "ab")
        self.etcd_procs[i] = self.run(i, cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def etcd_kill(self, i: int) -> float:
        t = time.time()
        p = self.etcd_procs.pop(i)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(5)
        return t

    # ------------------------------------------------------------ faults
    def partition(self, i: int) -> float:
        """Node ``i``'s link down at the bridge: nothing crosses, no reset is sent."""
        t = time.time()
        _ip("link", "set", self._port(i), "down", ns=self.switch)
        return t

    def heal(self, i: int) -> None:
        _ip("link", "set", self._port(i), "master", "br0", "up", ns=self.switch)

    def impair(self, delay_ms: float = 0.0, loss_pct: float = 0.0) -> str:
        """Delay and loss on every packet's way (call again to change them; 0, 0 clears);
        returns what was applied.  With ``sch_netem``: ``tc netem`` on each node's eth0.
        Without it (this project's CI kernel): the bridge is replaced, at the first call, by a
        switch process in the switch namespace (``_switch`` below: raw sockets on the ports,
        each frame delayed and dropped at random on its way, read from a control file so that
        later calls change it without a gap), so every frame crosses one impaired hop, as with
        netem on the sender."""
        args = ["qdisc", "replace", "dev", "eth0", "root", "netem", "delay", f"{delay_ms}ms", "loss", f"{loss_pct}%"]
        if self._switch_ctl is None:
            r = subprocess.run(self.wrap(0) + ["tc", *args], capture_output=True, text=True)
            if r.returncode == 0:
                for i in range(1, self.n):
                    subprocess.run(self.wrap(i) + ["tc", *args], check=True, capture_output=True)
                return f"tc netem delay {delay_ms} ms loss {loss_pct} %"
            if self._netem is not False:
                self._netem = False
                self._start_switch(r.stderr.strip())
        elif self._netem:
            for i in range(self.n):
                subprocess.run(self.wrap(i) + ["tc", *args], check=True, capture_output=True)
            return f"tc netem delay {delay_ms} ms loss {loss_pct} %"
        tmp = self._switch_ctl + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{delay_ms} {loss_pct}\n")
        os.replace(tmp, self._switch_ctl)
        return f"a userspace switch: delay {delay_ms} ms, loss {loss_pct} % per frame (no sch_netem: {self._why})"

    def limit(self, rate: str = "1gbit", burst: str = "256kb", latency_ms: float = 50.0,
              both_ways: bool = False) -> str:
        """Each node's egress rate-limited by ``tc tbf`` (a token bucket: ``rate``, ``burst``,
        at most ``latency_ms`` queued) -- with ``both_ways`` its ingress too (the bridge's port
        towards it: a NIC's two directions); returns what was applied."""
        tbf = ["tbf", "rate", rate, "burst", burst, "latency", f"{latency_ms}ms"]
        for i in range(self.n):
            subprocess.run(self.wrap(i) + ["tc", "qdisc", "replace", "dev", "eth0", "root"] + tbf, check=True,
                           capture_output=True)
            if both_ways:
                subprocess.run(["ip", "netns", "exec", self.switch, "tc", "qdisc", "replace", "dev", self._port(i),
                                "root"] + tbf, check=True, capture_output=True)
        where = "every node's eth0 and the bridge's port towards it" if both_ways else "every node's eth0"
        return f"tc tbf rate {rate} burst {burst} latency {latency_ms} ms on {where}"

    def _start_switch(self, why: str) -> None:
        if shutil.which("ethtool") is None:
            raise RuntimeError("no sch_netem and no ethtool: the userspace switch needs checksum "
                               "offloads off on each node (apt-get install ethtool)")
        for i in range(self.n):  # frames re-sent by a socket carry no offloaded checksum
            subprocess.run(self.wrap(i) + ["ethtool", "-K", "eth0", "tx", "off", "rx", "off", "gso", "off",
                                           "tso", "off", "gro", "off"], check=True, capture_output=True)
        self._why = why
        self._switch_ctl = f"/tmp/{self.prefix}-switch.ctl"
        with open(self._switch_ctl, "w") as f:
            f.write("0 0\n")
        ports = [self._port(i) for i in range(self.n)]
        for port in ports:
            _ip("link", "set", port, "nomaster", ns=self.switch)
            _ip("link", "set", port, "up", ns=self.switch)
        self.procs.append(subprocess.Popen(
            ["ip", "netns", "exec", self.switch, sys.executable, os.path.abspath(__file__), "switch",
             self._switch_ctl, *ports], start_new_session=True))
        time.sleep(0.5)  # its sockets bound

    # ------------------------------------------------------------ teardown
    def down(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for i in range(self.n):
            if _ip("netns", "pids", self.ns(i), check=False).returncode == 0:
                self.kill_node(i)
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for i in range(self.n):
            _ip("netns", "del", self.ns(i), check=False)
        _ip("netns", "del", self.switch, check=False)
        if self._switch_ctl:
            try:
                os.unlink(self._switch_ctl)
            except OSError:
                pass

    def __enter__(self) -> "Net":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()


def clean(prefix: str = PREFIX) -> list[str]:
    """Kill every process in, and delete, every namespace named ``prefix*`` (after a crash)."""
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    names = [line.split()[0] for line in r.stdout.splitlines() if line.startswith(prefix)]
    for name in names:
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    for name in names:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return names


def _switch(ctl: str, ports: Sequence[str]) -> None:
    """Forward every frame that arrives on a port to every other port, the control file's
    delay later, dropping its loss % at random (a hub with a slow, lossy wire; runs in the
    switch namespace, on ports that left the bridge)."""
    import heapq
    import random
    import socket
    import threading

    eth_p_all, outgoing = 0x0003, 4
    socks = []
    for port in ports:
        sk = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(eth_p_all))
        sk.bind((port, 0))
        socks.append(sk)
    due: list = []
    cv = threading.Condition()
    rng = random.Random(0)
    knobs = [0.0, 0.0]

    def control() -> None:
        stamp = None
        while True:
            try:
                st = os.stat(ctl).st_mtime_ns
                if st != stamp:
                    stamp = st
                    knobs[:] = [float(x) for x in open(ctl).read().split()[:2]]
            except (OSError, ValueError):
                pass
            time.sleep(0.05)

    def reader(k: int) -> None:
        seq = 0
        while True:
            frame, addr = socks[k].recvfrom(65536)
            delay_ms, loss_pct = knobs
            if addr[2] == outgoing or rng.random() * 100 < loss_pct:
                continue
            seq += 1
            with cv:
                heapq.heappush(due, (time.monotonic() + delay_ms / 1000.0, k, seq, frame))
                cv.notify()

    threading.Thread(target=control, daemon=True).start()
    for k in range(len(ports)):
        threading.Thread(target=reader, args=(k,), daemon=True).start()
    while True:
        with cv:
            while not due or due[0][0] > time.monotonic():
                cv.wait(None if not due else max(0.0, due[0][0] - time.monotonic()))
            _, k, _, frame = heapq.heappop(due)
        for j, sk in enumerate(socks):
            if j != k:
                try:
                    sk.send(frame)
                except OSError:  # a port down (a partition)
                    pass


if __name__ == "__main__":
    if sys.argv[1:] == ["clean"]:
        gone = clean()
        print(f"removed {len(gone)} namespace(s): {' '.join(gone) or '-'}")
    elif sys.argv[1:2] == ["switch"]:
        _switch(sys.argv[2], sys.argv[3:])
    else:
        print(__doc__)
