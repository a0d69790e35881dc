"""``LossReplay``: recompute a micro-batch's loss inside ``optimizer.step()``, the way the
user's loop computed it, so that a step interrupted by a failure is redone without one more
iteration of the user's loop.

When a worker dies during a step, its micro-batches of that step must be computed by the
survivors on the step's weights before anyone moves on.  In a plain Accelerate loop the only
code that turns a batch into a loss is the user's loop body, so the adapter learns it from the
loop itself: a forward hook on the prepared model records each call (its arguments and output)
during a training item, and ``accelerator.backward(loss)`` checks two things --

* the loss is the model's own output, or its ``.loss`` / ``["loss"]`` / ``[0]`` (the
  HuggingFace convention: ``loss = model(**batch).loss``), possibly divided or multiplied by a
  constant in one operation (``loss = outputs.loss / gradient_accumulation_steps``), and
* every argument of that call *is* the item's batch or one of its entries (``model(**batch)``,
  ``model(batch)``, ``model(*batch)``, ``model(input_ids=batch["input_ids"], ...)``).

Then ``loss(model, batch)`` can recompute the loss of any other batch of the same shape of
data.  When the loss is computed outside the model (``criterion(model(x), y)``) or from a
transformed input, the recipe is unknown and the adapter falls back to redoing the step through
one more loop item (docs/accelerate.md says so).  Only identities are compared; nothing is
evaluated or unpickled.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

__all__ = ["LossReplay"]

_Path = tuple  # () the whole batch, (key,) an entry


def _entries(batch: Any):
    yield (), batch
    if isinstance(batch, Mapping):
        for k, v in batch.items():
            yield (k,), v
    elif isinstance(batch, (list, tuple)):
        for i, v in enumerate(batch):
            yield (i,), v


def _path_of(value: Any, batch: Any) -> Optional[_Path]:
    for path, v in _entries(batch):
        if v is value:
            return path
    return None


_ITEMS = ("#items",)  # the path of a call argument that is the batch's item count (``count_items``)


def _get(batch: Any, path: _Path, items: Any = None) -> Any:
    if path == _ITEMS:
        return items
    return batch[path[0]] if path else batch


_PICKS = (lambda out: out, lambda out: getattr(out, "loss", None),
          lambda out: out.get("loss") if isinstance(out, Mapping) else None,
          lambda out: out[0] if isinstance(out, (list, tuple)) and out else None)


def _picker(output: Any, loss: torch.Tensor) -> Optional[tuple[int, Optional[float]]]:
    """How ``loss`` was taken from ``output``: (index into ``_PICKS``: the output itself,
    ``.loss``, ``["loss"]``, ``[0]``; a constant factor when it was divided / multiplied by
    one, ``loss = outputs.loss / ga``)."""
    for i, pick in enumerate(_PICKS):
        try:
            got = pick(output)
        except Exception:
            continue
        if got is loss:
            return i, None
        scale = _scaled(got, loss)
        if scale is not None:
            return i, scale
    return None


def _scaled(base: Any, loss: torch.Tensor) -> Optional[float]:
    """``c`` when ``loss`` is ``base * c`` or ``base / c'`` computed in one autograd step."""
    if not isinstance(base, torch.Tensor) or base.grad_fn is None or loss.grad_fn is None:
        return None
    if type(loss.grad_fn).__name__ not in ("DivBackward0", "DivBackward1", "MulBackward0", "MulBackward1"):
        return None
    if not any(fn is base.grad_fn for fn, _ in loss.grad_fn.next_functions):
        return None
    b = float(base.detach())
    return float(loss.detach()) / b if b != 0.0 and base.numel() == 1 else None


