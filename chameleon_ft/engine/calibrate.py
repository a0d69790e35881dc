"""Calibration: fit the performance model's coefficients to step timings the job observed.

The model predicts, for a step, compute seconds and communication seconds; the job measures
the same phases.  :func:`fit_coefficients` solves two least-squares problems through the origin
(observed compute = ``compute_scale`` · predicted compute, observed communication =
``comm_scale`` · predicted communication) and takes the per-step overhead as the median
residual of whole steps.  :func:`fit_link` fits a link's alpha (latency) and beta (bandwidth)
from timed all-reduces of known sizes with non-negative least squares.  :class:`Calibrator`
keeps a bounded window of recent samples so estimates follow the real job as it changes.
:class:`PipelineCalibrator` fits the pipeline terms the same way, online: per-block forward and
backward seconds and per-device speeds from what every stage measured, the effective links of
point-to-point messages, of the step's all-reduce and of migrations, and the per-step overhead.

Limits: a phase that was never observed keeps its prior coefficient; with fewer than
``min_samples`` samples nothing is fitted.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import numpy.ma  # noqa: F401  np.median imports it on first use: 27 ms, seen inside a recovery

from chameleon_ft.engine.cluster import Link
from chameleon_ft.engine.perf import Coefficients


def _nnls(a, b):
    """Non-negative least squares, as ``scipy.optimize.nnls`` returns it: ``(x, residual norm)``.

    Every fit here has two unknowns (a latency and a cost per byte), and importing scipy.optimize
    costs about a second of a core: the pipeline runtime's first fit, a few steps into every job,
    did it in every worker's main thread at once (8 workers on 2 cores: a 3-4 s stall, seen, and
    heartbeats starved with it).  With at most three unknowns the exact answer is found without
    it: the optimum is the unconstrained least-squares solution on its own support, so the best of
    the non-negative solutions over every support is the optimum (``tests/engine`` checks it
    against scipy).  Larger systems use scipy, imported on first use."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    k = a.shape[1]
    if k > 3:
        from scipy.optimize import nnls

        return nnls(a, b)
    best = (np.zeros(k), float(np.linalg.norm(b)))  # the empty support
    for mask in range(1, 2 ** k):
        cols = [j for j in range(k) if mask >> j & 1]
        sol = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
        if (sol < 0).any():
            continue
        x = np.zeros(k)
        x[cols] = sol
        res = float(np.linalg.norm(a @ x - b))
        if res < best[1] - 1e-12 * max(1.0, best[1]):
            best = (x, res)
    return best


@dataclass(frozen=True)
class StepSample:
    """One observed step: what the model predicted and what the job measured (seconds)."""

    predicted_compute: float
    predicted_comm: float
    observed_compute: float
    observed_comm: float
    observed_step: float


@dataclass(frozen=True)
class CollectiveSample:
    """One timed ring all-reduce over ``n`` participants of ``nbytes``."""

    n: int
    nbytes: float
    observed_s: float


def _ratio_fit(pred: np.ndarray, obs: np.ndarray, prior: float) -> float:
    """Least-squares slope through the origin; the prior when nothing was predicted."""
    denom = float(pred @ pred)
    return float(pred @ obs) / denom if denom > 0 else prior


def fit_coefficients(
    samples: Sequence[StepSample], prior: Coefficients = Coefficients(), min_samples: int = 3
) -> Coefficients:
    if len(samples) < min_samples:
        return prior
    pc = np.array([s.predicted_compute for s in samples])
    oc = np.array([s.observed_compute for s in samples])
    pm = np.array([s.predicted_comm for s in samples])
    om = np.array([s.observed_comm for s in samples])
    st = np.array([s.observed_step for s in samples])
    if not all(np.all(np.isfinite(a)) for a in (pc, oc, pm, om, st)):
        raise ValueError("predicted and observed step timings must be finite numbers")
    if any(np.any(a < 0) for a in (pc, oc, pm, om, st)):
        raise ValueError("predicted and observed step timings must be non-negative")
    cs = _ratio_fit(pc, oc, prior.compute_scale)
    ms = _ratio_fit(pm, om, prior.comm_scale)
    overhead = float(np.median(st - cs * pc - ms * pm))
    return Coefficients(compute_scale=max(cs, 1e-9), comm_scale=max(ms, 0.0), step_overhead_s=max(overhead, 0.0))


