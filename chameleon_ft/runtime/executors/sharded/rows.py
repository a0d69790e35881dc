"""The re-shard after a failure: the source's plan for the rows and every member carrying it
out (a mixin of ``ShardedExecutor``).

The source gathers the facts (who holds which row of the layout, which snapshots survive) and
asks ``shard_recovery.choose_recovery`` for heal / recompute / rehabilitate / restart
(``_shard_plan``); the plan names, for every old row, the member that contributes it and from
what (its live row, its own snapshot or the one it holds).  Then every member streams the new
layout's rows, one SUM all-reduce per row, to which exactly one member contributes each element
(its source rows' overlap with that row); each keeps its own (``_gather_rows``) and loads it
into the new generation's sharded model and optimizer (``_load_rows``).

Limits: in memory, never via disk; no member holds more than its source rows and one row in
flight besides its own; every element crosses an all-reduce over all members.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from chameleon_ft.engine import shard_recovery as sr
from chameleon_ft.runtime.executors.sharded.layout import (_Layout, _copy_overlaps, _flatten, _scalars,
                                                           _state_keys, _unflatten_into)


class _Reshard:
    """The plan for the rows after a failure, and moving them (every member calls the
    movers at the same point: collectives)."""

    def _shard_plan(self, view) -> dict:
        """The source's plan for the rows (first start, heal, recompute, rehabilitate)."""
        members = list(view.members)
        if self._live_start:  # a framework sharded the model over these members: rows in place
            return {"mode": "live"}
        if self.module is None:  # nobody holds sharded state: the source's unsharded model
            keys = _state_keys(self.optimizer, self.params)
            return {"mode": "init", "from": self.worker_id, "keys": keys,
                    "scalars": _scalars(self.optimizer, self.params, keys), "groups": self._groups_json(), "buffers": self._buffers(), "run": None}
        fields = dict(zip(members, self.peer_fields))
        rows = self.layout.shards
        holders: dict[int, list[int]] = {}
        snaps: dict[int, set] = {}
        snap_at: dict[tuple[int, int], tuple[int, str]] = {}
        for w in members:
            f = fields[w]
            if f[0] < 0 or [f[6], f[7]] != self.layout.to_json():
                continue
            holders.setdefault(f[0], []).append(w)
            for st in f[1:3]:
                if st >= 0:
                    snaps.setdefault(f[0], set()).add(st)
                    snap_at.setdefault((f[0], st), (w, "own"))
            for st in f[4:6]:
                if st >= 0 and f[3] >= 0:
                    snaps.setdefault(f[3], set()).add(st)
                    snap_at.setdefault((f[3], st), (w, "held"))
        lost = [k for k in range(rows) if k not in holders]
        lost_numel = sum(self.layout.numel(k) for k in lost)
        snap_step = sr.stale_snapshot(lost, snaps, self.step)
        facts = sr.ShardFacts(
            step=self.step, rows=rows, current=frozenset(holders), snapshots={k: sorted(v) for k, v in snaps.items()},
            step_s=self._median_step(), transfer_s=self._transfer_s,
            lost_fraction=lost_numel / max(1, self.layout.total),
            trend=sr.loss_trend(self.loss_history, at_snapshot=snap_step),
            checkpoint_step=self.last_checkpoint_step if self._has_checkpoint() else None,
            restart_s=self.policy.restart_s, allowed=self.paths, momentum=self._momentum(),
            warmup_steps=self.recipe.warmup_steps,
            restart_bias_correction=self.recipe.restart_bias_correction,
            remaining_steps=None if self.planned_steps is None else max(0, self.planned_steps - self.step),
            heal_scale=self.heal_scale, recovered=self._recovered(lost, snaps))
        d = sr.choose_recovery(facts)
        plan = {"mode": d.chosen, "decision": d.to_json(), "keys": list(self._current_keys()),
                "old": self.layout.to_json()}
        if d.chosen == "heal":
            plan["rows"] = [[k, min(holders[k]), "live", self.step] for k in range(rows)]
        elif d.chosen == "recompute":
            rollback = self._rollback_plan(d.rollback_to, rows, snap_at)
            if rollback is None:  # the source's row was snapshotted at t by a replica only
                raise RuntimeError(f"worker {self.worker_id}: no own snapshot at step {d.rollback_to} to roll back to")
            plan.update(rollback)
        elif d.chosen == "rehabilitate":
            plan["rows"] = []
            for k in range(rows):
                if k in holders:
                    plan["rows"].append([k, min(holders[k]), "live", self.step])
                else:
                    t = max(s for s in snaps[k] if s <= self.step)
                    plan["rows"].append([k, *snap_at[(k, t)], t])
            # The recompute that stays possible while the heal is watched (HealCheck's fallback).
            t_c = sr.common_snapshot(rows, snaps, self.step) if "recompute" in self.paths else None
            if t_c is not None:
                plan["fallback"] = self._rollback_plan(t_c, rows, snap_at)
        if d.chosen in ("heal", "rehabilitate"):
            plan.update(scalars=self._scalars(), groups=self._groups_json(), buffers=self._buffers(), run=None)
        return plan

    def _recovered(self, lost: list[int], snaps: dict) -> float:
        """The fraction of the progress since their snapshot that extrapolating the ``lost``
        rows along their last two snapshots brings back (``_row_source``: ``damping x min(1,
        gap between the two / steps since the latest)``; the least over the rows; 0 for a
        plain restore or a row with one snapshot)."""
        if self.recipe.extrapolate_snapshots < 2 or not lost:
            return 0.0
        out = []
        for k in lost:
            have = sorted(s for s in snaps.get(k, ()) if s <= self.step)
            if len(have) < 2 or self.step == have[-1]:
                return 0.0
            out.append(self.recipe.damping * min(1.0, (have[-1] - have[-2]) / (self.step - have[-1])))
        return min(out)

    def _rollback_plan(self, t: int, rows: int, snap_at: dict) -> Optional[dict]:
        """A recompute's plan: every row from its snapshot at step ``t`` (``snap_at``: (row,
        step) -> (member, own/held)), with the source's own snapshot's run state; None when
        the source has no own snapshot at ``t``."""
        own = next((s for s in self._valid(self._own) if s["step"] == t), None)
        if own is None:
            return None
        return {"mode": "recompute", "t": t, "rows": [[k, *snap_at[(k, t)], t] for k in range(rows)],
                "old": self.layout.to_json(), "keys": list(own["keys"]), "scalars": own["scalars"],
                "groups": own["groups"], "buffers": own["buffers"], "run": own["run"]}

    def _gather_rows(self, plan: dict, dst: _Layout, sink: Callable[[int, torch.Tensor], None],
                     sources: Optional[list] = None) -> None:
        """Every row of ``dst`` (parameters, then each tensor state), one at a time: one SUM
        all-reduce per row, to which exactly one member contributes each element (its source
        rows' overlap with it); ``sink(row, buffer)`` on every member.  At most one row's
        buffer is alive at a time, besides the member's own sources."""
        keys = plan["keys"]
        parts = 1 + len(keys)
        if plan["mode"] == "init":  # the source's unsharded model as one row
            src, sources = _Layout(self._shapes, 1, 1), []
            if self.worker_id == plan["from"]:
                state = lambda i, key: self.optimizer.state.get(self.params[i], {}).get(key)  # noqa: E731
                sources.append((0, _flatten(self.params, state, keys, self.dtype)))
        else:
            src = _Layout(self._shapes, *plan["old"])
            if sources is None:
                sources = self._plan_sources(plan)
        for r in range(dst.shards):
            segs, m = dst.segments(r), dst.numel(r)
            buf = torch.zeros(parts * m, dtype=self.dtype)
            for k, vec in sources:
                _copy_overlaps(buf, m, segs, vec, src.numel(k), src.segments(k), parts)
            self._store_op(lambda b=buf: self.gm.allreduce(b, dist.ReduceOp.SUM, timeout_s=self.hang_timeout_s))
            sink(r, buf)

    def _assemble_row(self, plan: dict, dst: _Layout, row: int, sources: Optional[list] = None) -> torch.Tensor:
        """This member's ``row`` of the ``dst`` layout (every member calls it: a collective);
        ``sources``: this member's contributions, when kept aside (default: the plan's)."""
        kept: dict[int, torch.Tensor] = {}
        self._gather_rows(plan, dst, lambda r, buf: kept.__setitem__(r, buf) if r == row else None, sources)
        return kept[row]

    def _plan_sources(self, plan: dict) -> list:
        """(old row, vector) of every row ``plan`` names this member to contribute."""
        return [(k, self._row_source(kind, step, k, plan)) for k, w, kind, step in plan["rows"] if w == self.worker_id]

    def _row_source(self, kind: str, step: int, k: int, plan: dict) -> torch.Tensor:
        if kind == "live":
            return self._row_vector()
        pool = self._own if kind == "own" else self._held
        snap = [s for s in pool if s["step"] == step and s["k"] == k]
        if not snap:
            raise RuntimeError(f"worker {self.worker_id}: no {kind} snapshot of row {k} at step {step}")
        vec = snap[-1]["row"]
        if (kind == "held" and plan["mode"] == "rehabilitate" and self.recipe.extrapolate_snapshots >= 2):
            older = [s for s in pool if s["k"] == k and s["step"] < step]
            if older:
                prev = older[-1]
                m = _Layout(self._shapes, *plan["old"]).numel(k)
                frac = min(1.0, (self.step - step) / max(1, step - prev["step"]))
                vec = vec.clone()
                vec[:m] += self.recipe.damping * frac * (vec[:m] - prev["row"][:m])
        return vec

    def _load_rows(self, mine: torch.Tensor, plan: dict) -> None:
        """This member's row (parameters, then each tensor state) into its sharded model and
        optimizer, with the plan's scalars, hyper-parameters and buffers."""
        m = self.layout.numel(self.row)
        with torch.no_grad():
            _unflatten_into(mine[:m], self._locals())
            if plan["keys"]:
                # Materialise the optimizer's state through its own code path, then overwrite.
                self._init_optimizer_state()
                for j, key in enumerate(plan["keys"], start=1):
                    _unflatten_into(mine[j * m:(j + 1) * m],
                                    [self._state_local(i, key) for i in range(len(self.shard_params))])
                for i, sc in (plan.get("scalars") or {}).items():
                    st = self.optimizer.state[self.shard_params[int(i)]]
                    for key, v in sc.items():
                        st[key] = v.clone() if isinstance(v, torch.Tensor) else v
            for g, saved in zip(self.optimizer.param_groups, plan.get("groups") or []):
                g.update({k: v for k, v in saved.items()})
            bufs = dict(self.module.named_buffers())
            for name, b in (plan.get("buffers") or {}).items():
                if name in bufs:
                    bufs[name].copy_(b)

    def _init_optimizer_state(self) -> None:
        """Let the optimizer create its per-parameter state (one step with zero gradients and
        zero learning rate), so that its tensors exist with the right placement."""
        saved = [g["lr"] for g in self.optimizer.param_groups]
        params = [p.detach().clone() for p in self._locals()]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        for p in self.shard_params:
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for g, lr in zip(self.optimizer.param_groups, saved):
            g["lr"] = lr
        with torch.no_grad():
            for t, v in zip(self._locals(), params):
                t.copy_(v)
