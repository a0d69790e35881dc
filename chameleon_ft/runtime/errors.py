"""How a worker under ``chameleon-ft run`` ends on an error, and what the launcher says of it.

A failure the job survives is another worker's death; an error *in* a worker is either one the
launcher acts on (checkpoint-restart, coordinator lost) or a configuration error that every
worker meets the same way (a bad option, a DataLoader the adapters cannot shard, a GPU they do
not support).  A configuration error is not a failure to survive: the worker writes one line
to ``RUN_DIR/worker-errors/<worker id>.txt`` and exits with ``CONFIG_EXIT_CODE`` without a
traceback; the launcher prints each distinct message once, names the workers that hit it,
stops the others and exits non-zero (``CHAMELEON_FT_TRACEBACK=1`` prints the traceback too).
torchrun's error files (``TORCHELASTIC_ERROR_FILE``) serve the same purpose for its launcher.

An exception the runtime does not know -- raised by the user's code, or by a library it calls
-- is a bug, not a failure to survive (issue 24): under the launcher the worker writes its
traceback to ``RUN_DIR/worker-errors/<worker id>.traceback`` and exits with
``USER_ERROR_EXIT_CODE`` (70); the launcher prints each distinct traceback once, stops the job
on every node and exits 70.  ``chameleon-ft run --on-worker-error continue`` (the environment
variable ``CHAMELEON_FT_ON_WORKER_ERROR=continue``) makes it a lost worker instead: the
traceback printed, exit 1, the survivors carry on.

``exit_code_for`` is the one mapping from exceptions to exit codes and ``exit_worker`` the one
way out, used by ``elastic_main``, the Lightning callback's ``on_exception`` and the hook for
uncaught exceptions (installed when ``chameleon_ft.runtime`` is imported in a launched worker;
the Accelerate adapter adds its resume hint).
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Optional

from chameleon_ft.runtime import env as E
from chameleon_ft.runtime.presence import goodbye
from chameleon_ft.runtime.preemption import PREEMPTED_EXIT_CODE

__all__ = ["ConfigError", "LauncherError", "MembershipError", "CollectiveFailure", "CollectiveMismatch", "CheckpointError", "Diverged", "Preempted", "RestartRequested",
           "WorldTooSmall", "NothingToHeal", "LeftBehind", "CONFIG_EXIT_CODE", "exit_code_for", "exit_worker",
           "end_process", "install_excepthook", "read_config_errors", "user_error", "read_user_errors"]

CONFIG_EXIT_CODE = 78  # sysexits' EX_CONFIG
_ERROR_DIR = "worker-errors"


class ConfigError(ValueError):
    """A worker's configuration cannot run (every worker meets it the same way)."""


class LauncherError(ConfigError, RuntimeError):
    """Fault tolerance was required but the process was not started by ``chameleon-ft run``
    (or an adapter cannot take over the framework object it was given)."""


class MembershipError(RuntimeError):
    """The coordinator is unreachable, or no quorum formed in time."""


class CollectiveFailure(RuntimeError):
    """A collective of generation ``token`` did not complete on this member.

    ``kind`` is ``"peer_error"`` (gloo reported a broken connection), ``"timeout"`` (the
    watchdog expired: a peer hangs or is very slow), ``"aborted"`` (another member, or the
    launcher, declared the generation over), ``"rebuild"`` (the group could not be formed) or
    ``"mismatch"`` (runtime collectives of different kinds or sizes met; see ``checked``).
    ``suspects`` are worker ids believed to have failed, empty when unknown.
    """

    def __init__(self, message: str, *, kind: str, token: str, generation: int,
                 suspects: tuple[int, ...] = (), reporter: Optional[int] = None):
        super().__init__(message)
        self.kind = kind
        self.token = token
        self.generation = generation
        self.suspects = tuple(sorted(set(suspects)))
        self.reporter = reporter


class CollectiveMismatch(RuntimeError):
    """A control collective gave up without moving any data: its peers were in a different
    collective (``peers``: (rank, worker id, their call) of each one that differed), or this
    member is still realigning after such a mismatch (``skipped``).  Nothing failed: the
    caller returns its local value and carries on."""

    def __init__(self, message: str, *, call: str, peers: tuple = (), skipped: bool = False):
        super().__init__(message)
        self.call = call
        self.peers = tuple(peers)
        self.skipped = skipped


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, corrupt or not ours."""


class WorldTooSmall(RuntimeError):
    """Fewer workers are left than ``ElasticConfig.min_world_size``."""


class NothingToHeal(RuntimeError):
    """A replacement joined a generation in which nobody holds the job's state."""


class LeftBehind(RuntimeError):
    """This worker was left out of the job for more committed steps than its training loop can
    skip: an adapter's loop is the user's code, which cannot jump over steps its peers took
    (a stop or a partition longer than the hang timeout but shorter than the launcher's kill).
    It leaves the job as a lost worker (exit 1); its peers carry on."""


class Diverged(RuntimeError):
    """Steps whose loss was NaN or infinite on some member: with ``ElasticConfig.nonfinite =
    "stop"`` the first one, under ``"skip"`` ``nonfinite_limit`` in a row.  Every member raises
    it at the same step (the flags ride in the commit); exit 1."""


