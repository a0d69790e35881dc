"""The control plane at scale: N emulated members that run the real membership code -- join
through the Lighthouse and the store, the liveness monitor, the abort watcher, the agreement
on a new generation -- without a model, against the embedded coordinator or (``--backend
etcd``) a 3-member etcd cluster on loopback with the quorum over etcd instead of the Lighthouse.

    python benchmarks/control_plane.py --members 16,64,256,1024 --out docs/benchmarks-control-plane.md
    python benchmarks/control_plane.py --backend etcd --members 16,64,256

Each member is a ``Membership`` on threads of its own, 8 to a host process (``--per-process``);
each has its own main store client, and the watchers and liveness monitors of a process share 4
(``--clients``: torch's TCPStore client stalls 5 s on the 25th and 51st client a process opens
-- measured on torch 2.13, the server in another process, plain sockets unaffected -- where a
real worker opens a handful);
a member's "main thread" only takes the next generation when the watcher saw its generation
end (what a worker's failed collective does).  Measured per N, on this machine:

* store requests per member per second in the steady state (every request a member's store
  clients make, counted on the client side, over ``--window`` seconds: a TCPStore call, or an
  HTTP request of the etcd client, the quorum's lease keep-alives included), and in total;
  With the embedded coordinator judging liveness (``--judge coordinator``: the launcher's ``--coordinator-judges``)
  a member's beats go on its presence connection, one byte each with no answer, and are not
  store requests; the coordinator's own requests (its judge, the generations' ends) are not in
  the members' column either (they are in its CPU);
* the members' heartbeats to the Lighthouse (gRPC, to the coordinator's process; embedded
  backend) per member and second, counted apart: they are not store requests;
* the coordinator's CPU (cores) and resident memory over the same window: the coordinator
  process (TCPStore server + Lighthouse), or the three etcd members together;
* a silent member (its threads stopped: what SIGSTOP or a lost node looks like): seconds from
  the silence to its generation ended (detected) and to a new generation without it agreed;
* a burst: 10 % of the members silent at once, the same two times.

The figures depend on this machine's 2 cores, which also run the N emulated members: where
they saturate, the per-member rates and times say so (the harness reports what it achieved).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness.systems import free_port  # noqa: E402


# ---------------------------------------------------------------- the host process (members)
class _Counting:
    """A store client that counts its requests (every method call)."""

    def __init__(self, inner, counter: list) -> None:
        self._inner, self._counter = inner, counter

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self._counter[0] += 1
            return attr(*args, **kwargs)
        return call


def host(args) -> None:
    """Run members ``args.ids`` (a:b) until told to stop; obey the orchestrator's commands."""
    import chameleon_ft.runtime.membership as mm

    counter = [0]
    if mm.is_etcd(args.store):  # every HTTP request of every etcd client (the quorum's too)
        from chameleon_ft.runtime.etcd import EtcdClient
        real_call = EtcdClient.call

        def counted(self, path, body):
            counter[0] += 1
            return real_call(self, path, body)
        EtcdClient.call = counted
    lighthouse = [0]  # the members' Lighthouse heartbeats (gRPC; embedded backend)
    real_beat = mm.Membership._heartbeat_once

    def beat(self, raise_errors: bool = False) -> None:
        lighthouse[0] += 1
        return real_beat(self, raise_errors)
    if not mm.is_etcd(args.store):
        mm.Membership._heartbeat_once = beat
    real_connect = mm.connect_store
    shared: list = []
    turn = [0]
    lock = threading.Lock()

    def connect(addr, timeout, **kw):
        # A member's main client is its own (it blocks in a wait at join); its watcher and
        # liveness monitor share a few per process (torch's TCPStore client stalls 5 s at the
        # 25th client a process opens); each client serialises its requests.
        if not threading.current_thread().name.startswith("cft-"):
            return _Counting(real_connect(addr, timeout, **kw), counter)
        with lock:
            if len(shared) < args.clients:
                shared.append(real_connect(addr, timeout, **kw))
                return _Counting(shared[-1], counter)
            turn[0] += 1
            return _Counting(shared[turn[0] % len(shared)], counter)
    if not mm.is_etcd(args.store):  # every module that opens a member's store client
        import chameleon_ft.runtime.abort_watch as aw
        mm.connect_store = aw.connect_store = connect
    lo, hi = (int(x) for x in args.ids.split(":"))
    ctl = Path(args.ctl)
    members: dict[int, mm.Membership] = {}
    silenced: set[int] = set()
    stop = threading.Event()

    def run(w: int) -> None:
        m = mm.Membership(w, args.store, args.lighthouse, heartbeat_timeout_s=1.0 * args.beat_scale, cut_off_s=None,
                          heartbeat_interval_s=0.1 * args.beat_scale, connect_timeout_s=args.connect_timeout)
        woken = threading.Event()  # the watcher agreed on the next generation: take it
        m.on_early_view = lambda view: woken.set()
        members[w] = m
        m.join(min_world_size=args.n, timeout_s=600)
        taken = m.view().token
        while not stop.is_set():  # a worker's main thread: it takes a generation the watcher
            if w in silenced:     # agreed on, and asks itself when the watcher did not
                return
            woken.clear()
            view = m.view()
            try:
                if view is not None and view.token != taken:
                    taken = m.next_view(30.0, after=taken).token
                elif view is not None and m.abort_seen(view.token):
                    taken = m.next_view(30.0, after=view.token).token
            except Exception:
                pass
            woken.wait(0.2)

    threads = [threading.Thread(target=run, args=(w,), daemon=True) for w in range(lo, hi)]
    for t in threads:
        t.start()
        time.sleep(0.002)
    while not all(w in members and members[w].view() is not None for w in range(lo, hi)):
        time.sleep(0.05)
    (ctl / f"ready.{lo}").touch()
    done: set[str] = set()
    while not (ctl / "stop").exists():
        for cmd in sorted(ctl.glob("cmd.*")):
            if cmd.name in done:
                continue
            done.add(cmd.name)
            order = json.loads(cmd.read_text())
            if order["what"] == "count":
                tmp = ctl / f"tmp.{order['id']}.{lo}"
                tmp.write_text(json.dumps({"requests": counter[0], "lighthouse": lighthouse[0], "t": time.time()}))
                tmp.rename(ctl / f"count.{order['id']}.{lo}")
            elif order["what"] == "silence":
                for w in order["workers"]:
                    if lo <= w < hi:
                        silenced.add(w)
                        m = members[w]
                        m._stop.set()  # the watcher, the Lighthouse heartbeats, the guard
                        monitor = getattr(m, "_monitor", None)
                        if monitor is not None:
                            monitor.stop(0)
        time.sleep(0.02)
    stop.set()
    os._exit(0)


