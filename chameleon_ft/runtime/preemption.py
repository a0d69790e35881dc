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

__all__ = ["PreemptionNotice", "PREEMPTED_EXIT_CODE"]

PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM  # 143: what a process ended by SIGTERM reports


class PreemptionNotice:
    """Notes a SIGTERM (``reason``) for the next commit to announce."""

    def __init__(self, worker_id: int) -> None:
        self.worker_id = worker_id
        self.reason: Optional[str] = None
        self._previous = None
        self.installed = False

    def install(self) -> bool:
        """Take SIGTERM (main thread only; returns whether it did)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self._previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._on_term)
        self.installed = True
        return True

    def uninstall(self) -> None:
        if self.installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self.installed = False

    def _on_term(self, signum, frame) -> None:
        if self.reason is None:
            self.reason = "SIGTERM"
            os.write(2, f"chameleon-ft worker {self.worker_id}: SIGTERM: leaving the job at the end of the "
                        "current step\n".encode())
        previous = self._previous
        if callable(previous) and previous not in (signal.SIG_DFL, signal.SIG_IGN):
            previous(signum, frame)