class Preempted(RuntimeError):
    """This worker was told to leave (SIGTERM: ``runtime/preemption.py``) and left the job at a
    step boundary, announced in that step's commit; its peers carry on without redoing a step.
    Exit ``PREEMPTED_EXIT_CODE`` (143)."""


class RestartRequested(RuntimeError):
    """The engine chose checkpoint-restart (or nothing in place was feasible).  ``decision``
    is the ``Decision`` (or its JSON, on members that received it from a peer)."""

    def __init__(self, decision):
        chosen = getattr(decision, "chosen", None) if not isinstance(decision, dict) else decision.get("chosen")
        super().__init__(f"engine chose {chosen or 'nothing feasible'}: checkpoint-restart "
                         "by the launcher")
        self.decision = decision


def exit_code_for(exc: BaseException) -> Optional[int]:
    """The exit code that tells the launcher what ``exc`` means, or None for a bug in the
    script (its traceback is the clearest report)."""
    if isinstance(exc, ConfigError):
        return CONFIG_EXIT_CODE
    if isinstance(exc, (RestartRequested, NothingToHeal)):
        return E.RESTART_EXIT_CODE
    if isinstance(exc, MembershipError):
        return E.MEMBERSHIP_EXIT_CODE
    if isinstance(exc, Preempted):
        return PREEMPTED_EXIT_CODE
    if isinstance(exc, (E.EnvError, WorldTooSmall, CheckpointError, LeftBehind, Diverged)):
        return 1
    return None


def _wid() -> str:
    return os.environ.get(E.WORKER_ID, "?")


def exit_worker(exc: BaseException, code: int, hint: str = "") -> None:
    """Say what ended this worker and leave with ``code`` (``os._exit``: a gloo op abandoned by
    a failure may still hold a thread until its timeout)."""
    msg = f"{type(exc).__name__}: {exc}" if code == CONFIG_EXIT_CODE else str(exc)
    run_dir = os.environ.get(E.RUN_DIR)
    if code == CONFIG_EXIT_CODE and run_dir and os.environ.get(E.WORKER_ID):
        d = Path(run_dir) / _ERROR_DIR
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{_wid()}.txt").write_text(msg.replace("\n", " ") + "\n")
        if os.environ.get("CHAMELEON_FT_TRACEBACK") == "1":
            traceback.print_exception(type(exc), exc, exc.__traceback__)
    else:
        print(f"chameleon-ft worker {_wid()}: {msg}", file=sys.stderr, flush=True)
        if hint:
            print(f"chameleon-ft worker {_wid()}: {hint}", file=sys.stderr, flush=True)
    end_process(code)


def end_process(code: int) -> None:
    """Leave with ``code`` now (``os._exit``: a gloo op abandoned by a failure may still hold a
    thread until its timeout), the output flushed and the coordinator told goodbye: an outcome,
    not a death (``runtime/presence.py``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    goodbye()
    os._exit(code)


def user_error(exc: BaseException) -> None:
    """End this worker on an exception the runtime does not know (a bug in the user's code):
    under the launcher its traceback goes to ``worker-errors/<id>.traceback`` for the launcher
    to print once, and the worker exits 70 (the job stops); with ``--on-worker-error continue``,
    or outside the launcher, the traceback is printed and the exit code is 1."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    run_dir = os.environ.get(E.RUN_DIR)
    if (os.environ.get(E.ON_ERROR, "stop") != "continue" and run_dir and os.environ.get(E.WORKER_ID)):
        try:
            d = Path(run_dir) / _ERROR_DIR
            d.mkdir(parents=True, exist_ok=True)
            (d / f"{_wid()}.traceback").write_text(text)
            code = E.USER_ERROR_EXIT_CODE
        except OSError:
            code = 1
    else:
        code = 1
    if code == 1:
        print(text, file=sys.stderr, end="", flush=True)
    end_process(code)


def read_user_errors(run_dir: str) -> dict[int, str]:
    """Tracebacks the workers left (worker id -> text); the launcher's side."""
    out = {}
    for p in sorted((Path(run_dir) / _ERROR_DIR).glob("*.traceback")):
        try:
            out[int(p.stem)] = p.read_text()
        except (ValueError, OSError):
            continue
    return out


_restart_hint = ""


def install_excepthook(restart_hint: Optional[str] = None) -> None:
    """Under ``chameleon-ft run`` only: an uncaught runtime outcome or configuration error ends
    the worker with its exit code (see ``exit_code_for``); any other exception is a bug in the
    user's code (``user_error``).  ``restart_hint``: what to tell the user after a checkpoint-restart."""
    global _restart_hint
    if restart_hint is not None:
        _restart_hint = restart_hint
    if not os.environ.get(E.WORKER_ID) or getattr(sys.excepthook, "_chameleon_ft", False):
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        code = exit_code_for(exc)
        if code is None:
            if isinstance(exc, KeyboardInterrupt):
                return previous(exc_type, exc, tb)
            user_error(exc)
        exit_worker(exc, code, _restart_hint if code == E.RESTART_EXIT_CODE else "")

    hook._chameleon_ft = True
    sys.excepthook = hook


def read_config_errors(run_dir: str) -> dict[int, str]:
    """Messages the workers left (worker id -> one line); the launcher's side."""
    out = {}
    for p in sorted((Path(run_dir) / _ERROR_DIR).glob("*.txt")):
        try:
            out[int(p.stem)] = p.read_text().strip()
        except (ValueError, OSError):
            continue
    return out
