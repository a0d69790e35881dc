"""Chaos at cluster shape: seeded random node-level faults on namespace nodes.

    python -m tests.fidelity.node_trials --trials 20 --seed 0 [--kinds node_lost,partition]

Each trial builds 3 nodes as network namespaces (``tests/_helpers/netns.py``) with an etcd
member each (the job's rendezvous: ``--rdzv-backend etcd``, no coordinator on any one node), starts
one ``chameleon-ft`` launcher per node with 2 ``ElasticTrainer`` workers (``mlp_worker.py``), and at
a drawn step makes one fault of a drawn kind on a drawn node (node 0 included):

* ``node_lost``  every process of the node SIGKILLed -- its launcher, its workers, its etcd
  member: the others go on (a ``node_loss`` record naming its workers) and end on the
  failure-free trajectory;
* ``node_term``  SIGTERM to the node's launcher (a preemption notice for the machine): it forwards
  it, its workers leave at a step boundary, announced (``preemption`` records, no step redone), it
  exits 143; the others end on the trajectory;
* ``partition``  the node's link down (no reset reaches anyone) for a drawn 1-3 s: the majority
  finds it by heartbeats and goes on; the minority's workers stop by themselves (launcher exit 3)
  and write nothing after the cut; the link is healed and the node's launcher started again: its
  workers join the running job, take the state from a peer and every worker ends on the trajectory;
* ``etcd_lost``  the node's etcd member SIGKILLed (and, in half of the trials, started again 2 s
  later): nothing happens -- no failure, no recovery, every worker ends on the trajectory.

Each trial checks the launchers' exit codes, the failure records the kind calls for, every
epoch's sample ids exactly once (event log), bitwise-equal replicas, the weights within 1e-5 of
the failure-free 4-worker run (the same global batch), that every worker expected to finish wrote
its final state, and that nothing is left behind: no process of the job in any namespace once its
launchers are done, no namespace once the trial is over.  ``--markdown docs/reliability.md``
writes the summary into that file's node block.  Needs root, iproute2 and etcd.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))  # the shared helpers
sys.path.insert(0, str(TESTS / "runtime" / "_workers"))
from _helpers import netns  # noqa: E402
from elastic_job import (STEPS_PER_EPOCH, Job, assert_exactly_once, assert_replicas_equal,  # noqa: E402
                         max_relative_diff, reference)
from tests.fidelity.trials import TOLERANCE, write_block  # noqa: E402

from chameleon_ft.runtime.eventlog import resumed_after  # noqa: E402

NODES, NPROC = 3, 2
WORKERS = NODES * NPROC
KINDS = ("node_lost", "node_term", "partition", "etcd_lost")
EPOCHS = {"partition": 48}  # long enough for a stopped node's launcher (with etcd: ~20 s) to be started again and join
DEFAULT_EPOCHS = 6
MB_SLEEP = {"partition": 0.05}
DEFAULT_MB_SLEEP = 0.02
# What a node's launcher exits with after each kind, on the node hit (the others: 0).
HIT_EXIT = {"node_lost": None, "node_term": 128 + signal.SIGTERM, "partition": 3, "etcd_lost": 0}


@dataclass(frozen=True)
class NodeTrial:
    trial: int
    kind: str
    node: int  # the node the fault hits
    step: int  # the fault is made once a worker logged this step
    down_s: float = 0.0  # partition: seconds the link stays down
    restart_etcd: bool = False  # etcd_lost: the member started again 2 s later

    @property
    def epochs(self) -> int:
        return EPOCHS.get(self.kind, DEFAULT_EPOCHS)

    def workers(self, node: int) -> list[int]:
        return list(range(node * NPROC, (node + 1) * NPROC))


def draw(rng: random.Random, index: int, kinds=KINDS) -> NodeTrial:
    kind = rng.choice(kinds)
    node = rng.randrange(NODES)
    if kind == "partition":  # early enough that the node's restarted workers join long before the end
        return NodeTrial(index, kind, node, rng.randint(3, 12), down_s=round(rng.uniform(1.0, 3.0), 2))
    last = DEFAULT_EPOCHS * STEPS_PER_EPOCH
    return NodeTrial(index, kind, node, rng.randint(2, last - 8), restart_etcd=rng.random() < 0.5)


def _start(job: Job, net, eps: list[str], nodes) -> None:
    for i in nodes:
        job.start(extra=["--nnodes", str(NODES), "--node-rank", str(i), "--rdzv-backend", "etcd",
                         "--rdzv-endpoint", ",".join(eps), "--rdzv-id", f"chaos{os.getpid()}"], wrap=net.wrap(i))


def _failures(evs: list[dict]) -> list[tuple[list[int], str]]:
    return [(sorted(e["workers"]), e["kind"]) for e in evs if e["event"] == "failure"]


def _leftover(net, etcd_pids: set[int]) -> list[int]:
    """Processes of the job still in the nodes' namespaces (the etcd members aside)."""
    time.sleep(0.3)
    return sorted(pid for i in range(NODES) for pid in net.pids(i) if pid not in etcd_pids)