def fit_link(samples: Iterable[CollectiveSample], prior: Link | None = None) -> Link:
    """Alpha-beta fit of a ring all-reduce: t = alpha·2(n-1) + (1/beta)·2(n-1)/n·bytes."""
    rows, obs = [], []
    for s in samples:
        if s.n > 1:
            rows.append([2 * (s.n - 1), 2 * (s.n - 1) / s.n * s.nbytes])
            obs.append(s.observed_s)
    if len(rows) < 2:
        if prior is None:
            raise ValueError("need at least two all-reduce samples over 2+ participants to fit a link")
        return prior
    (alpha, inv_bw), _ = _nnls(np.array(rows), np.array(obs))
    if inv_bw <= 0:
        # Sizes too small to see bandwidth: keep the prior's, or call it effectively infinite.
        bw = prior.bandwidth_Bps if prior else 1e15
    else:
        bw = 1.0 / inv_bw
    return Link(latency_s=float(alpha), bandwidth_Bps=float(bw))


class Calibrator:
    """A sliding window of step samples; ``coefficients()`` refits on demand."""

    def __init__(self, prior: Coefficients = Coefficients(), window: int = 50, min_samples: int = 3):
        self.prior = prior
        self.min_samples = min_samples
        self.samples: deque[StepSample] = deque(maxlen=window)
        self.collectives: deque[CollectiveSample] = deque(maxlen=window)

    def observe(self, sample: StepSample) -> None:
        self.samples.append(sample)

    def observe_collective(self, sample: CollectiveSample) -> None:
        self.collectives.append(sample)

    def coefficients(self) -> Coefficients:
        return fit_coefficients(list(self.samples), self.prior, self.min_samples)

    def link(self, prior: Link) -> Link:
        return fit_link(self.collectives, prior)


def size_bucket(nbytes: float) -> int:
    """A message size's power-of-two bucket (the p2p fit's unit of "one size")."""
    return int(nbytes).bit_length()


def fit_migration(samples: Sequence[tuple[int, float, float]], p2p: Link | None = None) -> Link:
    """The migration link from (transfers on the critical path, their bytes, seconds) samples:
    ``seconds = hops x alpha + bytes / beta``.  Samples whose hops-to-bytes ratios barely differ
    (one migration, or several alike) cannot tell ``alpha`` from ``beta`` -- non-negative least
    squares then can put a 1 MB heal's 5.3 s into latency alone and price a 10-transfer re-plan
    at 50 s (the ``slowlink`` trace) -- so ``alpha`` is then the point-to-point
    link's latency (the start-up probe tells it from bandwidth) and only ``beta`` is fitted."""
    rows = np.array([[r, nb] for r, nb, _ in samples], dtype=float)
    t = np.array([x for *_, x in samples], dtype=float)
    ratios = rows[:, 0] / np.maximum(rows[:, 1], 1.0)
    if len(samples) >= 2 and ratios.max() > 2.0 * ratios.min():
        (alpha, inv_bw), _ = _nnls(rows, t)
    else:
        alpha = p2p.latency_s if p2p is not None else 0.0
        rest = np.maximum(t - rows[:, 0] * alpha, 0.0)
        inv_bw = float(rows[:, 1] @ rest / max(float(rows[:, 1] @ rows[:, 1]), 1e-30))
    return Link(latency_s=float(alpha), bandwidth_Bps=float(1 / inv_bw) if inv_bw > 0 else 1e15)