class LossReplay:
    """Learns how the user's loop computes a training loss from a batch (see module doc)."""

    def __init__(self) -> None:
        self._call: Optional[tuple] = None
        self.recipe: Optional[tuple] = None  # (arg paths, kwarg paths, picker)
        self.seen = False  # a backward was checked (so ``recipe is None`` means: none)
        self.replaying = False
        # ``count_items(batch)``: the batch's item count, as the loop gave it to backward
        # (``num_items``) and to the model call (the HF Trainer's ``num_items_in_batch``); set by
        # a wrapper that knows the rule.  Without it a counted loss has no recipe.
        self.count_items = None

    @property
    def ready(self) -> bool:
        return self.recipe is not None

    def spill(self, i: int, n_items: int) -> bool:
        """Whether item ``i`` of ``n_items`` should be one micro-batch, the surplus left for
        ``loss()`` inside the step: yes with a recipe; before the first backward (recipe not
        known yet), yes for the first item (it teaches the recipe: merged, a surplus micro-batch
        would run with the first one's seed and random layers would differ from where the
        loop runs it; when no recipe is learnt, the step hands the surplus back and runs it
        as one more loop item, said once), no otherwise."""
        if self.recipe is not None:
            return True
        return not self.seen and i == 0

    def on_forward(self, args: tuple, kwargs: dict, output: Any, batch: Any) -> None:
        """A forward call of the trained model during an item whose batch is ``batch``."""
        if not self.replaying:
            self._call = (args, kwargs, output, batch)

    def on_backward(self, loss: torch.Tensor, items: Any = None) -> None:
        """``accelerator.backward(loss)``: keep the recipe if ``loss`` came from the last call.
        ``items``: the item count the loop gave with it; replayed by ``count_items`` (a call
        argument that *is* it becomes that count), or without it no recipe."""
        call, self._call = self._call, None
        self.seen = True
        if call is None or (items is not None and self.count_items is None):
            self.recipe = None
            return
        args, kwargs, output, batch = call

        def path(value):
            return _ITEMS if items is not None and value is items else _path_of(value, batch)

        pick = _picker(output, loss)
        arg_paths = [path(a) for a in args]
        kw_paths = {k: path(v) for k, v in kwargs.items()}
        if pick is None or None in arg_paths or None in kw_paths.values():
            self.recipe = None
            return
        self.recipe = (arg_paths, kw_paths, pick, items is not None)

    def items(self, batch: Any) -> Any:
        """The item count of ``batch`` for a counted recipe (``count_items``), else None."""
        return self.count_items(batch) if self.counted and self.count_items is not None else None

    @property
    def counted(self) -> bool:
        return self.recipe is not None and self.recipe[3]

    def loss(self, model: torch.nn.Module, batch: Any, items: Any = None) -> torch.Tensor:
        """The loss of ``batch`` computed as the user's loop computed the last one (``items``:
        its count, from ``items()``, where the loop's call took it)."""
        arg_paths, kw_paths, (i, scale), _ = self.recipe
        self.replaying = True
        try:
            with torch.enable_grad():
                out = model(*[_get(batch, p, items) for p in arg_paths],
                            **{k: _get(batch, p, items) for k, p in kw_paths.items()})
            loss = _PICKS[i](out)
            return loss * scale if scale is not None else loss
        finally:
            self.replaying = False

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> Optional[dict]:
        """The recipe as plain data (paths are keys or positions), for ``save_state``: a resumed
        run then computes its first step's surplus inside the step too.  It is checked again
        at the first backward after the resume (``seen`` stays False until then)."""
        if self.recipe is None:
            return None
        arg_paths, kw_paths, (i, scale), counted = self.recipe
        return {"args": [list(p) for p in arg_paths], "kwargs": {k: list(p) for k, p in kw_paths.items()},
                "pick": i, "scale": scale, "counted": counted}

    def load_state_dict(self, state: Optional[dict]) -> None:
        if not state:
            return
        self.recipe = ([tuple(p) for p in state["args"]], {k: tuple(p) for k, p in state["kwargs"].items()},
                       (int(state["pick"]), state["scale"]), bool(state.get("counted", False)))
        self.seen = False
