"""Test harness: run ``python -m chameleon_ft.launch ... mlp_worker.py`` and inspect the run.

Everything the tests kill is found by PID from the event log (workers log their pid in
``run_start``); ``cleanup`` kills the launcher's and every worker's process group, so a test
leaves nothing behind even when it fails half-way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from chameleon_ft.runtime.eventlog import read_events

WORKER = Path(__file__).with_name("mlp_worker.py")
DATASET, GLOBAL_BATCH, STEPS_PER_EPOCH = 256, 32, 8


class Job:
    def __init__(self, run_dir: Path, *, nproc: int = 4, epochs: int = 2, mb_sleep: float = 0.01,
                 hang_timeout: float = 5.0, max_replacements: int = 0, launch_args=(),
                 worker_args=(), env: Optional[dict] = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cmd_tail = ["--run-dir", str(self.run_dir), "--hang-timeout", str(hang_timeout),
                         "--max-replacements", str(max_replacements), *launch_args,
                         str(WORKER), "--out", str(self.run_dir), "--epochs", str(epochs),
                         "--mb-sleep", str(mb_sleep), *worker_args]
        self.nproc = nproc
        self.env = dict(os.environ, **(env or {}))
        self.launchers: list[subprocess.Popen] = []

    # ---------------------------------------------------------------- processes
    def start(self, nproc: Optional[int] = None, extra=()) -> subprocess.Popen:
        out = open(self.run_dir / f"launcher{len(self.launchers)}.out", "wb")
        cmd = [sys.executable, "-m", "chameleon_ft.launch", "--nproc-per-node",
               str(nproc or self.nproc), *extra, *self.cmd_tail]
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                             start_new_session=True)
        out.close()
        self.launchers.append(p)
        return p

    def wait(self, timeout: float = 60.0) -> list[int]:
        deadline = time.monotonic() + timeout
        return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in self.launchers]

    def output(self) -> str:
        return "".join(f.read_text(errors="replace") for f in sorted(self.run_dir.glob("launcher*.out")))

    def cleanup(self) -> None:
        pids = {p.pid for p in self.launchers} | set(self.worker_pids().values())
        for pid in pids:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in self.launchers:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    # ---------------------------------------------------------------- the run
    def events(self) -> list[dict]:
        path = self.run_dir / "events.jsonl"
        return read_events(path) if path.exists() else []

    def worker_pids(self) -> dict[tuple[int, int], int]:
        """(worker id, replacement number) -> pid, for every worker that started."""
        return {(e["worker"], e.get("replacement", 0)): e["pid"] for e in self.events()
                if e["event"] == "run_start" and "worker" in e}

    def pid(self, wid: int) -> int:
        return max((r, pid) for (w, r), pid in self.worker_pids().items() if w == wid)[1]

    def wait_for(self, pred: Callable[[list[dict]], bool], timeout: float, what: str) -> list[dict]:
        deadline = time.monotonic() + timeout
        while True:
            evs = self.events()
            if pred(evs):
                return evs
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(0.002)

    def wait_step(self, step: int, timeout: float = 40.0) -> None:
        """Until some worker attempts global step ``step`` (its record precedes the all-reduce)."""
        self.wait_for(lambda evs: any(e["event"] == "step" and e["step"] >= step for e in evs),
                      timeout, f"step {step}")

    def kill(self, wid: int, sig: int = signal.SIGKILL) -> float:
        pid = self.pid(wid)
        t = time.time()
        os.kill(pid, sig)
        return t

    def final(self) -> dict[int, dict]:
        return {int(p.stem.split("_")[1]): torch.load(p, weights_only=True)
                for p in self.run_dir.glob("final_*.pt")}


# -------------------------------------------------------------------- checks
def committed_ids(events: list[dict]) -> dict[int, list[int]]:
    """Sample ids of each committed global step.

    Each member logs its ids before every all-reduce attempt, tagged with the generation's
    token.  A step is attempted again only if no member committed it, so the last attempt of a
    step is the one that committed, and its ids are the union over that token's records."""
    by_step: dict[int, list[dict]] = {}
    for e in sorted((e for e in events if e["event"] == "step"), key=lambda e: e["ts"]):
        by_step.setdefault(e["step"], []).append(e)
    out = {}
    for step, recs in by_step.items():
        token = recs[-1]["token"]
        out[step] = [i for r in recs if r["token"] == token for i in r["ids"]]
    return out


def assert_exactly_once(events: list[dict], epochs: int) -> None:
    ids = committed_ids(events)
    assert sorted(ids) == list(range(epochs * STEPS_PER_EPOCH)), f"steps committed: {sorted(ids)}"
    for e in range(epochs):
        seen = [i for s in range(e * STEPS_PER_EPOCH, (e + 1) * STEPS_PER_EPOCH) for i in ids[s]]
        assert sorted(seen) == list(range(DATASET)), (
            f"epoch {e}: {len(seen)} ids, {len(set(seen))} distinct, "
            f"missing {sorted(set(range(DATASET)) - set(seen))[:10]}")
    for s, got in ids.items():
        assert len(got) == GLOBAL_BATCH, f"step {s} processed {len(got)} samples"


def assert_replicas_equal(finals: dict[int, dict], members) -> None:
    ref = finals[members[0]]
    for w in members:
        f = finals[w]
        assert f["step"] == ref["step"] and f["members"] == ref["members"]
        for a, b in zip(f["params"] + f["momentum"], ref["params"] + ref["momentum"]):
            assert torch.equal(a, b), f"worker {w} differs from worker {members[0]}"


def max_relative_diff(a: dict, b: dict) -> float:
    return max(float((x - y).norm() / y.norm()) for x, y in zip(a["params"], b["params"]))


_REFERENCE: dict = {}


def reference(tmp_root: Path, epochs: int = 2) -> dict:
    """Final state of a failure-free 4-worker run (computed once per test session)."""
    if epochs not in _REFERENCE:
        job = Job(tmp_root / f"reference-{epochs}", epochs=epochs, mb_sleep=0.0)
        try:
            job.start()
            assert job.wait(60) == [0], job.output()
            _REFERENCE[epochs] = job.final()[0]
        finally:
            job.cleanup()
    return _REFERENCE[epochs]
