"""Nodes with real network paths on one machine: Linux network namespaces joined by veth pairs
to a bridge that lives in a namespace of its own (the host's network is never touched), with
addresses only inside them.  Needs root and iproute2; nftables for packet loss.

    net = Net(3).up()                  # namespaces <prefix>-n0..n2 at 10.<k>.0.1..3/24, eth0
    net.run(i, cmd)                    # a process inside node i
    net.kill_node(i)                   # SIGKILL every process in node i's namespace
    net.partition(i) / net.heal(i)     # node i's link down / up (at the bridge)
    net.impair(i, delay_ms, loss)      # tc netem, or nftables loss where the kernel has no netem
    net.down()                         # every process killed, every namespace deleted

``python tests/_helpers/netns.py clean`` removes what a crashed test left (every namespace whose
name starts with ``cftnet``), as ``Net.down`` does.

Limits: IPv4 only; ``impair`` adds delay only with ``sch_netem`` (this project's CI kernel has
none: there it drops packets with nftables and says that no delay was added).
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
        self.impaired: dict[int, str] = {}

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

    # ------------------------------------------------------------ faults
    def partition(self, i: int) -> float:
        """Node ``i``'s link down at the bridge: nothing crosses, no reset is sent."""
        t = time.time()
        _ip("link", "set", self._port(i), "down", ns=self.switch)
        return t

    def heal(self, i: int) -> None:
        _ip("link", "set", self._port(i), "master", "br0", "up", ns=self.switch)

    def impair(self, i: int, delay_ms: float = 0.0, loss_pct: float = 0.0) -> str:
        """Delay and loss on node ``i``'s outgoing packets; returns what was applied."""
        args = ["qdisc", "replace", "dev", "eth0", "root", "netem"]
        if delay_ms:
            args += ["delay", f"{delay_ms}ms"]
        if loss_pct:
            args += ["loss", f"{loss_pct}%"]
        r = subprocess.run(self.wrap(i) + ["tc", *args], capture_output=True, text=True)
        if r.returncode == 0:
            self.impaired[i] = "netem"
            return f"tc netem delay {delay_ms} ms loss {loss_pct} %"
        if shutil.which("nft") is None:
            raise RuntimeError(f"tc netem unavailable ({r.stderr.strip()}) and no nft for the loss")
        rules = ["add table inet cftimpair",
                 "add chain inet cftimpair out { type filter hook output priority 0 ; }",
                 f"add rule inet cftimpair out meta oifname eth0 numgen random mod 10000 < "
                 f"{int(round(loss_pct * 100))} drop"]
        for rule in rules:
            q = subprocess.run(self.wrap(i) + ["nft", *rule.split()], capture_output=True, text=True)
            if q.returncode != 0:
                raise RuntimeError(f"nft {rule}: {q.stderr.strip()}")
        self.impaired[i] = "nft"
        return f"nftables loss {loss_pct} % (this kernel has no sch_netem: no delay added)"

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


if __name__ == "__main__":
    if sys.argv[1:] == ["clean"]:
        gone = clean()
        print(f"removed {len(gone)} namespace(s): {' '.join(gone) or '-'}")
    else:
        print(__doc__)