def _etcd_pids(net) -> set[int]:
    """The etcd members' processes (``ip netns exec`` execs etcd in place: the same PID)."""
    return {p.pid for p in net.etcd_procs.values()}


def run_trial(trial: NodeTrial, root: Path) -> dict:
    """Run ``trial``; a JSON-able record of what was checked (``problems`` empty: passed)."""
    rec = {**asdict(trial), "epochs": trial.epochs, "ok": False, "problems": []}
    problems = rec["problems"]
    t0 = time.monotonic()
    run = root / f"node-trial-{trial.trial}"
    run.mkdir(parents=True, exist_ok=True)
    prefix = f"c{os.getpid() % 1000}t{trial.trial % 100}"
    hit = trial.workers(trial.node)
    try:
        ref = reference(root / "reference", trial.epochs)
        with netns.Net(NODES, prefix=prefix) as net:
            eps = net.etcd_up(str(run / "etcd"))
            job = Job(run / "job", nproc=NPROC, epochs=trial.epochs,
                      mb_sleep=MB_SLEEP.get(trial.kind, DEFAULT_MB_SLEEP), hang_timeout=10)
            (run / "job").mkdir(exist_ok=True)
            try:
                _start(job, net, eps, range(NODES))
                job.wait_step(trial.step, 180)
                codes, t_fault = _make_fault(trial, job, net, eps)
                rec["exit"] = codes
                rec["leftover"] = _leftover(net, _etcd_pids(net))
                evs, finals, out = job.events(), job.final(), job.output()
            finally:
                job.cleanup()
        rec["namespaces_left"] = [n for n in _namespaces() if n.startswith(f"{netns.PREFIX}{prefix}")]
        problems += _exit_problems(trial, codes, out)
        if rec["leftover"]:
            problems.append(f"processes of the job left in the namespaces: {rec['leftover']}")
        if rec["namespaces_left"]:
            problems.append(f"namespaces left: {rec['namespaces_left']}")
        problems += _kind_problems(trial, evs, t_fault, rec)
        survivors = [w for w in range(WORKERS) if w not in hit or trial.kind in ("partition", "etcd_lost")]
        if sorted(finals) != survivors:
            problems.append(f"final states from {sorted(finals)}, expected {survivors}")
        for name, check in (("exactly-once", lambda: assert_exactly_once(evs, trial.epochs)),
                            ("replicas", lambda: assert_replicas_equal(finals, sorted(finals)))):
            try:
                check()
            except AssertionError as exc:
                problems.append(f"{name}: {str(exc)[:500]}")
        if finals:
            rec["rel_diff"] = max_relative_diff(finals[min(finals)], ref)
            if not rec["rel_diff"] < TOLERANCE:
                problems.append(f"weights {rec['rel_diff']:.3g} from the failure-free run (tolerance {TOLERANCE})")
        rec["ok"] = not problems
    except Exception as exc:  # a harness error is a failed trial, with its reason
        problems.append(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}")
    rec["seconds"] = round(time.monotonic() - t0, 1)
    return rec


