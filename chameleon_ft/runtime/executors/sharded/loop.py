"""``LoopShardedExecutor``: the sharded executor driven by a loop that is the user's
(``accelerate_ft`` with an FSDP2 plugin, and through it the HF ``Trainer`` with ``fsdp=``).

It speaks the item protocol of ``DataParallelExecutor`` that ``accelerate_ft.StepProtocol``
drives -- ``items(n)``, ``backward(loss, item, tokens)``, ``sync_and_step()``,
``last_loss_tensor``, ``last_grad_norms`` -- on ``ShardedExecutor``'s model, rows, snapshots
and recovery, with what a sharded step needs on top:

* **Every member runs the same passes.**  FSDP's all-gathers and reduce-scatters pair up
  across members, so a member's share of a step is always ``n`` items (merged micro-batches;
  a member with fewer runs *ghosts*: a real sample whose loss is weighted by zero), and a
  step a failure interrupted is redone as ``n`` items on every member too.
* **A failure inside the user's forward/backward raises nothing** (``FsdpComms.give_way``):
  the loop goes on to its ``optimizer.step()``, where the step is recovered and redone.
* **The units** are the modules the user's wrap policy names (Accelerate's
  ``transformer_cls_names_to_wrap``, a model's ``_no_split_modules``), deepest first, and the
  root, sharded again on every generation's mesh from the template.
* **Token weighting and the gradient norm ride in the commit's all-reduce**: each member's
  token count and the squared norm of its gradient rows are summed with the loss, so the
  update divides by the global batch's tokens and clipping uses the global norm, with no
  collective of their own (an adopting member gets them with the state).
* **The whole model** (``refresh_model``): the user's unsharded model object is kept as the
  copy that evaluations and saves see; gathered from the rows (a collective) when asked,
  once per committed step.

Limits: as ``ShardedExecutor`` (FULL_SHARD/SHARD_GRAD_OP over all members, no HSDP); the
gradients are reduce-scattered after every item (no ``no_sync`` accumulation); the 2-norm
only; the unsharded model object stays in memory (it is the evaluation and saving copy).
"""

from __future__ import annotations

import copy
import math
import time
from typing import Callable, Iterator, Optional, Sequence

import torch

from chameleon_ft.runtime.executors.sharded.executor import ShardedExecutor
from chameleon_ft.runtime.sampler import StepItem, step_items

__all__ = ["LoopShardedExecutor"]


