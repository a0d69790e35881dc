"""Elastic, exactly-once data sampling for data-parallel training with changing membership.

``ElasticSampler`` is the state every worker holds identically: a global, seeded sample order
per epoch and a *committed cursor* (the number of global steps of this epoch that completed on
every member).  Global batch ``t`` is ``order[t*B:(t+1)*B]`` and is cut into
``B // micro_batch`` micro-batches in order.  Which samples form global batch ``t`` -- and
which samples form its micro-batch ``j`` -- never depends on who is alive; membership only
decides *who* runs micro-batch ``j``.  That is what keeps the training trajectory identical
under data rerouting: weight each micro-batch's mean loss by ``MicroBatch.weight`` (its share of
the global batch's samples) and SUM-all-reduce the gradients, and the update equals the
failure-free one up to floating-point summation order.

An *allocation* maps the members, in the order given, to a number of micro-batches each per
step; micro-batches go to members contiguously in that order.  A step that was interrupted is
simply not committed: after ``set_allocation`` for the survivors, ``step_plan()`` hands out the
same global batch again, so no sample is lost or processed twice.

``ElasticBatchSampler`` is a ``batch_sampler`` for ``torch.utils.data.DataLoader`` that yields
one member's micro-batch index lists from the committed cursor to the end of the epoch.  It
snapshots the sampler's state when an iterator is created, so after a reconfiguration build a
fresh DataLoader iterator (the batch sampler is always iterated in the main process, so this
holds with ``num_workers > 0`` too).

Limits, honestly:
  * The sampler does not communicate.  Every member must apply the same ``set_allocation``,
    ``commit`` and ``set_epoch`` calls (or load the same ``state_dict``); the runtime does that
    from the agreed membership.  ``state_dict`` makes disagreement easy to check.
  * The cursor counts global steps, so the global batch and micro-batch sizes are fixed for the
    life of a sampler; a "shrink" that changes the global batch needs a new sampler starting at
    ``cursor * old_B`` samples, which is not provided here.
  * The last partial global batch (``drop_last=False``) keeps the same number of micro-batch
    slots, with samples spread as evenly as possible over them; when it has fewer samples than
    slots, the empty slots are left out, so a member may get fewer (or no) micro-batches in that
    step and must still take part in the gradient all-reduce.
  * The permutation is ``torch.randperm`` seeded with ``seed + epoch``; it is reproducible for a
    given torch build, not guaranteed across torch versions.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional, Sequence, Sized, Union

import torch

__all__ = ["MicroBatch", "StepItem", "step_items", "ElasticSampler", "ElasticBatchSampler", "equal_allocation",
           "seed_generators"]

_STATE_VERSION = 2


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of one global step.

    ``index`` is its position ``j`` within the global batch (stable under any membership);
    ``weight`` is ``n_samples / samples_in_global_batch``, so weights of a step sum to 1.
    """

    step: int
    index: int
    indices: tuple[int, ...]
    weight: float

    @property
    def n_samples(self) -> int:
        return len(self.indices)


@dataclass(frozen=True)
class StepItem:
    """One item of a member's share of a step as a framework loop sees it: several whole
    micro-batches merged or one micro-batch (``parts``, in slot order).

    ``weight`` is the item's share of the global batch's samples (the sum of its parts');
    ``completes`` the slots whose last samples are in this item (their gradients are complete
    once its backward ran).  An item with no parts is a *ghost*: the member has nothing left
    to compute in this step but must still run the loop body once more."""

    parts: tuple[MicroBatch, ...]
    completes: tuple[int, ...]

    @property
    def indices(self) -> tuple[int, ...]:
        if len(self.parts) == 1:
            return self.parts[0].indices
        return tuple(i for mb in self.parts for i in mb.indices)

    @property
    def weight(self) -> float:
        return sum(mb.weight for mb in self.parts)

    @property
    def ghost(self) -> bool:
        return not self.parts

    @property
    def seed_slot(self) -> int:
        """The slot whose per-(step, slot) seed the item runs with (its first part's)."""
        return self.parts[0].index if self.parts else -1


