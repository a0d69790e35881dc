"""The pipeline half of the runtime's engine bridge: feeding ``calibrate.PipelineCalibrator``
with what a pipeline job's steps measured, reading the fit back as the engine's inputs, and
keeping a re-plan undoable until its migration is confirmed.

Mixed into ``EngineBridge`` (``runtime/engine_bridge.py``), whose state (plan, alive, allocation, workload,
cluster) it uses; kept apart so that each module stays one concept.  Every input comes from
the step's all-reduce (the same on every member) and the fit travels with the engine state,
so every member holds the same figures.
"""

from __future__ import annotations

from dataclasses import replace
from statistics import median
from typing import Optional

from chameleon_ft.engine.calibrate import CollectiveSample
from chameleon_ft.engine.cluster import cluster_to_json
from chameleon_ft.engine.failures import Event, EventKind
from chameleon_ft.engine.perf import coefficients_to_json, estimate
from chameleon_ft.engine.plan import Plan
from chameleon_ft.engine.selector import select
from chameleon_ft.engine.workload import workload_to_json

import torch

__all__ = ["PipelineCalibration", "calibration_row", "read_rows"]

_P2P_SLOTS = 8  # waited-for message samples each member shares per step


def _row_width(n_blocks: int) -> int:
    """Per block 4 figures, then task overhead, tasks, optimizer s, parameters, then the
    message samples (bytes, seconds)."""
    return 4 * n_blocks + 4 + 2 * _P2P_SLOTS


