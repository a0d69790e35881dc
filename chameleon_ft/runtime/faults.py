"""Fault injection for tests, benchmarks and recipes.

A ``FaultSpec`` says what goes wrong, where and when: ``kill`` (SIGKILL to itself: a fail-stop
crash), ``hang`` (SIGSTOP to itself: alive but silent), ``slow`` (sleep after a phase so that it
takes ``factor`` times as long: a straggler), ``jitter`` (the same padding, but only for a random
``prob`` share of the phases: scheduling noise, not a straggler) or ``exit`` (a clean
``sys.exit`` with a nonzero code) or ``corrupt`` (sharded jobs, phase ``snapshot``: the
snapshot this worker sends to its buddy is damaged in flight, after its checksum; phase
``restore``: the parameters a rehabilitation restores into this worker's row are negated and
doubled -- a heal that cannot close) or ``drop`` (phase ``commit``: the step's commit
all-reduce, completed everywhere, is reported failed on this worker -- gloo's partial completion,
after which the others have committed the step and this member must roll forward) or ``nan``
(phase ``backward``: this worker's loss becomes NaN, at ``step=`` or at every step of a
``from=``/``to=`` range -- one bad batch, or a diverged run), aimed at ranks or at every local
rank of a node, at a global step and a step phase.

Specs travel as a compact string, for CLI flags and the ``CHAMELEON_FT_FAULTS`` variable::

    kill:rank=2:step=10:phase=backward;slow:rank=1:factor=3:from=5:to=20;hang:node=1:step=4
    jitter:rank=0,1,2,3:factor=4:prob=0.1

Fields: ``rank=R[,R...]`` or ``node=K`` (one is required), ``step=S`` (exactly that step;
without it a kill/hang/exit fires at the first matching phase and a slow/jitter fault at every
one), ``from=S``/``to=S`` (slow and jitter; inclusive range, either end open: a ``slow`` with
``to=`` is a straggler that recovers), ``phase=P`` (default ``any``; ``save``: inside the
lowest-ranked member's checkpoint write, once the data is in the temporary file and before the
rename; ``reconfigure``: inside a reconfiguration's agreement, on every member, after the
source's engine decided and wrote its failure record and before the agreed state is broadcast;
its step is the step the members agreed on), ``once`` (fire at most once), ``factor=F`` (slow and jitter, >= 1, default 2 for slow and 4 for jitter), ``delay=S``
(slow and jitter, instead of ``factor``: pad by S seconds whatever the phase took -- a pad that
does not grow with the machine's load), ``prob=P``
(jitter only, in (0, 1], default 0.1; drawn from a generator seeded by the rank, so a run is
reproducible) and ``code=C`` (exit only, nonzero, default 1).

Workers call ``FaultInjector.at(step, phase)`` at phase boundaries, or wrap a phase in
``with injector.phase(step, "forward"):`` so that ``slow`` can measure it.  ``kill_process`` is
the outside view: send SIGKILL / SIGSTOP / SIGCONT to a PID.

Limits, honestly: faults fire only where the worker calls the injector, so "killed during the
all-reduce" means "killed when entering the all-reduce phase", not at an arbitrary instruction;
``slow``/``jitter`` pad a phase after it ran (wall time, not a slower device); the signals are POSIX-only
and ``process_state`` reads Linux ``/proc``.  ``kill``/``hang``/``exit`` fire at most once per
process, so a hung worker that is continued (SIGCONT) and redoes the step does not hang again.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping, Sequence

__all__ = [
    "ACTIONS",
    "PHASES",
    "ENV_VAR",
    "FaultSpec",
    "FaultInjector",
    "parse_faults",
    "format_faults",
    "faults_from_env",
    "kill_process",
    "process_state",
]

log = logging.getLogger(__name__)

ACTIONS = ("kill", "hang", "slow", "jitter", "exit", "corrupt", "drop", "nan")
_PADDING = ("slow", "jitter")  # actions that pad a phase instead of ending or stopping it
_RANGED = _PADDING + ("nan",)  # actions that take from=/to= and fire at every matching phase
PHASES = ("step_start", "forward", "backward", "allreduce", "commit", "optimizer", "migrate", "snapshot", "restore",
          "save", "reconfigure", "any")
ENV_VAR = "CHAMELEON_FT_FAULTS"

_KEYS = ("rank", "node", "step", "from", "to", "phase", "once", "factor", "delay", "code", "prob")


@dataclass(frozen=True)
class FaultSpec:
    """One fault.  Build it directly or with ``FaultSpec.parse``; both validate."""

    action: str
    ranks: tuple[int, ...] = ()
    node: int | None = None
    step: int | None = None
    phase: str = "any"
    once: bool = False
    factor: float | None = None
    from_step: int | None = None
    to_step: int | None = None
    code: int | None = None
    prob: float | None = None
    delay: float | None = None

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown fault action {self.action!r}; expected one of {ACTIONS}")
        if self.phase not in PHASES:
            raise ValueError(f"unknown phase {self.phase!r}; expected one of {PHASES}")
        object.__setattr__(self, "ranks", tuple(self.ranks))
        if not self.ranks and self.node is None:
            raise ValueError(f"{self.action} fault needs a target: rank=R or node=K")
        if self.ranks and self.node is not None:
            raise ValueError("give either rank= or node=, not both")
        if any(r < 0 for r in self.ranks) or (self.node is not None and self.node < 0):
            raise ValueError("rank and node must be >= 0")
        for name in ("step", "from_step", "to_step"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"{name.replace('_step', '')} must be >= 0, got {v}")
        if self.action in _PADDING:
            if self.delay is not None:
                if self.factor is not None:
                    raise ValueError(f"{self.action} takes factor= or delay=, not both")
                object.__setattr__(self, "delay", float(self.delay))
                if not 0 <= self.delay < float("inf"):  # also rejects NaN
                    raise ValueError(f"{self.action} delay must be a finite number of seconds >= 0, "
                                     f"got {self.delay}")
            else:
                default = 2.0 if self.action == "slow" else 4.0
                object.__setattr__(self, "factor", default if self.factor is None else float(self.factor))
                if not self.factor >= 1:  # also rejects NaN
                    raise ValueError(f"{self.action} factor must be >= 1, got {self.factor}")
            if self.step is not None and (self.from_step is not None or self.to_step is not None):
                raise ValueError(f"{self.action} takes step= or a from=/to= range, not both")
            if self.from_step is not None and self.to_step is not None and self.to_step < self.from_step:
                raise ValueError(f"empty step range from={self.from_step} to={self.to_step}")
        else:
            for key in ("factor", "delay"):
                if getattr(self, key) is not None:
                    raise ValueError(f"{key}= applies to jitter and slow faults only")
            if self.action not in _RANGED and (self.from_step is not None or self.to_step is not None):
                raise ValueError("from=/to= apply to jitter, slow and nan faults only; use step=")
            if self.step is not None and (self.from_step is not None or self.to_step is not None):
                raise ValueError(f"{self.action} takes step= or a from=/to= range, not both")
        if self.action == "jitter":
            object.__setattr__(self, "prob", 0.1 if self.prob is None else float(self.prob))
            if not 0 < self.prob <= 1:
                raise ValueError(f"jitter prob must be in (0, 1], got {self.prob}")
        elif self.prob is not None:
            raise ValueError("prob= applies to jitter faults only")
        if self.action == "exit":
            if self.code is None:
                object.__setattr__(self, "code", 1)
            if self.code == 0 or not 0 < self.code < 256:
                raise ValueError(f"exit code must be in 1..255, got {self.code}")
        elif self.code is not None:
            raise ValueError("code= applies to exit faults only")

    # -- matching ----------------------------------------------------------------------

    def targets(self, rank: int, node_rank: int | None) -> bool:
        if self.node is not None:
            return node_rank == self.node
        return rank in self.ranks

    def target_ranks(self, nproc_per_node: int) -> tuple[int, ...]:
        """Global ranks this spec hits (a node spec covers all its local ranks)."""
        if self.node is None:
            return self.ranks
        return tuple(range(self.node * nproc_per_node, (self.node + 1) * nproc_per_node))

    def matches(self, step: int, phase: str) -> bool:
        if self.phase != "any" and self.phase != phase:
            return False
        if self.step is not None:
            return step == self.step
        if self.from_step is not None and step < self.from_step:
            return False
        if self.to_step is not None and step > self.to_step:
            return False
        return True

    # -- text form ---------------------------------------------------------------------

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        parts = [p.strip() for p in text.strip().split(":")]
        if not parts or not parts[0]:
            raise ValueError(f"empty fault spec in {text!r}")
        action, fields = parts[0].lower(), {}
        for part in parts[1:]:
            key, eq, value = part.partition("=")
            key = key.strip().lower()
            if key not in _KEYS:
                raise ValueError(f"unknown fault field {key!r} in {text!r}; expected one of {_KEYS}")
            if key in fields:
                raise ValueError(f"fault field {key!r} given twice in {text!r}")
            if not eq and key != "once":
                raise ValueError(f"fault field {key!r} needs a value ({key}=...) in {text!r}")
            fields[key] = value.strip()
        kw: dict = {"action": action}
        try:
            if "rank" in fields:
                kw["ranks"] = tuple(int(r) for r in fields["rank"].split(","))
            for key, name in (("node", "node"), ("step", "step"), ("from", "from_step"),
                              ("to", "to_step"), ("code", "code")):
                if key in fields:
                    kw[name] = int(fields[key])
            for key in ("factor", "prob", "delay"):
                if key in fields:
                    kw[key] = float(fields[key])
        except ValueError:
            raise ValueError(f"bad number in fault spec {text!r}") from None
        if "phase" in fields:
            kw["phase"] = fields["phase"].lower()
        if "once" in fields:
            flag = fields["once"].lower()
            if flag not in ("", "1", "true", "yes", "0", "false", "no"):
                raise ValueError(f"once must be a flag (once, once=1, once=0), got {flag!r}")
            kw["once"] = flag in ("", "1", "true", "yes")
        return cls(**kw)

    def to_string(self) -> str:
        out = [self.action]
        if self.node is not None:
            out.append(f"node={self.node}")
        else:
            out.append("rank=" + ",".join(str(r) for r in self.ranks))
        for key, value in (("step", self.step), ("from", self.from_step), ("to", self.to_step)):
            if value is not None:
                out.append(f"{key}={value}")
        if self.phase != "any":
            out.append(f"phase={self.phase}")
        if self.factor is not None:
            out.append(f"factor={self.factor!r}")  # repr round-trips a float exactly
        if self.delay is not None:
            out.append(f"delay={self.delay!r}")
        if self.prob is not None:
            out.append(f"prob={self.prob!r}")
        if self.code is not None:
            out.append(f"code={self.code}")
        if self.once:
            out.append("once")
        return ":".join(out)


def parse_faults(text: str | None) -> list[FaultSpec]:
    """Parse ``spec;spec;...``; empty or ``None`` gives no faults."""
    if not text or not text.strip():
        return []
    return [FaultSpec.parse(p) for p in text.split(";") if p.strip()]


def format_faults(specs: Iterable[FaultSpec]) -> str:
    return ";".join(s.to_string() for s in specs)


def faults_from_env(env: Mapping[str, str] | None = None) -> list[FaultSpec]:
    return parse_faults((os.environ if env is None else env).get(ENV_VAR))


class FaultInjector:
    """Fires the specs that target this process when the worker reaches a phase.

    ``node_rank`` defaults to ``rank // nproc_per_node`` when ``nproc_per_node`` is given.
    ``on_fire(spec, step, phase)`` is called (and a log line written to stderr) just before a
    fault acts, so a test or a benchmark can see what was injected even when the process dies.
    """

    def __init__(
        self,
        specs: Sequence[FaultSpec] | str | None,
        rank: int,
        local_rank: int | None = None,
        node_rank: int | None = None,
        nproc_per_node: int | None = None,
        *,
        on_fire: Callable[[FaultSpec, int, str], None] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if isinstance(specs, str) or specs is None:
            specs = parse_faults(specs)
        if node_rank is None and nproc_per_node:
            node_rank = rank // nproc_per_node
        if local_rank is None:
            local_rank = rank % nproc_per_node if nproc_per_node else rank
        self.rank, self.local_rank, self.node_rank = rank, local_rank, node_rank
        self.nproc_per_node = nproc_per_node
        self.specs = [s for s in specs if s.targets(rank, node_rank)]
        self._fired: set[int] = set()
        self._on_fire = on_fire
        self._sleep = sleep
        self._rng = random.Random(rank)  # jitter draws: reproducible per rank
        self.slept = 0.0  # total injected delay, for benchmarks to report

    @classmethod
    def from_env(cls, rank: int, **kwargs) -> "FaultInjector":
        return cls(faults_from_env(), rank, **kwargs)

    def __bool__(self) -> bool:
        return bool(self.specs)

    def _due(self, step: int, phase: str, actions: tuple[str, ...]) -> Iterator[FaultSpec]:
        if phase not in PHASES or phase == "any":
            raise ValueError(f"phase must be one of {PHASES[:-1]}, got {phase!r}")
        for i, spec in enumerate(self.specs):
            if spec.action not in actions or not spec.matches(step, phase):
                continue
            if i in self._fired and (spec.once or spec.action not in _RANGED):
                continue
            self._fired.add(i)
            yield spec

    def at(self, step: int, phase: str, phase_time: float | None = None) -> None:
        """Fire kill/hang/exit faults due now; with ``phase_time`` (seconds the phase took)
        also apply ``slow`` faults.  Nothing to check without faults (the common path)."""
        if not self.specs:
            return
        for spec in self._due(step, phase, ("kill", "hang", "exit")):
            self._act(spec, step, phase)
        if phase_time is not None:
            self._slow(step, phase, phase_time)

    def corrupt(self, step: int, phase: str = "snapshot") -> bool:
        """Whether a ``corrupt`` fault is due now (the caller damages the data itself)."""
        return self.fires(step, phase, "corrupt")

    def fires(self, step: int, phase: str, action: str) -> bool:
        """Whether an ``action`` fault the caller carries out itself (``corrupt``, ``drop``)
        is due now; announced like the others."""
        if not self.specs:
            return False
        due = list(self._due(step, phase, (action,)))
        for spec in due:
            self._announce(spec, step, phase)
        return bool(due)

    @contextmanager
    def phase(self, step: int, phase: str) -> Iterator[None]:
        """Fire kill/hang/exit on entry; measure the body and pad it for ``slow`` on exit."""
        self.at(step, phase)
        t0 = time.perf_counter()
        yield
        self._slow(step, phase, time.perf_counter() - t0)

    def _slow(self, step: int, phase: str, phase_time: float) -> None:
        for spec in self._due(step, phase, _PADDING):
            if spec.action == "jitter" and self._rng.random() >= spec.prob:
                continue
            delay = spec.delay if spec.delay is not None else (spec.factor - 1.0) * max(phase_time, 0.0)
            self._announce(spec, step, phase, f" delay={delay:.4f}s")
            self.slept += delay
            self._sleep(delay)

    def _announce(self, spec: FaultSpec, step: int, phase: str, extra: str = "") -> None:
        msg = (f"chameleon-ft fault: {spec.action} rank={self.rank} pid={os.getpid()} "
               f"step={step} phase={phase}{extra}")
        log.warning(msg)
        if spec.action not in _PADDING:
            # The process may not get another chance to flush.
            print(msg, file=sys.stderr, flush=True)
        if self._on_fire is not None:
            self._on_fire(spec, step, phase)

    def _act(self, spec: FaultSpec, step: int, phase: str) -> None:
        self._announce(spec, step, phase)
        sys.stdout.flush()
        if spec.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif spec.action == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)  # returns here after SIGCONT
        elif spec.action == "exit":
            sys.exit(spec.code)


_SIGNALS = {
    "kill": signal.SIGKILL,
    "hang": signal.SIGSTOP,
    "stop": signal.SIGSTOP,
    "cont": signal.SIGCONT,
    "resume": signal.SIGCONT,
    "term": signal.SIGTERM,
}


def kill_process(pid: int, action: str) -> None:
    """Signal ``pid`` from outside: ``kill`` (SIGKILL), ``hang``/``stop`` (SIGSTOP),
    ``cont``/``resume`` (SIGCONT) or ``term`` (SIGTERM).  Raises ``ProcessLookupError``
    when the process is gone."""
    try:
        sig = _SIGNALS[action]
    except KeyError:
        raise ValueError(f"unknown action {action!r}; expected one of {tuple(_SIGNALS)}") from None
    if pid <= 0:
        raise ValueError(f"refusing to signal pid {pid} (process group semantics)")
    os.kill(pid, sig)


def process_state(pid: int) -> str:
    """The state letter from ``/proc/<pid>/stat`` (R, S, D, T stopped, Z zombie...); Linux only."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    # The command name is parenthesised and may contain spaces or parentheses.
    return stat[stat.rindex(")") + 2]
