"""The selector: for one event, build every candidate response, score it, pick one.

Candidates (each with predicted step time, transition time, memory, global batch and score, or
the reason it is ruled out):

* ``reroute`` — keep the layout; a dead device's micro-batches go to its same-stage data-parallel
  peers (devices in other pipelines holding the same layers).  Ruled out when a stage lost all of
  its replicas.  Transition: the group rebuild only.
* ``replan`` — dynamic parallelism: the planner's best plan over the survivors and the migration plan's
  migration.  Transition: search + migration + rebuild.  When a replacement is expected (and the
  plans have stages), scored over two phases like ``wait``: the re-planned layout until it
  arrives, then grown back -- or, when it arrives before the migration ends, nothing until the
  runtime has undone the re-plan and healed it (``_grow_back``).
* ``shrink`` — drop the broken replicas and their micro-batches (smaller global batch; learning
  rate scaled linearly, ``lr · B'/B``).  Only when the user allows the global batch to change.
* ``wait`` — a replacement is expected within ``replacement_eta_s``: reroute until it arrives,
  then pause to heal it from a peer, then run the full plan (scored over both phases).
* ``restart`` — checkpoint-restart over the survivors: restart cost plus the steps since the
  checkpoint, redone.  The fallback when nothing in place is feasible.
* ``recompute`` / ``rehabilitate`` — only when some state has no surviving replica (see
  :mod:`chameleon_ft.engine.rehab`).
* ``keep`` / ``rebalance`` — for stragglers: carry on, or give the slow device fewer micro-batches
  (and re-split layers); ``keep`` / ``heal`` / ``grow`` for a device that joined: ignore it, put
  it into a slot that a rerouted-around device left (its state copied from a peer), or re-plan
  over everyone.

Score = ``(B / t_step) · (D − t_transition) / D``: samples per second over the expected time to
the next failure ``D``, discounted by the time spent getting there.  An option that goes through
phases (``wait``: rerouted, a pause to heal, the full plan) scores the samples of every phase
that falls within ``D``, divided by ``D`` (:func:`phased_score`).  Ties go to the shorter
transition, then to the candidate listed first (the order above).  Decisions are deterministic for the same inputs and serialise
to JSON.
"""

from __future__ import annotations

import gc
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from collections import Counter
from itertools import chain

from chameleon_ft.engine.cluster import Cluster
# The decision types, the scoring and the reroute arithmetic live in their own modules; they
# are re-exported here, where they were first defined.
from chameleon_ft.engine.decision import Decision, Option, crossover_mttf, phased_score, score  # noqa: F401
from chameleon_ft.engine.failures import Event, EventKind
from chameleon_ft.engine.perf import Coefficients, estimate
from chameleon_ft.engine.plan import Pipeline, Plan, PlanError, split_and_load
from chameleon_ft.engine.planner import SearchSpace, plan_search, reallocate
from chameleon_ft.engine.rehab import LossTrend, rehab_cost
from chameleon_ft.engine.migration import migrate
from chameleon_ft.engine.reroute import reroute_load, unreplicated  # noqa: F401
from chameleon_ft.engine.workload import Workload

POLICIES = ("reroute", "replan", "shrink", "wait", "restart", "recompute", "rehabilitate",
            "keep", "rebalance", "heal", "grow")
BATCH_CHANGING = frozenset({"shrink"})