def fit_p2p(sizes: Sequence[float], seconds: Sequence[float], prior: Link | None = None) -> Link:
    """Alpha-beta fit of point-to-point messages: ``t = alpha + bytes / beta`` (non-negative
    least squares through each size's median).  With one message size the two cannot be told apart: the time is then
    charged to ``beta`` (the prior's latency kept, or none), which predicts that size exactly."""
    x = np.asarray(sizes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if len(x) == 0:
        if prior is None:
            raise ValueError("need point-to-point samples to fit a link")
        return prior
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(t))) or np.any(x < 0) or np.any(t < 0):
        raise ValueError("message sizes and times must be finite and non-negative")
    if np.ptp(x) > 0.1 * max(float(x.max()), 1.0):
        # Fitted through each message size's median (sizes grouped by power of two): the
        # times are heavy-tailed (a receiver that posts late, a busy core), and the many
        # messages of one size would otherwise outweigh the few of another.
        groups: dict[int, list[int]] = {}
        for i, v in enumerate(x):
            groups.setdefault(size_bucket(v), []).append(i)
        gx = np.array([np.median(x[ix]) for ix in groups.values()])
        gt = np.array([np.median(t[ix]) for ix in groups.values()])
        (alpha, inv_bw), _ = _nnls(np.column_stack([np.ones_like(gx), gx]), gt)
        if inv_bw > 0:
            return Link(latency_s=float(alpha), bandwidth_Bps=float(1.0 / inv_bw))
    alpha = min(prior.latency_s if prior else 0.0, float(np.median(t)))
    rest = float(np.median(t)) - alpha
    size = float(np.median(x))
    if rest <= 0 or size <= 0:  # all latency: bandwidth effectively infinite
        return Link(latency_s=float(np.median(t)), bandwidth_Bps=1e18)
    return Link(latency_s=alpha, bandwidth_Bps=size / rest)


@dataclass(frozen=True)
class PipelineFit:
    """What :class:`PipelineCalibrator` measured: per-block forward/backward seconds per
    micro-batch on a speed-1.0 device, each block's output bytes, each device's speed, the
    effective links of point-to-point messages, of the step's all-reduce and of migrations
    (None: not observed yet) and the per-step overhead the model does not explain."""

    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    out_bytes: tuple[int, ...]
    speeds: dict[int, float]
    p2p: Link | None
    collective: Link | None
    migration: Link | None
    step_overhead_s: float
    task_overhead_s: float = 0.0  # per forward or backward task, beyond compute and wire
    optimizer_s_per_param: float = 0.0
    hop_overhead_s: float = 0.0  # per 1F1B slot of a multi-stage pipeline, unexplained otherwise

    def to_json(self) -> dict:
        def link(l: Link | None):
            return None if l is None else {"latency_s": l.latency_s, "bandwidth_Bps": l.bandwidth_Bps}
        return {"blocks": [[f, b, o] for f, b, o in zip(self.fwd_s, self.bwd_s, self.out_bytes)],
                "speeds": {str(d): s for d, s in sorted(self.speeds.items())},
                "p2p": link(self.p2p), "collective": link(self.collective),
                "migration": link(self.migration), "step_overhead_s": self.step_overhead_s,
                "task_overhead_s": self.task_overhead_s, "optimizer_s_per_param": self.optimizer_s_per_param,
                "hop_overhead_s": self.hop_overhead_s}

    @classmethod
    def from_json(cls, d: dict) -> "PipelineFit":
        def link(x):
            return None if x is None else Link(float(x["latency_s"]), float(x["bandwidth_Bps"]))
        blocks = d.get("blocks", [])
        return cls(tuple(float(b[0]) for b in blocks), tuple(float(b[1]) for b in blocks),
                   tuple(int(b[2]) for b in blocks), {int(k): float(v) for k, v in d.get("speeds", {}).items()},
                   link(d.get("p2p")), link(d.get("collective")), link(d.get("migration")),
                   float(d.get("step_overhead_s", 0.0)), float(d.get("task_overhead_s", 0.0)),
                   float(d.get("optimizer_s_per_param", 0.0)), float(d.get("hop_overhead_s", 0.0)))


