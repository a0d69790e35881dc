"""The whole (unsharded) state of the sharded executor: checkpoints, ``full_parameters`` and a
framework's ``full_state`` / ``load_full_state`` (a mixin of ``ShardedExecutor``).

Gathering assembles every row on every member (one SUM all-reduce per row, ``_gather_rows``);
loading keeps each member's own slices of the whole and moves nothing.

Limits: gathering holds the whole state on every member, by definition; a checkpoint is written
by the lowest-ranked member only, as one file loadable with ``weights_only=True``, from which
any world size resumes, plus the model's plain ``state_dict`` beside it (``codec.model_file``:
``model.load_state_dict(torch.load(..., weights_only=True))``, no chameleon-ft needed).
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from chameleon_ft.runtime import codec as run_state
from chameleon_ft.runtime.executors.sharded.layout import _Layout, _copy_overlaps, _flatten
from chameleon_ft.runtime.groups import CollectiveFailure


class _WholeState:
    """Whole tensors by name from the rows, and back (``_keys``, ``layout``, ``row``: the
    executor's attributes)."""

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The whole parameters by name, gathered from the shards (a collective: every member
        calls it at the same point).  After ``finish()`` (the end of ``fit()``) no collective:
        the final gather's copy."""
        final = getattr(self, "_final", None)
        if final is not None and final[0] == self.step:
            return {n: t.clone() for n, t in final[1].items()}
        return self._split(self._assemble_full(self._live_plan([])), 0)

    def finish(self) -> bool:
        """The end of training, on every member at the same point: the whole parameters are
        gathered once and copied, with the buffers, into the user's model (the module given to
        the trainer), so that after ``fit()`` ``model.state_dict()`` is the trained model, as
        with DDP; ``full_parameters()`` then returns them without a collective.  False when a
        failure interrupted the gather: the job recovered (a recompute may have rolled it
        back) and the caller trains on, then calls again."""
        t0 = time.perf_counter()
        try:
            full = self._assemble_full(self._live_plan([]))
        except CollectiveFailure as failure:
            self._recover(failure, t0)
            return False
        params = self._split(full, 0)
        self._into_model(params)
        self._final = (self.step, params)
        return True

    def _into_model(self, params: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in zip(self._names, self.params):
                p.copy_(params[name])
            bufs = dict(self.model.named_buffers())
            for name, b in self._buffers().items():
                if name in bufs:
                    bufs[name].copy_(b)

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The whole parameters by name and the optimizer's whole state in torch's
        ``state_dict`` format (state by parameter index, ``param_groups``), gathered from the
        rows (a collective: every member calls it at the same point; a framework's unsharded
        checkpoint)."""
        keys = self._current_keys()
        full = self._assemble_full(self._live_plan(keys))
        params = self._split(full, 0)
        per_key = {key: self._split(full, j) for j, key in enumerate(keys, start=1)}
        scalars = self._scalars()
        state = {}
        for at, i in enumerate(self._torch_order()):
            if not self.optimizer.state.get(self.shard_params[i]):
                continue
            st = {key: per_key[key][self._names[i]] for key in keys}
            st.update(scalars.get(i, {}))
            state[at] = st
        return params, {"state": state, "param_groups": self.optimizer.state_dict()["param_groups"]}

    def load_full_state(self, params: dict[str, torch.Tensor], optim: Optional[dict]) -> None:
        """Load a ``full_state`` (whole tensors) into this member's rows of the layout it holds
        now (no collective: each member keeps its own slices)."""
        keys = sorted({k for st in (optim or {}).get("state", {}).values() for k, v in st.items()
                       if isinstance(v, torch.Tensor) and v.dim() > 0})
        order = self._torch_order()
        by_param = {order[int(at)]: st for at, st in (optim or {}).get("state", {}).items()}
        state = lambda i, key: by_param.get(i, {}).get(key)  # noqa: E731
        whole = _Layout(self._shapes, 1, 1)
        tensors = [params[n].to(self.dtype) if n in params else torch.zeros(shape, dtype=self.dtype)
                   for n, shape in zip(self._names, self._shapes)]
        full = _flatten(tensors, state, keys, self.dtype)
        m = self.layout.numel(self.row)
        row = torch.zeros((1 + len(keys)) * m, dtype=self.dtype)
        _copy_overlaps(row, m, self.layout.segments(self.row), full, whole.total, whole.segments(0), 1 + len(keys))
        scalars = {i: {k: v for k, v in st.items() if k not in keys} for i, st in by_param.items()}
        groups = (optim or {}).get("param_groups") or []
        self._keys = keys
        self._load_rows(row, {"keys": keys, "scalars": scalars,
                              "groups": [{k: v for k, v in g.items() if k != "params"} for g in groups],
                              "buffers": None})

    def _assemble_full(self, plan: dict) -> torch.Tensor:
        """The whole flat state (parameters, then each tensor state) on every member: for an
        unsharded checkpoint and ``full_parameters``, which are whole by definition."""
        lay = _Layout(self._shapes, *plan["old"])
        parts, total = 1 + len(plan["keys"]), lay.total
        full = torch.zeros(parts * total, dtype=self.dtype)

        def put(r: int, buf: torch.Tensor) -> None:
            m, d = lay.numel(r), 0
            for a, b in lay.segments(r):
                for j in range(parts):
                    full[j * total + a:j * total + b] = buf[j * m + d:j * m + d + b - a]
                d += b - a
        self._gather_rows(plan, lay, put)
        return full

    def _torch_order(self) -> list[int]:
        """Our parameter index of each of torch's (its ``state_dict`` numbers parameters
        across the param groups, in order)."""
        return [i for g in self._opt_groups for i in g]

    def _live_plan(self, keys: list[str]) -> dict:
        """Every row from its holder in replica group 0 (ranks 0..S-1), as it is now."""
        members = list(self.view.members)
        return {"mode": "heal", "keys": list(keys), "old": self.layout.to_json(),
                "rows": [[k, members[k], "live", self.step] for k in range(self.layout.shards)]}

    def _split(self, full: torch.Tensor, j: int) -> dict[str, torch.Tensor]:
        """Part ``j`` of an assembled flat state (0: parameters, then each state) by name."""
        at = j * self.layout.total
        return {n: full[at + o:at + o + k].view(shape).clone() for n, o, k, shape in
                zip(self._names, self.layout.offsets, self.layout.numels, self._shapes)}

    def save_checkpoint(self, path: str) -> None:
        """Call on every member at the same step: the rows are gathered (one all-reduce) and
        the lowest-ranked member writes the whole, unsharded run state (loadable with
        ``weights_only=True``; any world size resumes from it).  A failure during the gather
        recovers like a failed step and leaves the previous checkpoint in place."""
        self._current_keys()
        t0 = time.perf_counter()
        try:
            full = self._assemble_full(self._live_plan(self._keys))
        except CollectiveFailure as failure:
            self._recover(failure, t0)
            return
        self.last_checkpoint_step = self.step
        if self.rank != 0:
            return
        params = self._split(full, 0)
        self._into_model(params)  # the user's model holds what the plain state_dict file says
        run_state.save_model(run_state.model_file(path), self.model.state_dict())
        run_state.save_checkpoint(path, {
            "sharded": True, "names": list(self._names), "params": params,
            "state": {key: self._split(full, j) for j, key in enumerate(self._keys, start=1)},
            "scalars": self._scalars(), "groups": self._groups_json(), "buffers": self._buffers(),
            "run": self._run_state(), "engine": self.policy.state_dict()})

    def load_checkpoint(self, path: str) -> None:
        """Resume from ``path`` before ``start()`` (a ``CheckpointError`` names what is wrong
        with the file); the first generation shards it over whoever is there."""
        s = run_state.load_checkpoint(path)
        if not s.get("sharded") or list(s.get("names", [])) != self._names:
            raise run_state.CheckpointError(f"{path}: not a checkpoint of this sharded model")
        with torch.no_grad():
            for name, p in zip(self._names, self.params):
                p.copy_(s["params"][name])
            bufs = dict(self.model.named_buffers())
            for name, b in s["buffers"].items():
                if name in bufs:
                    bufs[name].copy_(b)
        for i, (name, p) in enumerate(zip(self._names, self.params)):
            st = {key: s["state"][key][name].clone() for key in s["state"]}
            st.update(s["scalars"].get(i, {}))
            self.optimizer.state[p] = st
        for g, saved in zip(self.optimizer.param_groups, s["groups"]):
            g.update(saved)
        self._load_run(s["run"])
        self.policy.load_state_dict(s["engine"])
        self.policy.plan = None
