"""One JSONL event log per run: what happened, when, and how long recovery took.

Every line is one JSON object with ``ts`` (``time.time()``), ``event`` and the event's fields.
Event types and their fields:

  ``run_start``   free-form (config, world size, ...)
  ``membership``  generation, members, reason
  ``failure``     workers, kind (fail_stop | hang | straggler | node_loss), detected_by, step,
                  phase (when known)
  ``decision``    decision: a JSON-able dict made by the engine, stored as given
  ``recovery``    mttr: {detect, membership, rebuild, state_transfer, first_step, total}, ...
  ``step``        step, world_size, samples, step_time  (optional and sparse)
  ``migration``   phase (start | end), rounds, bytes moved and predicted, seconds
  ``calibration`` the engine's fitted terms (pipeline jobs: per-block costs, device speeds,
                  links, overhead) and the running plan's predicted step, every few steps
  ``prediction``  after a failure/join Decision: the chosen candidate's predicted step and
                  transition seconds beside the measured ones, and every candidate's figures
  ``shard_recovery`` sharded jobs, after a failure: every path's predicted lost seconds, the
                  choice, the rollback or snapshot step, the predicted steps to heal
  ``snapshot``    sharded jobs: a buddy snapshot found corrupt (checksum) and discarded
  ``heal_check``  sharded jobs after a rehabilitation: kind check (at the predicted heal step:
                  the loss gap to the failure-free trend, on_track) or end (measured heal
                  steps, healed, the measured / predicted ratio the next prediction uses)
  ``run_end``     free-form

Several processes may append to one file: it is opened with ``O_APPEND`` and each line goes
out in a single ``os.write``, which Linux applies atomically at the end of a regular file, so
lines do not interleave and a process killed between writes leaves no partial line.  A crash
*inside* a write (or a full disk) can still leave a truncated line -- a SIGKILL can stop a
write longer than a page at a page boundary -- ; ``read_events`` skips it.

Limits, honestly: no fsync by default (a machine crash may lose the last lines; pass
``fsync=True`` to pay for durability); ``ts`` is wall-clock time from each writer, so ordering
across machines is only as good as their clock sync; the MTTR breakdown uses the monotonic clock
of the one process that ran ``RecoveryTimer``; throughput in ``summarize`` is samples divided by
the logged step times, so it covers only the steps that were logged and excludes time spent
outside steps (recovery downtime shows up in MTTR instead).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

__all__ = [
    "read_jsonl",
    "committed_attempts",
    "EVENT_TYPES",
    "FAILURE_KINDS",
    "MTTR_PHASES",
    "EventLog",
    "RecoveryTimer",
    "read_events",
    "EventTail",
    "summarize",
]

EVENT_TYPES = ("run_start", "membership", "failure", "decision", "recovery", "step", "migration",
               "calibration", "prediction", "shard_recovery", "snapshot", "heal_check", "roll_forward",
               "nonfinite", "steering", "run_end")
FAILURE_KINDS = ("fail_stop", "hang", "straggler", "node_loss", "preemption")
MTTR_PHASES = ("detect", "membership", "rebuild", "state_transfer", "first_step")


class EventLog:
    """Appends events to ``path``; ``defaults`` (e.g. ``rank=3``) go into every line."""

    def __init__(self, path: str | os.PathLike, *, fsync: bool = False, **defaults: Any) -> None:
        self.path = os.fspath(path)
        self.fsync = fsync
        self.defaults = defaults
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._head: Optional[str] = None  # ``step``'s line up to its own fields
        self._token: tuple = (None, "")  # the last token and its JSON

    def write(self, event: str, **fields: Any) -> dict:
        """Append one event and return the record written."""
        if event not in EVENT_TYPES:
            raise ValueError(f"unknown event type {event!r}; expected one of {EVENT_TYPES}")
        if self._fd is None:
            raise ValueError(f"event log {self.path} is closed")
        record = {"ts": time.time(), "event": event, **self.defaults, **fields}
        # allow_nan=False: NaN/Infinity are not JSON and would break other readers.
        self._append((json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode())
        return record

    def _append(self, data: bytes) -> None:
        written = os.write(self._fd, data)
        if written != len(data):
            # Only on a full disk or similar; writing the rest could interleave with another
            # writer, so report it and let the reader skip the partial line.
            raise OSError(f"short write to event log {self.path}: {written} of {len(data)} bytes")
        if self.fsync:
            os.fsync(self._fd)

    # -- typed helpers ------------------------------------------------------------------

    def run_start(self, **fields: Any) -> dict:
        return self.write("run_start", **fields)

    def membership(self, generation: int, members: Sequence[int], reason: str, **fields: Any) -> dict:
        return self.write("membership", generation=generation, members=list(members),
                          reason=reason, **fields)

    def failure(
        self,
        workers: Sequence[int],
        kind: str,
        detected_by: str,
        step: int | None,
        phase: str | None = None,
        **fields: Any,
    ) -> dict:
        if kind not in FAILURE_KINDS:
            raise ValueError(f"unknown failure kind {kind!r}; expected one of {FAILURE_KINDS}")
        if phase is not None:
            fields["phase"] = phase
        return self.write("failure", workers=list(workers), kind=kind, detected_by=detected_by,
                          step=step, **fields)

    def deaths(self, dead: Sequence[int], info: Optional[Mapping[str, Any]], decisions: Sequence[Mapping[str, Any]],
               *, worker_id: int, step: int, claim: Callable[[int], bool] = lambda w: True) -> None:
        """A recovery's failure record (its source's, before the state broadcast): the ``dead``
        that ``claim`` says nobody recorded yet (``coordination.first_to_record``: a source
        killed after writing it is followed by one that counts the same deaths; one killed
        before the broadcast, by one whose engine state still counts them), with the kind its
        failure ``info`` and Decisions give."""
        dead = [w for w in dead if claim(w)] if info is not None else []
        if dead:
            kind = "hang" if info.get("hang") else "preemption" if info.get("kind") == "leave" else (
                "node_loss" if any(d["event"]["kind"] == "node_loss" for d in decisions) else "fail_stop")
            self.failure(dead, kind, detected_by=f"worker {worker_id}", step=step,
                         collective=info.get("kind"), reason=info.get("reason"))

    def decision(self, decision: Mapping[str, Any], **fields: Any) -> dict:
        return self.write("decision", decision=decision, **fields)

    def recovery(self, mttr: "Mapping[str, float] | RecoveryTimer", **fields: Any) -> dict:
        """``mttr`` is a breakdown dict (``total`` is added as the sum when missing) or a
        ``RecoveryTimer``."""
        breakdown = mttr.breakdown() if isinstance(mttr, RecoveryTimer) else dict(mttr)
        breakdown.setdefault("total", sum(v for k, v in breakdown.items() if k != "total"))
        return self.write("recovery", mttr=breakdown, **fields)

    def step(self, step: int, world_size: int, samples: int, step_time: float, **fields: Any) -> Optional[dict]:
        """One attempted step.  The common line (no sample ids, an ``int`` epoch, a ``str``
        token, a finite time) is formatted directly -- a line per step of 1-2 ms must cost
        microseconds -- and returns None; any other goes through ``write`` (the record)."""
        if fields.keys() <= {"epoch", "token", "ids"} and fields.get("ids") is None:
            done = self._step_line(step, world_size, samples, step_time, fields.get("epoch"), fields.get("token"),
                                   ',"ids":null' if "ids" in fields else "")
            if done:
                return None
        return self.write("step", step=step, world_size=world_size, samples=samples,
                          step_time=step_time, **fields)

    def attempt(self, step: int, world_size: int, samples: int, step_time: float, epoch: int, token: str) -> None:
        """``step(step, world_size, samples, step_time, epoch=epoch, token=token, ids=None)``
        without the keyword arguments (the data-parallel step's line, every step)."""
        if not self._step_line(step, world_size, samples, step_time, epoch, token, ',"ids":null'):
            self.write("step", step=step, world_size=world_size, samples=samples, step_time=step_time,
                       epoch=epoch, token=token, ids=None)

    def _step_line(self, step, world_size, samples, step_time, epoch, token, ids: str) -> bool:
        """Append the common step line, formatted directly; False (nothing written) when a field
        is not of the common kind (``write`` then checks and formats it)."""
        if not (type(epoch) is int and type(token) is str and type(step) is int and type(world_size) is int
                and type(samples) is int and type(step_time) is float and math.isfinite(step_time)
                and self._fd is not None):
            return False
        if self._head is None:
            self._head = json.dumps({"event": "step", **self.defaults}, separators=(",", ":"))[:-1]
        if token != self._token[0]:
            self._token = (token, json.dumps(token))
        self._append(f'{self._head},"ts":{time.time()!r},"step":{step},"world_size":{world_size},"samples":{samples},'
                     f'"step_time":{step_time!r},"epoch":{epoch},"token":{self._token[1]}{ids}}}\n'.encode())
        return True

    def run_end(self, **fields: Any) -> dict:
        return self.write("run_end", **fields)

    # -- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def read_jsonl(path: str | os.PathLike) -> list:
    """Every parseable line of a JSON-lines file another process may be writing or was killed
    while writing (a cut line is skipped); [] when the file does not exist (yet)."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path, "rb") as f:
        for raw in f.read().split(b"\n"):
            try:
                out.append(json.loads(raw))
            except ValueError:
                pass
    return out


def read_events(path: str | os.PathLike, *, strict: bool = False) -> list[dict]:
    """All events in file order.  A last line without its newline (a writer died mid-write)
    is ignored; other unreadable lines are skipped, or raise ``ValueError`` when ``strict``."""
    with open(path, "rb") as f:
        data = f.read()
    return _parse(data, path, strict)[0]


def _parse(data: bytes, path, strict: bool = False, lineno: int = 0) -> tuple[list[dict], int, int]:
    """The events of the complete lines in ``data`` (numbered from ``lineno`` + 1); returns
    them, the number of bytes consumed (up to the last newline) and the last line number."""
    end = data.rfind(b"\n") + 1
    # Whatever follows the last newline is an unfinished line (or b"" for a clean file).
    events = []
    for raw in data[:end].split(b"\n")[:-1]:
        lineno += 1
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
            if not isinstance(record, dict) or "event" not in record or "ts" not in record:
                raise ValueError("not an event object")
        except ValueError as e:
            if strict:
                raise ValueError(f"{path}:{lineno}: bad event line: {e}") from None
            continue
        events.append(record)
    return events, end, lineno


class EventTail:
    """``read_events`` of a growing log, parsing only what was appended since the last
    ``read()`` (a poller that re-parsed the whole file every few milliseconds spent a
    noticeable share of a core on it).  The same events as ``read_events``: an unfinished
    last line is read once its newline arrives; a file that shrank is read again from the
    start; a missing file has no events."""

    def __init__(self, path: str | os.PathLike):
        self.path = path
        self._events: list[dict] = []
        self._offset = 0
        self._lineno = 0

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < self._offset:  # rewritten: start again
                    self._events, self._offset, self._lineno = [], 0, 0
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        new, used, self._lineno = _parse(data, self.path, lineno=self._lineno)
        self._events += new
        self._offset += used
        return list(self._events)


class RecoveryTimer:
    """Times the phases of one recovery.  ``mark(phase)`` ends ``phase`` now; the phase ran
    from the previous mark (or from ``start``).  Marking a phase twice adds to it (a phase
    retried after a second failure)."""

    def __init__(self, start: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.start = clock() if start is None else start
        self._last = self.start
        self.phases: dict[str, float] = {}

    def mark(self, phase: str) -> float:
        now = self._clock()
        elapsed = now - self._last
        self.phases[phase] = self.phases.get(phase, 0.0) + elapsed
        self._last = now
        return elapsed

    def breakdown(self) -> dict[str, float]:
        """Every standard phase (0.0 when not marked), any extra phases, and ``total``."""
        out = {p: self.phases.get(p, 0.0) for p in MTTR_PHASES}
        out.update({p: v for p, v in self.phases.items() if p not in out})
        out["total"] = self._last - self.start
        return out


def _median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _throughput(steps: Iterable[dict]) -> float | None:
    steps = list(steps)
    t = sum(e.get("step_time", 0.0) for e in steps)
    return sum(e.get("samples", 0) for e in steps) / t if t > 0 else None


def committed_attempts(events: Iterable[Mapping[str, Any]]) -> dict[int, list[Mapping[str, Any]]]:
    """The ``step`` records of each step's last attempt, by step.

    Each member logs a record before every all-reduce attempt, tagged with the generation's
    ``token`` (``<generation>.<time>[/<rollback>]``).  A step is attempted again only if no
    member committed it, so the attempt of the newest generation (then rollback) is the one
    that committed -- by token, not by when a record was written: a member stopped inside an
    abandoned attempt may write its record after its peers committed the step again.  Tokens
    that do not parse (or tie) fall back to the last written."""
    by_step: dict[int, list[Mapping[str, Any]]] = {}
    for e in sorted((e for e in events if e["event"] == "step"), key=lambda e: e["ts"]):
        by_step.setdefault(int(e["step"]), []).append(e)
    out = {}
    for step, recs in by_step.items():
        last = max(range(len(recs)), key=lambda i: (_attempt_order(recs[i].get("token")), i))
        token = recs[last].get("token")
        out[step] = [r for r in recs if r.get("token") == token]
    return out


def _attempt_order(token: Optional[str]) -> tuple:
    """A step record's token as (generation, agreed time, rollback): later attempts sort higher."""
    if not token:
        return (-1, -1, -1)
    base, _, rollback = token.partition("/")
    generation, _, when = base.partition(".")
    try:
        return (int(generation), int(when or 0), int(rollback or 0))
    except ValueError:
        return (-1, -1, -1)


def resumed_after(events: Iterable[Mapping[str, Any]], t: float) -> Optional[float]:
    """Seconds from ``t`` (a fault made from outside) to the first step the survivors attempt
    in the generation formed after it -- a step record of the failed generation, logged just
    after the fault, does not count; None when no new generation formed."""
    evs = sorted(events, key=lambda e: e["ts"])
    new = next((e["ts"] for e in evs if e["event"] == "membership" and e["ts"] > t
                and e.get("reason") == "failure"), None)
    if new is None:
        return None
    return next((e["ts"] - t for e in evs if e["event"] == "step" and e["ts"] >= new), None)


def summarize(events: Iterable[Mapping[str, Any]]) -> dict:
    """Headline figures of a run.

    Keys: failures, failure_kinds, recoveries, mttr_median, mttr_max, mttr_breakdown_median,
    decisions, membership_changes, final_world_size, steps (step events), last_step,
    total_samples, throughput (overall), throughput_before_failure, throughput_after_failure
    (samples per second of logged step time, split at the first failure), wall_time.
    """
    # Several writers append concurrently, so order by timestamp; the sort is stable.
    events = sorted(events, key=lambda e: e["ts"])
    failures = [e for e in events if e["event"] == "failure"]
    recoveries = [e for e in events if e["event"] == "recovery"]
    steps = [e for e in events if e["event"] == "step"]
    totals = [r["mttr"]["total"] for r in recoveries if "total" in r.get("mttr", {})]
    phase_names = [p for p in MTTR_PHASES] + sorted(
        {k for r in recoveries for k in r.get("mttr", {})} - set(MTTR_PHASES) - {"total"}
    )
    breakdown = {
        p: _median_or_none([r["mttr"][p] for r in recoveries if p in r.get("mttr", {})])
        for p in phase_names
    }

    final_world_size = None
    for e in events:
        if e["event"] == "membership":
            final_world_size = len(e["members"])
        elif e["event"] == "step" and "world_size" in e:
            final_world_size = e["world_size"]

    kinds: dict[str, int] = {}
    for f in failures:
        kinds[f.get("kind", "unknown")] = kinds.get(f.get("kind", "unknown"), 0) + 1

    first_failure_ts = failures[0]["ts"] if failures else None
    before = [s for s in steps if first_failure_ts is None or s["ts"] < first_failure_ts]
    after = [s for s in steps if first_failure_ts is not None and s["ts"] >= first_failure_ts]

    starts = [e["ts"] for e in events if e["event"] == "run_start"]
    ends = [e["ts"] for e in events if e["event"] == "run_end"]
    return {
        "failures": len(failures),
        "failure_kinds": kinds,
        "recoveries": len(recoveries),
        "mttr_median": _median_or_none(totals),
        "mttr_max": max(totals) if totals else None,
        "mttr_breakdown_median": breakdown if recoveries else {},
        "decisions": sum(1 for e in events if e["event"] == "decision"),
        "membership_changes": sum(1 for e in events if e["event"] == "membership"),
        "final_world_size": final_world_size,
        "steps": len(steps),
        "last_step": max((s["step"] for s in steps), default=None),
        "total_samples": sum(s.get("samples", 0) for s in steps),
        "throughput": _throughput(steps),
        "throughput_before_failure": _throughput(before),
        "throughput_after_failure": _throughput(after) if failures else None,
        "wall_time": (max(ends) - min(starts)) if starts and ends else None,
    }