class PipelineCalibrator:
    """Online calibration of the pipeline terms of the performance model, from the live job.

    Fed once per committed step with what every member measured (shared by the step's
    all-reduce, so every member holds the same figures):

    * ``blocks``: per (device, block) the summed forward and backward seconds and the number of
      micro-batches, and the block's output bytes.  A block's cost is the *fastest* holder's
      median time per micro-batch over the window (the fastest copy runs at nominal speed); a
      device's speed is the median over its blocks of cost / its own time.  Devices are compared
      through the blocks they share: a slowdown of every holder of a block is read as the
      block's cost until a re-plan mixes holders (stated limit).
    * point-to-point messages: (bytes, seconds) of sends whose receiver was already waiting,
      so the time is the transfer, not the sender's compute (:func:`fit_p2p`);
    * the step's all-reduce over ``n`` members of ``nbytes`` (the fastest member's time: the
      others include waiting for the last to arrive) -> :func:`fit_link`;
    * migrations: (transfers on the critical path, their bytes, seconds) -- the migration plan's
      ``critical_path``: rounds are an order, not barriers;
    * per task (a stage's forward or backward of one micro-batch), the seconds beyond its
      blocks' compute, the wait for its input and the wire: the runtime's per-task cost;
    * the optimizer step's seconds per parameter updated;
    * the step's measured seconds with the model's prediction from the fitted terms: the median
      residual is a per-slot cost of the hand-off between stages while the plan has
      multi-stage pipelines, else the per-step overhead (framework, Python).

    The window keeps the last ``window`` steps, so the figures follow the job (a straggler
    that appears, a re-plan that changes who holds what)."""

    def __init__(self, window: int = 20, min_steps: int = 3):
        self.window, self.min_steps = int(window), int(min_steps)
        self.blocks: deque = deque(maxlen=self.window)  # {(d, b): (fwd per mb, bwd per mb)}
        self.out_bytes: dict[int, int] = {}
        # (bytes, seconds) per message size (a power-of-two bucket): a size seen once (the
        # runtime's start-up link probe) keeps its samples beside the steps' many messages of
        # one size, which alone cannot tell latency from bandwidth (``fit_p2p``).
        self._p2p: dict[int, deque] = {}
        self.collectives: deque[CollectiveSample] = deque(maxlen=self.window)
        self.migrations: deque = deque(maxlen=8)  # (critical-path transfers, their bytes, seconds)
        self.residuals: deque = deque(maxlen=self.window)
        self.hop_residuals: deque = deque(maxlen=self.window)
        self.task_costs: deque = deque(maxlen=self.window)
        self.optimizer_costs: deque = deque(maxlen=self.window)

    def observe_step(self, times: dict[tuple[int, int], tuple[float, float, int]],
                     out_bytes: dict[int, int] | None = None, tasks: tuple[float, int] = (0.0, 0),
                     optimizer: tuple[float, float] = (0.0, 0.0)) -> None:
        """``times[(device, block)] = (forward seconds, backward seconds, micro-batches)``;
        ``tasks``: (seconds of the step's tasks beyond compute and waiting, number of tasks);
        ``optimizer``: (optimizer seconds, parameters updated), summed over the members."""
        if tasks[1] > 0 and math.isfinite(tasks[0]) and tasks[0] >= 0:
            self.task_costs.append(tasks[0] / tasks[1])
        if optimizer[1] > 0 and math.isfinite(optimizer[0]) and optimizer[0] > 0:
            self.optimizer_costs.append(optimizer[0] / optimizer[1])
        per_mb = {}
        for key, (f, b, n) in times.items():
            if n > 0 and f >= 0 and b >= 0 and math.isfinite(f) and math.isfinite(b):
                per_mb[key] = (f / n, b / n)
        if per_mb:
            self.blocks.append(per_mb)
        for blk, nb in (out_bytes or {}).items():
            if nb > 0:
                self.out_bytes[int(blk)] = int(nb)

    def observe_p2p(self, nbytes: float, seconds: float) -> None:
        if math.isfinite(nbytes) and math.isfinite(seconds) and nbytes >= 0 and seconds >= 0:
            self._p2p.setdefault(size_bucket(nbytes), deque(maxlen=8 * self.window)).append((float(nbytes), float(seconds)))

    @property
    def p2p(self) -> list[tuple[float, float]]:
        """Every kept message sample, (bytes, seconds), by size."""
        return [x for _, q in sorted(self._p2p.items()) for x in q]

    def observe_collective(self, sample: CollectiveSample) -> None:
        if sample.observed_s > 0 and math.isfinite(sample.observed_s) and math.isfinite(sample.nbytes) \
                and sample.nbytes >= 0:
            self.collectives.append(sample)

    def observe_migration(self, hops: int, nbytes: float, seconds: float) -> None:
        if hops > 0 and seconds > 0 and math.isfinite(seconds) and math.isfinite(nbytes) and nbytes >= 0:
            self.migrations.append((int(hops), float(nbytes), float(seconds)))

    def observe_residual(self, seconds: float, slots: int = 0) -> None:
        """Measured step minus the model's step without overheads (may be negative: noise).
        ``slots``: the 1F1B slots (``m + e + p - 1``) of the running plan's slowest pipeline when it
        has several stages -- the residual is then read as a per-slot cost of the hand-off
        between stages (a plan without stages cannot tell it apart, and vice versa); 0: a
        per-step overhead."""
        if math.isfinite(seconds):
            if slots > 0:
                self.hop_residuals.append(float(seconds) / slots)
            else:
                self.residuals.append(float(seconds))

    @property
    def ready(self) -> bool:
        return len(self.blocks) >= self.min_steps

    def block_costs(self, num_blocks: int) -> tuple[list[float], list[float], dict[int, float]]:
        """(forward s, backward s per block at speed 1.0, speed per device)."""
        samples: dict[tuple[int, int], list[tuple[float, float]]] = {}
        for step in self.blocks:
            for key, v in step.items():
                samples.setdefault(key, []).append(v)
        med = {k: (float(np.median([f for f, _ in v])), float(np.median([b for _, b in v])))
               for k, v in samples.items()}
        fwd, bwd = [0.0] * num_blocks, [0.0] * num_blocks
        for b in range(num_blocks):
            holders = [(f + bw, f, bw) for (d, bb), (f, bw) in med.items() if bb == b]
            if holders:
                _, fwd[b], bwd[b] = min(holders)
        speeds: dict[int, float] = {}
        for d in sorted({d for d, _ in med}):
            ratios = [(fwd[b] + bwd[b]) / (f + bw) for (dd, b), (f, bw) in med.items()
                      if dd == d and f + bw > 0 and fwd[b] + bwd[b] > 0]
            if ratios:
                speeds[d] = float(min(1.0, np.median(ratios)))
        return fwd, bwd, speeds

    def fit(self, num_blocks: int, prior_p2p: Link | None = None) -> PipelineFit | None:
        if not self.ready:
            return None
        fwd, bwd, speeds = self.block_costs(num_blocks)
        samples = self.p2p
        p2p = fit_p2p(*zip(*samples), prior=prior_p2p) if samples else None
        coll = fit_link(self.collectives, None) if sum(s.n > 1 for s in self.collectives) >= 2 else None
        mig = fit_migration(self.migrations, p2p) if self.migrations else None
        overhead = float(np.median(self.residuals)) if self.residuals else 0.0
        task = float(np.median(self.task_costs)) if self.task_costs else 0.0
        opt = float(np.median(self.optimizer_costs)) if self.optimizer_costs else 0.0
        hop = float(np.median(self.hop_residuals)) if self.hop_residuals else 0.0
        return PipelineFit(tuple(fwd), tuple(bwd), tuple(self.out_bytes.get(b, 0) for b in range(num_blocks)),
                           speeds, p2p, coll, mig, max(0.0, overhead), task, opt, max(0.0, hop))

    def state_dict(self) -> dict:
        return {"blocks": [[[d, b, f, bw] for (d, b), (f, bw) in step.items()] for step in self.blocks],
                "out_bytes": [[b, n] for b, n in sorted(self.out_bytes.items())],
                "p2p": [list(x) for x in self.p2p],
                "collectives": [[s.n, s.nbytes, s.observed_s] for s in self.collectives],
                "migrations": [list(x) for x in self.migrations],
                "residuals": list(self.residuals), "task_costs": list(self.task_costs),
                "optimizer_costs": list(self.optimizer_costs), "hop_residuals": list(self.hop_residuals)}

    def load_state_dict(self, s: dict) -> None:
        self.blocks.clear()
        for step in s.get("blocks", []):
            self.blocks.append({(int(d), int(b)): (float(f), float(bw)) for d, b, f, bw in step})
        self.out_bytes = {int(b): int(n) for b, n in s.get("out_bytes", [])}
        self._p2p.clear()
        for nbytes, sec in s.get("p2p", []):
            self.observe_p2p(nbytes, sec)
        self.collectives.clear()
        self.collectives.extend(CollectiveSample(int(n), float(nb), float(t)) for n, nb, t in s.get("collectives", []))
        self.migrations.clear()
        self.migrations.extend((int(r), float(nb), float(t)) for r, nb, t in s.get("migrations", []))
        self.residuals.clear()
        self.residuals.extend(float(x) for x in s.get("residuals", []))
        self.task_costs.clear()
        self.task_costs.extend(float(x) for x in s.get("task_costs", []))
        self.optimizer_costs.clear()
        self.optimizer_costs.extend(float(x) for x in s.get("optimizer_costs", []))
        self.hop_residuals.clear()
        self.hop_residuals.extend(float(x) for x in s.get("hop_residuals", []))
