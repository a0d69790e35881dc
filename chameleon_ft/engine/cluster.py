"""Cluster description: devices, nodes and the links between them.

A device has a speed factor (1.0 = the reference device the workload was costed on; a
straggler running at a third of the speed has 1/3) and a memory capacity.  Links come in two
tiers, intra-node and inter-node, each with an alpha (latency, s) and a beta (bandwidth,
bytes/s); calibration may add measured effective links for the gradient all-reduce and for
state migration.  Plain data; the planner and the performance model read it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Iterable, Mapping

import numpy as np


@dataclass(frozen=True)
class Device:
    id: int
    node: int
    speed: float = 1.0
    memory_bytes: float = 80e9

    def __post_init__(self) -> None:
        if self.speed <= 0:
            raise ValueError(f"device {self.id}: speed must be positive, got {self.speed}")
        if self.memory_bytes <= 0:
            raise ValueError(f"device {self.id}: memory must be positive")


@dataclass(frozen=True)
class Link:
    latency_s: float
    bandwidth_Bps: float

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bandwidth_Bps <= 0:
            raise ValueError(f"invalid link {self}")

    def transfer_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth_Bps


@dataclass(frozen=True)
class DeviceArrays:
    index: np.ndarray  # device id -> position
    speed: np.ndarray
    node: np.ndarray
    memory: np.ndarray


@dataclass(frozen=True)
class Cluster:
    devices: tuple[Device, ...]
    intra: Link = Link(5e-6, 150e9)  # NVLink-class
    inter: Link = Link(10e-6, 25e9)  # 200 Gb/s-class NIC
    # Measured effective links of two kinds of traffic whose software costs differ from a
    # plain message's (calibration, ``PipelineCalibrator``): the step's gradient all-reduce and
    # state migration.  None: the tier links above.
    collective: Link | None = None
    migration: Link | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        ids = [d.id for d in self.devices]
        if len(set(ids)) != len(ids):
            raise ValueError("device ids must be unique")
        object.__setattr__(self, "_by_id", {d.id: d for d in self.devices})
        object.__setattr__(self, "_arrays", None)

    def arrays(self) -> "DeviceArrays":
        """Per-device speed, node and memory as numpy arrays, indexed through ``index[id]``."""
        if self._arrays is None:  # type: ignore[has-type]
            ids = np.array(self.ids, dtype=np.int64)
            index = np.full(int(ids.max()) + 1 if len(ids) else 1, -1, dtype=np.int64)
            index[ids] = np.arange(len(ids))
            object.__setattr__(self, "_arrays", DeviceArrays(
                index=index,
                speed=np.array([d.speed for d in self.devices], dtype=float),
                node=np.array([d.node for d in self.devices], dtype=np.int64),
                memory=np.array([d.memory_bytes for d in self.devices], dtype=float),
            ))
        return self._arrays  # type: ignore[return-value]

    def __getitem__(self, device_id: int) -> Device:
        try:
            return self._by_id[device_id]  # type: ignore[attr-defined]
        except KeyError:
            raise KeyError(f"unknown device {device_id}") from None

    def __contains__(self, device_id: int) -> bool:
        return device_id in self._by_id  # type: ignore[attr-defined]

    @property
    def ids(self) -> tuple[int, ...]:
        return tuple(self._by_id)  # type: ignore[attr-defined]

    def ids_except(self, keep: Iterable[int]) -> set[int]:
        """This cluster's device ids that are not in ``keep`` (one set operation in C)."""
        return self._by_id.keys() - keep  # type: ignore[attr-defined]

    def link(self, a: int, b: int) -> Link:
        return self.intra if self[a].node == self[b].node else self.inter

    def state_link(self, a: int, b: int) -> Link:
        """The link a state transfer (migration, heal) from ``a`` to ``b`` runs at."""
        return self.migration or self.link(a, b)

    def group_link(self, ids: Iterable[int]) -> Link:
        """The slowest tier a collective over ``ids`` has to cross."""
        nodes = {self[i].node for i in ids}
        return self.intra if len(nodes) <= 1 else self.inter

    def without(self, dead: Iterable[int]) -> "Cluster":
        """This cluster less ``dead``; derived from this one's tables (at 131k devices,
        rebuilding them was a tenth of a decision)."""
        by_id = self._by_id  # type: ignore[attr-defined]
        gone = sorted({d for d in dead if d in by_id})
        if not gone:
            return self
        arrays = self.arrays()
        pos = np.sort(arrays.index[np.array(gone, dtype=np.int64)])
        devices = list(self.devices)
        for i in pos[::-1].tolist():
            del devices[i]
        keep = np.ones(len(self.devices), dtype=bool)
        keep[pos] = False
        index = arrays.index - np.searchsorted(pos, arrays.index)  # positions shift past removed ones
        index[arrays.index < 0] = -1
        index[np.array(gone, dtype=np.int64)] = -1
        out = object.__new__(Cluster)
        for f in fields(self):
            object.__setattr__(out, f.name, getattr(self, f.name))
        object.__setattr__(out, "devices", tuple(devices))
        by_id = dict(by_id)
        for d in gone:
            del by_id[d]
        object.__setattr__(out, "_by_id", by_id)
        object.__setattr__(out, "_arrays", DeviceArrays(index=index, speed=arrays.speed[keep],
                                                        node=arrays.node[keep], memory=arrays.memory[keep]))
        return out

    def with_speeds(self, speeds: Mapping[int, float]) -> "Cluster":
        return replace(
            self,
            devices=tuple(replace(d, speed=speeds.get(d.id, d.speed)) for d in self.devices),
        )

    def node_of(self, device_id: int) -> int:
        return self[device_id].node

    def devices_on_node(self, node: int) -> tuple[int, ...]:
        return tuple(d.id for d in self.devices if d.node == node)