def _make_fault(trial: NodeTrial, job: Job, net, eps) -> tuple[list, float]:
    """Make ``trial``'s fault on the running job and wait for its launchers: (exit codes by
    node, None for a launcher not waited for; the time the fault was made)."""
    k, codes = trial.node, [None] * NODES
    others = [i for i in range(NODES) if i != k]
    if trial.kind == "node_lost":
        t = net.kill_node(k)
        net.etcd_procs.pop(k, None)
    elif trial.kind == "node_term":
        t = time.time()
        job.launchers[k].send_signal(signal.SIGTERM)
        codes[k] = _wait(job.launchers[k], 30)
    elif trial.kind == "partition":
        t = net.partition(k)
        codes[k] = _wait(job.launchers[k], 30)
        time.sleep(max(0.0, trial.down_s - (time.time() - t)))
        net.heal(k)
        _start(job, net, eps, [k])  # a new launcher: job.launchers[NODES]
        codes[k] = [codes[k], None]
    else:  # etcd_lost
        t = net.etcd_kill(k)
        if trial.restart_etcd:
            time.sleep(2.0)
            net.etcd_start(k)
    for i in others:
        codes[i] = _wait(job.launchers[i], 240)
    if trial.kind == "partition":
        codes[k][1] = _wait(job.launchers[NODES], 120)
    elif trial.kind == "etcd_lost":
        codes[k] = _wait(job.launchers[k], 120)
    return codes, t


def _wait(p: subprocess.Popen, timeout: float):
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        return "timeout"


def _exit_problems(trial: NodeTrial, codes: list, out: str) -> list[str]:
    want = [0] * NODES
    want[trial.node] = HIT_EXIT[trial.kind]
    if trial.kind == "partition":
        want[trial.node] = [3, 0]  # stopped by itself, then the restarted launcher finished
    if codes != want:
        tail = "\n".join(ln for ln in out.splitlines() if "frame #" not in ln)[-1500:]
        return [f"launcher exit codes {codes}, expected {want}: {tail}"]
    return []


def _kind_problems(trial: NodeTrial, evs: list[dict], t_fault: float, rec: dict) -> list[str]:
    """What the fault kind promises (module doc); fills ``rec['mttr_s']``."""
    fails, hit, out = _failures(evs), trial.workers(trial.node), []
    if trial.kind == "etcd_lost":
        recs = [e for e in evs if e["event"] == "recovery"]
        if fails or recs:
            out.append(f"an etcd member lost made failures {fails} / {len(recs)} recoveries")
        return out
    want_kind = {"node_lost": ("node_loss",), "partition": ("hang", "node_loss"), "node_term": ("preemption",)}[trial.kind]
    mine = [f for f in fails if set(f[0]) & set(hit)]
    if sorted(w for f in mine for w in f[0]) != hit or any(k not in want_kind for _, k in mine):
        out.append(f"failure records {fails}, expected node {trial.node}'s workers {hit} as {want_kind}")
    if len(mine) != len(fails):
        out.append(f"failures of workers not hit: {fails}")
    if trial.kind == "node_term":
        after = [(e["worker"], e["step"]) for e in evs if e["event"] == "step" and e["ts"] >= t_fault]
        if len(after) != len(set(after)):
            out.append("a step was redone after the SIGTERM")
        rec_ = [e for e in evs if e["event"] == "recovery" and e["ts"] > t_fault]
        if rec_:
            rec["mttr_s"] = rec_[0]["mttr"]["total"]
    else:
        rec["mttr_s"] = resumed_after(evs, t_fault)
    if trial.kind == "partition" and _rejoined_at(evs, t_fault, hit) == float("inf"):
        out.append(f"node {trial.node}'s restarted workers never joined")
    return out


def _rejoined_at(evs: list[dict], t: float, hit: list[int]) -> float:
    joined = [e["ts"] for e in evs if e["event"] == "membership" and e["ts"] > t
              and set(hit) <= set(e.get("members", ()))]
    return min(joined, default=float("inf"))


