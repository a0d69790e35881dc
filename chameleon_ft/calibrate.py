"""Calibration: fit the performance model's coefficients to step timings the job observed.

The model predicts, for a step, compute seconds and communication seconds; the job measures
the same phases.  :func:`fit_coefficients` solves two least-squares problems through the origin
(observed compute = ``compute_scale`` · predicted compute, observed communication =
``comm_scale`` · predicted communication) and takes the per-step overhead as the median
residual of whole steps.  :func:`fit_link` fits a link's alpha (latency) and beta (bandwidth)
from timed all-reduces of known sizes with non-negative least squares.  :class:`Calibrator`
keeps a bounded window of recent samples so estimates follow the real job as it changes.

Limits: a phase that was never observed keeps its prior coefficient; with fewer than
``min_samples`` samples nothing is fitted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
from scipy.optimize import nnls

from .cluster import Link
from .perf import Coefficients


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
    (alpha, inv_bw), _ = nnls(np.array(rows), np.array(obs))
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