@dataclass(frozen=True)
class SelectorConfig:
    allowed: frozenset[str] = frozenset(POLICIES)
    allow_batch_change: bool = False
    replacement_eta_s: float | None = None  # a replacement is expected this soon (None: not expected)
    rebuild_s: float = 0.1  # re-forming process groups in place
    restart_s: float = 60.0  # checkpoint-restart: relaunch, re-import, load, re-form
    snapshot_load_s: float = 1.0  # loading lost state from an in-memory/disk snapshot
    steps_since_checkpoint: int = 0
    steps_since_snapshot: int = 0
    mttf_s: float | None = None  # override D (else the caller's estimate)
    # Un-overlapped plan-search time charged to re-planning candidates.  A constant (the runtime
    # passes the last measured one) so that a decision is a pure function of its inputs.
    search_s: float = 0.0
    space: SearchSpace = SearchSpace()
    # A straggler rebalance of a pipeline plan may re-split its layers (a migration between two
    # steps); False: it only moves micro-batches between the running pipelines (no state moves).
    straggler_relayout: bool = True
    # A re-plan's (or grow's) migration runs while the job trains on the running layout
    # (rerouted around the dead), switching at a step boundary once the state has moved: its
    # transition is the search and the rebuild only, the migration's seconds a rerouted phase.
    overlap_migration: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.allowed) - set(POLICIES)
        if unknown:
            raise ValueError(f"unknown policies {sorted(unknown)}; known: {', '.join(POLICIES)}")
        object.__setattr__(self, "allowed", frozenset(self.allowed))
        for name in ("rebuild_s", "restart_s", "snapshot_load_s", "search_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.replacement_eta_s is not None and self.replacement_eta_s < 0:
            raise ValueError("replacement_eta_s must be >= 0")


@dataclass
class JobState:
    """What the selector needs to know about the running job."""

    workload: Workload
    cluster: Cluster  # every device the job knows, alive or not
    plan: Plan  # the plan running when the event happened
    alive: frozenset[int]
    coeffs: Coefficients = Coefficients()
    loss: LossTrend | None = None
    lr: float | None = None


@contextmanager
def _no_cyclic_gc():
    """Python's cyclic collector off for one decision.  A decision at 131k devices makes
    hundreds of thousands of short-lived objects, all freed by reference counting; the
    collections they triggered walked the job's whole heap (the cluster, the plans) and were a
    third of the decision's time (386 ms median with them, 265 ms without, this machine).
    Cycles made meanwhile are collected after it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def select(event: Event, state: JobState, config: SelectorConfig = SelectorConfig(), mttf_s: float | None = None) -> Decision:
    """Every candidate for ``event``, scored, and the choice."""
    with _no_cyclic_gc():
        return _select(event, state, config, mttf_s)


def _select(event: Event, state: JobState, config: SelectorConfig, mttf_s: float | None) -> Decision:
    t0 = time.perf_counter()
    if config.mttf_s is not None:
        mttf_s = config.mttf_s
    if mttf_s is None or mttf_s <= 0:
        raise ValueError("select() needs the expected time to the next failure (mttf_s > 0)")
    unknown = {d for d in event.devices if d not in state.cluster}
    if unknown:
        raise ValueError(f"event names unknown devices {sorted(unknown)}")
    B = state.workload.global_batch
    if event.removes_devices:
        options, search_s = _failure_options(event, state, config, mttf_s)
    elif event.kind == EventKind.STRAGGLER:
        options, search_s = _straggler_options(event, state, config)
    else:
        options, search_s = _join_options(event, state, config)
    for o in options:
        # ``keep`` (go on with the running plan on a straggler or a joiner) is doing nothing,
        # not a way of recovering: restricting the policies never rules it out (it did, and a
        # job allowed only {replan, restart} restarted when a live member came back).
        if o.feasible and o.policy not in config.allowed and o.policy != "keep":
            o.feasible, o.reason = False, "not in the allowed policies"
        if o.feasible and o.policy in BATCH_CHANGING and not config.allow_batch_change:
            o.feasible, o.reason = False, "changes the global batch (allow_batch_change is off)"
        if o.feasible:
            o.score = (phased_score(o.phases, mttf_s) if o.phases
                       else score(o.global_batch or B, o.step_time, o.transition_s, mttf_s))
    # Equal scores (e.g. a replacement that would arrive after D makes wait = reroute): the
    # shorter transition wins, as less can go wrong during it; then the listed order.
    feasible = [o for o in options if o.feasible]
    best = max(feasible, key=lambda o: (o.score, -o.transition_s), default=None)
    return Decision(event, mttf_s, options, best.policy if best else None, time.perf_counter() - t0, search_s)


def _best_by_score(result, plan, w, cluster, alive, cfg, mttf_s, top: int = 3, running_step=None):
    """The searched plan that scores best once its migration is priced in (a faster plan can
    cost more to reach; overlapped, ``running_step`` is what the job runs meanwhile).  Small
    jobs weigh the ``top`` fastest; large ones only the fastest, to stay within the decision
    budget."""
    k = top if len(alive) <= 4 * cfg.space.global_limit else 1
    best = None
    for cand in result.candidates[:k] or [result.best]:
        mig = migrate(plan, cand.plan, w, cluster, alive)
        t = cand.estimate.step_time
        if running_step is not None and mig.transfers:
            value = phased_score(overlapped_phases(cfg, mig.seconds, running_step, t, w.global_batch)[1], mttf_s)
        else:
            value = score(w.global_batch, t, cfg.search_s + mig.seconds + cfg.rebuild_s, mttf_s)
        if best is None or value > best[0]:
            best = (value, cand, mig)
    return best[1], best[2]


def overlapped_phases(cfg: SelectorConfig, migration_s: float, running_step: float, step: float,
                      batch: int, search: bool = True, running_batch=None) -> tuple[float, tuple]:
    """An overlapped migration (``SelectorConfig.overlap_migration``): (its un-overlapped
    transition -- the search, unless ``search`` is False (a heal), and the rebuild --, the phases:
    the running layout, at ``running_batch`` (default ``batch``), while the state moves, then the
    new one)."""
    u = (cfg.search_s if search else 0.0) + cfg.rebuild_s
    return u, ((u, u + migration_s, running_step, running_batch or batch), (u + migration_s, math.inf, step, batch))


def _overlap(o: Option, running_step, cfg: SelectorConfig) -> None:
    """Price ``o`` (a re-plan or grow with transfers) as overlapped: see ``overlapped_phases``."""
    if running_step is None or o.migration is None or not o.migration.transfers:
        return
    o.transition_s, o.phases = overlapped_phases(cfg, o.migration.seconds, running_step, o.step_time,
                                                 o.global_batch)
    o.breakdown = {**o.breakdown, "overlapped_s": o.migration.seconds, "running_step_s": running_step}


def _option_from_plan(policy: str, plan: Plan, state: JobState, cluster: Cluster, running: bool = False,
                      **kw) -> Option:
    """``running``: the plan the job runs now (``keep``): it fits whatever the memory model
    says (an over-estimate must not leave a straggler or a joiner with nothing feasible)."""
    est = estimate(plan, state.workload, cluster, state.coeffs, kw.pop("dead", frozenset()), kw.get("extra"))
    if not est.fits and not running:
        return Option(policy, False, f"needs more memory than devices {list(est.over_memory[:4])} have")
    return Option(policy, True, step_time=est.step_time, peak_memory=est.peak_memory,
                  plan=plan, breakdown=est.breakdown(), **kw)


def _failure_options(event: Event, state: JobState, cfg: SelectorConfig, mttf_s: float) -> tuple[list[Option], float]:
    w, plan = state.workload, state.plan
    alive = set(state.alive)
    alive.difference_update(event.devices)
    dead = set(plan.device_set.difference(alive))  # earlier reroutes may have left dead devices in the plan
    wanted = cfg.allowed
    B = w.global_batch
    survivors = state.cluster.without(state.cluster.ids_except(alive))
    lost = unreplicated(plan, alive)
    lost_msg = ""
    if lost:
        lost_msg = "no surviving replica of " + ", ".join(f"layers {a}-{b} shard {q}/{k}" for a, b, q, k in lost[:3])
    options: list[Option] = []

    # reroute
    extra, why = reroute_load(plan, dead, alive)
    if "reroute" not in wanted:
        options.append(Option("reroute", False, "not in the allowed policies"))
    elif lost or why:
        options.append(Option("reroute", False, lost_msg or why))
    else:
        o = _option_from_plan("reroute", plan, state, state.cluster, dead=frozenset(dead), extra=extra)
        o.transition_s, o.global_batch = cfg.rebuild_s, _plan_batch(state)
        o.dead = frozenset(dead)
        options.append(o)
    # What an overlapped re-plan runs while its state moves: the layout rerouted around the dead.
    running = None
    if cfg.overlap_migration and plan.max_depth > 1 and not lost and not why:
        rr = options[-1] if options[-1].policy == "reroute" and options[-1].feasible else \
            _option_from_plan("reroute", plan, state, state.cluster, dead=frozenset(dead), extra=extra)
        running = rr.step_time if rr.feasible else None

    # replan (also the layout every other over-the-survivors option restarts with)
    best = mig = None
    search_s = cfg.search_s
    replan_why = "not in the allowed policies"
    t0 = time.perf_counter()
    if wanted & {"replan", "restart", "recompute", "rehabilitate"}:
        try:
            result = plan_search(w, survivors, state.coeffs, cfg.space, survivors=alive, base=plan)
            best, mig = _best_by_score(result, plan, w, survivors, alive, cfg, mttf_s, running_step=running)
        except PlanError as e:
            replan_why = str(e)
    measured = time.perf_counter() - t0
    if best is None:
        options.append(Option("replan", False, replan_why))
    elif lost:
        options.append(Option("replan", False, lost_msg))
    else:
        o = Option(
            "replan", True, step_time=best.estimate.step_time, peak_memory=best.estimate.peak_memory,
            transition_s=search_s + mig.seconds + cfg.rebuild_s, global_batch=B, plan=mig.plan,
            migration=mig, breakdown=best.estimate.breakdown(),
        )
        if cfg.replacement_eta_s is not None and max(plan.max_depth, mig.plan.max_depth) > 1:
            _grow_back(o, plan, dead, state, cfg, running)
        else:
            _overlap(o, running, cfg)
        options.append(o)

    # shrink: drop every pipeline that lost a device (whole shard groups under FSDP)
    k = plan.shard_degree
    broken_groups = {plan.locate(d)[0] // k for d in dead if plan.locate(d) is not None}
    kept = [p for j, p in enumerate(plan.pipelines) if j // k not in broken_groups]
    if not kept:
        options.append(Option("shrink", False, "no intact replica is left"))
    else:
        # Idle survivors (of this and earlier broken replicas) re-form whole replicas, never
        # beyond the batch the plan ran before this failure.
        formed: set[int] = set()
        if k == 1:
            kept, formed = _reform(kept, alive, survivors, plan.num_microbatches)
        shrunk = Plan(tuple(kept), shard_degree=k)
        o = _option_from_plan("shrink", shrunk, state, survivors)
        if o.feasible:
            nb = shrunk.num_microbatches * w.micro_batch  # lr_scale is relative to the workload's batch
            heal = heal_seconds(shrunk, formed, w, survivors) if formed else 0.0
            o.transition_s, o.global_batch, o.lr_scale = heal + cfg.rebuild_s, nb, nb / B
            o.reason = f"global batch {B} -> {nb}, learning rate x{nb / B:.3g} (linear scaling rule)"
            if formed:
                o.reason += f"; {len(formed)} idle devices re-form replicas"
        options.append(o)

    # wait for a replacement: carried out as reroute until it arrives, then healed from a peer
    if cfg.replacement_eta_s is None:
        options.append(Option("wait", False, "no replacement is expected (replacement_eta_s not set)"))
    elif lost or why:
        options.append(Option("wait", False, lost_msg or why))
    else:
        options.append(_wait_option(plan, dead, extra, state, cfg, mttf_s))

    # checkpoint-restart over the survivors
    if "restart" not in wanted:
        options.append(Option("restart", False, "not in the allowed policies"))
    elif best is None:
        options.append(Option("restart", False, f"no plan over the survivors ({replan_why}): restart needs replacements"))
    else:
        redo = cfg.steps_since_checkpoint * best.estimate.step_time
        options.append(Option(
            "restart", True, step_time=best.estimate.step_time, peak_memory=best.estimate.peak_memory,
            transition_s=cfg.restart_s + redo, global_batch=B, plan=best.plan,
            reason=f"restart {cfg.restart_s:g} s + {cfg.steps_since_checkpoint} steps redone",
            breakdown=best.estimate.breakdown(),
        ))

    # state without a surviving replica: roll everyone back, or restore only the lost part
    if lost and best is not None:
        layers = sum(w.params_in(a, b) / kk for a, b, _, kk in lost)
        fraction = layers / max(w.total_params, 1)
        outcome = rehab_cost(cfg.steps_since_snapshot, fraction, state.loss)
        base_s = search_s + mig.seconds + cfg.rebuild_s + cfg.snapshot_load_s
        t = best.estimate.step_time
        options.append(Option(
            "recompute", True, step_time=t, peak_memory=best.estimate.peak_memory,
            transition_s=base_s + outcome.recompute_steps * t, global_batch=B, plan=mig.plan,
            migration=mig, reason=f"roll back {cfg.steps_since_snapshot} steps",
        ))
        if outcome.rehab_steps is None:
            options.append(Option("rehabilitate", False, outcome.reason))
        else:
            options.append(Option(
                "rehabilitate", True, step_time=t, peak_memory=best.estimate.peak_memory,
                transition_s=base_s + outcome.rehab_steps * t, global_batch=B, plan=mig.plan,
                migration=mig, reason=f"{outcome.rehab_steps:.1f} extra steps ({outcome.reason}); "
                f"{fraction:.1%} of the model restored from the snapshot",
            ))
    elif lost:
        for name in ("recompute", "rehabilitate"):
            why = "not in the allowed policies" if name not in wanted else f"no plan over the survivors ({replan_why})"
            options.append(Option(name, False, why))
    return options, measured


def _reform(pipes: list[Pipeline], alive: set[int], cluster: Cluster, budget: int) -> tuple[list[Pipeline], set[int]]:
    """Re-form whole replicas of the most common pipeline shape out of idle alive devices, each
    with that shape's micro-batch count, until the plan's micro-batches reach ``budget``."""
    missing = budget - sum(p.microbatches for p in pipes)
    if missing <= 0 or not pipes:
        return pipes, set()
    shapes = Counter(map(split_and_load, pipes))
    bounds, m = max(shapes, key=lambda k: (shapes[k], k[1]))
    used = set(chain.from_iterable(p.devices for p in pipes))
    loose = sorted(alive.difference(used), key=lambda d: (cluster[d].node, d))
    depth = len(bounds) - 1
    out, added = list(pipes), set()
    while missing > 0 and len(loose) >= depth and m > 0:
        take, loose = loose[:depth], loose[depth:]
        out.append(Pipeline(tuple(take), bounds, min(m, missing)))
        missing -= out[-1].microbatches
        added.update(take)
    return out, added


def _heal_option(event: Event, state: JobState, cfg: SelectorConfig, grown: Cluster, alive: set[int],
                 running=None) -> Option:
    """Put joined devices back without re-planning: into slots that rerouted-around devices left,
    then, while the global batch is below the workload's (after a shrink), as whole replicas of
    the most common pipeline shape.  Every device that comes in receives its state from peers."""
    w, plan = state.workload, state.plan
    vacant = sorted(d for d in plan.devices if d not in state.alive)
    rename: dict[int, int] = {d: d for d in event.devices if d in vacant}  # own slot back first
    free = [v for v in vacant if v not in rename]
    for d in event.devices:
        if d not in rename.values() and free:
            rename[free.pop(0)] = d
    pipes = [replace(p, devices=tuple(rename.get(x, x) for x in p.devices)) for p in plan.pipelines]
    added: set[int] = set(rename.values())
    if plan.shard_degree == 1:
        pipes, formed = _reform(pipes, alive, grown, w.num_microbatches)
        added |= formed
    if not added:
        return Option("heal", False, "no slot left by a failed device and no dropped replica to re-form")
    healed = Plan(tuple(pipes), plan.shard_degree)
    still = {d for d in healed.devices if d not in alive}
    extra, why = reroute_load(healed, still, alive) if still else ({}, "")
    if why:
        return Option("heal", False, why)
    o = _option_from_plan("heal", healed, state, grown, dead=frozenset(still), extra=extra)
    if o.feasible:
        heal = heal_seconds(healed, added, w, grown)
        o.transition_s = heal + cfg.rebuild_s
        o.global_batch = healed.num_microbatches * w.micro_batch
        if running is not None and cfg.overlap_migration and plan.max_depth > 1 and heal > 0:
            # Overlapped (runtime overlap.py): the running layout trains while the copy moves.
            o.transition_s, o.phases = overlapped_phases(cfg, heal, running, o.step_time, o.global_batch,
                                                         search=False, running_batch=_plan_batch(state))
            o.breakdown = {**o.breakdown, "overlapped_s": heal, "running_step_s": running}
        o.dead, o.extra = frozenset(still), extra
        o.reason = f"{len(added)} device(s) healed from peers"
    return o


def _plan_batch(state: JobState) -> int:
    """Global batch the running plan processes (smaller than the workload's after a shrink)."""
    return state.plan.num_microbatches * state.workload.micro_batch


def _rerouted(state: JobState) -> tuple[frozenset[int], dict[int, float]]:
    """Dead devices still in the plan (after reroutes) and the extra load they put on peers."""
    alive = set(state.alive)
    dead = frozenset(set(state.plan.devices) - alive)
    extra, _ = reroute_load(state.plan, set(dead), alive) if dead else ({}, "")
    return dead, extra


def heal_seconds(plan: Plan, dead: set[int], w: Workload, cluster: Cluster) -> float:
    """Each replacement receives its predecessor's layers from a peer, all in parallel."""
    worst = 0.0
    for d in dead:
        where = plan.locate(d)
        if where is None:
            continue
        lo, hi = plan.pipelines[where[0]].layers_of_stage(where[1])
        nbytes = w.params_in(lo, hi) * w.state_bytes_per_param / plan.shard_degree
        worst = max(worst, (cluster.migration or cluster.inter).transfer_s(nbytes))
    return worst


def _wait_option(plan: Plan, dead: set[int], extra: dict[int, float], state: JobState,
                 cfg: SelectorConfig, mttf_s: float) -> Option:
    """Reroute until the replacement arrives (``replacement_eta_s``), then pause to heal it from
    a peer and re-form the groups, then run the healed plan.  Scored by the samples both phases
    process within ``D``, divided by ``D``."""
    w = state.workload
    rerouted = _option_from_plan("wait", plan, state, state.cluster, dead=frozenset(dead), extra=extra)
    healed = estimate(plan, w, state.cluster, state.coeffs)
    if not rerouted.feasible or not healed.fits:
        return rerouted if not rerouted.feasible else Option("wait", False, "the healed plan does not fit in memory")
    eta, rebuild = cfg.replacement_eta_s, cfg.rebuild_s
    heal = heal_seconds(plan, dead, w, state.cluster)
    resume = max(eta, rebuild) + heal + rebuild
    B = _plan_batch(state)
    rerouted.transition_s, rerouted.global_batch = rebuild, B
    rerouted.dead, rerouted.extra = frozenset(dead), extra
    # Overlapped (runtime overlap.py), the rerouted layout trains on while the replacement heals.
    until = resume if cfg.overlap_migration and plan.max_depth > 1 else eta
    rerouted.phases = ((rebuild, until, rerouted.step_time, B), (resume, math.inf, healed.step_time, B))
    rerouted.reason = (f"reroute {rerouted.step_time:.4g} s/step until the replacement arrives "
                       f"(in {eta:g} s), pause {heal + rebuild:.3g} s to heal it, then "
                       f"{healed.step_time:.4g} s/step" + (f"; D = {mttf_s:.3g} s ends before that"
                                                           if resume >= mttf_s else ""))
    rerouted.breakdown = {**rerouted.breakdown, "healed_step_s": healed.step_time,
                          "arrival_s": eta, "heal_s": heal}
    return rerouted


def _grow_back(o: Option, plan: Plan, dead: set[int], state: JobState, cfg: SelectorConfig,
               running=None) -> None:
    """A replacement is expected: a pipeline re-plan runs until it arrives, then the job grows
    back to the plan before the failure (this migration the other way, and the replacement
    healed) -- the phases ``wait`` is scored over too, so that the two compare like for like.
    (A data-parallel re-plan is carried out as a reroute: ``wait`` already prices it.)

    A replacement expected *before the re-plan's state has moved* ends that migration: the
    membership change interrupts the recovery, the runtime undoes the re-plan (nobody dropped a
    block) and heals the replacement into the old plan (``PipelineExecutor.source_payload``).
    Nothing trains until then -- priced so, a re-plan no longer wins there on a layout it would
    never reach (it did on the ``slowlink`` trace, 2026-12-03).  ``running``: the migration is
    overlapped (``overlapped_phases``) and the job runs this step time meanwhile, so also until
    an interrupting replacement arrives; growing back is overlapped too."""
    full = estimate(plan, state.workload, state.cluster, state.coeffs)
    B = o.global_batch
    heal = heal_seconds(plan, dead, state.workload, state.cluster)
    overlap = running is not None and o.migration is not None and bool(o.migration.transfers)
    if overlap:  # u: the un-overlapped part; moved: the state is where the plan wants it
        u, phases = overlapped_phases(cfg, o.migration.seconds, running, o.step_time, B)
        moved = phases[1][0]
    else:
        u = moved = o.transition_s
    if cfg.replacement_eta_s < moved:
        grown = ((cfg.replacement_eta_s + heal + cfg.rebuild_s, math.inf, full.step_time, B),)
        o.phases = ((u, cfg.replacement_eta_s, running, B),) + grown if overlap else grown
        o.transition_s = u
        o.reason = (f"the replacement expected in {cfg.replacement_eta_s:.1f} s arrives during the "
                    f"{o.migration.seconds if overlap else o.transition_s:.1f} s re-plan: its migration would "
                    "be undone and the replacement healed")
        o.breakdown = {**o.breakdown, "grown_step_s": full.step_time, "arrival_s": cfg.replacement_eta_s,
                       "interrupted": 1.0}
        return
    if overlap:
        _overlap(o, running, cfg)
    if not full.fits or full.step_time >= o.step_time:
        return  # the re-planned layout is as fast as the old one: it stays when the replacement comes
    start = max(cfg.replacement_eta_s, moved)
    back = start + o.migration.seconds + heal + cfg.rebuild_s
    if overlap:  # the re-planned layout runs while the state moves back
        o.phases = ((u, moved, running, B), (moved, back, o.step_time, B), (back, math.inf, full.step_time, B))
    else:
        o.phases = ((moved, start, o.step_time, B), (back, math.inf, full.step_time, B))
    o.breakdown = {**o.breakdown, "grown_step_s": full.step_time, "arrival_s": cfg.replacement_eta_s}


def _straggler_options(event: Event, state: JobState, cfg: SelectorConfig) -> tuple[list[Option], float]:
    """``keep`` the running plan with the measured speeds, or ``rebalance``: the best plan for
    them.  The event's slowdown applies to its devices on top of ``state.cluster``'s speeds; a
    slowdown of 1 (a flag cleared, a rebalance undone) re-plans for the speeds as they are.
    The plan's batch is conserved (also after a shrink); ``cfg.space.min_microbatches`` keeps a
    slow device measurable."""
    w, plan = state.workload, state.plan
    speeds = {d: state.cluster[d].speed / event.slowdown for d in event.devices}
    slowed = state.cluster.with_speeds(speeds)
    dead, extra = _rerouted(state)
    keep = _option_from_plan("keep", plan, state, slowed, running=True, dead=dead, extra=extra)
    keep.transition_s, keep.global_batch = 0.0, _plan_batch(state)
    options = [keep]
    alive = set(state.alive)
    t0 = time.perf_counter()
    try:
        pool = slowed.without(set(slowed.ids) - alive)
        if cfg.straggler_relayout or plan.max_depth == 1:
            best = plan_search(w, pool, state.coeffs, cfg.space, survivors=alive, base=plan,
                               num_microbatches=plan.num_microbatches).best
            new, est, rebuild = best.plan, best.estimate, cfg.rebuild_s
        else:  # the runtime moves micro-batches between its running pipelines, no state
            if dead:
                raise PlanError("a rerouted pipeline plan keeps its routes until the next failure Decision")
            new = reallocate(plan, w, pool, state.coeffs, cfg.space.min_microbatches)
            est, rebuild = estimate(new, w, pool, state.coeffs), 0.0
        mig = migrate(plan, new, w, slowed, alive)
        options.append(Option(
            "rebalance", True, step_time=est.step_time, peak_memory=est.peak_memory,
            transition_s=cfg.search_s + mig.seconds + rebuild, global_batch=_plan_batch(state),
            plan=mig.plan, migration=mig, breakdown=est.breakdown(),
            reason=event.detail or f"devices {list(event.devices)} measured {event.slowdown:.2f}x slower",
        ))
    except PlanError as e:
        options.append(Option("rebalance", False, str(e)))
    return options, time.perf_counter() - t0


def _join_options(event: Event, state: JobState, cfg: SelectorConfig) -> tuple[list[Option], float]:
    w, plan = state.workload, state.plan
    B = w.global_batch
    before = frozenset(state.alive) - set(event.devices)  # the joiners hold nothing yet
    state = replace(state, alive=before)
    dead, extra = _rerouted(state)
    keep = _option_from_plan("keep", plan, state, state.cluster, running=True, dead=dead, extra=extra)
    keep.transition_s, keep.global_batch = 0.0, _plan_batch(state)
    options = [keep]
    alive = set(state.alive) | set(event.devices)
    grown = state.cluster.without(set(state.cluster.ids) - alive)
    options.append(_heal_option(event, state, cfg, grown, alive, keep.step_time))
    t0 = time.perf_counter()
    try:
        result = plan_search(w, grown, state.coeffs, cfg.space, survivors=alive, base=plan)
        best = result.best
        mig = migrate(plan, best.plan, w, grown, alive, empty=set(event.devices))
        o = Option("grow", True, step_time=best.estimate.step_time, peak_memory=best.estimate.peak_memory,
                   transition_s=cfg.search_s + mig.seconds + cfg.rebuild_s, global_batch=B,
                   plan=mig.plan, migration=mig, breakdown=best.estimate.breakdown())
        if cfg.overlap_migration and plan.max_depth > 1:
            _overlap(o, keep.step_time, cfg)  # the joiners wait idle while their state moves
        options.append(o)
    except PlanError as e:
        options.append(Option("grow", False, str(e)))
    return options, time.perf_counter() - t0