def _namespaces() -> list[str]:
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def run_trials(n: int, seed: int, root: Path, kinds=KINDS, log=None) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for i in range(n):
        rec = run_trial(draw(rng, i, kinds), root)
        records.append(rec)
        if log is not None:
            log(rec)
    return records


def summarise(records: list[dict]) -> dict:
    """By fault kind: trials, passed, the nodes hit, median and max MTTR."""
    out = {}
    for kind in KINDS:
        rs = [r for r in records if r["kind"] == kind]
        if not rs:
            continue
        mttr = [r["mttr_s"] for r in rs if r.get("mttr_s") is not None]
        diffs = [r["rel_diff"] for r in rs if "rel_diff" in r]
        out[kind] = {"trials": len(rs), "passed": sum(r["ok"] for r in rs), "nodes": sorted({r["node"] for r in rs}),
                     "median_mttr_s": statistics.median(mttr) if mttr else None, "max_mttr_s": max(mttr, default=None),
                     "max_rel_diff": max(diffs, default=None), "failed": [r["trial"] for r in rs if not r["ok"]]}
    return out


BEGIN = "<!-- node chaos summary: generated by tests/fidelity/node_trials.py --markdown -->"
END = "<!-- end of node chaos summary -->"


def markdown(records: list[dict], command: str, started: str) -> str:
    fmt = lambda x: "-" if x is None else f"{x:.3f} s"  # noqa: E731
    lines = [BEGIN, f"`{command}` ({started}; {len(records)} trials, {sum(r['ok'] for r in records)} passed).", "",
             "| fault kind | trials | passed | nodes hit | MTTR median | MTTR max | max rel. diff | failed trials |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | --- |"]
    for kind, k in summarise(records).items():
        worst = "-" if k["max_rel_diff"] is None else f"{k['max_rel_diff']:.1e}"
        lines.append(f"| {kind} | {k['trials']} | {k['passed']} | {k['nodes']} | {fmt(k['median_mttr_s'])} | "
                     f"{fmt(k['max_mttr_s'])} | {worst} | {k['failed'] or '-'} |")
    return "\n".join(lines + ["", END])


def main(argv=None) -> int:
    os.environ.setdefault("CHAMELEON_FT_LOG_SAMPLES", "1")  # the exactly-once check reads the ids
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"fault kinds to draw from, of {','.join(KINDS)}")
    p.add_argument("--out", default=None, help="keep run directories and node_trials.jsonl here")
    p.add_argument("--markdown", default=None, help="write the summary into this file's node block "
                                                    "(docs/reliability.md)")
    a = p.parse_args(argv)
    kinds = tuple(k.strip() for k in a.kinds.split(",") if k.strip())
    if not kinds or set(kinds) - set(KINDS):
        p.error(f"--kinds: choose among {list(KINDS)}")
    why = netns.available() or (None if shutil.which("etcd") else "needs etcd")
    if why:
        p.error(why)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the jobs' and namespaces' cleanup
    root = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="node-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    jsonl = (root / "node_trials.jsonl").open("a")

    def log(rec):
        jsonl.write(json.dumps(rec) + "\n")
        jsonl.flush()
        extra = f" down={rec['down_s']}s" if rec["kind"] == "partition" else (
            " restarted" if rec["kind"] == "etcd_lost" and rec["restart_etcd"] else "")
        mttr = rec.get("mttr_s")
        print(f"{'ok  ' if rec['ok'] else 'FAIL'} #{rec['trial']:3d} {rec['kind']:9s} node {rec['node']} "
              f"@{rec['step']}{extra} mttr={'-' if mttr is None else f'{mttr:.3f}'} "
              f"rel={rec.get('rel_diff', float('nan')):.2e} {rec['seconds']}s "
              f"{'; '.join(p[:400] for p in rec['problems'])}", flush=True)

    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        records = run_trials(a.trials, a.seed, root, kinds, log)
    finally:
        jsonl.close()
    print(json.dumps(summarise(records), indent=1))
    if a.markdown:
        command = "python -m tests.fidelity.node_trials " + " ".join(argv if argv is not None else sys.argv[1:])
        write_block(Path(a.markdown), markdown(records, command, started), BEGIN, END)
    if not a.out:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