def calibration_row(res, n_blocks: int, world: int, rank: int, optimizer_s: tuple) -> torch.Tensor:
    """This member's row of the step's calibration matrix (every member's row is zero
    elsewhere, so the commit's sum hands everyone every row), from its ``step.StepResult``
    (None: zeros): per block forward s, backward s, micro-batches and output bytes, then task
    overhead, tasks, ``optimizer_s`` (seconds, parameters) and up to ``_P2P_SLOTS`` (bytes,
    seconds) messages."""
    nb, width = n_blocks, _row_width(n_blocks)
    row = torch.zeros(world * width, dtype=torch.float64)
    if res is not None:
        mine = row[rank * width:(rank + 1) * width]
        for b, (f, bw, cnt) in res.block_times.items():
            mine[4 * b:4 * b + 3] = torch.tensor([f, bw, cnt], dtype=torch.float64)
        for b, nbytes in res.out_bytes.items():
            mine[4 * b + 3] = nbytes
        mine[4 * nb:4 * nb + 4] = torch.tensor([res.task_overhead_s, res.tasks, *optimizer_s], dtype=torch.float64)
        probes = res.probes[:_P2P_SLOTS // 2]  # the link probe's samples go first
        p2p, room = sorted(res.p2p, key=lambda x: x[1]), _P2P_SLOTS - len(probes)
        if len(p2p) > room:  # keep an even spread of the step's samples
            p2p = [p2p[i * len(p2p) // room] for i in range(room)]
        p2p = probes + p2p
        for i, (nbytes, sec) in enumerate(p2p):
            at = 4 * nb + 4 + 2 * i
            mine[at:at + 2] = torch.tensor([nbytes, sec], dtype=torch.float64)
    return row


def read_rows(flat: torch.Tensor, members, n_blocks: int) -> tuple:
    """Every member's row back, as ``PipelineCalibration.observe_pipeline``'s arguments."""
    nb, width = n_blocks, _row_width(n_blocks)
    rows = flat[:len(members) * width].double().view(len(members), width).tolist()
    times, out_bytes, p2p, overhead, tasks, opt_s, opt_params = {}, {}, [], 0.0, 0, 0.0, 0.0
    for w, row in zip(members, rows):
        for b in range(nb):
            f, bw, cnt, ob = row[4 * b:4 * b + 4]
            if cnt > 0:
                times[(w, b)] = (f, bw, int(round(cnt)))
                out_bytes[b] = int(round(ob))
        overhead += row[4 * nb]
        tasks += int(round(row[4 * nb + 1]))
        opt_s, opt_params = opt_s + row[4 * nb + 2], opt_params + row[4 * nb + 3]
        for i in range(_P2P_SLOTS):
            nbytes, sec = row[4 * nb + 4 + 2 * i:4 * nb + 6 + 2 * i]
            if nbytes > 0 and sec > 0:
                p2p.append((nbytes, sec))
    return times, out_bytes, p2p, (overhead, tasks), (opt_s, opt_params)

_REFIT_EVERY = 5  # steps between refits of the pipeline terms (each costs a few ms of Python)


class PipelineCalibration:
    def observe_pipeline(self, times: dict, out_bytes: dict, p2p, tasks=(0.0, 0), optimizer=(0.0, 0.0)) -> None:
        """One committed step's pipeline measurements, shared by every member: per (device,
        block) (forward s, backward s, micro-batches), block output bytes, (bytes, seconds)
        of waited-for messages, (per-task overhead seconds, tasks) and (optimizer seconds,
        parameters updated) summed over members."""
        self.pipe_cal.observe_step(times, out_bytes, tasks, optimizer)
        for nbytes, sec in p2p:
            self.pipe_cal.observe_p2p(nbytes, sec)

    def layout(self) -> dict:
        """The plan, load, batch, alive workers and replacements used now (what
        ``begin_migration`` keeps to undo a re-plan)."""
        return {"plan": self.plan.to_json() if self.plan else None, "current_batch": self.current_batch,
                "allocation": [[w, n] for w, n in sorted(self.allocation.items())], "alive": sorted(self.alive),
                "replacements_used": [[n, k] for n, k in sorted(self.replacements_used.items())]}

    def begin_migration(self, before: dict) -> None:
        """The Decision just taken moves state (a re-plan): keep ``before`` (``layout()`` from
        before it) and the workers it lost until every member confirms the migration."""
        self.migrating_from = {**before, "dead": sorted(self.decided_dead)}

    def undo_migration(self) -> None:
        """A failure interrupted the migration before every member confirmed it: nobody dropped
        a block, so the survivors still hold the layout before it.  Back to that plan and load;
        the next ``on_membership`` decides again for the workers that Decision lost (with any
        lost since) and for the ones it took in (a grow or heal: they join again), from what the
        survivors hold now -- the Decision is not silently dropped (it was, until 2026-12-03: a
        re-plan whose migration broke off left the job rerouted while the engine priced it)."""
        prev, self.migrating_from = self.migrating_from, None
        self.plan = Plan.from_json(prev["plan"])
        self.allocation = {int(w): int(n) for w, n in prev["allocation"]}
        self.current_batch = int(prev["current_batch"])
        self._redo = frozenset(int(w) for w in prev["dead"])
        self.alive = frozenset(int(w) for w in prev["alive"]) - self._redo
        self.replacements_used = {int(n): int(k) for n, k in prev["replacements_used"]}
        self._predicted = None

    def observe_migration(self, hops: int, nbytes: float, seconds: float) -> None:
        """A migration that was carried out: the transfers on its critical path
        (``engine.migration.critical_path``), their bytes, and the seconds it took (this member's)."""
        self.pipe_cal.observe_migration(hops, nbytes, seconds)
        self._refit()

    def _refit(self) -> None:
        self.fit = self.pipe_cal.fit(len(self.layer_params), prior_p2p=None)
        self._predicted = None
        self._steps_since_fit = 0

    def _per_mb(self, timings) -> dict[int, float]:
        """Each member's compute seconds per micro-batch, as the straggler detector compares
        them.  The stages of a pipeline job differ in work, so a worker's figure is scaled so
        that the fastest worker of its stage (the same blocks) reads the median stage's: the
        detector then sees a worker's slowdown against its same-stage peers only."""
        per_mb = {w: c / n for w, (c, n, _, _) in timings.items() if n > 0 and c > 0}
        if self.stages == 1 or self.plan is None or len(per_mb) < 2:
            return per_mb
        groups: dict[tuple, list[int]] = {}
        for p in self.plan.pipelines:
            for s, d in enumerate(p.devices):
                if d in per_mb:
                    groups.setdefault((p.bounds[s], p.bounds[s + 1]), []).append(d)
        fastest = {k: min(per_mb[d] for d in ds) for k, ds in groups.items()}
        ref = median(fastest.values())
        out = {d: per_mb[d] / fastest[k] * ref for k, ds in groups.items() for d in ds}
        # A worker whose blocks no other worker holds as one stage (unequal pipelines after a
        # re-plan) has no peer to be compared with: against the fit's nominal seconds of its
        # blocks instead (each block's fastest holder, from any stage that holds it), relative
        # to every worker's ratio (else a 4x slow worker alone in its stage is never flagged).
        fit, total = self.fit, sum(self.layer_params)
        alone = [ds[0] for ds in groups.values() if len(ds) == 1]
        if alone and fit is not None and len(fit.fwd_s) == len(self.layer_params) and total > 0:
            ratio = {}
            for lo, hi in groups:
                for d in groups[(lo, hi)]:
                    nominal = sum(fit.fwd_s[lo:hi]) + sum(fit.bwd_s[lo:hi])
                    if nominal > 0:
                        ratio[d] = per_mb[d] * sum(self.layer_params[lo:hi]) / total / nominal
            if len(ratio) > 1:
                mid = median(ratio.values())
                out.update({d: ratio[d] / mid * ref for d in alone if d in ratio})
        return out

    def _path(self, timings) -> float:
        """What a straggler rebalance must shorten, measured: the slowest member's compute in a
        data-parallel job; the step itself in a pipeline job (a worker's compute there is one
        stage's, not the step's critical path), as the members reported the previous one."""
        if self.stages == 1:
            return max(c for c, n, _, _ in timings.values() if n > 0 and c > 0)
        return max(s for *_, s in timings.values())

    def _rerouted_extra(self) -> dict[int, float]:
        return {d: float(n - self._plan_share(d)) for d, n in self.allocation.items() if n > self._plan_share(d)}

    def predicted_step(self, overhead: bool = True) -> Optional[float]:
        """The model's step time of the running plan and load (None before a plan)."""
        if self.plan is None:
            return None
        dead = frozenset(set(self.plan.devices) - self.alive)
        coeffs = self.coefficients()
        if not overhead:
            coeffs = replace(coeffs, step_overhead_s=0.0, hop_overhead_s=0.0)
        return estimate(self.plan, self.workload(), self.cluster(), coeffs, dead, self._rerouted_extra()).step_time

    def _calibrate_pipeline(self, timings) -> None:
        """Feed the step's all-reduce and the step time's unexplained part; refit."""
        if self.plan is None:
            return
        n = len(timings)
        comm = [c for _, _, c, _ in timings.values() if c > 0]
        if n > 1 and comm:
            # The fastest member's time: the others also waited for the last one to arrive.
            nbytes = sum(self.layer_params) * 4
            self.pipe_cal.observe_collective(CollectiveSample(n, float(nbytes), min(comm)))
        steps = [s for *_, s in timings.values() if s > 0]
        key = (repr(self.plan.to_json()), tuple(sorted(self.alive)))
        if steps and self.fit is not None and key == self._residual_key:
            # The previous step's seconds, against the same plan's prediction without overhead
            # (cached until the next refit).
            if self._predicted is None or self._predicted[0] != key:
                self._predicted = (key, self.predicted_step(overhead=False), float(self._slots()))
            self.pipe_cal.observe_residual(max(steps) - self._predicted[1], int(self._predicted[2]))
        self._residual_key = key
        self._steps_since_fit += 1
        if self.fit is None or self._steps_since_fit >= _REFIT_EVERY:
            self._refit()
        warming = getattr(self, "_warm_thread", None)
        if self.search_s == 0.0 and self.fit is not None and len(self.alive) > 2 and not (warming and warming.is_alive()):
            # What a failure's plan search costs this job, before the first failure measures
            # it: price the loss of one worker once (no state changes) -- once the helper thread
            # imported what a re-plan imports (``EngineBridge._warm_up``): in the main thread
            # that import stalls every worker of an 8-worker job for ~4 s at step 2.
            probe = Event(EventKind.FAIL_STOP, (max(self.alive),), 0.0)
            d = select(probe, self.job_state(self.alive), self.selector_config(0), self.mttf(len(self.alive) - 1))
            self.search_s = max(d.search_s, 1e-6)

    def _slots(self) -> int:
        """1F1B slots (``m + e + p - 1``, ``e`` the micro-batches rerouted through its busiest
        stage) of the running plan's longest multi-stage pipeline, else 0: what the model
        charges ``hop_overhead_s`` for."""
        extra = self._rerouted_extra()
        slots = [p.microbatches + max(extra.get(d, 0.0) for d in p.devices) + p.depth - 1
                 for p in self.plan.pipelines if p.depth > 1 and p.microbatches > 0]
        return int(round(max(slots))) if slots else 0

    def calibration_json(self) -> dict:
        """The fitted pipeline terms and the running plan's predicted step (the event log's
        ``calibration`` record)."""
        out = self.fit.to_json() if self.fit else {}
        out["predicted_step_s"] = self.predicted_step()
        out["plan"] = self.plan.describe() if self.plan else None
        out["agree_s"], out["rebuild_s"], out["search_s"] = self.agree_s, self.rebuild_s, self.search_s
        # The engine's inputs as the simulator reads them (``chameleon-ft simulate --trace``).
        out["setup"] = {"workload": workload_to_json(self.workload()), "cluster": cluster_to_json(self.cluster()),
                        "coefficients": coefficients_to_json(self.coefficients()),
                        "plan": self.plan.to_json() if self.plan else None, "mttf_s": self.mttf()}
        return out


