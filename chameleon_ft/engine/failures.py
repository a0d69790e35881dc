"""Failure events and the expected time to the next failure (``D``).

An :class:`Event` is what the monitor reports: a fail-stop of some devices, a whole node lost,
a hang (treated as a fail-stop once detected), a straggler with its measured slowdown, or a
replacement that joined.  :class:`FailureRateEstimator` estimates the per-device failure rate
online with a Gamma-Poisson model: a prior (per-device rate and how many device-seconds of
evidence it is worth) updated by failures and exposure seen in this run, so ``D`` starts from
public fleet figures and follows the job.  ``D = 1 / (rate · devices)``.

Prior strength: the fleet rate counts as much as ``PRIOR_JOB_S`` (one day) of *this* job's own
exposure, i.e. ``devices × 1 day`` device-seconds (:meth:`FailureRateEstimator.for_job`).  A
fleet average says little about one job (a flaky node, preemptible instances or injected faults
change the rate by orders of magnitude), so the job's record should take over within its first
day.  Counting the prior as a day of a 16k-GPU fleet instead would make it worth ~1.4e9
device-seconds: a 4-worker job would need ~10 years to move it, and ``D`` would stay at ~4e7 s
whatever it saw.  With one day of this job, the first failure after an hour of a 4-worker job
brings ``D`` from ~4.6e7 s to ~1e5 s (``(α₀ + 1) / (β₀ + exposure)``, α₀ = rate · β₀ ≈ 0.002);
for 16,384 GPUs the prior is worth ~7.8 expected failures, so one failure moves it ~13 %.

Limits: failures are taken as independent and memoryless (exponential inter-arrival times);
correlated bursts (a switch taking out a rack) show up only as node-level events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

# Llama 3 pre-training: 419 unexpected interruptions in 54 days on 16,384 GPUs.
LLAMA3_RATE_PER_DEVICE_S = 419 / (54 * 86400 * 16384)
# The prior counts as this many seconds of the job's own exposure (see the module docstring).
PRIOR_JOB_S = 86400.0


class EventKind(str, Enum):
    FAIL_STOP = "fail_stop"
    NODE_LOSS = "node_loss"
    HANG = "hang"
    STRAGGLER = "straggler"
    JOIN = "join"


@dataclass(frozen=True)
class Event:
    kind: EventKind
    devices: tuple[int, ...]
    time_s: float = 0.0
    slowdown: float = 1.0  # stragglers: measured factor (3.0 = three times slower)
    detail: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", EventKind(self.kind))
        object.__setattr__(self, "devices", tuple(sorted(self.devices)))
        if not self.devices:
            raise ValueError("an event names at least one device")
        if self.slowdown < 1.0:
            raise ValueError("slowdown is a factor >= 1")

    @property
    def removes_devices(self) -> bool:
        return self.kind in (EventKind.FAIL_STOP, EventKind.NODE_LOSS, EventKind.HANG)

    def to_json(self) -> dict:
        out = {"kind": self.kind.value, "devices": list(self.devices), "time_s": self.time_s}
        if self.kind == EventKind.STRAGGLER:
            out["slowdown"] = self.slowdown
        if self.detail:
            out["detail"] = self.detail
        return out


@dataclass
class FailureRateEstimator:
    """Gamma-Poisson estimate of the per-device failure rate (failures per device-second).

    The default prior is worth one device-day: right for a one-device job; use
    :meth:`for_job` to weigh it as a day of a job of any size."""

    prior_rate: float = LLAMA3_RATE_PER_DEVICE_S
    prior_device_s: float = PRIOR_JOB_S  # device-seconds of evidence the prior is worth
    failures: int = 0
    device_s: float = 0.0
    _history: list[float] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.prior_rate <= 0 or self.prior_device_s <= 0:
            raise ValueError("prior rate and prior strength must be positive")

    @classmethod
    def for_job(cls, devices: int, prior_rate: float = LLAMA3_RATE_PER_DEVICE_S,
                prior_job_s: float = PRIOR_JOB_S) -> "FailureRateEstimator":
        """The prior for a job of ``devices`` devices, worth ``prior_job_s`` of its exposure."""
        if devices <= 0:
            raise ValueError("need at least one device")
        return cls(prior_rate, devices * prior_job_s)

    @property
    def evidence(self) -> bool:
        """Whether anything of this run was observed yet."""
        return bool(self.failures or self.device_s)

    def observe(self, devices: int, seconds: float, failures: int = 0) -> None:
        """``devices`` ran for ``seconds`` and ``failures`` of them failed meanwhile."""
        if devices < 0 or seconds < 0 or failures < 0:
            raise ValueError("exposure and failures must be non-negative")
        self.device_s += devices * seconds
        self.failures += failures

    @property
    def rate(self) -> float:
        alpha = self.prior_rate * self.prior_device_s + self.failures
        return alpha / (self.prior_device_s + self.device_s)

    def mttf(self, devices: int) -> float:
        """Expected seconds to the next failure among ``devices`` devices (``D``)."""
        if devices <= 0:
            raise ValueError("need at least one device")
        return 1.0 / (self.rate * devices)

    def state_dict(self) -> dict:
        return {"prior_rate": self.prior_rate, "prior_device_s": self.prior_device_s,
                "failures": self.failures, "device_s": self.device_s}

    @classmethod
    def from_state_dict(cls, d: dict) -> "FailureRateEstimator":
        return cls(float(d["prior_rate"]), float(d["prior_device_s"]), int(d["failures"]), float(d["device_s"]))
