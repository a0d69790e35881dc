"""Rehabilitation's repair of restored elements (a mixin of ``ShardedExecutor``).

A rehabilitated row comes from its buddy's stale snapshot (``rehab.RehabRecipe``: optionally a
damped extrapolation from its last two).  Its optimizer state is repaired as the recipe says
(first moments and other momentum-like states reset, second moments ``*sq*`` kept:
``_repair``), then for the restored elements only, the ``k``-th update after the repair is
scaled by ``min(1, k / W)`` (a linear learning-rate warm-up) times ``(1 - b**t) / (1 - b**k)``
(the first moment's bias correction restarted at the repair, while Adam's own step ``t`` keeps
counting): ``_repair_update``.

Limits: torch's optimizers keep one step counter and one learning rate per parameter, and a row
is a slice of every parameter, so the repair scales the restored elements' whole update
(AdamW's decoupled decay included) rather than changing the optimizer's own state.
"""

from __future__ import annotations

from typing import Optional

import torch

from chameleon_ft.runtime.executors.sharded.layout import _Layout, _flatten, _restored, _unflatten_into


class _RehabRepair:
    """The repair of the elements a rehabilitation restored (``_warm``, ``_repair_info``: the
    executor's attributes)."""

    def _start_repair(self, plan: dict) -> None:
        """After a rehabilitation: the elements of this member's row that were restored from a
        stale snapshot get the recipe's repair on their updates (``_repair_update``)."""
        beta = self._momentum()
        restart = self.recipe.restart_bias_correction and beta > 0
        w = max(0, int(self.recipe.warmup_steps))
        if not w and not restart:
            self._repair_info = {"warmup_steps": 0, "restart_bias_correction": False}
            return
        mask = torch.zeros(self.layout.numel(self.row), dtype=torch.bool, device=self.device)
        for at, n in _restored(plan, self.layout, self.row):
            mask[at:at + n] = True
        if bool(mask.any()):
            self._warm = {"from": self.step, "mask": mask, "beta": beta, "restart": restart, "w": w}
        self._repair_info = {"warmup_steps": w, "restart_bias_correction": restart,
                             "restored_elements": int(mask.sum())}

    def _restored_values(self) -> Optional[torch.Tensor]:
        if self._warm is None:
            return None
        return _flatten(self._locals(), self._state_local, [], self.dtype)[self._warm["mask"]]

    def _repair_update(self, before: torch.Tensor) -> None:
        """Scale the restored elements' update of the ``k``-th step since the repair by
        ``min(1, k / W)`` (the learning-rate warm-up) times ``(1 - b**t) / (1 - b**k)`` (the
        first moment's bias correction restarted: Adam's ``t`` keeps counting from the run's
        start, the reset moment only has ``k`` steps; SGD: ``t`` infinite).  Per element, so
        only the restored part of the row is touched; the whole update of those elements
        (AdamW's decoupled decay included) is scaled."""
        rp = self._warm
        k = self.step - rp["from"] + 1
        scale = min(1.0, k / rp["w"]) if rp["w"] else 1.0
        corr = 1.0
        if rp["restart"]:
            t = self.optimizer.state.get(self.shard_params[0], {}).get("step")
            b = rp["beta"]
            corr = (1.0 - b ** float(t) if t is not None else 1.0) / (1.0 - b ** k)
        locs = self._locals()
        flat = _flatten(locs, self._state_local, [], self.dtype)
        flat[rp["mask"]] = before + (scale * corr) * (flat[rp["mask"]] - before)
        with torch.no_grad():
            _unflatten_into(flat, locs)
        if k >= rp["w"] and abs(corr - 1.0) < 1e-3:
            self._warm = None

    def _repair(self, mine: torch.Tensor, plan: dict, new: _Layout, row: int) -> None:
        """Rehabilitation's optimizer repair on the lost rows' elements of this member's new
        ``row``: first moments (and other momentum-like states) reset, second moments
        (``*sq*``) kept."""
        m = new.numel(row)
        spoil = self.faults.corrupt(self.step, "restore")  # test-only: a heal that cannot close
        for at, n in _restored(plan, new, row):
            if spoil:
                mine[at:at + n] *= -2.0
            for j, key in enumerate(plan["keys"], start=1):
                second = "sq" in key
                if (second and not self.recipe.keep_second_moment) or (not second and self.recipe.reset_first_moment):
                    mine[j * m + at:j * m + at + n] = 0.0

    def _momentum(self) -> float:
        """The first-moment decay that rehabilitation's reset throws away (0 when kept)."""
        if not self.recipe.reset_first_moment:
            return 0.0
        g = self.optimizer.param_groups[0]
        if "betas" in g:
            return float(g["betas"][0])
        return float(g.get("momentum", 0.0) or 0.0)
