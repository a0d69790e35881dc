"""Preemption announced: SIGTERM makes a worker leave the job at the next step boundary.

SIGTERM is the notice a machine gets before it is taken away: spot and preemptible instances,
Kubernetes' pod deletion, SLURM's preemption and ``scancel`` (and ``--signal`` for an earlier
notice).  Handled as a crash, the leaving worker dies mid-step, its peers find out a collective
later and redo the step.  Announced instead (``PreemptionNotice``): the handler only notes it;
the worker finishes the step it is in, and its flag rides in that step's commit
(``RecoveryCore._tail_row``), so every member learns who leaves from the same reduced numbers,
after the same commit.  The leaver marks itself gone and exits ``PREEMPTED_EXIT_CODE`` (143, as a
process ended by SIGTERM); the others reconfigure right after that commit: nothing is redone.

``chameleon-ft run`` forwards a SIGTERM it gets to its workers and waits ``--term-grace``
seconds for them to leave before it kills them (a worker that cannot reach a step boundary in
time -- a long evaluation, a stuck collective -- is then lost as after a kill).
``--preempt-signal USR1`` (SLURM's ``--signal=USR1@90``: a notice some time before the end)
makes that signal a notice too, for the launcher and its workers.  A preempted node's launcher
exits 143; with SLURM's ``--requeue`` the requeued job starts a new job that resumes from the
script's checkpoint (the survivors' job on other nodes is not affected).

Limits: the notice is read at a step's commit; one that arrives during the commit's all-reduce
is announced at the next step.  Handled in the main thread only (where Python runs signal
handlers).  A handler the script installed before is called after ours.  Lightning installs its
own SIGTERM handling, which stops its loop (``SIGTERMException``): there the notice is not used.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Optional

__all__ = ["PreemptionNotice", "PREEMPTED_EXIT_CODE", "PREEMPT_SIGNALS_ENV", "notice_signals"]

PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM  # 143: what a process ended by SIGTERM reports


PREEMPT_SIGNALS_ENV = "CHAMELEON_FT_PREEMPT_SIGNALS"  # more notice signals (``--preempt-signal``)


def notice_signals(names: Optional[str] = None) -> tuple[signal.Signals, ...]:
    """SIGTERM and the signals named in ``names`` (default: the environment's
    ``CHAMELEON_FT_PREEMPT_SIGNALS``, e.g. ``USR1`` for SLURM's ``--signal=USR1@90``); ValueError
    for a name that is not a signal."""
    names = os.environ.get(PREEMPT_SIGNALS_ENV, "") if names is None else names
    out = [signal.SIGTERM]
    for name in (n.strip().upper() for n in names.split(",") if n.strip()):
        try:
            sig = signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
        except KeyError:
            raise ValueError(f"{name!r} is not a signal name (e.g. USR1, TERM)") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGINT):
            raise ValueError(f"{sig.name} cannot be a preemption notice")
        if sig not in out:
            out.append(sig)
    return tuple(out)


class PreemptionNotice:
    """Notes a SIGTERM (or another ``notice_signals`` signal) as ``reason`` for the next commit
    to announce."""

    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        self.reason: Optional[str] = None
        self._previous: dict = {}
        self.installed = False

    def install(self) -> bool:
        """Take the notice signals (main thread only; returns whether it did)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in notice_signals():
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_notice)
        self.installed = True
        return True

    def uninstall(self) -> None:
        if self.installed and threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            self.installed = False

    def _on_notice(self, signum, frame) -> None:
        if self.reason is None:
            self.reason = signal.Signals(signum).name
            os.write(2, f"chameleon-ft worker {self.worker_id}: {self.reason}: leaving the job at the end of the "
                        "current step\n".encode())
        previous = self._previous.get(signum)
        if callable(previous) and previous not in (signal.SIG_DFL, signal.SIG_IGN):
            previous(signum, frame)