class LoopShardedExecutor(ShardedExecutor):
    """See module doc.  ``units``: names of the submodules sharded as units of their own
    (any order; the root always is one); ``reshard_after_forward``: FSDP2's (True: FULL_SHARD)."""

    # The adapters run control collectives (gather, barriers) between two steps: the commit
    # carries its header so that a stray one gives way.
    step_header = "step"
    update_fn: Optional[Callable[[], None]] = None  # the adapter's optimizer update (None: step())

    def __init__(self, model: torch.nn.Module, optimizer, *args, units: Sequence[str] = (),
                 reshard_after_forward: bool = True, **kwargs) -> None:
        # deepest first: a generation shards inner units before outer ones
        self._unit_names = sorted(set(units), key=lambda n: -n.count("."))
        self._reshard = bool(reshard_after_forward)
        super().__init__(model, optimizer, *args, **kwargs)
        self.training = True  # the mode a new generation's module starts in
        self._loss_sum: Optional[torch.Tensor] = None
        self._tokens = 0.0
        self._last_loss: Optional[float] = None
        self.last_grad_norms: list[float] = []
        self.grad_norm: Optional[float] = None  # the committed step's global gradient 2-norm
        self._refreshed: Optional[tuple] = None  # (step, generation) the model object holds
        self._spilled: list = []  # the step's surplus micro-batches (None: a ghost pass)
        self._whole: Optional[tuple] = None  # ((step, generation), the optimizer's whole state)

    # ---------------------------------------------------------------- the model
    def _make_module(self, mesh) -> torch.nn.Module:
        module = copy.deepcopy(self._template)
        for name in self._unit_names:
            self._fully_shard(module.get_submodule(name), mesh=mesh, reshard_after_forward=self._reshard)
        self._fully_shard(module, mesh=mesh, reshard_after_forward=self._reshard)
        module.to_empty(device=self.device)
        module.train(self.training)
        return module

    def refresh_model(self) -> torch.nn.Module:
        """The user's unsharded model object holding the committed weights and buffers
        (gathered from the rows: a collective, every member at the same point; nothing when it
        already holds this step's)."""
        if self._refreshed != self._key():
            self._into_model(self.full_parameters())
            self._refreshed = self._key()
        return self.model

    def whole_state(self) -> tuple[torch.nn.Module, dict]:
        """``refresh_model()`` and the optimizer's whole state in torch's format (a collective,
        once per committed step: a checkpoint)."""
        if self._whole is None or self._whole[0] != self._key():
            params, optim = self.full_state()
            self._into_model(params)
            self._refreshed = self._key()
            self._whole = (self._key(), optim)
        return self.model, self._whole[1]

    def load_whole(self, optim: Optional[dict]) -> None:
        """The weights the caller loaded into the user's model object (a checkpoint, the best
        model), and the optimizer's whole state (None: none), into this member's rows (no
        collective)."""
        self.load_full_state({n: p.detach() for n, p in self.model.named_parameters()}, optim)
        self._refreshed, self._whole = self._key(), None

    def _key(self) -> tuple:
        return (self.step, self.view.token if self.view is not None else None)

    # ---------------------------------------------------------------- the step's items
    def items(self, n_items: Optional[int], spill: Optional[Callable[[int], bool]] = None) -> Iterator[StepItem]:
        """This member's share of the step as ``n_items`` items.  A share larger than that is
        merged into them or, when ``spill(0)`` and ``spill(1)`` (the adapter can compute
        micro-batches itself), run as one micro-batch per item with the surplus left for
        ``spilled()`` -- each micro-batch then keeps its own seed, as without a failure.
        ``spill(1)`` is asked after the first item ran (its backward may have taught the
        adapter how): when ``spill(0)`` held and ``spill(1)`` does not, the first item was one
        micro-batch and the rest of the share is merged into the other items.  Every member
        runs the same number of passes (module doc) whenever ``spill(1)``, asked after the first
        item, answers alike on every member.  During them a failed collective gives way
        (``FsdpComms.give_way``)."""
        if self._step_start is None:
            self._step_start = time.perf_counter()
            self._compute_s, self._ids, self._loss_sum, self._tokens = 0.0, [], None, 0.0
            self.faults.at(self.step, "step_start")
        share = self.sampler.local_microbatches(self.worker_id)
        self._n_mb = len(share)
        self.comms.give_way = True
        self._spilled = []
        most = max(len(self.sampler.local_microbatches(w)) for w in self.members)
        if n_items is None or most <= n_items or spill is None or not spill(0):
            yield from self._run(step_items(share, n_items))
            return
        # The first item is one micro-batch (or a ghost); the rest follows what spill(1) says
        # once it ran.  (``_spilled`` is set before the items it follows: a loop takes exactly
        # n_items of them and never reaches the generator's end.)
        self._spilled = share[n_items:] + [None] * (most - max(len(share), n_items))
        yield from self._run(step_items(share[:1], 1))
        if n_items == 1:
            return
        rest = share[1:]
        if not spill(1):
            self._spilled = []
            yield from self._run(step_items(rest, n_items - 1))
            return
        own = [step_items([mb], 1)[0] for mb in rest[:n_items - 1]]
        ghosts = n_items - 1 - len(own)
        yield from self._run(own + (step_items([], ghosts) if ghosts else []))

    def _run(self, items) -> Iterator[StepItem]:
        for item in items:
            self._before_item(item)
            t0 = time.perf_counter()
            yield item
            self._compute_s += time.perf_counter() - t0
            if self.cfg.log_samples:
                self._ids.extend(item.indices)

    def spilled(self) -> Iterator[StepItem]:
        """The surplus ``items`` left, one micro-batch a pass, then the ghosts that bring this
        member to the passes of the member with the most."""
        todo, self._spilled = self._spilled, []
        yield from self._run([step_items([mb], 1)[0] if mb is not None else step_items([], 1)[0] for mb in todo])

    def microbatches(self):
        return iter(())  # (a user's loop runs items: module doc)

    def unspill(self) -> list[int]:
        return []

    def backward(self, loss: torch.Tensor, item: Optional[StepItem], tokens=None, **kwargs) -> None:
        """Back-propagate ``loss`` (the item's mean loss) weighted by its sample share, or by
        ``tokens`` (its item count: a token-weighted step); a ghost (``item`` None or empty)
        by zero -- its pass runs FSDP's collectives for the others."""
        self.faults.at(self.step, "backward")
        ghost = item is None or getattr(item, "ghost", False)
        scaled = loss * (0.0 if ghost else self._token_weight(item, tokens))
        if not ghost:
            part = scaled.detach()
            self._loss_sum = part if self._loss_sum is None else self._loss_sum + part
        scaled.backward(**kwargs)

    def sync_and_step(self) -> bool:
        """Commit the step (``update_fn``: the optimizer update, after the gradients were divided
        by the step's tokens); False when a failure interrupted it (recovered: redo)."""
        if self._step_start is None:
            self._step_start = time.perf_counter()
        t0 = self._step_start
        failure = self.comms.failure if self.comms is not None else None
        if self.comms is not None:
            self.comms.give_way = False
        if failure is not None:  # a collective of the forward/backward gave way
            return self.interrupted(failure, t0)
        loss = float(self._loss_sum) if self._loss_sum is not None else 0.0
        sq = float(sum(p.grad.to_local().double().pow(2).sum() for p in self.shard_params if p.grad is not None))
        done = self.commit(loss, t0, self._n_mb, list(self._ids), update=self._update_with,
                           tokens=float(self._tokens), extra=[sq / self.layout.replicas])
        self._loss_sum, self._tokens = None, 0.0
        return done

    def _update_with(self) -> None:
        tokens, sq = self.commit_sums[0], self.commit_sums[1]
        self.grad_norm = math.sqrt(max(0.0, sq)) / (tokens if tokens > 0 else 1.0)
        if self.update_fn is not None:
            self.update_fn()
        else:
            self.optimizer.step()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their global 2-norm is at most ``max_norm`` (the norm is
        the commit's: call it inside the update); returns the norm before clipping."""
        norm = self.grad_norm or 0.0
        coef = float(max_norm) / (norm + 1e-6)
        if coef < 1.0:
            with torch.no_grad():
                for p in self.shard_params:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        return torch.tensor(norm)

    def _after_commit_sharded(self, loss: float, snap_cost: float) -> None:
        self._last_loss = loss
        super()._after_commit_sharded(loss, snap_cost)

    @property
    def last_loss(self) -> Optional[float]:
        """The global batch's mean loss of the last committed step (the same on every member)."""
        return self._last_loss

    @property
    def last_loss_tensor(self) -> Optional[torch.Tensor]:
        return None if self._last_loss is None else torch.tensor(self._last_loss, dtype=self.dtype)

    def _discard(self) -> None:
        super()._discard()
        self._loss_sum, self._tokens = None, 0.0
        if self.comms is not None:
            self.comms.failure = None

    def state_dict(self) -> dict:
        return {**super().state_dict(), "last_loss": self._last_loss, "last_grad_norms": list(self.last_grad_norms),
                "grad_norm": self.grad_norm}

    def load_state_dict(self, s: dict) -> None:
        super().load_state_dict(s)
        self._last_loss = s.get("last_loss", self._last_loss)
        self.last_grad_norms = [float(v) for v in s.get("last_grad_norms", [])]
        self.grad_norm = s.get("grad_norm", self.grad_norm)