# ---------------------------------------------------------------- the orchestrator
def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


_COORDINATOR = """
import sys, time
from chameleon_ft.runtime.coordination import CoordinatorServer
scale = float(sys.argv[3])
c = CoordinatorServer(min_replicas=1, join_timeout_ms=int(sys.argv[2]), heartbeat_timeout_ms=int(1000 * scale),
                      **({} if sys.argv[1] == "members" else {"liveness_timeout_s": 1.0 * scale}))
print(c.store_addr, c.lighthouse_addr, flush=True)
while True:
    time.sleep(1)
"""


class Etcd:
    """A 3-member etcd cluster on loopback (Debian's ``etcd``; 50 ms heartbeats, 500 ms
    election timeout: the namespace nodes' settings in ``tests/_helpers/netns.py``)."""

    def __init__(self, data: Path) -> None:
        ports = [(free_port(), free_port()) for _ in range(3)]
        peers = ",".join(f"e{i}=http://127.0.0.1:{p}" for i, (_, p) in enumerate(ports))
        self.procs = []
        for i, (c, p) in enumerate(ports):
            self.procs.append(subprocess.Popen(
                ["etcd", "--name", f"e{i}", "--data-dir", str(data / f"e{i}"),
                 "--listen-client-urls", f"http://127.0.0.1:{c}", "--advertise-client-urls", f"http://127.0.0.1:{c}",
                 "--listen-peer-urls", f"http://127.0.0.1:{p}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{p}",
                 "--initial-cluster", peers, "--initial-cluster-state", "new",
                 "--heartbeat-interval", "50", "--election-timeout", "500", "--pre-vote"],
                stdout=subprocess.DEVNULL, stderr=open(data / f"e{i}.log", "w")))
        self.endpoints = [f"127.0.0.1:{c}" for c, _ in ports]
        from chameleon_ft.runtime.etcd import EtcdClient
        client, deadline = EtcdClient(self.endpoints, 1.0), time.monotonic() + 30
        while not client.healthy():
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not come up: {(data / 'e0.log').read_text()[-2000:]}")
            time.sleep(0.2)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


