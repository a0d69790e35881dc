"""Decisions that steer a training loop -- stop, and a framework's save/best bookkeeping --
agreed on a commit when they could not be agreed where they were made.

A framework decides to stop or to save with a collective (Lightning's ``reduce_boolean_decision``,
Accelerate's ``check_trigger``).  After a failure outside a step an adapter's collectives return
the local value until the next training step (``adapter_kit.LiveCollectives``), so members could
decide differently: one leaves the loop while its peers train on, or their checkpoint
bookkeeping drifts apart.  Such a decision is held here instead:

* a **stop** is deferred: the decision returns "not now", this member's vote rides the next
  commit's tail, and after that commit every member knows the same voters; if any voted, the
  loop stops after that step everywhere (``stop_at``: the committed step count it stops at,
  carried in the run state so that a member adopting the step learns it too);
* any **other** decision (a checkpoint's "is this the best?", "does the file exist?") keeps its
  local value, and the member flags that it decided locally; after the next commit every member
  knows that someone did (``adopt``), and the adapter replaces its bookkeeping by rank 0's (the
  member that wrote the files).

The cost: a stop decided while a worker was being replaced takes effect one step later than it
would have.  Limits: only the decisions an adapter routes here (see the adapters' docs).
"""

from __future__ import annotations

from typing import Optional

__all__ = ["Steering"]


class Steering:
    """One member's held loop-steering decisions (see module doc)."""

    def __init__(self) -> None:
        self.local = False  # decided something locally since the last commit
        self.stop_vote = False  # a stop decided locally since the last commit
        self.stop_at: Optional[int] = None  # agreed: the loop stops once this many steps committed
        self.adopt = False  # agreed: some member decided locally; take rank 0's bookkeeping
        self.voters: tuple[int, ...] = ()  # of the last agreement (for the event log)

    def defer_stop(self, decision: bool) -> None:
        self.local = True
        self.stop_vote = self.stop_vote or bool(decision)

    def decided_locally(self) -> None:
        self.local = True

    def word(self) -> float:
        """This member's number in the commit's tail: 1 decided locally, +2 voted stop."""
        return float(self.local) + 2.0 * float(self.stop_vote)

    def agree(self, words: dict[int, float], step: int) -> bool:
        """Every member's ``word`` as read from the commit that made ``step`` committed steps;
        True when somebody held a decision (the caller records it)."""
        voters = tuple(w for w, x in words.items() if int(x) & 2)
        held = any(int(x) & 1 for x in words.values())
        self.local = self.stop_vote = False
        if voters:
            self.stop_at = step
        self.adopt = self.adopt or held
        self.voters = voters
        return held

    def stops_now(self, step: int) -> bool:
        """The loop stops after the step that made ``step`` committed steps."""
        return self.stop_at is not None and self.stop_at == step

    def state_dict(self) -> dict:
        return {"stop_at": self.stop_at}

    def load_state_dict(self, s: Optional[dict]) -> None:
        if s:
            self.stop_at = s.get("stop_at")
