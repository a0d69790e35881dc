"""Per-run figures from the common progress log (``steps.jsonl``, see ``baselines/common.py``).

A step *execution* is one (step, restart) pair; its time is when its first worker logged it,
its samples the ids trained for it (below).

Samples lost and duplicated are counted from the sample ids the workers trained, per epoch, the
way the runtime tests check exactly-once (``sample_accounting``).  Each worker logs its ids
before an all-reduce (``attempt``, with a ``key`` the members of that all-reduce share) and its
commit after it (``step``, same key; ``baselines/common.py``).  The ids of a step's committed
execution are those of every attempt under a committed (step, key): a worker killed after the
all-reduce but before logging its commit did train them.  An epoch's expected ids are the whole
dataset for an epoch the run finished, and for the last one the samples its committed steps
span (unshuffled data: sample ``i`` of an epoch is id ``i``; a step spans its global batch).
*lost* = expected ids no committed update trained; *duplicated* = trainings of an id beyond its
first in its epoch (a checkpoint restart redoes steps).

* MTTR: fault -> first step committed by a membership without the victim (smaller ``world``,
  or a later torchrun restart); one per fault in ``mttrs_s``.
* full strength (replacement): fault -> first step committed by N workers again.
* fault offset: how long after the last committed step the fault was sent (where it landed).
* samples lost / duplicated: from the trained ids (above).
* throughput before: samples/s over the steps from ``WARMUP`` to the first fault; after: from
  the first step after the recovery from the last fault to the end (straggler: before / from
  the step the slowdown starts); failure-free: the system's own failure-free run.
* post-recovery efficiency = after / (failure-free x W / N), W = the world at the end (the
  survivors; N again once a replacement joined).
* peak RSS: the largest worker's ``ru_maxrss``.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

WARMUP = 3


def trained_ids(records: list[dict]) -> dict[tuple, list[int]]:
    """(step, key) of each committed execution -> the ids its workers trained (see above)."""
    dropped = {(r["step"], r["key"], r["pid"]) for r in records
               if r["kind"] == "step" and "key" in r and r.get("trained") is False}
    out: dict[tuple, list[int]] = {(r["step"], r["key"]): [] for r in records if r["kind"] == "step" and "key" in r}
    for r in records:
        k = (r.get("step"), r.get("key"))
        if r["kind"] == "attempt" and k in out and (*k, r.get("pid")) not in dropped:
            out[k] += r["ids"]
    return out


def executions(records: list[dict]) -> list[dict]:
    """One record per (step, restart): the first worker's, with ``samples`` the number of ids
    trained in it (the logged count where the log has no ids)."""
    ids = trained_ids(records)
    first: dict[tuple, dict] = {}
    keys: dict[tuple, set] = {}
    for r in sorted((r for r in records if r["kind"] == "step"), key=lambda r: r["ts"]):
        k = (r["step"], r.get("restart", 0))
        first.setdefault(k, r)
        if "key" in r:
            keys.setdefault(k, set()).add(r["key"])
    return sorted(({**r, "samples": sum(len(ids[(k[0], key)]) for key in keys[k]) if k in keys else r["samples"]}
                   for k, r in first.items()), key=lambda r: r["ts"])


def sample_accounting(records: list[dict], dataset: int) -> Optional[tuple[int, int]]:
    """(lost, duplicated) samples from the ids trained in committed steps; None without ids."""
    ids = trained_ids(records)
    if not ids:
        return None
    epoch = {}
    batch = {}
    for r in records:
        if r["kind"] == "step" and "key" in r:
            epoch[(r["step"], r["key"])] = r.get("epoch", 0)
            batch[r["step"]] = r.get("batch", 0)
    seen: dict[int, Counter] = {}
    span: dict[int, dict[int, int]] = {}   # epoch -> step -> its global batch
    for k, got in ids.items():
        e = epoch[k]
        seen.setdefault(e, Counter()).update(got)
        span.setdefault(e, {})[k[0]] = batch[k[0]]
    last = max(span)
    lost = dup = 0
    for e, counts in seen.items():
        expected = dataset if e < last else min(dataset, sum(span[e].values()))
        lost += sum(1 for i in range(expected) if i not in counts)
        dup += sum(c - 1 for c in counts.values())
    return lost, dup


def attempts_from_events(events: list[dict]) -> list[dict]:
    """chameleon-ft's runtime event log -> ``attempt`` records: each member's sample ids before
    every all-reduce attempt, keyed by the generation's token."""
    return [{"kind": "attempt", "step": e["step"], "key": e.get("token"), "ids": e["ids"], "pid": e.get("pid"),
             "ts": e["ts"]} for e in events if e["event"] == "step" and e.get("ids") is not None]