class Run:
    """One N: the coordinator (or etcd), the host processes, the control directory."""

    def __init__(self, n: int, per_process: int, ctl: Path, clients: int = 8, backend: str = "embedded",
                 connect_timeout: float = 30.0, judge: str = "coordinator", join_ms: int = 50,
                 beat_scale: float = 1.0) -> None:
        self.n, self.ctl, self.connect_timeout = n, ctl, connect_timeout
        ctl.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.coord = self.etcd = None
        if backend == "etcd":
            self.etcd = Etcd(ctl)
            self.store, self.lighthouse = f"etcd://{','.join(self.etcd.endpoints)}/cpbench", f"etcd?join_ms={join_ms}"
            self.pids = self.etcd.pids
            from chameleon_ft.runtime.coordination import AUTH_KEY, job_digest
            from chameleon_ft.runtime.etcd import EtcdStore, parse_etcd
            endpoints, prefix = parse_etcd(self.store)  # what the job's first launcher records
            EtcdStore(endpoints, prefix).compare_set(AUTH_KEY, "", job_digest())
        else:
            self.coord = subprocess.Popen([sys.executable, "-c", _COORDINATOR, judge, str(join_ms), str(beat_scale)], stdout=subprocess.PIPE,
                                          text=True, env=env)
            self.store, self.lighthouse = self.coord.stdout.readline().split()
            self.pids = [self.coord.pid]
        from chameleon_ft.runtime.coordination import connect_store
        self.client = connect_store(self.store, 10.0)
        self.hosts = []
        for lo in range(0, n, per_process):
            hi = min(n, lo + per_process)
            self.hosts.append(subprocess.Popen(
                [sys.executable, __file__, "--host", "--ids", f"{lo}:{hi}", "--n", str(n), "--store", self.store,
                 "--lighthouse", self.lighthouse, "--ctl", str(ctl), "--clients", str(clients),
                 "--connect-timeout", str(self.connect_timeout), "--beat-scale", str(beat_scale)], env=env,
                stdout=subprocess.DEVNULL, stderr=open(ctl / f"host.{lo}.log", "w")))
        self.los = list(range(0, n, per_process))
        self._cmds = 0

    def wait_ready(self, timeout_s: float) -> float:
        t0 = time.time()
        while not all((self.ctl / f"ready.{lo}").exists() for lo in self.los):
            if time.time() - t0 > timeout_s:
                logs = "".join((self.ctl / f"host.{lo}.log").read_text()[-600:] for lo in self.los[:2])
                raise TimeoutError(f"{self.n} members not joined in {timeout_s} s: {logs}")
            if any(h.poll() is not None for h in self.hosts):
                raise RuntimeError(f"a host process died: {(self.ctl / 'host.0.log').read_text()[-2000:]}")
            time.sleep(0.1)
        return time.time() - t0

    def command(self, what: str, **kw) -> int:
        self._cmds += 1
        path = self.ctl / f"cmd.{self._cmds:04d}"
        tmp = self.ctl / f"tmp.{path.name}"  # (not ``cmd.*``: the hosts glob for those)
        tmp.write_text(json.dumps({"what": what, "id": self._cmds, **kw}))
        tmp.rename(path)
        return self._cmds

    def count(self) -> tuple[int, int, float]:
        cid = self.command("count")
        files = [self.ctl / f"count.{cid}.{lo}" for lo in self.los]
        while not all(f.exists() for f in files):
            dead = [lo for lo, h in zip(self.los, self.hosts) if h.poll() is not None]
            if dead:
                raise RuntimeError(f"host process {dead[0]} died: {(self.ctl / f'host.{dead[0]}.log').read_text()[-2000:]}")
            time.sleep(0.02)
        got = [json.loads(f.read_text()) for f in files]
        return (sum(g["requests"] for g in got), sum(g["lighthouse"] for g in got),
                sum(g["t"] for g in got) / len(got))

    def latest(self) -> dict:
        from chameleon_ft.runtime.coordination import read_latest
        return read_latest(self.client) or {}

    def whole(self, size: int, timeout_s: float = 120.0) -> Optional[float]:
        """Seconds until the newest generation holds ``size`` members (None: not in time).  On a
        loaded machine a member that asks later than the Lighthouse's join window (50 ms) is
        left out of a quorum and admitted again afterwards: this is how long that took."""
        t0 = time.time()
        while time.time() - t0 < timeout_s:
            if len(self.latest().get("members", [])) == size:
                return round(time.time() - t0, 2)
            time.sleep(0.05)
        return None

    def silence_and_time(self, workers: list[int], timeout_s: float = 60.0) -> tuple[Optional[float], Optional[float]]:
        """Silence ``workers``; seconds to their generation's end and to a new one without them."""
        from chameleon_ft.runtime.coordination import abort_key
        before = self.latest()
        t0 = time.time()
        self.command("silence", workers=workers)
        detect = agreed = None
        gone = set(workers)
        while time.time() - t0 < timeout_s and agreed is None:
            if detect is None and self.client.check([abort_key(before["token"])]):
                detect = time.time() - t0
            now = self.latest()
            if now.get("token") != before.get("token") and not gone & set(now.get("members", [])):
                agreed = time.time() - t0
            time.sleep(0.01)
        return detect, agreed

    def close(self) -> None:
        (self.ctl / "stop").write_text("1")
        for h in self.hosts:
            try:
                h.wait(10)
            except subprocess.TimeoutExpired:
                h.kill()
        if self.coord is not None:
            self.coord.kill()
            self.coord.wait()
        if self.etcd is not None:
            self.etcd.close()