def step_items(mbs: Sequence[MicroBatch], n_items: int | None) -> list[StepItem]:
    """``mbs`` (a member's micro-batches of one step, in slot order) as exactly ``n_items``
    items, so that a user's loop makes the same number of iterations per step whatever the
    member's share (``None``: one item per micro-batch).

    With at least ``n_items`` micro-batches, consecutive whole micro-batches are merged
    (counts as even as possible, larger items first): a micro-batch's samples stay together,
    so each keeps its own per-slot seed when it is alone in its item.  With fewer, each
    micro-batch is an item of its own and the remaining items are ghosts (no sample): cutting a
    micro-batch's samples across items would run its halves with the same per-slot seed (other
    dropout masks, other batch statistics than without the failure; seen as a 0.5 % drift
    after a member that adopted a step got one micro-batch of the redone next one).  Weights
    are per sample, so the items' weighted gradients add up to the same step."""
    mbs = list(mbs)
    if n_items is None:
        return [StepItem((mb,), (mb.index,)) for mb in mbs]
    if n_items < 1:
        raise ValueError(f"n_items must be >= 1, got {n_items}")
    if len(mbs) < n_items:
        return [StepItem((mb,), (mb.index,)) for mb in mbs] + [StepItem((), ())] * (n_items - len(mbs))
    out: list[StepItem] = []
    q, r = divmod(len(mbs), n_items)
    lo = 0
    for k in range(n_items):
        group = mbs[lo:lo + q + (k < r)]
        lo += len(group)
        out.append(StepItem(tuple(group), tuple(mb.index for mb in group)))
    return out


def equal_allocation(n_members: int, n_microbatches: int) -> list[int]:
    """As equal as possible; earlier members get the extra micro-batches."""
    if n_members <= 0:
        raise ValueError("membership is empty: at least one member is needed")
    base, extra = divmod(n_microbatches, n_members)
    return [base + (1 if i < extra else 0) for i in range(n_members)]


