"""The runtime's bridge to the engine: build its inputs from the live job, turn its Decisions
into micro-batch allocations.  The engine decides; this module only translates.

``EngineBridge`` holds, as plain JSON-able state that every member keeps identical:

* the running ``Plan`` (data parallel: one single-stage pipeline per worker id) and the set of
  alive worker ids -- after a reroute the plan keeps its dead devices, as the selector expects;
* the ``Workload``: one ``Layer`` per parameterised top-level child of the model, parameters
  counted, forward/backward seconds split from the measured per-micro-batch compute time
  (1/3 forward, 2/3 backward, in proportion to parameters), frozen after ``warmup_steps``;
* a ``Calibrator`` fed with every step's phase timings (predicted by ``perf.estimate`` for the
  running plan, observed by the members), so Decisions use this job's coefficients;
* a ``StragglerDetector`` fed with every member's compute seconds per micro-batch; each flag,
  clear and undone rebalance is a straggler Decision (see *Stragglers* below);
* a ``FailureRateEstimator`` for ``D`` (the expected time to the next failure): its prior scaled
  to this job's worker count at ``start``, fed with every committed step's exposure and every
  lost worker; ``mttf_s`` (``chameleon-ft run --mttf``) overrides it;
* the plan-search seconds the last failure or join Decision measured, charged to the next
  Decision's re-planning candidates (``SelectorConfig.search_s``; it travels with the state, so
  every member uses the same figure).

Stragglers: the engine's plans keep at least one micro-batch on every live worker
(``SearchSpace.min_microbatches``) when the batch has that many, so a flagged worker keeps
yielding timings and can be cleared.  A rebalance is checked: after ``verify_steps`` steps the
median measured compute path (the slowest member's compute seconds) must be ``min_gain`` below
the median of the steps before; otherwise it is undone -- the flag is dropped, the rank's
timings are ignored for a while (doubling with every undo) and the plan is re-derived from the
remaining flags (the even split when none).  A cleared flag re-derives the plan the same way.
These re-derivations are straggler Decisions with slowdown 1 whose reason says why.

Every input comes from values all members share (all-reduced timings, the agreed view), so
straggler decisions are taken by every member independently and agree.  Failure and join
decisions are taken by one member during recovery and shipped to the others (see ``runtime/recovery.py``).

Limits, honestly: only policies a data-parallel runtime can carry out are offered to the
selector: ``reroute``, ``replan`` (pipeline depth 1), ``wait`` (carried out as reroute until
the replacement arrives -- nobody idles), ``restart`` (the workers exit for the launcher),
``keep``/``rebalance``/``heal``/``grow``, and ``shrink`` when the user allows the global batch
to change (the sampler then cuts the epoch's remaining samples into smaller batches and the
learning rate follows the linear scaling rule; a heal or grow brings both back).  Per-layer
costs are split by parameter count, not measured per layer.
"""

from __future__ import annotations


import random
import threading
import time
from collections import deque
from dataclasses import replace
from statistics import median
from typing import Optional, Sequence

from chameleon_ft.engine.calibrate import Calibrator, PipelineCalibrator, PipelineFit, StepSample
from chameleon_ft.engine.cluster import homogeneous
from chameleon_ft.engine.failures import Event, EventKind, FailureRateEstimator
from chameleon_ft.engine.migration import warm_imports
from chameleon_ft.engine.perf import Coefficients, estimate
from chameleon_ft.engine.plan import Pipeline, Plan, even_split
from chameleon_ft.engine.planner import SearchSpace, at_least_one_each, balance_layers
from chameleon_ft.engine.selector import POLICIES, Decision, JobState, SelectorConfig, select
from chameleon_ft.runtime.errors import ConfigError, RestartRequested
from chameleon_ft.runtime.executors.pipeline.calibration import PipelineCalibration
from chameleon_ft.engine.stragglers import StragglerDetector
from chameleon_ft.engine.workload import Layer, Workload

__all__ = ["EngineBridge", "RestartRequested", "layer_params"]

_DEFAULT_MB_S = 1e-3  # per-micro-batch compute assumed before anything was measured
# Knobs of the rebalance check, next to the StragglerDetector's own fields.
_CHECK_DEFAULTS = {"verify_steps": 4, "min_gain": 0.05}


