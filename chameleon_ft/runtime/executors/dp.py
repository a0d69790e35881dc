"""``DataParallelExecutor``: the data-parallel executor on the shared recovery core.

A framework-agnostic core that the trainer and the Lightning/Accelerate adapters wrap::

    ctx = DataParallelExecutor(model, optimizer, len(dataset), global_batch=32, micro_batch=4)
    ctx.start()                                   # join, form the group, get the state
    while ctx.epoch < epochs:
        for mb in ctx.microbatches():             # this member's share of the current step
            loss = loss_fn(model, batch(mb.indices))
            ctx.backward(loss, mb)                # (loss * mb.weight).backward()
        ctx.sync_and_step()                       # all-reduce + commit, or recover and redo

A step: compute the member's micro-batches (gradients weighted by their share of the global
batch's samples); during the last one's backward the gradients are all-reduced in buckets as
they become final (``buckets.py``, DDP's scheme on the live generation's group), the last
bucket after backward with the step's loss and the members' timings in its tail; then the
update.  Nothing on that path reads the device (there the loss stays a tensor until someone
looks: ``last_loss``; gradients on the host bring it as a number with the tail's one read);
the one wait is the reduction's completion, the commit point.
The commit protocol, recovery and Decisions are the core's (``recovery.py``); this module adds
the micro-batch loop, the loop-shaped items of the adapters, and the salvage of an interrupted
step (only the dead members' micro-batches are recomputed).

Limits, honestly: the model is a replica per worker (no sharding).
"""

from __future__ import annotations


import logging
import time
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from chameleon_ft.engine.plan import even_split
from chameleon_ft.runtime.errors import Diverged
from chameleon_ft.runtime.executors.buckets import GradientBuckets
from chameleon_ft.runtime.recovery import _TAIL, RecoveryCore
from chameleon_ft.runtime.hyperparams import group_hyperparams, restore_group_hyperparams, scale_lr
from chameleon_ft.runtime.sampler import MicroBatch, StepItem, step_items

log = logging.getLogger(__name__)

__all__ = ["DataParallelExecutor"]

# The salvage's report of the slots a member computed, carried in the recovery all-reduce
# (``recovery_fields``): a first word (1: slots follow, 0: none, -1: more slots than fit) and
# this many words of _SLOT_BITS slots each.
_SLOT_WORDS, _SLOT_BITS = 4, 62