def _as_int(value, what: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {value!r}") from None


class ElasticSampler:
    """Shared, deterministic sampling state: order, committed cursor and allocation.

    Args:
        dataset: a dataset (anything with ``len``) or its length.
        global_batch: samples per global step (``B``); must be a multiple of ``micro_batch``.
        micro_batch: samples per micro-batch.
        seed: base seed; epoch ``e`` uses ``seed + e``.
        shuffle: permute the order each epoch; otherwise ``range(len(dataset))``.
        drop_last: drop a last global batch smaller than ``global_batch``.
        members: optional initial members (equal allocation).
        epoch: initial epoch.
    """

    def __init__(
        self,
        dataset: Union[Sized, int],
        global_batch: int,
        micro_batch: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        members: Sequence[int] | None = None,
        epoch: int = 0,
    ) -> None:
        n = dataset if isinstance(dataset, int) else len(dataset)
        self.dataset_len = _as_int(n, "dataset length")
        self.global_batch = _as_int(global_batch, "global_batch")
        self.micro_batch = _as_int(micro_batch, "micro_batch")
        if self.dataset_len < 0:
            raise ValueError(f"dataset length must be >= 0, got {self.dataset_len}")
        if self.micro_batch <= 0 or self.global_batch <= 0:
            raise ValueError("global_batch and micro_batch must be positive")
        if self.global_batch % self.micro_batch:
            raise ValueError(
                f"global_batch ({self.global_batch}) must be a multiple of "
                f"micro_batch ({self.micro_batch})"
            )
        self.seed = _as_int(seed, "seed")
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.epoch = _as_int(epoch, "epoch")
        if self.epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {self.epoch}")
        self.base_global_batch = self.global_batch  # the user's batch (shrink changes global_batch)
        self.cursor = 0
        # After a global-batch change at step ``base`` of this epoch, step t >= base starts at
        # sample ``offset + (t - base) * global_batch`` of the epoch's order.
        self.base = 0
        self.offset = 0
        self.members: tuple[int, ...] = ()
        self.allocation: tuple[int, ...] = ()
        self._order_cache: tuple[int, list[int]] | None = None
        self._mb_cache: dict[tuple, tuple[MicroBatch, ...]] = {}  # microbatches(), recent steps
        if members is not None:
            self.set_allocation(members)

    # -- shape of the epoch -------------------------------------------------------------

    @property
    def num_microbatches(self) -> int:
        """Micro-batch slots per global step (``B // micro_batch``)."""
        return self.global_batch // self.micro_batch

    @property
    def steps_per_epoch(self) -> int:
        left = self.dataset_len - self.offset
        if self.drop_last:
            return self.base + left // self.global_batch
        return self.base + math.ceil(left / self.global_batch)

    def _start(self, step: int) -> int:
        return self.offset + (step - self.base) * self.global_batch

    def samples_in_step(self, step: int) -> int:
        self._check_step(step)
        return min(self.global_batch, self.dataset_len - self._start(step))

    def remaining_samples(self) -> int:
        """Samples of this epoch not yet covered by a committed step."""
        if self.drop_last:
            return (self.steps_per_epoch - self.cursor) * self.global_batch
        return max(0, self.dataset_len - self._start(self.cursor))

    def epoch_samples(self) -> int:
        """Samples an epoch covers (fewer than the dataset with ``drop_last``)."""
        if self.drop_last:
            return self.offset + (self.steps_per_epoch - self.base) * self.global_batch
        return self.dataset_len

    def set_global_batch(self, global_batch: int) -> None:
        """Change the global batch from the cursor step on (a ``shrink``, or growing back).

        Committed steps keep the samples they had; the epoch's remaining samples are cut into
        batches of the new size, so nothing is lost or repeated.  The allocation is reset:
        call ``set_allocation`` next."""
        global_batch = _as_int(global_batch, "global_batch")
        if global_batch <= 0 or global_batch % self.micro_batch or global_batch > self.base_global_batch:
            raise ValueError(f"global_batch {global_batch} must be a positive multiple of "
                             f"micro_batch {self.micro_batch}, at most {self.base_global_batch}")
        if global_batch == self.global_batch:
            return
        self.offset = self._start(self.cursor)
        self.base = self.cursor
        self.global_batch = global_batch
        self.members, self.allocation = (), ()

    def order(self) -> list[int]:
        """This epoch's global sample order (cached; do not mutate)."""
        if self._order_cache is None or self._order_cache[0] != self.epoch:
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + self.epoch)
                order = torch.randperm(self.dataset_len, generator=g).tolist()
            else:
                order = list(range(self.dataset_len))
            self._order_cache = (self.epoch, order)
        return self._order_cache[1]

    def global_batch_indices(self, step: int) -> list[int]:
        """Sample ids of global batch ``step`` -- independent of membership."""
        self._check_step(step)
        start = self._start(step)
        return self.order()[start : start + self.samples_in_step(step)]

    def microbatches(self, step: int, lo: int = 0, hi: Optional[int] = None) -> list[MicroBatch]:
        """Non-empty micro-batches of ``step`` in slot order, independent of membership (only
        the slots ``lo <= j < hi`` when given).  A new list each call; the micro-batches of the
        last few steps asked for are kept (a step asks for its own several times).  The
        non-empty slots are a prefix of the step's (``_microbatches``), so slot ``j`` is the
        ``j``-th micro-batch."""
        key = (self.epoch, self.global_batch, self.base, self.offset, step)
        got = self._mb_cache.get(key)
        if got is None:
            if len(self._mb_cache) >= 8:
                self._mb_cache.clear()
            got = self._mb_cache[key] = tuple(self._microbatches(step))
        return list(got[lo:hi])

    def _microbatches(self, step: int) -> list[MicroBatch]:
        n_t = self.samples_in_step(step)
        start0 = self._start(step)
        order = self.order()
        # Full batches give micro_batch samples per slot; a partial last batch is spread
        # evenly over the same slots so that the allocation's shares still hold.
        base, extra = divmod(n_t, self.num_microbatches)
        out = []
        for j in range(self.num_microbatches):
            size = base + (1 if j < extra else 0)
            if size:
                start = start0 + j * base + min(j, extra)
                out.append(MicroBatch(step, j, tuple(order[start:start + size]), size / n_t))
        return out

    # -- allocation ----------------------------------------------------------------------

    def set_allocation(
        self,
        members: Sequence[int],
        microbatches_per_member: Sequence[int] | Mapping[int, int] | None = None,
    ) -> None:
        """Set who runs which micro-batch slots from now on (the cursor does not move).

        ``microbatches_per_member`` is a sequence aligned with ``members`` or a mapping
        member -> count; it must sum to ``num_microbatches``.  ``None`` means as equal as
        possible, earlier members getting the extra ones.
        """
        members = tuple(_as_int(m, "member id") for m in members)
        if not members:
            raise ValueError("membership is empty: at least one member is needed")
        if len(set(members)) != len(members):
            raise ValueError(f"duplicate member ids in {members}")
        if any(m < 0 for m in members):
            raise ValueError(f"member ids must be >= 0, got {members}")
        if microbatches_per_member is None:
            counts = equal_allocation(len(members), self.num_microbatches)
        elif isinstance(microbatches_per_member, Mapping):
            unknown = set(microbatches_per_member) - set(members)
            if unknown:
                raise ValueError(f"allocation names non-members {sorted(unknown)}; members are {members}")
            counts = [_as_int(microbatches_per_member.get(m, 0), "micro-batch count") for m in members]
        else:
            counts = [_as_int(c, "micro-batch count") for c in microbatches_per_member]
            if len(counts) != len(members):
                raise ValueError(
                    f"allocation has {len(counts)} entries for {len(members)} members {members}"
                )
        if any(c < 0 for c in counts):
            raise ValueError(f"micro-batch counts must be >= 0, got {counts}")
        if sum(counts) != self.num_microbatches:
            raise ValueError(
                f"allocation {dict(zip(members, counts))} sums to {sum(counts)} micro-batches, but "
                f"a step has {self.num_microbatches} (global_batch={self.global_batch} / "
                f"micro_batch={self.micro_batch})"
            )
        self.members = members
        self.allocation = tuple(counts)

    def step_plan(self, step: int | None = None) -> dict[int, list[MicroBatch]]:
        """Micro-batches of ``step`` (default: the cursor) for every member, in member order."""
        return self._plan(self.cursor if step is None else step, self.members, self.allocation)

    def local_microbatches(self, member: int, step: int | None = None) -> list[MicroBatch]:
        """The micro-batches ``member`` runs in ``step`` (default: the cursor)."""
        if member not in self.members:
            raise ValueError(f"unknown member {member!r}; current members are {self.members}")
        i = self.members.index(member)
        lo = sum(self.allocation[:i])
        return self.microbatches(self.cursor if step is None else step, lo, lo + self.allocation[i])

    def warm(self, member: int, step: int) -> None:
        """Compute ``step``'s micro-batches now, into the cache ``microbatches`` reads, when
        ``step`` is in this epoch and ``member`` is in the allocation: a caller with idle time
        (a step's reduction in flight) takes this work off the next step's start.  What it
        computes does not depend on the allocation; a change of the batch or the epoch first
        makes the next step compute its own (the cache is keyed by them)."""
        if step < self.steps_per_epoch and member in self.members:
            self.microbatches(step)

    def _plan(self, step, members, counts) -> dict[int, list[MicroBatch]]:
        if not members:
            raise ValueError("no allocation: call set_allocation(members) first")
        plan: dict[int, list[MicroBatch]] = {}
        lo = 0
        for m, c in zip(members, counts):
            plan[m] = self.microbatches(step, lo, lo + c)
            lo += c
        return plan

    # -- progress ------------------------------------------------------------------------

    def commit(self, step: int | None = None) -> None:
        """Record that ``step`` (default: the cursor) completed on every member.

        Steps commit in order; committing anything but the cursor is a bug in the caller.
        """
        step = self.cursor if step is None else _as_int(step, "step")
        if step != self.cursor:
            raise ValueError(f"can only commit the cursor step {self.cursor}, got {step}")
        if step >= self.steps_per_epoch:
            raise ValueError(f"epoch {self.epoch} is complete ({self.steps_per_epoch} steps)")
        self.cursor += 1

    @property
    def epoch_done(self) -> bool:
        return self.cursor >= self.steps_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch``; the cursor resets only when the epoch changes, so calling it
        again for the current epoch (e.g. after loading a mid-epoch state) keeps progress."""
        epoch = _as_int(epoch, "epoch")
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self.epoch:
            self.epoch = epoch
            self.cursor = self.base = self.offset = 0

    def _check_step(self, step) -> None:
        step = _as_int(step, "step")
        if not self.base <= step < self.steps_per_epoch:
            raise ValueError(f"step {step} out of range: the epoch's steps with this global batch "
                             f"are {self.base}..{self.steps_per_epoch - 1}")

    # -- checkpointing -------------------------------------------------------------------

    _CONFIG = ("dataset_len", "base_global_batch", "micro_batch", "seed", "shuffle", "drop_last")

    def state_dict(self) -> dict:
        """Plain ints/bools/lists only, so it survives ``json``."""
        return {
            "version": _STATE_VERSION,
            "dataset_len": self.dataset_len,
            "base_global_batch": self.base_global_batch,
            "global_batch": self.global_batch,
            "base": self.base,
            "offset": self.offset,
            "micro_batch": self.micro_batch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "members": list(self.members),
            "allocation": list(self.allocation),
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore epoch, cursor and allocation; the configuration must match this sampler's
        (a different dataset or batch size would silently change the trajectory)."""
        if not isinstance(state, Mapping):
            raise ValueError(f"sampler state must be a dict, got {type(state).__name__}")
        missing = [k for k in (*self._CONFIG, "version", "epoch", "cursor", "members", "allocation",
                               "global_batch", "base", "offset") if k not in state]
        if missing:
            raise ValueError(f"sampler state is missing {missing}")
        if state["version"] != _STATE_VERSION:
            raise ValueError(f"sampler state version {state['version']!r} is not {_STATE_VERSION}")
        for key in self._CONFIG:
            if state[key] != getattr(self, key) or type(state[key]) is not type(getattr(self, key)):
                raise ValueError(
                    f"sampler state has {key}={state[key]!r} but this sampler has "
                    f"{key}={getattr(self, key)!r}"
                )
        epoch = _as_int(state["epoch"], "epoch")
        cursor = _as_int(state["cursor"], "cursor")
        gb, base, offset = (_as_int(state[k], k) for k in ("global_batch", "base", "offset"))
        if epoch < 0:
            raise ValueError(f"sampler state has epoch={epoch} < 0")
        if gb <= 0 or gb % self.micro_batch or gb > self.base_global_batch:
            raise ValueError(f"sampler state has global_batch={gb}: not a positive multiple of "
                             f"micro_batch {self.micro_batch} up to {self.base_global_batch}")
        if not (0 <= base <= cursor and 0 <= offset <= self.dataset_len):
            raise ValueError(f"sampler state has base={base}, offset={offset}, cursor={cursor}: inconsistent")
        probe = ElasticSampler(self.dataset_len, self.base_global_batch, self.micro_batch,
                               drop_last=self.drop_last)
        probe.global_batch, probe.base, probe.offset = gb, base, offset
        if not cursor <= probe.steps_per_epoch:
            raise ValueError(f"sampler state has cursor={cursor} outside [0, {probe.steps_per_epoch}]")
        if not isinstance(state["members"], list) or not isinstance(state["allocation"], list):
            raise ValueError("sampler state members/allocation must be lists")
        if state["members"] or state["allocation"]:
            # Validate on a scratch copy so a bad state leaves this sampler untouched.
            probe.set_allocation(state["members"], state["allocation"])
            members, allocation = probe.members, probe.allocation
        else:
            members, allocation = (), ()
        self.members, self.allocation = members, allocation
        self.global_batch, self.base, self.offset = gb, base, offset
        self.epoch, self.cursor = epoch, cursor

    @classmethod
    def from_state_dict(cls, state: Mapping) -> "ElasticSampler":
        try:
            s = cls(
                state["dataset_len"], state["base_global_batch"], state["micro_batch"],
                seed=state["seed"], shuffle=state["shuffle"], drop_last=state["drop_last"],
            )
        except KeyError as e:
            raise ValueError(f"sampler state is missing {e.args[0]!r}") from None
        s.load_state_dict(state)
        return s

    def __repr__(self) -> str:
        return (
            f"ElasticSampler(n={self.dataset_len}, B={self.global_batch}, mb={self.micro_batch}, "
            f"epoch={self.epoch}, cursor={self.cursor}/{self.steps_per_epoch}, "
            f"allocation={dict(zip(self.members, self.allocation))})"
        )