def measure(n: int, per_process: int, window_s: float, ctl: Path, clients: int = 8,
            backend: str = "embedded", connect_timeout: float = 30.0, judge: str = "coordinator",
            join_ms: int = 50, beat_scale: float = 1.0) -> dict:
    run = Run(n, per_process, ctl, clients, backend, connect_timeout, judge, join_ms, beat_scale)
    cpu = lambda: sum(_cpu_s(p) for p in run.pids)  # noqa: E731
    try:
        join_s = run.wait_ready(60 + n * 0.5)
        # Settle: every member's threads running.  The request rate ramps up for a few seconds
        # after a 64-member join (in 1 s windows: 1.4, 1.4, 2.0, then 3.9 a member).
        time.sleep(6.0)
        # The steady state: a window in which the generation did not change (a late member's
        # re-admission makes a new one, and every watcher reads its key at each change); up to
        # five windows are tried, the last one is taken.
        for tries in range(1, 6):
            before = run.latest().get("token")
            r0, h0, t0 = run.count()
            c0 = cpu()
            time.sleep(window_s)
            r1, h1, t1 = run.count()
            c1 = cpu()
            if run.latest().get("token") == before:
                break
        rate = (r1 - r0) / (t1 - t0)
        out = {"members": n, "backend": backend, "join_ms": join_ms, "beat_scale": beat_scale, "join_s": round(join_s, 2), "requests_per_s": round(rate),
               "requests_per_member_s": round(rate / n, 1),
               "lighthouse_per_member_s": round((h1 - h0) / (t1 - t0) / n, 1) if backend == "embedded" else None,
               "coordinator_cores": round((c1 - c0) / (t1 - t0), 2), "windows": tries,
               "coordinator_rss_mb": round(sum(_rss_mb(p) for p in run.pids), 1)}
        out["whole_s"] = run.whole(n)  # every member in one generation before the silence
        members = sorted(run.latest()["members"])
        victim = members[len(members) // 2]  # not the judge
        out["silent_detect_s"], out["silent_agreed_s"] = run.silence_and_time([victim])
        out["rejoined_s"] = run.whole(n - 1)  # members a too-early quorum left out are back
        members = sorted(run.latest()["members"])
        burst = members[1::10][:max(1, len(members) // 10)]
        out["burst"] = len(burst)
        out["burst_detect_s"], out["burst_agreed_s"] = run.silence_and_time(burst)
        return out
    finally:
        run.close()


def table(rows: list[dict], label: str) -> str:
    head = ("| members | store requests/s | per member/s | Lighthouse heartbeats per member/s | "
            "coordinator CPU (cores) | coordinator RSS (MB) | "
            "silent member: detected (s) | new generation (s) | all re-admitted (s) | burst of 10 %: detected (s) | "
            "new generation (s) |")
    lines = [f"**{label}**", "", head, "|" + "---|" * 11]
    f = lambda v: "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))  # noqa: E731
    for r in rows:
        lines.append(f"| {r['members']} | {r['requests_per_s']} | {r['requests_per_member_s']} | "
                     f"{f(r.get('lighthouse_per_member_s'))} | "
                     f"{r['coordinator_cores']} | {r['coordinator_rss_mb']} | {f(r['silent_detect_s'])} | "
                     f"{f(r['silent_agreed_s'])} | {f(r.get('rejoined_s'))} | {f(r['burst_detect_s'])} ({r['burst']}) | "
                     f"{f(r['burst_agreed_s'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ids", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--lighthouse", help=argparse.SUPPRESS)
    p.add_argument("--ctl", help=argparse.SUPPRESS)
    p.add_argument("--members", default="16,64,256")
    p.add_argument("--backend", choices=("embedded", "etcd"), default="embedded",
                   help="the embedded coordinator, or a 3-member etcd cluster on loopback")
    p.add_argument("--clients", type=int, default=4, help="store clients per host process, shared by its members")
    p.add_argument("--per-process", type=int, default=8,
                   help="members per host process (torch's TCPStore client stalls 5 s at the 25th client of a process)")
    p.add_argument("--window", type=float, default=3.0)
    p.add_argument("--connect-timeout", type=float, default=30.0,
                   help="each member's limit for reaching the coordinator (the runtime's default is 5 s: at 64 "
                        "members and up, N clients connecting at once to the one TCPStore of a loaded 2-core "
                        "machine time out)")
    p.add_argument("--judge", choices=("coordinator", "members"), default="coordinator",
                   help="embedded backend: the coordinator judges liveness (the launcher's --coordinator-judges: the workers beat "
                        "on their presence connections) or the members do (a judge member reads the counters)")
    p.add_argument("--join-ms", type=int, default=50,
                   help="the quorum's join window (the launcher's --join-timeout-ms; default 50)")
    p.add_argument("--beat-scale", type=float, default=1.0,
                   help="every heartbeat interval (0.1 s) and timeout (1 s) times this: the members' beats to the "
                        "Lighthouse and to the liveness judge, the Lighthouse's and the judge's timeouts (to emulate "
                        "more members than this machine's cores carry at the real rates: per-member rates scale by "
                        "1/S, detection by S)")
    p.add_argument("--label", default="this tree")
    p.add_argument("--json", default=None, help="append the rows to this JSON-lines file")
    p.add_argument("--out", default=None, help="write the table to this markdown file (appended)")
    a = p.parse_args()
    if a.host:
        return host(a)
    import tempfile
    rows = []
    for n in [int(x) for x in a.members.split(",")]:
        with tempfile.TemporaryDirectory() as d:
            row = measure(n, a.per_process, a.window, Path(d), a.clients, a.backend, a.connect_timeout, a.judge,
                          a.join_ms, a.beat_scale)
        row["label"] = a.label
        rows.append(row)
        print(json.dumps(row), flush=True)
        if a.json:
            with open(a.json, "a") as fh:
                fh.write(json.dumps(row) + "\n")
    text = table(rows, a.label)
    print(text)
    if a.out:
        with open(a.out, "a") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