def _pack_slots(slots: list[int]) -> list[int]:
    words = [0] * _SLOT_WORDS
    for j in slots:
        words[j // _SLOT_BITS] |= 1 << (j % _SLOT_BITS)
    return words


def _unpack_slots(words: list[int], n: int) -> list[int]:
    """The slots below ``n`` whose bits ``_pack_slots`` set."""
    return [j for j in range(n) if words[j // _SLOT_BITS] >> (j % _SLOT_BITS) & 1]


class DataParallelExecutor(RecoveryCore):
    """Data-parallel training that survives failures in place (see module doc)."""

    # Every worker holds the whole model: any plan over the survivors is an allocation of
    # micro-batches, so every data policy of the engine can be carried out.
    POLICIES = frozenset({"reroute", "replan", "shrink", "wait", "restart", "keep", "rebalance",
                          "heal", "grow"})

    # The step's all-reduce carries no header (one collective per step, as DDP): between two
    # steps the members run nothing else unless an adapter offers the user control
    # collectives (metric syncs, barriers), which must then give way to the step
    # (``control_collectives=True``: the adapters pass it; groups.py, "Collective headers").
    step_header = None
    reduces_in_buckets = True  # during backward (executors/buckets.py): GroupManager.data_group

    def __init__(self, *args, control_collectives: bool = False, **kwargs):
        if control_collectives:
            # Its header travels beside the last bucket; the buckets go on a group of their own
            # (GroupManager.data_group), so a control collective never meets one.
            self.step_header = "step"
        super().__init__(*args, **kwargs)
        self.buckets = GradientBuckets(self.params, self.cfg.bucket_cap_mb, compress=self.cfg.grad_compression,
                                       release=self.cfg.gradient_as_bucket_view)
        self._loss_sum: Optional[torch.Tensor] = None  # this member's losses of the step, times _loss_w
        self._loss_w = 1.0
        self._seeds: dict = {}  # backward's starting gradients by (weight, dtype, device)
        self._tokens = 0.0  # this member's token count of the step (token-weighted losses)
        self._last_loss: Optional[torch.Tensor | float] = None
        # Slots of the current step whose gradients this member holds (kept across a failed
        # all-reduce), and the slots it still has to compute when a failure interrupted it.
        self._done_slots: list[int] = []
        self._redo_slots: Optional[list[int]] = None
        self._spilled: list[MicroBatch] = []  # see items(spill=True)
        self._home_slots: Optional[frozenset] = None  # slots of this member under its first allocation
        self.last_grad_norms: list[float] = []  # an adapter's clipping norms of that step
        self._groups_at_commit: Optional[list] = None  # runtime/hyperparams.py
        self._fields_batch: Optional[int] = None  # the global batch when recovery_fields reported
        self._factors: dict = {}  # _write_tail's factors of the loss, (w, 0), by (w, dtype)

    def reset_step(self) -> None:
        self._done_slots, self._redo_slots = [], None
        self._loss_sum, self._tokens = None, 0.0
        self.buckets.disarm()

    @property
    def last_loss(self) -> Optional[float]:
        """The global batch's mean loss of the last committed step, the same on every member
        (reduced with the gradients); None until one is known.  Reading it waits for the
        device where the gradients are on one (``last_loss_tensor`` does not); on the host it
        is already a number."""
        if isinstance(self._last_loss, torch.Tensor):
            self._last_loss = float(self._last_loss)
        return self._last_loss

    @last_loss.setter
    def last_loss(self, value: Optional[float]) -> None:
        self._last_loss = value

    @property
    def last_loss_tensor(self) -> Optional[torch.Tensor]:
        """``last_loss`` as a 0-dim tensor on the gradients' device (no host read)."""
        v = self._last_loss
        return v if isinstance(v, torch.Tensor) or v is None else torch.tensor(v, dtype=self.dtype)

    def state_dict(self) -> dict:
        # The last step's loss and clipping norms travel with the state: a member that adopts a
        # step its peers committed never saw them, and its loop logs them (the HF Trainer's
        # ``loss`` and ``grad_norm``); so do the optimizer's hyperparameters as at that commit
        # (runtime/hyperparams.py: a framework's own scheduler step may have moved them since).
        groups = self._groups_at_commit if self._groups_at_commit is not None else group_hyperparams([self.optimizer])
        return {**super().state_dict(), "last_loss": self.last_loss, "last_grad_norms": list(self.last_grad_norms),
                "groups_at_commit": groups}

    def replicated_state(self) -> Optional[dict]:
        """The parameters (every replica applies the same reduced gradients) and the
        optimizer's state; the model's buffers are each replica's own (not reduced: they go
        from the source)."""
        params = {name for name, _ in self.model.named_parameters()}
        return {"model": {k: v for k, v in self.model.state_dict().items() if k in params},
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, s: dict) -> None:
        super().load_state_dict(s)  # the optimizer's state, then the scheduler's
        self.last_loss = s.get("last_loss", self.last_loss)
        self.last_grad_norms = [float(v) for v in s.get("last_grad_norms", [])]
        if s.get("groups_at_commit") is not None:
            restore_group_hyperparams([self.optimizer], s["groups_at_commit"])
            self._groups_at_commit = group_hyperparams([self.optimizer])

    def _apply_lr_scale(self) -> None:
        before = self.lr_scale
        super()._apply_lr_scale()
        if self._groups_at_commit is not None and self.lr_scale != before:
            scale_lr(self._groups_at_commit, self.lr_scale / before)

    def recovery_fields(self) -> list[int]:
        """The slots of its current step whose gradients this member holds (``_salvage``): one
        bit each, so that they travel in the recovery's all-reduce instead of one of their own."""
        self._fields_batch = self.sampler.global_batch
        mine = self._done_slots if self.holds_gradients else []
        if not mine:
            return [0] * (1 + _SLOT_WORDS)
        if max(mine) >= _SLOT_WORDS * _SLOT_BITS:
            return [-1] + [0] * _SLOT_WORDS
        return [1] + _pack_slots(mine)

    def carry_out(self, payload: dict, top: int, n: int, r: int) -> None:
        self._salvage(top, n, r)

    # ---------------------------------------------------------------- one step
    def microbatches(self) -> Iterator[MicroBatch]:
        """This member's micro-batches of the current step (possibly none), in slot order.

        Before each one: the fault injector's ``forward`` hook and, with
        ``seed_microbatches``, a per-(step, slot) seed."""
        for item in self.items(None):
            yield item.parts[0]

    def items(self, n_items: Optional[int],
              spill: Optional[Callable[[int], bool]] = None) -> Iterator[StepItem]:
        """This member's share of the current step as ``n_items`` items (``sampler.step_items``:
        merged micro-batches, parts of one, or ghosts), for adapters whose loop is the user's
        and must make the same number of iterations per step whatever the share; ``None``:
        one item per micro-batch.

        ``spill(i)``, asked before item ``i`` when the share is larger than ``n_items``: True
        makes that item one micro-batch and leaves the surplus for ``spilled()`` (an adapter
        that can compute it itself, inside the step); False merges the rest evenly into the
        remaining items.  Before each item: the ``forward`` fault hook and the per-(step, slot)
        seed of its first micro-batch; after it, its completed slots count as computed (kept
        across a failed all-reduce)."""
        if self._step_start is None:
            self._step_start = time.perf_counter()
            if self._redo_slots is None:
                self._compute_s, self._n_mb, self._ids, self._done_slots = 0.0, 0, [], []
            self.faults.at(self.step, "step_start")
        todo = self.pending_microbatches()
        self._redo_slots = None
        self._spilled = []
        if self._home_slots is None:  # the first step this member runs: its launch share
            self._home_slots = frozenset(mb.index for mb in self.sampler.local_microbatches(self.worker_id))
        if spill is None or n_items is None or len(todo) <= n_items:
            yield from self._run(step_items(todo, n_items), last=True)
            return
        # The member's own slots first: its loop then sees the items it would have seen without
        # the failure, and the adopted micro-batches are the surplus.
        todo.sort(key=lambda mb: (mb.index not in self._home_slots, mb.index))
        for i in range(n_items):
            left = n_items - i
            take = 1 if spill(i) else (len(todo) if left == 1 else -(-len(todo) // left))
            group, todo = todo[:take], todo[take:]
            yield from self._run(step_items(group, 1), last=i == n_items - 1 and not todo)
        self._spilled = todo

    def spilled(self) -> Iterator[MicroBatch]:
        """The micro-batches ``items(..., spill=True)`` left over, one at a time (seeded and
        counted like the items)."""
        todo, self._spilled = self._spilled, []
        for item in self._run(step_items(todo, None), last=True):
            yield item.parts[0]

    def unspill(self) -> list[int]:
        """Hand the surplus left by ``items(..., spill=...)`` back as slots still to compute in
        this step (the next ``items()``/``microbatches()`` yields them); returns them."""
        slots, self._spilled = [mb.index for mb in self._spilled], []
        if slots:
            self._redo_slots = slots
        return slots

    def _run(self, items: list[StepItem], last: bool) -> Iterator[StepItem]:
        """Yield ``items``; with ``last`` (nothing more of this step follows them on this member)
        the buckets are armed before the last one that computes: its backward reduces."""
        final = None
        if last:  # the last item that is not a ghost
            for k in range(len(items) - 1, -1, -1):
                if not items[k].ghost:
                    final = k
                    break
        for k, item in enumerate(items):
            if k == final:
                self._arm()
            self._before_item(item)
            t0 = time.perf_counter()
            yield item
            self._compute_s += time.perf_counter() - t0
            self._n_mb += len(item.completes)
            self._done_slots.extend(item.completes)
            if self.cfg.log_samples:
                self._ids.extend(item.indices)

    @property
    def holds_gradients(self) -> bool:
        """This member holds gradients of the current step (micro-batches computed, or kept
        across a failed all-reduce for the redo: ``_salvage``).  Not after its buckets took the
        gradients (``gradient_as_bucket_view``): a failed reduction may have changed them."""
        return (bool(self._done_slots) and not self.buckets.released
                and any(p.grad is not None for p in self.params))

    def pending_microbatches(self) -> list[MicroBatch]:
        """What the next ``microbatches()`` yields: this member's share of the current step or,
        after a failure interrupted the step, only the orphaned slots it was given (adapters
        whose loop is the user's code need to know where a step ends)."""
        if self._redo_slots is not None:
            wanted = set(self._redo_slots)
            return [mb for mb in self.sampler.microbatches(self.sampler.cursor) if mb.index in wanted]
        return self.sampler.local_microbatches(self.worker_id)

    def backward(self, loss: torch.Tensor, mb: MicroBatch, tokens=None, **kwargs) -> None:
        """Accumulate ``loss`` (the micro-batch's mean loss) weighted by its sample share, or --
        with ``tokens``, the number of items ``loss`` is the mean over -- by its token count:
        the step's gradient is then the sum over the global batch's tokens divided by their
        number (``_token_weight``).  A step's micro-batches are weighted one way or the other.
        The weighted loss is added to the step's (a device op: nothing is read); ``kwargs`` go
        to ``Tensor.backward``.

        A sample-weighted scalar loss is not multiplied: backward starts from its weight
        instead of 1 (``gradient=``; the same gradients, bit for bit, as ``(loss * w).backward()``
        without the product and its backward node), and the loss is weighted where the commit's
        tail is written."""
        if tokens is not None or "gradient" in kwargs or loss.dim():
            self.weigh(loss, mb, tokens).backward(**kwargs)
            return
        loss = self._nan_fault(loss)
        self.faults.at(self.step, "backward")
        w = self._token_weight(mb)
        self._add_loss(loss.detach(), w)
        key = (w, loss.dtype, loss.device)
        seed = self._seeds.get(key)
        if seed is None:  # a fill on the loss's device: nothing crosses from the host
            seed = self._seeds[key] = torch.full((), w, dtype=loss.dtype, device=loss.device)
        loss.backward(gradient=seed, **kwargs)

    def weigh(self, loss: torch.Tensor, mb: MicroBatch, tokens=None) -> torch.Tensor:
        """``RecoveryCore.weigh``, the ``nan`` fault, and the weighted loss added to the step's
        (what the commit's non-finite check reads)."""
        scaled = super().weigh(self._nan_fault(loss), mb, tokens)
        self._add_loss(scaled.detach(), 1.0)
        return scaled

    def _nan_fault(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss``, or NaN where the ``nan`` fault fires at this step's backward (a test's bad batch)."""
        if self.faults and self.faults.fires(self.step, "backward", "nan"):
            return loss * float("nan")
        return loss

    def _add_loss(self, part: torch.Tensor, w: float) -> None:
        """Add ``part * w`` to the step's loss; the first one's weight is applied where the
        tail is written (``_loss_w``), so that a member's one micro-batch costs no product here."""
        if self._loss_sum is None:
            self._loss_sum, self._loss_w = part, w
            return
        total = self._loss_sum if self._loss_w == 1.0 else self._loss_sum * self._loss_w
        self._loss_sum, self._loss_w = total + (part if w == 1.0 else part * w), 1.0

    def _arm(self) -> None:
        """The coming backward is this member's last of the step: its gradients are reduced in
        buckets as they become final; the step header (control collectives on) is posted now."""
        if self.buckets.armed:
            return
        # The tail: the loss, the tokens, then (gradients on the CPU: in the same buffer) every
        # member's timings.
        on_host = not (self.params and self.params[0].is_cuda)
        self.buckets.set_tail(2 + (_TAIL * self.view.world_size if on_host else 0))
        self.buckets.arm(self.gm.start_reduce, self.view.world_size)

    def sync_and_step(self) -> bool:
        """Reduce the accumulated gradients and commit the step.

        Returns True when the step committed; False when a failure interrupted it: the
        gradients were discarded, the job reconfigured, and the caller simply runs the (same
        or next) step again with ``microbatches()``."""
        if self._step_start is None:  # a member that had nothing to do this step
            self._step_start = time.perf_counter()
            if self._redo_slots is None:
                self._compute_s, self._n_mb, self._ids = 0.0, 0, []
            self._redo_slots = None
        self.faults.at(self.step, "allreduce")
        self._arm()  # (no-op when the last backward was armed)
        buckets = self.buckets
        tail = buckets.tail()
        on_host = buckets.tail_len > 2  # the timings ride in the tail: the gradients are on the host
        words = buckets.tail_words() if on_host else None
        if words is not None and not isinstance(self._tokens, torch.Tensor):
            self._write_tail(words)
        else:
            self._write_tail_ops(tail)
        host_tail = None

        def reduce() -> None:
            nonlocal host_tail
            # Posted here, after everything the member's loop ran in this step (a control
            # collective inside it pairs with its peers' before it), and settled after the
            # buckets: it travels while the last bucket does.  Only until a step of the
            # generation agreed (``GroupManager.step_aligned``).
            posted = (self.gm.post_header("step", label="buckets", arg=len(buckets))
                      if self.step_header is not None and not self.gm.step_aligned() else None)
            # The attempt's record with its sample ids is written before the last bucket
            # leaves: no peer can commit this member's samples before it exists, even if this
            # process is killed the next instant (gloo's own thread would finish the op
            # without it).  Without ids (the default) it is written while the buckets travel.
            ids = self.cfg.log_samples
            if ids:
                self._log_attempt()
            try:
                buckets.launch_rest()
            finally:  # (a launch that failed is an attempt too)
                if not ids:
                    self._log_attempt()
            # While the buckets travel: the next step's micro-batches (the sampler's cache).
            self.sampler.warm(self.worker_id, self.sampler.cursor + 1)
            buckets.wait_all(lambda handle: self.gm.wait_reduce(handle, self.hang_timeout_s))
            if posted is not None:
                self.gm.settle_header(posted, self.hang_timeout_s)
            if not on_host:  # the gradients on a device: the timings go over gloo, on the host
                host_tail = torch.zeros(_TAIL * self.view.world_size, dtype=torch.float64)
                r = self.view.rank
                host_tail[_TAIL * r:_TAIL * (r + 1)] = torch.tensor(self._tail_row(self._compute_s))
                self.gm.allreduce(host_tail, dist.ReduceOp.SUM, timeout_s=self.hang_timeout_s, copy=False)

        comm = self._commit_attempt(reduce, logged=True)
        if comm is None:
            buckets.disarm()  # (a failure before the buckets' finish: the header, a drop)
            return False  # this member's gradients are kept for the redone step (see _salvage)
        self._loss_sum = None
        if host_tail is None:  # on the host: the loss, the tokens and the timings in the step's one read
            (_, tokens), timing_rows = self._read_tail(tail if words is None else words, lead=2)
            denom = tokens if tokens > 0 else None
            if words is not None:  # the loss divided in the tail's dtype, as a tensor op would
                loss = float(words[0] if denom is None else words[0] / words.dtype.type(denom))
            else:
                loss = tail[0].clone() if denom is None else tail[0] / denom
        else:  # on a device: no read; a sample-weighted step divides by 1
            timing_rows = self._read_tail(host_tail)[1]
            denom = tail[1:2].clamp(min=1).clone()
            loss = tail[0] / denom
        self._tokens = 0.0
        if self._nonfinite:  # nothing of the step is applied; the batch counts as consumed
            self._skip_nonfinite()
        else:
            self._nonfinite_run = 0
            self._last_loss = loss  # a tensor stays one until someone looks
            if denom is not None:
                buckets.divide(denom)
            buckets.assign_grads()
            self.faults.at(self.step, "optimizer")
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self._groups_at_commit = group_hyperparams([self.optimizer])
        self.optimizer.zero_grad(set_to_none=True)
        self._done_slots = []
        self._finish_step(timing_rows, comm)
        return True

    def _write_tail(self, words) -> None:
        """The commit's tail on the host (``words``: a numpy view of it): the tokens and every
        member's timings (ours set, the others zero) written as numbers; the loss, and its
        non-finite flag (loss * 0: 0, or NaN for a NaN or infinite loss), by one tensor op --
        nothing is read from the loss."""
        at = 2 + _TAIL * self.view.rank
        words.fill(0.0)
        words[1] = float(self._tokens)
        words[at:at + _TAIL] = self._tail_row(self._compute_s)
        if self._loss_sum is not None:
            pair = self.buckets.tail_pair(at + 5)
            key = (self._loss_w, pair.dtype)
            factors = self._factors.get(key)
            if factors is None:
                factors = self._factors[key] = torch.tensor([self._loss_w, 0.0], dtype=pair.dtype)
            torch.mul(self._loss_sum, factors, out=pair)

    def _write_tail_ops(self, tail: torch.Tensor) -> None:
        """``_write_tail`` by tensor ops: the gradients on a device (the tail then holds the loss
        and the tokens only), a dtype numpy has not, or the tokens a tensor.  On a device nothing
        crosses from the host: the loss is copied on the device and a token count that is a
        number is filled in as a kernel argument (a host tensor copied in would synchronise)."""
        if self._loss_sum is None:
            tail[0:1].zero_()
        elif self._loss_w == 1.0:
            tail[0:1].copy_(self._loss_sum.reshape(1))
        else:  # (the weight as a kernel argument)
            torch.mul(self._loss_sum.reshape(1), self._loss_w, out=tail[0:1])
        if isinstance(self._tokens, torch.Tensor):
            tail[1:2].copy_(self._tokens.reshape(1))
        else:
            tail[1:2].fill_(float(self._tokens))
        timings = tail[2:]
        if timings.numel():  # on the host: every member's timings, ours set
            r = self.view.rank
            row = [0.0] * timings.numel()
            row[_TAIL * r:_TAIL * (r + 1)] = self._tail_row(self._compute_s)
            timings.copy_(torch.tensor(row, dtype=timings.dtype))
            if self._loss_sum is not None:  # a NaN/inf loss flagged by one tensor op, nothing read:
                at = 2 + _TAIL * r + 5  # loss - loss is 0, or NaN when the loss was NaN or infinite
                torch.sub(tail[0:1], tail[0:1], out=tail[at:at + 1])

    def _skip_nonfinite(self) -> None:
        """Some member's loss was not finite (``_nonfinite``, read from the commit's tail: every
        member knows the same): the step's update is applied nowhere (the caller ends the step
        without ``optimizer.step()``).  The members whose loss it was record their micro-batches;
        the policy (``ElasticConfig.nonfinite``) stops the job, alike everywhere, at once or
        after ``nonfinite_limit`` such steps in a row (``Diverged``)."""
        bad, self._nonfinite = self._nonfinite, ()
        self._nonfinite_run += 1
        cfg = self.cfg
        stop = cfg.nonfinite == "stop" or self._nonfinite_run >= cfg.nonfinite_limit
        if self.log and (self.worker_id in bad or self.rank == 0):
            mine = {"microbatches": list(self._done_slots), **({"samples": list(self._ids)} if cfg.log_samples else {})}
            self.log.write("nonfinite", step=self.step, workers=list(bad), in_a_row=self._nonfinite_run,
                           action="stop" if stop else "skip", **(mine if self.worker_id in bad else {}))
        self._last_loss = float("nan")  # (what the step saw)
        what = (f"step {self.step}: the loss of worker(s) {list(bad)} was not finite (NaN or inf)"
                + (f", {self._nonfinite_run} steps in a row" if self._nonfinite_run > 1 else ""))
        if stop:
            raise Diverged(f"{what}; nothing of it was applied; the job stops (ElasticConfig.nonfinite="
                           f"{cfg.nonfinite!r}, nonfinite_limit={cfg.nonfinite_limit})")
        if self.rank == 0 or self.worker_id in bad:
            log.warning("%s: the step is skipped on every member (its update applied nowhere)", what)

    def _salvage(self, top: int, n: int, r: int) -> None:
        """Redo an interrupted step without recomputing what survivors already computed.

        Every member at the agreed step reports the slots whose gradients it still holds (in
        the recovery's all-reduce: ``recovery_fields``; a step of more than 248 slots in one
        small all-reduce of its own); the slots nobody holds -- the dead members' share -- are split over
        the members in order, and each member computes only its part before the all-reduce.
        The step's samples and their weights are unchanged, so the update is the one the
        failure-free run makes (up to summation order).  Members that adopted a committed step
        or hold nothing simply compute their part from zero."""
        mine = self._done_slots if (self.step == top and self.holds_gradients) else []
        covered = torch.zeros(self.sampler.num_microbatches, dtype=torch.int64)
        rows = self.peer_fields
        if self.sampler.global_batch != self._fields_batch:
            pass  # the agreed state changed the global batch: every member discards (nothing covered)
        elif all(len(row) == 1 + _SLOT_WORDS and row[0] >= 0 for row in rows):
            # The slots of the members at the agreed step (reported in the recovery all-reduce).
            for i, row in enumerate(rows):
                if row[0] == 1 and self.peer_steps[i] == top and not self.peer_fresh[i]:
                    covered[_unpack_slots(row[1:], len(covered))] = 1
        else:  # a step of more slots than the report holds: one all-reduce of its own
            if mine:
                covered[mine] = 1
            self._store_op(lambda: self.gm.allreduce(covered, dist.ReduceOp.SUM, timeout_s=self.hang_timeout_s))
        if not mine:
            self._discard()
        if not bool(covered.any()):
            self._discard()
            return
        slots = [mb.index for mb in self.sampler.microbatches(self.sampler.cursor)]
        orphans = [j for j in slots if covered[j] == 0]
        lo = 0
        for i, share in enumerate(even_split(len(orphans), n)):
            if i == r:
                self._redo_slots = orphans[lo:lo + share]
            lo += share