class ElasticBatchSampler:
    """``batch_sampler`` yielding ``member``'s micro-batch index lists from the cursor on.

    Each ``iter()`` snapshots the cursor and allocation, so an old iterator never sees a
    new allocation half-way: after a reconfiguration, commit, ``set_allocation`` and create a
    fresh DataLoader iterator.  ``schedule()`` gives the same micro-batches as ``MicroBatch``
    records (step, slot, weight) in the same order, so a loop can tell where a step ends and
    how to weight each loss -- a member may have a different number of micro-batches per step.
    """

    def __init__(self, sampler: ElasticSampler, member: int) -> None:
        self.sampler = sampler
        self.member = _as_int(member, "member id")

    def schedule(self) -> list[MicroBatch]:
        s = self.sampler
        if self.member not in s.members:
            raise ValueError(f"unknown member {self.member!r}; current members are {s.members}")
        members, counts = s.members, s.allocation
        return [
            mb
            for t in range(s.cursor, s.steps_per_epoch)
            for mb in s._plan(t, members, counts)[self.member]
        ]

    def __iter__(self) -> Iterator[list[int]]:
        s = self.sampler
        if self.member not in s.members:
            raise ValueError(f"unknown member {self.member!r}; current members are {s.members}")
        return self._generate(s.cursor, s.steps_per_epoch, s.members, s.allocation, s.epoch)

    def _generate(self, start, stop, members, counts, epoch) -> Iterator[list[int]]:
        s = self.sampler
        for t in range(start, stop):
            if s.epoch != epoch:
                raise RuntimeError(
                    "the sampler's epoch changed under a live iterator; create a new iterator"
                )
            for mb in s._plan(t, members, counts)[self.member]:
                yield list(mb.indices)

    def __len__(self) -> int:
        s = self.sampler
        if self.member not in s.members:
            return 0
        return len(self.schedule())


def seed_generators(seed: int) -> None:
    """Seed the CPU generator (and CUDA's, once initialised).  Not ``torch.manual_seed``: for a
    backend not yet initialised it records a formatted stack trace per call (cuda, mtia, xpu),
    about 0.5 ms each -- too much once per micro-batch."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():  # (initialised implies available)
        torch.cuda.manual_seed_all(seed)