class EngineBridge(PipelineCalibration):
    """Engine state of one job, identical on every member.

    Args:
        layer_params: parameters of each parameterised top-level child of the model.
        global_batch, micro_batch: the sampler's sizes.
        per_node: workers per node (``LOCAL_WORLD_SIZE``), for the cluster and node losses.
        replacement_eta_s: when the launcher can still start replacements, how soon one is
            expected (enables ``wait``/``heal``); None otherwise.  A prior: once a replacement
            joined, the median of the observed loss -> join delays takes its place.
        max_replacements: replacements each node's launcher may start (``--max-replacements``):
            once a node's are used up (counted from the joins seen), a failure there expects none.
        mttf_s: fixed ``D`` (seconds); default: the failure-rate estimator's.
        straggler_options: ``StragglerDetector`` fields (``window``, ``windows``, ``enter``,
            ``leave``, ``min_cost_s``, ``min_cost_frac``, ``min_evidence_s``) and the rebalance check's
            ``verify_steps`` (steps measured after a rebalance) and ``min_gain`` (the share of
            the compute path it must save, else it is undone).
    """

    def __init__(self, layer_params: Sequence[int], global_batch: int, micro_batch: int, *,
                 per_node: int = 1, warmup_steps: int = 3, replacement_eta_s: Optional[float] = None,
                 mttf_s: Optional[float] = None, rebuild_s: float = 0.1, restart_s: float = 60.0,
                 stragglers: bool = True, allowed=None, allow_batch_change: bool = False,
                 straggler_options: Optional[dict] = None, items_per_step: int = 0,
                 stages: int = 1, max_replacements: Optional[int] = None,
                 memory_bytes: Optional[float] = None, one_each: bool = False):
        # Every live member gets at least one micro-batch per step (when the batch has that
        # many): the executor's constraint, applied to the allocation *and* the plan, so the
        # engine's state is what runs (``planner.at_least_one_each``).
        self.one_each = bool(one_each)
        self.items_per_step = int(items_per_step)
        # Each device's memory for the engine's fit checks (None: the cluster model's default).
        if memory_bytes is not None and not memory_bytes > 0:
            raise ConfigError(f"device_memory_bytes must be a positive number of bytes, got {memory_bytes!r}")
        self.memory_bytes = memory_bytes
        # Pipeline jobs (``stages`` > 1): the first plan has pipelines of that depth, and the
        # selector may re-plan to any depth (the pipeline executor runs unequal pipelines).
        self.stages = max(1, int(stages))
        self._warmed = self.stages == 1  # see _warm_up
        # Bytes per parameter that a migration moves (weights, optimizer state): measured by
        # the pipeline runtime after its first step, so the migration plan predicts real bytes.
        self.weight_bytes, self.optim_bytes = 4, 8
        self.last_migration, self.overlap_migration = None, False  # (ElasticConfig.overlap_migration)
        # Pipeline re-plans keep at least this many pipelines (copies of every block).
        self.min_replicas = 2
        # Until every member confirms a re-plan's migration: the plan and load before it and the workers
        # it lost (``begin_migration``); a failure that interrupts the migration undoes it (``undo_migration``).
        self.migrating_from: Optional[dict] = None
        self._redo: frozenset[int] = frozenset()
        self.decided_dead: frozenset[int] = frozenset()  # the workers the last on_membership lost
        self.layer_params = [int(p) for p in layer_params] or [1]
        self.global_batch, self.micro_batch = int(global_batch), int(micro_batch)
        self.per_node = max(1, int(per_node))
        self.warmup_steps = warmup_steps
        self.replacement_eta_s = replacement_eta_s
        self.max_replacements = max_replacements
        self.replacements_used: dict[int, int] = {}  # node -> replacements that joined
        # Seconds from a worker's loss (as the survivors saw it) to its replacement joining, as
        # observed in this job: once there is one, the ETA is their median, not the prior.
        self.replacement_delays: list[float] = []
        self._lost_at: dict[int, float] = {}  # worker -> wall time its loss was agreed
        self.mttf_s, self.rebuild_s, self.restart_s = mttf_s, rebuild_s, restart_s
        self.stragglers = stragglers
        # What the executor carries out (its ``POLICIES`` less what the user ruled out); None:
        # everything the engine knows (a bridge used on its own, e.g. in a test).
        self.allowed = frozenset(POLICIES if allowed is None else allowed)
        self.allow_batch_change = allow_batch_change
        # Samples per step now: below global_batch after a shrink, back up after a heal/grow.
        self.current_batch = self.global_batch
        self.plan: Optional[Plan] = None
        self.alive: frozenset[int] = frozenset()
        self.allocation: dict[int, int] = {}
        self.mb_seconds: Optional[float] = None  # frozen per-micro-batch compute, after warm-up
        self._warm: list[float] = []
        self.calibrator = Calibrator()
        opts = dict(straggler_options or {})
        check = {k: opts.pop(k, v) for k, v in _CHECK_DEFAULTS.items()}
        self.verify_steps, self.min_gain = max(1, int(check["verify_steps"])), float(check["min_gain"])
        try:
            self.detector = StragglerDetector(**opts)
        except TypeError:
            raise ConfigError(f"unknown straggler options {sorted(opts)}; known: window, windows, enter, "
                             "leave, min_cost_s, min_cost_frac, min_evidence_s, verify_steps, "
                             "min_gain") from None
        self._detector_opts = opts
        self._recent: deque = deque(maxlen=self.verify_steps)  # compute path of the last steps
        self._check: Optional[dict] = None  # the last rebalance, until its gain is measured
        self._undos: dict[int, int] = {}  # rebalances undone, per rank
        self.estimator = FailureRateEstimator()
        self.search_s = 0.0  # measured by the last failure/join Decision
        self._predicted: Optional[tuple] = None  # (plan, alive, compute, all-reduce) of _calibrate
        # Pipeline jobs: the pipeline terms fitted online (per-block costs, device speeds,
        # links, overhead; see calibrate.PipelineCalibrator), and the fixed cost of an in-place
        # reconfiguration beyond the group rebuild (the state agreement), measured.
        self.pipe_cal = PipelineCalibrator()
        self.fit: Optional[PipelineFit] = None
        self.agree_s = 0.0
        self._residual_key: Optional[tuple] = None
        self._steps_since_fit = 0
        self._since_s = 0.0  # shared step seconds since the last step observed (``observe_step``)

    # ---------------------------------------------------------------- engine inputs
    def workload(self) -> Workload:
        fit = self.fit
        if fit is not None and len(fit.fwd_s) == len(self.layer_params) and sum(fit.fwd_s) + sum(fit.bwd_s) > 0:
            # Pipeline jobs, once calibrated: each block's measured cost and output size.
            layers = tuple(Layer(params=p, fwd_s=f, bwd_s=b, act_bytes=0, out_bytes=o)
                           for p, f, b, o in zip(self.layer_params, fit.fwd_s, fit.bwd_s, fit.out_bytes))
        else:
            per_mb = self.mb_seconds if self.mb_seconds is not None else _DEFAULT_MB_S
            total = sum(self.layer_params)
            layers = tuple(Layer(params=p, fwd_s=per_mb * p / total / 3, bwd_s=2 * per_mb * p / total / 3,
                                 act_bytes=0) for p in self.layer_params)
        return Workload(layers, self.global_batch, self.micro_batch,
                        name="elastic-pp" if self.stages > 1 else "elastic-dp",
                        items_per_step=self.items_per_step, weight_bytes=self.weight_bytes,
                        optim_bytes=self.optim_bytes, grad_sync="model" if self.stages > 1 else "stage")

    def cluster(self, extra_ids=(), unflag=()):
        ids = set(self.plan.devices if self.plan else ()) | set(self.alive) | set(extra_ids)
        n = max(ids) + 1 if ids else 1
        # ``unflag``: devices whose slowdown the event itself carries (not to count it twice).
        speeds = {d: 1.0 / max(s, 1.0) for d, s in self.detector.flagged.items() if d not in unflag}
        cluster = homogeneous(n, per_node=self.per_node,
                              **({"memory_bytes": self.memory_bytes} if self.memory_bytes else {}))
        fit = self.fit
        if fit is not None:
            # Measured: device speeds, and the links of this job's messages, all-reduce and
            # migrations (one fitted point-to-point link for both tiers: the samples mix them).
            speeds = {**{d: v for d, v in fit.speeds.items() if d < n and d not in unflag}, **speeds}
            p2p = fit.p2p or cluster.intra
            cluster = replace(cluster, intra=p2p, inter=p2p, collective=fit.collective,
                              migration=fit.migration or fit.p2p)
        return cluster.with_speeds(speeds)

    def _eta(self, dead=()) -> Optional[float]:
        """The replacement ETA for a failure of ``dead``: None when none of their nodes'
        launchers has a replacement left."""
        if self.replacement_eta_s is None or self.max_replacements is None or not dead:
            return self.replacement_eta_s
        used = [self.replacements_used.get(d // self.per_node, 0) for d in dead]
        return None if all(u >= self.max_replacements for u in used) else self.replacement_eta_s

    def selector_config(self, steps_since_checkpoint: int, dead=()) -> SelectorConfig:
        # Pipeline jobs charge every in-place option the measured state agreement too (its
        # figure differs per member, which only the source's recovery decisions may use:
        # data-parallel straggler decisions are taken by every member on its own).
        rebuild = self.rebuild_s + (self.agree_s if self.stages > 1 else 0.0)
        return SelectorConfig(
            allowed=self.allowed, allow_batch_change=self.allow_batch_change, replacement_eta_s=self._eta(dead),
            rebuild_s=rebuild, restart_s=self.restart_s, search_s=self.search_s,
            steps_since_checkpoint=steps_since_checkpoint, straggler_relayout=self.stages == 1,
            overlap_migration=self.overlap_migration and self.stages > 1,
            space=SearchSpace(pp_max=None if self.stages > 1 else 1, min_microbatches=1,
                              dp_min=self.min_replicas if self.stages > 1 else 1))

    def mttf(self, devices: Optional[int] = None) -> float:
        """``D`` for ``devices`` workers (default: the alive ones)."""
        return self.mttf_s or self.estimator.mttf(max(1, len(self.alive) if devices is None else devices))

    def coefficients(self) -> Coefficients:
        if self.stages > 1:  # the pipeline terms are measured directly; the rest is overhead
            if self.fit is None:
                return Coefficients()
            # A micro-batch costs each stage two tasks (forward, backward).
            return Coefficients(step_overhead_s=self.fit.step_overhead_s,
                                task_overhead_s=2 * self.fit.task_overhead_s,
                                optimizer_s_per_param=self.fit.optimizer_s_per_param,
                                hop_overhead_s=self.fit.hop_overhead_s)
        return self.calibrator.coefficients()

    def job_state(self, alive, extra_ids=(), unflag=()) -> JobState:
        return JobState(workload=self.workload(), cluster=self.cluster(extra_ids, unflag), plan=self.plan,
                        alive=frozenset(alive), coeffs=self.coefficients())

    # ---------------------------------------------------------------- lifecycle
    def start(self, members: Sequence[int]) -> dict[int, int]:
        """The initial plan over ``members`` (data parallel, or pipelines of ``stages``
        consecutive members with the layers balanced); returns the allocation."""
        self.plan = (self._pipeline_plan(sorted(members)) if self.stages > 1
                     else Plan.data_parallel(sorted(members), self.workload()))
        self.alive = frozenset(members)
        if not self.estimator.evidence:
            self.estimator = FailureRateEstimator.for_job(len(self.alive))
        self.current_batch = self.global_batch
        self._set_allocation(self.plan, {})
        return self.allocation

    def _pipeline_plan(self, members: list[int]) -> Plan:
        w = self.workload()
        p = self.stages
        if len(members) < p or w.num_layers < p:
            raise ConfigError(f"{p} pipeline stages need at least {p} workers and {p} blocks, "
                              f"got {len(members)} workers and {w.num_layers} blocks")
        chunks = [members[i:i + p] for i in range(0, len(members) - len(members) % p, p)]
        bounds = balance_layers(w, [1.0] * p)
        alloc = even_split(w.num_microbatches, len(chunks))
        return Plan(tuple(Pipeline(tuple(c), bounds, m) for c, m in zip(chunks, alloc)))

    def on_membership(self, members: Sequence[int], hang: bool, step: int,
                      steps_since_checkpoint: int = 0) -> list[Decision]:
        """The agreed view changed: one Decision for the lost workers (if any), one for the
        joined (if any); the plan and allocation follow the choices.  Raises
        ``RestartRequested`` when the engine picks checkpoint-restart."""
        members = frozenset(members)
        self._flush_exposure()  # (counted for the members it ran with)
        # ``_redo``: the workers an undone Decision lost (``undo_migration``), decided on again
        dead = (self.alive - members) | (self._redo - members)
        redone, self._redo, joined, self.decided_dead = self._redo, frozenset(), members - self.alive, dead
        decisions = []
        if dead or joined:  # a rebalance's gain can no longer be told from the change
            self._check = None
            self._recent.clear()
        now = time.time()
        for d in dead - redone:
            self._lost_at[d] = now
        for d in joined:
            lost = self._lost_at.pop(d, None)
            if lost is not None:
                self.replacement_delays.append(max(0.0, now - lost))
                if self.replacement_eta_s is not None:
                    self.replacement_eta_s = median(self.replacement_delays)
        if dead:
            if self.plan is None or not set(self.plan.devices) & members:
                self.start(sorted(members))  # nothing of the old plan survives: start over
            else:
                kind = EventKind.HANG if hang else (
                    EventKind.NODE_LOSS if self._whole_nodes(dead) else EventKind.FAIL_STOP)
                self.estimator.observe(0, 0.0, failures=len(dead - redone))
                self.detector.forget(dead)
                event = Event(kind, tuple(sorted(dead)), float(step))
                d = select(event, self.job_state(self.alive), self.selector_config(steps_since_checkpoint, dead),
                           self.mttf(len(self.alive - dead)))
                self.search_s = d.search_s
                decisions.append(d)
                self._apply(d, self.alive - dead)
        if joined:
            for d in joined:
                self.replacements_used[d // self.per_node] = self.replacements_used.get(d // self.per_node, 0) + 1
            event = Event(EventKind.JOIN, tuple(sorted(joined)), float(step))
            d = select(event, self.job_state(self.alive | joined, joined),
                       self.selector_config(steps_since_checkpoint), self.mttf(len(self.alive | joined)))
            self.search_s = d.search_s
            decisions.append(d)
            self._apply(d, self.alive | joined, idle=frozenset(joined))
        return decisions

    def _warm_up(self) -> None:
        """A pipeline job's first re-plan imports networkx and scipy.optimize (a first decision
        0.09-0.26 s against 4-6 ms): import them in a helper thread once the job trains, each
        worker after a random delay of up to 2 s -- not at start, where 8 workers importing at
        once on 2 cores can starve their heartbeat threads past the 1 s timeout and churn the
        start-up through generations (docs/runtime-pipeline.md)."""
        self._warmed = True
        self._warm_thread = threading.Timer(random.uniform(0.0, 2.0), warm_imports)
        self._warm_thread.daemon = True
        self._warm_thread.start()

    def observe_step(self, timings: dict[int, tuple[float, int, float, float]], step: int,
                     steps_since_checkpoint: int = 0) -> Optional[Decision]:
        """Feed one committed step's shared timings, per member: (compute seconds,
        micro-batches, previous step's all-reduce seconds, previous step's seconds).  Returns a
        straggler Decision when the detector flags or clears someone or a rebalance is undone."""
        if not self._warmed:
            self._warm_up()
        step_prev = max((s for _, _, _, s in timings.values()), default=0.0)
        # Steps shorter than the detector's min_cost_s (5 ms) are observed one in every
        # min_cost_s of them (the step that completes the span; an observation costs tens of
        # microseconds): in a step that short no member's slowdown costs min_cost_s, so none
        # counts as evidence, and a step that holds one is that long and observed.  Every step
        # while warming up, while someone is flagged or a rebalance is measured.  The same on
        # every member: the timings are the shared ones, the sum is in the state.
        self._since_s += step_prev
        if (self._since_s < self.detector.min_cost_s and self.mb_seconds is not None
                and not self.detector.flagged and self._check is None and self.stages == 1):
            return None
        self._flush_exposure()
        per_mb = self._per_mb(timings)  # pipeline jobs: against same-stage peers
        if self.mb_seconds is None and per_mb:
            self._warm.append(sorted(per_mb.values())[len(per_mb) // 2])
            if len(self._warm) >= self.warmup_steps:
                self.mb_seconds = sorted(self._warm)[len(self._warm) // 2]
                self._predicted = None
        if self.stages > 1:
            self._calibrate_pipeline(timings)
        else:
            self._calibrate(timings)
        if not (self.stragglers and len(per_mb) >= 2):
            return None
        share = sum(self.allocation.values()) / max(1, len(self.alive))
        events = [e for e in self.detector.observe(per_mb, float(step), share=share, step_s=step_prev)
                  if e.devices[0] in self.alive]
        path = self._path(timings)  # what a rebalance must shorten
        changed, notes = set(), []
        undo = self._verify(path)
        self._recent.append(path)
        if undo:  # drop the flags the rebalance acted on; re-derive for the remaining ones
            undone, self._check = self._check["devices"], None
            for r in undone:
                self._undos[r] = self._undos.get(r, 0) + 1
                self.detector.clear(r, hold=self._hold_steps(r))
            changed |= set(undone)
            notes.append(f"rebalance for {undone} undone: {undo}")
        cleared = [r for r in self.detector.cleared if r in self.alive]
        if cleared:
            if self._check and set(cleared) & set(self._check["devices"]):
                self._check = None
            changed |= set(cleared)
            notes.append(f"flag of {cleared} cleared ({self.detector.window} steps below "
                         f"{self.detector.leave}x, or no timing for as long)")
        if len(events) > 1:
            notes.append("also flagged: " + ", ".join(f"{e.devices[0]} ({e.slowdown:.2f}x)" for e in events[1:]))
        if events:
            first = events[0]
            event = Event(first.kind, first.devices, first.time_s, first.slowdown,
                          "; ".join([first.detail] + notes))
        elif notes:
            event = Event(EventKind.STRAGGLER, tuple(sorted(changed)), float(step), 1.0, "; ".join(notes))
        else:
            return None
        d = select(event, self.job_state(self.alive, unflag=event.devices if events else ()),
                   self.selector_config(steps_since_checkpoint), self.mttf())
        self._apply(d, self.alive)
        if events and d.chosen == "rebalance" and self._recent:
            self._check = {"devices": list(event.devices), "before": median(self._recent),
                           "predicted": d.option("rebalance").step_time / d.option("keep").step_time,
                           "after": []}
        return d

    def _flush_exposure(self) -> None:
        """The step seconds summed since the last observation, as the failure-rate estimator's
        exposure of the members alive now."""
        if self._since_s > 0:
            self.estimator.observe(len(self.alive), self._since_s)
        self._since_s = 0.0

    def _hold_steps(self, rank: int) -> int:
        """Steps a rank's timings are ignored after its rebalance was undone: two windows of
        evidence, doubling with every undo, so a slowdown a rebalance cannot help does not
        flap."""
        return self.detector.window * self.detector.windows * 2 ** (self._undos.get(rank, 1) - 1)

    def _verify(self, path: float) -> str:
        """After ``verify_steps`` steps of a rebalance, why it is to be undone ('' to keep it)."""
        if self._check is None:
            return ""
        after = self._check["after"]
        after.append(path)
        if len(after) < self.verify_steps:
            return ""
        before, now, pred = self._check["before"], median(after), self._check["predicted"]
        if now < before * (1 - self.min_gain):
            self._check = None  # it paid
            return ""
        return (f"measured compute path {now * 1e3:.2f} ms over {len(after)} steps vs "
                f"{before * 1e3:.2f} ms before (predicted {before * pred * 1e3:.2f} ms; a rebalance "
                f"must save {self.min_gain:.0%})")

    # ---------------------------------------------------------------- helpers
    def _whole_nodes(self, dead: frozenset[int]) -> bool:
        """Every worker the plan had on each affected node is gone (a lost node)."""
        if len(dead) < 2 or self.per_node < 2:
            return False
        for n in {d // self.per_node for d in dead}:
            on_node = {d for d in self.plan.devices if d // self.per_node == n}
            if not on_node <= dead:
                return False
        return True

    def _calibrate(self, timings) -> None:
        if self.mb_seconds is None or self.plan is None:
            return
        comm = [c for _, _, c, _ in timings.values() if c > 0]
        steps = [s for _, _, _, s in timings.values() if s > 0]
        # The compute scale comes from the median worker's measured/predicted ratio, so that a
        # straggler (flagged or not yet) does not inflate it: its speed is the detector's
        # business, and counting it in both would double its slowdown in every prediction.
        ratios = sorted(c / (n * self.mb_seconds * self.detector.flagged.get(w, 1.0))
                        for w, (c, n, _, _) in timings.items() if n > 0 and c > 0)
        if not comm or not steps or not ratios:
            return
        # A plan is immutable: compared by identity, not by its JSON.
        if self._predicted is None or self._predicted[0] is not self.plan or self._predicted[1] != self.alive:
            dead = frozenset(set(self.plan.devices) - self.alive)
            est = estimate(self.plan, self.workload(), self.cluster(), Coefficients(), dead, self._rerouted_extra())
            self._predicted = (self.plan, self.alive, est.compute, est.allreduce)
        *_, pc, pm = self._predicted
        compute = pc * ratios[len(ratios) // 2]
        self.calibrator.observe(StepSample(pc, pm, compute, sum(comm) / len(comm), max(steps)))

    def _plan_share(self, d: int) -> int:
        where = self.plan.locate(d)
        return self.plan.pipelines[where[0]].microbatches if where else 0

    def _apply(self, d: Decision, alive: frozenset[int], idle: frozenset = frozenset()) -> None:
        """Carry ``d``'s plan and allocation over ``alive``; ``idle``: joiners, who hold no part
        of the plan when it is kept (members with no micro-batch until a later Decision)."""
        o = d.choice
        if o is None or o.policy == "restart":
            raise RestartRequested(d)
        # "wait" carries the rerouted plan and load until the replacement joins
        plan = o.plan if o.plan is not None else self.plan
        batch = o.global_batch or self.current_batch
        idle = idle if o.policy == "keep" else frozenset()
        alloc = self._allocation_of(plan, alive - idle, o.extra, batch)
        if alloc is None:
            raise RestartRequested(d)
        alloc = dict(sorted({**alloc, **{w: 0 for w in idle}}.items()))
        plan, alloc = self._settle(plan, alloc)
        self.plan, self.alive, self.allocation = plan, frozenset(alive), alloc
        self.current_batch = batch
        # The migration plan's migration of a re-plan (transient: the runtime carries it out at once).
        self.last_migration = o.migration
        self._predicted = None

    @property
    def lr_scale(self) -> float:
        """Learning-rate factor for the current global batch (linear scaling rule)."""
        return self.current_batch / self.global_batch

    def _allocation_of(self, plan: Plan, alive, extra, batch: Optional[int] = None) -> Optional[dict[int, int]]:
        if plan.max_depth != 1:
            if self.stages == 1 or plan.num_microbatches != (batch or self.global_batch) // self.micro_batch:
                return None
            # Micro-batches each alive device computes a hop of: its pipeline's, plus the
            # rerouted ones it takes for a dead same-stage peer.
            alloc = {w: 0 for w in alive}
            for p in plan.pipelines:
                for d in p.devices:
                    if d in alloc:
                        alloc[d] += p.microbatches
            for w, e in extra.items():
                if w in alloc:
                    alloc[w] += int(round(e))
            return dict(sorted(alloc.items()))
        alloc = {w: 0 for w in alive}
        for p in plan.pipelines:
            if p.devices[0] in alloc:
                alloc[p.devices[0]] += p.microbatches
        for w, e in extra.items():
            if w in alloc:
                alloc[w] += int(round(e))
        if sum(alloc.values()) != (batch or self.global_batch) // self.micro_batch:
            return None
        return dict(sorted(alloc.items()))

    def _set_allocation(self, plan: Plan, extra) -> None:
        alloc = self._allocation_of(plan, self.alive, extra)
        if alloc is None:
            raise ValueError(f"plan {plan.describe()} is not a data-parallel allocation of "
                             f"{self.global_batch // self.micro_batch} micro-batches")
        self.plan, self.allocation = self._settle(plan, alloc)

    def _settle(self, plan: Plan, alloc: dict[int, int]) -> tuple[Plan, dict[int, int]]:
        """The executor's allocation constraint (``one_each``) on a data-parallel plan: when it
        changes the counts, the plan becomes the data-parallel plan that runs them (one
        pipeline per live member, nothing rerouted), so estimates and the next Decision start
        from what really runs."""
        if not self.one_each or plan.max_depth != 1:
            return plan, alloc
        members = list(alloc)
        counts = at_least_one_each(list(alloc.values()), members)
        if counts == list(alloc.values()):
            return plan, alloc
        bounds = plan.pipelines[0].bounds
        return (Plan(tuple(Pipeline((w,), bounds, m) for w, m in zip(members, counts)),
                     shard_degree=plan.shard_degree),
                dict(zip(members, counts)))

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {
            "plan": self.plan.to_json() if self.plan else None,
            "alive": sorted(self.alive),
            "allocation": [[w, n] for w, n in sorted(self.allocation.items())],
            "current_batch": self.current_batch,
            "mb_seconds": self.mb_seconds, "warm": list(self._warm),
            "rebuild_s": self.rebuild_s, "search_s": self.search_s,
            "calibrator": [list(vars(s).values()) for s in self.calibrator.samples],
            "detector": self.detector.state_dict(),
            "straggler_check": {"recent": list(self._recent), "check": self._check,
                                "undos": [[r, n] for r, n in sorted(self._undos.items())]},
            "estimator": self.estimator.state_dict(),
            "state_bytes": [self.weight_bytes, self.optim_bytes],
            "migrating_from": self.migrating_from,
            "pipeline_calibration": self.pipe_cal.state_dict() if self.stages > 1 else None,
            # The fit itself and where the refit schedule stands: a member that loads this state
            # between two refits must hold the same figures as the one it came from.
            "pipeline_fit": self.fit.to_json() if self.fit else None,
            "pipeline_refit": [self._steps_since_fit, list(self._residual_key) if self._residual_key else None],
            "agree_s": self.agree_s, "observe_since_s": self._since_s,
            "replacements_used": [[n, k] for n, k in sorted(self.replacements_used.items())],
            "replacement": {"eta_s": self.replacement_eta_s, "delays": list(self.replacement_delays),
                            "lost_at": [[d, t] for d, t in sorted(self._lost_at.items())]},
        }

    def load_state_dict(self, s: dict) -> None:
        self.plan = Plan.from_json(s["plan"]) if s["plan"] else None
        self.alive = frozenset(int(w) for w in s["alive"])
        self.allocation = {int(w): int(n) for w, n in s["allocation"]}
        self.current_batch = int(s.get("current_batch", self.global_batch))
        self.mb_seconds, self._warm = s["mb_seconds"], list(s["warm"])
        self.rebuild_s = float(s["rebuild_s"])
        self.search_s = float(s.get("search_s", 0.0))
        self.calibrator.samples.clear()
        for v in s["calibrator"]:
            self.calibrator.observe(StepSample(*v))
        self.detector = StragglerDetector(**self._detector_opts)
        self.detector.load_state_dict(s["detector"])
        check = s.get("straggler_check", {})
        self._recent = deque(check.get("recent", []), maxlen=self.verify_steps)
        self._check = check.get("check")
        self._undos = {int(r): int(n) for r, n in check.get("undos", [])}
        self.estimator = FailureRateEstimator.from_state_dict(s["estimator"])
        self.weight_bytes, self.optim_bytes = (int(x) for x in s.get("state_bytes", (4, 8)))
        self.migrating_from = s.get("migrating_from")
        self.agree_s = float(s.get("agree_s", 0.0))
        self._since_s = float(s.get("observe_since_s", 0.0))
        self.replacements_used = {int(n): int(k) for n, k in s.get("replacements_used", [])}
        rep = s.get("replacement")
        if rep is not None:
            self.replacement_eta_s = rep["eta_s"]
            self.replacement_delays = [float(x) for x in rep["delays"]]
            self._lost_at = {int(d): float(t) for d, t in rep["lost_at"]}
        if s.get("pipeline_calibration") is not None:
            self.pipe_cal.load_state_dict(s["pipeline_calibration"])
            self.fit = PipelineFit.from_json(s["pipeline_fit"]) if s.get("pipeline_fit") else None
            since, key = s.get("pipeline_refit") or (0, None)
            self._steps_since_fit = int(since)
            self._residual_key = (key[0], tuple(key[1])) if key else None
        self._predicted = None


def layer_params(model: "torch.nn.Module") -> list[int]:
    """Parameters of each parameterised top-level child (the engine's layers), plus the
    model's own direct parameters as one more layer when it has any."""
    sizes = [sum(p.numel() for p in child.parameters()) for child in model.children()]
    own = sum(p.numel() for p in model.parameters(recurse=False))
    return [s for s in sizes if s > 0] + ([own] if own else []) or [max(1, own)]
