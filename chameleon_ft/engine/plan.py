"""Execution plans: which device runs which layers on how many micro-batches.

A :class:`Plan` is a set of pipelines over device ids.  Pipeline ``j`` has ``p_j`` stages (one
device each); ``bounds`` splits the layer chain among them (stage ``s`` runs layers
``bounds[s]:bounds[s+1]``); it processes ``microbatches`` micro-batches per step under 1F1B.
Pipelines may differ in length and split.  Data parallelism is "many pipelines"; plain DDP is
"many one-stage pipelines".  FSDP/HSDP is expressed with ``shard_degree``: consecutive groups
of ``shard_degree`` pipelines shard their stages' parameters, gradients and optimizer state
(replicate × shard); ``shard_degree == len(pipelines)`` is plain FSDP/ZeRO-3.

Plans are immutable values; :func:`validate` rejects an invalid one with a clear
:class:`PlanError`.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field, replace
from itertools import accumulate, chain
from operator import attrgetter
from typing import Iterable, Iterator

import numpy as np

from chameleon_ft.engine.workload import Workload


_DEVICES, _BOUNDS, _MICROBATCHES = attrgetter("devices"), attrgetter("bounds"), attrgetter("microbatches")
# A pipeline's (layer split, micro-batches): its shape in a plan (the depth is in the split).
split_and_load = attrgetter("bounds", "microbatches")
_SCANNED_LOCATES = 16  # look-ups of a plan answered by a scan before its table is built


class PlanError(ValueError):
    """The plan cannot run: it says which rule it breaks."""


@dataclass(frozen=True)
class Pipeline:
    devices: tuple[int, ...]
    bounds: tuple[int, ...]  # len(devices) + 1 layer boundaries, 0 ... num_layers
    microbatches: int

    def __post_init__(self) -> None:
        if type(self.devices) is not tuple:  # (a plan at 131k devices makes 8k of these)
            object.__setattr__(self, "devices", tuple(self.devices))
        if type(self.bounds) is not tuple:
            object.__setattr__(self, "bounds", tuple(self.bounds))

    @property
    def depth(self) -> int:
        return len(self.devices)

    def layers_of_stage(self, stage: int) -> tuple[int, int]:
        return self.bounds[stage], self.bounds[stage + 1]


@dataclass(frozen=True)
class Slot:
    """Where a device sits in a plan and what state it holds."""

    pipeline: int
    stage: int
    layers: tuple[int, int]
    shard: int  # index within its shard group
    shard_degree: int


@dataclass(frozen=True)
class Plan:
    pipelines: tuple[Pipeline, ...]
    shard_degree: int = 1
    # Derived tables, built on first use (a plan is immutable): device -> (pipeline, stage),
    # the flat device tuple, and ``_memo`` for the rest (the device set and array, the
    # pipelines by split, ``locate``'s scan).
    _where: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _devices: list = field(default_factory=list, init=False, repr=False, compare=False)
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pipelines", tuple(self.pipelines))

    # -- construction -------------------------------------------------------------------
    @staticmethod
    def data_parallel(devices: Iterable[int], workload: Workload, shard_degree: int = 1) -> "Plan":
        """One single-stage pipeline per device, micro-batches spread as evenly as possible."""
        devs = tuple(devices)
        alloc = even_split(workload.num_microbatches, len(devs))
        return Plan(
            tuple(Pipeline((d,), (0, workload.num_layers), m) for d, m in zip(devs, alloc)),
            shard_degree=shard_degree,
        )

    # -- queries ------------------------------------------------------------------------
    @property
    def devices(self) -> tuple[int, ...]:
        if not self._devices:
            self._devices.append(tuple(chain.from_iterable(map(_DEVICES, self.pipelines))))
        return self._devices[0]

    @property
    def device_set(self) -> frozenset[int]:
        """The plan's devices as a set (built once: 131k devices cost milliseconds)."""
        if "device_set" not in self._memo:
            self._memo["device_set"] = frozenset(self.devices)
        return self._memo["device_set"]

    @property
    def num_microbatches(self) -> int:
        return sum(map(_MICROBATCHES, self.pipelines))

    @property
    def max_depth(self) -> int:
        return max(p.depth for p in self.pipelines)

    def locate(self, device: int) -> tuple[int, int] | None:
        """(pipeline, stage) of ``device``, or None when the plan does not use it.

        The first few look-ups scan the flat device tuple (a failure looks up its dead devices
        only: the full table costs ~10 ms at 131k devices); later ones build the table."""
        if self._where:
            return self._where.get(device)
        memo = self._memo
        memo["locates"] = memo.get("locates", 0) + 1
        if memo["locates"] > _SCANNED_LOCATES:
            for j, pipe in enumerate(self.pipelines):
                for s, dev in enumerate(pipe.devices):
                    self._where[dev] = (j, s)
            return self._where.get(device)
        if device not in self.device_set:
            return None
        i = self.devices.index(device)
        ends = self._ends()
        j = bisect_right(ends, i)
        return j, i - (ends[j - 1] if j else 0)

    def by_split(self) -> dict[tuple[int, ...], list[int]]:
        """Pipeline indices by layer split, in order of first use (built once per plan;
        treat as read-only)."""
        if "by_split" not in self._memo:
            splits = list(map(_BOUNDS, self.pipelines))
            code = {b: i for i, b in enumerate(dict.fromkeys(splits))}
            if len(code) == 1:
                out = {splits[0]: list(range(len(splits)))}
            else:  # (grouped in numpy: a Python loop over 8k pipelines was ~6 ms)
                codes = np.fromiter(map(code.__getitem__, splits), dtype=np.int64, count=len(splits))
                out = {b: np.flatnonzero(codes == i).tolist() for b, i in code.items()}
            self._memo["by_split"] = out
        return self._memo["by_split"]

    def loads(self) -> np.ndarray:
        """Each pipeline's micro-batches as a float array (built once per plan; read-only)."""
        if "loads" not in self._memo:
            self._memo["loads"] = np.fromiter(map(_MICROBATCHES, self.pipelines), dtype=float,
                                              count=len(self.pipelines))
        return self._memo["loads"]

    def device_rows(self, members: list[int]) -> np.ndarray:
        """The devices of pipelines ``members`` (all of one depth) as a (pipelines x depth)
        int64 array; a contiguous run of pipelines is a view of the plan's flat device array."""
        depth = len(self.pipelines[members[0]].devices) if members else 0
        if members and members[-1] - members[0] + 1 == len(members):
            flat = self._memo.get("device_array")
            if flat is None:
                flat = self._memo["device_array"] = np.fromiter(self.devices, dtype=np.int64, count=len(self.devices))
            ends = self._ends()
            start = ends[members[0] - 1] if members[0] else 0
            return flat[start:ends[members[-1]]].reshape(len(members), depth)
        return device_matrix([self.pipelines[j] for j in members], depth)

    def _ends(self) -> list[int]:
        """Where each pipeline's devices end in the flat device tuple."""
        ends = self._memo.get("ends")
        if ends is None:
            ends = self._memo["ends"] = list(accumulate(map(len, map(_DEVICES, self.pipelines))))
        return ends

    def templates(self) -> dict[tuple[tuple[int, ...], int], list[int]]:
        """Pipeline indices by (layer split, shard index): the pipelines that hold the same
        state (built once per plan; treat as read-only)."""
        if "templates" not in self._memo:
            k = self.shard_degree
            out: dict[tuple[tuple[int, ...], int], list[int]] = {}
            for j, pipe in enumerate(self.pipelines):
                out.setdefault((pipe.bounds, j % k), []).append(j)
            self._memo["templates"] = out
        return self._memo["templates"]

    def slot(self, device: int) -> Slot:
        where = self.locate(device)
        if where is None:
            raise KeyError(f"device {device} is not in the plan")
        j, s = where
        return Slot(j, s, self.pipelines[j].layers_of_stage(s), j % self.shard_degree, self.shard_degree)

    def slots(self) -> dict[int, Slot]:
        return {d: self.slot(d) for d in self.devices}

    def shard_groups(self) -> Iterator[tuple[int, ...]]:
        """Pipeline indices of each shard group (replicas of one full copy of the model)."""
        k = self.shard_degree
        for g in range(0, len(self.pipelines), k):
            yield tuple(range(g, g + k))

    def with_microbatches(self, alloc: Iterable[int]) -> "Plan":
        return replace(
            self,
            pipelines=tuple(replace(p, microbatches=m) for p, m in zip(self.pipelines, alloc)),
        )

    def to_json(self) -> dict:
        return {
            "shard_degree": self.shard_degree,
            "pipelines": [
                {"devices": list(p.devices), "bounds": list(p.bounds), "microbatches": p.microbatches}
                for p in self.pipelines
            ],
        }

    @staticmethod
    def from_json(data: dict) -> "Plan":
        return Plan(
            tuple(
                Pipeline(tuple(p["devices"]), tuple(p["bounds"]), int(p["microbatches"]))
                for p in data["pipelines"]
            ),
            shard_degree=int(data.get("shard_degree", 1)),
        )

    def describe(self) -> str:
        depths: dict[int, int] = {}
        for p in self.pipelines:
            depths[p.depth] = depths.get(p.depth, 0) + 1
        shape = " + ".join(f"{n}x PP{d}" for d, n in sorted(depths.items()))
        shard = f", shard {self.shard_degree}" if self.shard_degree > 1 else ""
        return f"{shape}{shard} on {len(self.devices)} devices"