def throughput(execs: list[dict]) -> Optional[float]:
    if len(execs) < 3:
        return None
    dt = execs[-1]["ts"] - execs[0]["ts"]
    return sum(e["samples"] for e in execs[1:]) / dt if dt > 0 else None


def _median(xs: list[float]) -> Optional[float]:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def step_time(execs: list[dict]) -> Optional[float]:
    """Median wall time between consecutive committed steps."""
    return _median([b["ts"] - a["ts"] for a, b in zip(execs, execs[1:])])


def recovered_at(ex: list[dict], t_fault: float) -> Optional[dict]:
    """The first step committed after ``t_fault`` by a smaller membership than the one before
    it, or by a later restart round (torchrun / checkpoint-restart)."""
    prior = [e for e in ex if e["ts"] < t_fault]
    # The world before the fault: the largest of the last few steps (a TorchFT replica late
    # for one quorum sits that step out, so a single step's world can be one short).
    world0 = max(e["world"] for e in prior[-5:]) if prior else None
    restart0 = max((e.get("restart", 0) for e in prior), default=0)
    for e in ex:
        if e["ts"] > t_fault and ((world0 is not None and e["world"] < world0) or e.get("restart", 0) > restart0):
            return e
    return None


def run_metrics(records: list[dict], *, nproc: int, steps: int, global_batch: int,
                t_faults: list[float], exit_codes: Optional[list[int]], wall_s: float,
                split_step: Optional[int] = None, dataset: int = 4096) -> dict:
    """``t_faults``: when each fault was sent; ``split_step`` (straggler): the step from which the
    fault acts (throughput before/after is split there instead of at a fault time)."""
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
        "step_time_s": step_time([e for e in ex if e["step"] >= WARMUP]),
        "mttr_s": None, "mttrs_s": [], "throughput_before": None, "throughput_after": None,
        "step_time_after_s": None, "survivors": None, "full_strength_s": None,
        "fault_offset_s": None, "samples_lost": None, "samples_duplicated": None,
    }
    counted = sample_accounting(records, dataset)
    if completed and counted:
        m["samples_lost"], m["samples_duplicated"] = counted
    # The step's global batch as the commit records give it (shrink lowers it after a failure).
    m["batch_first"], m["batch_last"] = (ex[0].get("batch"), ex[-1].get("batch")) if ex else (None, None)
    t0 = ex[0]["ts"] if ex else 0.0
    m["timeline"] = [[round(e["ts"] - t0, 4), e["step"], e["samples"], e["world"]] for e in ex]
    m["t0"] = t0
    if split_step is not None:
        before = [e for e in ex if WARMUP <= e["step"] < split_step]
        after = [e for e in ex if e["step"] >= split_step]
        m["throughput_before"], m["throughput_after"] = throughput(before), throughput(after)
        m["step_time_after_s"], m["survivors"] = step_time(after), nproc
        return m
    if not t_faults:
        return m
    t_fault = t_faults[0]
    prior = [e for e in ex if e["ts"] < t_fault]
    if prior:
        m["fault_offset_s"] = t_fault - prior[-1]["ts"]   # how far into a step the fault landed
    m["throughput_before"] = throughput([e for e in prior if e["step"] >= WARMUP])
    for t in t_faults:
        r = recovered_at(ex, t)
        m["mttrs_s"].append(r["ts"] - t if r else None)
    first = recovered_at(ex, t_fault)
    if first:
        m["mttr_s"] = first["ts"] - t_fault
        full = [e for e in ex if e["ts"] >= first["ts"] and e["world"] >= nproc]
        if full:
            m["full_strength_s"] = full[0]["ts"] - t_fault
    # After the recovery from the last fault: throughput, step time, and the world at the end.
    last_rec = recovered_at(ex, t_faults[-1])
    if last_rec:
        after = [e for e in ex if e["ts"] >= last_rec["ts"]]
        m["throughput_after"] = throughput(after)
        m["step_time_after_s"] = step_time(after)
        m["survivors"] = after[-1]["world"]
    return m


def efficiency(after: Optional[float], failure_free: Optional[float], survivors: Optional[int],
               nproc: int) -> Optional[float]:
    if not (after and failure_free and survivors):
        return None
    return after / (failure_free * survivors / nproc)