def homogeneous(
    n: int,
    per_node: int = 8,
    memory_bytes: float = 80e9,
    intra: Link = Link(5e-6, 150e9),
    inter: Link = Link(10e-6, 25e9),
) -> Cluster:
    """``n`` identical devices, ``per_node`` to a node."""
    if n <= 0 or per_node <= 0:
        raise ValueError("n and per_node must be positive")
    return Cluster(
        devices=tuple(Device(i, i // per_node, 1.0, memory_bytes) for i in range(n)),
        intra=intra,
        inter=inter,
    )


# -- JSON (the stored form ``chameleon-ft simulate --trace`` reads) -------------------------
def cluster_to_json(c: Cluster) -> dict:
    """``devices`` ids 0..n-1, ``per_node`` to a node (from the first node), links as
    [latency s, bandwidth B/s]; speeds and memory per device when they differ."""
    out = {"devices": len(c.devices), "per_node": len(c.devices_on_node(c.devices[0].node)),
           "intra": [c.intra.latency_s, c.intra.bandwidth_Bps], "inter": [c.inter.latency_s, c.inter.bandwidth_Bps]}
    speeds = [d.speed for d in c.devices]
    mems = [d.memory_bytes for d in c.devices]
    out["memory_bytes"] = mems[0] if len(set(mems)) == 1 else mems
    if any(s != 1.0 for s in speeds):
        out["speeds"] = speeds
    for kind in ("collective", "migration"):
        link = getattr(c, kind)
        if link is not None:
            out[kind] = [link.latency_s, link.bandwidth_Bps]
    return out


def cluster_from_json(data: dict) -> Cluster:
    n, per_node = int(data["devices"]), int(data.get("per_node", data["devices"]))
    mem = data.get("memory_bytes", 80e9)
    mems = mem if isinstance(mem, list) else [mem] * n
    speeds = data.get("speeds", [1.0] * n)
    return Cluster(tuple(Device(i, i // per_node, float(speeds[i]), float(mems[i])) for i in range(n)),
                   intra=Link(*map(float, data.get("intra", (5e-6, 150e9)))),
                   inter=Link(*map(float, data.get("inter", (10e-6, 25e9)))),
                   collective=Link(*map(float, data["collective"])) if data.get("collective") else None,
                   migration=Link(*map(float, data["migration"])) if data.get("migration") else None)