def device_matrix(pipes: Iterable[Pipeline], depth: int) -> np.ndarray:
    """The devices of pipelines of one depth as a (pipelines x depth) int64 array (from one
    flat iterator: numpy's conversion of a list of tuples was ~8 ms per 131k devices)."""
    pipes = list(pipes)
    flat = np.fromiter(chain.from_iterable(map(_DEVICES, pipes)), dtype=np.int64, count=len(pipes) * depth)
    return flat.reshape(len(pipes), depth)


def even_split(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` integers differing by at most one, larger ones first."""
    if parts <= 0:
        raise PlanError("cannot split work over zero parts")
    q, r = divmod(total, parts)
    return [q + 1 if i < r else q for i in range(parts)]


def validate(
    plan: Plan,
    workload: Workload,
    available: Iterable[int] | None = None,
    num_microbatches: int | None = None,
) -> None:
    """Raise :class:`PlanError` unless ``plan`` can run ``workload`` on ``available`` devices.

    ``num_microbatches`` defaults to the workload's (global batch conserved exactly)."""
    if not plan.pipelines:
        raise PlanError("the plan has no pipelines")
    # Checked once per distinct (depth, bounds) (most pipelines share one), in order of first
    # use, so that an error names the first pipeline that breaks a rule; the scans run in C.
    pipes = plan.pipelines
    loads = list(map(_MICROBATCHES, pipes))
    if min(loads) < 0:
        raise PlanError(f"pipeline {next(j for j, m in enumerate(loads) if m < 0)}: negative micro-batch count")
    shapes = list(zip(map(len, map(_DEVICES, pipes)), map(_BOUNDS, pipes)))
    for depth, bounds in dict.fromkeys(shapes):
        j = shapes.index((depth, bounds))
        pipe = pipes[j]
        if depth == 0:
            raise PlanError(f"pipeline {j} has no stages")
        if len(pipe.bounds) != depth + 1:
            raise PlanError(
                f"pipeline {j}: {depth} stages need {depth + 1} layer bounds, got {len(pipe.bounds)}"
            )
        if pipe.bounds[0] != 0 or pipe.bounds[-1] != workload.num_layers:
            raise PlanError(f"pipeline {j}: layer bounds must cover 0..{workload.num_layers}, got {pipe.bounds}")
        if any(b >= c for b, c in zip(pipe.bounds, pipe.bounds[1:])):
            raise PlanError(f"pipeline {j}: every stage needs at least one layer, bounds {pipe.bounds}")
    devices = plan.devices
    seen = plan.device_set
    if len(seen) != len(devices):
        counts: dict[int, int] = {}
        for d in devices:
            counts[d] = counts.get(d, 0) + 1
        raise PlanError(f"device {min(d for d, n in counts.items() if n > 1)} is used more than once")
    if available is not None:
        extra = seen.difference(available)  # (no copy of a set of 131k survivors)
        if extra:
            raise PlanError(f"the plan uses devices that are not available: {sorted(extra)}")
    want = workload.num_microbatches if num_microbatches is None else num_microbatches
    if plan.num_microbatches != want:
        raise PlanError(
            f"the plan runs {plan.num_microbatches} micro-batches per step, the global batch needs {want}"
        )
    k = plan.shard_degree
    if k < 1 or len(plan.pipelines) % k:
        raise PlanError(f"shard degree {k} must divide the number of pipelines ({len(plan.pipelines)})")
    if k > 1:  # (with k = 1 every group is one pipeline)
        for group in plan.shard_groups():
            if len({plan.pipelines[j].bounds for j in group}) != 1:
                raise PlanError(f"pipelines {group} shard the same state and need the same layer split")
