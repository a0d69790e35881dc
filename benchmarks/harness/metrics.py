"""Per-run figures from the common progress log (``steps.jsonl``, see ``baselines/common.py``).

A step *execution* is one (step, restart) pair; its time is when its first worker logged it.
Only committed steps are logged, so a step counted twice was executed twice (checkpoint
restart): its samples are *duplicated*.  Samples of the run's steps that no committed update
covered (TorchFT's dead replica's shard) are *lost*.

* MTTR: fault -> first step committed by a membership without the victim (smaller ``world``,
  or a later torchrun restart).
* throughput before: samples/s over the steps from ``WARMUP`` to the fault; after: from the
  first step after recovery to the end; failure-free: the system's own failure-free run.
* post-recovery efficiency = after / (failure-free x survivors / N).
* peak RSS: the largest worker's ``ru_maxrss``.
"""

from __future__ import annotations

from typing import Optional

WARMUP = 3


def executions(records: list[dict]) -> list[dict]:
    first: dict[tuple, dict] = {}
    for r in sorted((r for r in records if r["kind"] == "step"), key=lambda r: r["ts"]):
        first.setdefault((r["step"], r.get("restart", 0)), r)
    return sorted(first.values(), key=lambda r: r["ts"])


def throughput(execs: list[dict]) -> Optional[float]:
    if len(execs) < 3:
        return None
    dt = execs[-1]["ts"] - execs[0]["ts"]
    return sum(e["samples"] for e in execs[1:]) / dt if dt > 0 else None


def run_metrics(records: list[dict], *, nproc: int, steps: int, global_batch: int,
                t_fault: Optional[float], exit_codes: Optional[list[int]], wall_s: float) -> dict:
    ex = executions(records)
    done = {e["step"] for e in ex}
    completed = len(done) >= steps and max(done, default=-1) == steps - 1
    finals = [r for r in records if r["kind"] == "final"]
    rss = [r.get("rss_kb", 0) for r in records if r["kind"] == "step"]
    m: dict = {
        "completed": completed,
        # A process we SIGKILLed ourselves (a torchft replica group) exits -9: not a crash.
        "crashed": not completed or exit_codes is None or any(c not in (0, -9) for c in exit_codes),
        "exit_codes": exit_codes,
        "wall_s": wall_s,
        "committed_steps": len(done),
        "final_loss": finals[-1]["loss"] if finals else None,
        "peak_rss_mb": max(rss) / 1024 if rss else None,
        "throughput": throughput([e for e in ex if e["step"] >= WARMUP]),
        "mttr_s": None, "throughput_before": None, "throughput_after": None, "survivors": None,
        "samples_lost": None, "samples_duplicated": None,
    }
    last = {}
    for e in ex:
        last[e["step"]] = e
    if completed:
        m["samples_lost"] = steps * global_batch - sum(e["samples"] for e in last.values())
        m["samples_duplicated"] = sum(e["samples"] for e in ex) - sum(e["samples"] for e in last.values())
    if t_fault is None:
        return m
    before = [e for e in ex if e["step"] >= WARMUP and e["ts"] < t_fault]
    m["throughput_before"] = throughput(before)
    restart0 = max((e.get("restart", 0) for e in ex if e["ts"] < t_fault), default=0)
    after = [e for e in ex if e["ts"] > t_fault and (e["world"] < nproc or e.get("restart", 0) > restart0)]
    if after:
        m["mttr_s"] = after[0]["ts"] - t_fault
        m["throughput_after"] = throughput(after)
        m["survivors"] = after[-1]["world"]
    return m


def efficiency(after: Optional[float], failure_free: Optional[float], survivors: Optional[int],
               nproc: int) -> Optional[float]:
    if not (after and failure_free and survivors):
        return None
    return after / (failure_free * survivors / nproc)
