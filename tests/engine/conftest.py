"""Shared builders for the engine tests: tiny workloads and clusters whose numbers are easy to
compute by hand, and an independent oracle of "which layers does a device hold"."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from chameleon_ft.engine.cluster import Cluster, Device, Link
from chameleon_ft.engine.plan import Plan
from chameleon_ft.engine.workload import Layer, Workload

# Per-test settings (not a global profile, so other test folders are left alone): no deadline
# (2 shared cores), and the same examples every run: the suite is a regression gate, not a fuzzer.
ENGINE = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    print_blob=True,
)

# Round numbers so hand computations stay exact-ish.
INTRA = Link(0.001, 1e9)
INTER = Link(0.01, 1e8)


def chain(
    costs,
    params=None,
    acts=None,
    outs=None,
    microbatches: int = 4,
    micro_batch: int = 1,
    weight_bytes: int = 4,
    grad_bytes: int = 4,
    optim_bytes: int = 8,
) -> Workload:
    """A chain of layers; ``costs`` are forward+backward seconds (split 1/3 : 2/3)."""
    n = len(costs)
    params = params or [1000] * n
    acts = acts or [0] * n
    outs = outs or [0] * n
    layers = tuple(
        Layer(params=p, fwd_s=c / 3, bwd_s=2 * c / 3, act_bytes=a, out_bytes=o)
        for c, p, a, o in zip(costs, params, acts, outs)
    )
    return Workload(layers, global_batch=microbatches * micro_batch, micro_batch=micro_batch,
                    weight_bytes=weight_bytes, grad_bytes=grad_bytes, optim_bytes=optim_bytes)


def cluster(n: int, per_node: int | None = None, speeds=None, memory: float = 1e15) -> Cluster:
    per_node = per_node or n
    speeds = speeds or [1.0] * n
    return Cluster(tuple(Device(i, i // per_node, speeds[i], memory) for i in range(n)), intra=INTRA, inter=INTER)


def held_layers(plan: Plan | None, device: int) -> tuple[set[int], int, int] | None:
    """Oracle: (set of layers, shard index, shard degree) that ``device`` holds in ``plan``."""
    if plan is None:
        return None
    for j, pipe in enumerate(plan.pipelines):
        if device in pipe.devices:
            s = pipe.devices.index(device)
            return set(range(pipe.bounds[s], pipe.bounds[s + 1])), j % plan.shard_degree, plan.shard_degree
    return None


def usable(held, shard: int, degree: int) -> set[int]:
    """Layers of ``held`` that serve a slot (shard, degree): a full replica serves any shard, a
    shard serves only the same shard of the same degree."""
    if held is None:
        return set()
    layers, q, k = held
    if k == 1 or (k == degree and q == shard):
        return layers
    return set()
