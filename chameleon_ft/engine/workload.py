"""Workload description: what one training step costs, layer by layer.

A :class:`Workload` is the engine's view of the model and the batch: per-layer parameter
counts, forward/backward seconds per micro-batch on a reference device (speed 1.0),
activation bytes per micro-batch, and the bytes that each parameter costs in weights,
gradients and optimizer state.  It is plain data: no torch, no process group.

Limits: layers are a chain (no branches); tensor parallelism is folded into the notion of a
"device" (a device may stand for a tensor-parallel group).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Layer:
    """One layer (or block) of the model, costed per micro-batch on a speed-1.0 device."""

    params: int
    fwd_s: float
    bwd_s: float
    act_bytes: int  # activations kept for backward, per micro-batch
    out_bytes: int = 0  # boundary activation sent to the next stage, per micro-batch

    def __post_init__(self) -> None:
        if self.params < 0 or self.fwd_s < 0 or self.bwd_s < 0 or self.act_bytes < 0:
            raise ValueError(f"layer costs must be non-negative, got {self}")


@dataclass(frozen=True)
class Workload:
    """The model (a chain of layers) and the batch it trains on."""

    layers: tuple[Layer, ...]
    global_batch: int  # samples per optimizer step
    micro_batch: int  # samples per micro-batch
    weight_bytes: int = 4  # bytes per parameter for weights
    grad_bytes: int = 4  # bytes per parameter for gradients
    optim_bytes: int = 8  # bytes per parameter of optimizer state (Adam: 2 fp32 moments)
    name: str = "workload"
    # 0: a data-parallel worker runs its micro-batches one at a time (one micro-batch of
    # activations at once).  k > 0: a framework loop runs k items per step and a worker's share
    # is merged into them (accelerate_ft without a loss recipe), so it holds
    # ceil(micro-batches / k) micro-batches of activations at once.
    items_per_step: int = 0
    # How gradients are synchronised: "stage" -- one all-reduce per group of devices holding the
    # same layers (Megatron, DeepSpeed); "model" -- every device all-reduces one buffer of the
    # whole model (zeros for layers it does not hold), as chameleon-ft's pipeline runtime does.
    grad_sync: str = "stage"
    _prefix: tuple[float, ...] = field(default=(), init=False, repr=False, compare=False)
    _params: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)
    _acts: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a workload needs at least one layer")
        if self.micro_batch <= 0 or self.global_batch <= 0:
            raise ValueError("global_batch and micro_batch must be positive")
        if self.global_batch % self.micro_batch:
            raise ValueError(
                f"global_batch {self.global_batch} is not a multiple of micro_batch {self.micro_batch}"
            )
        if self.grad_sync not in ("stage", "model"):
            raise ValueError(f"grad_sync must be 'stage' or 'model', got {self.grad_sync!r}")
        object.__setattr__(self, "layers", tuple(self.layers))
        prefix, params, acts = [0.0], [0], [0]
        for layer in self.layers:
            prefix.append(prefix[-1] + layer.fwd_s + layer.bwd_s)
            params.append(params[-1] + layer.params)
            acts.append(acts[-1] + layer.act_bytes)
        object.__setattr__(self, "_prefix", tuple(prefix))
        object.__setattr__(self, "_params", tuple(params))
        object.__setattr__(self, "_acts", tuple(acts))
        object.__setattr__(self, "_hash", hash(self._fields()))

    # Workloads key the planner's caches: hash once, and compare cheaply when it matters.
    def _fields(self) -> tuple:
        return (self.layers, self.global_batch, self.micro_batch, self.weight_bytes,
                self.grad_bytes, self.optim_bytes, self.name, self.grad_sync)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Workload) or self._hash != other._hash:
            return False
        return self._fields() == other._fields()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // self.micro_batch

    @property
    def total_params(self) -> int:
        return self._params[-1]

    @property
    def state_bytes_per_param(self) -> int:
        """Bytes that must move to give a device a layer: weights plus optimizer state."""
        return self.weight_bytes + self.optim_bytes

    def compute_s(self, start: int, stop: int) -> float:
        """Forward+backward seconds of layers [start, stop) for one micro-batch at speed 1.0."""
        return self._prefix[stop] - self._prefix[start]

    def params_in(self, start: int, stop: int) -> int:
        return self._params[stop] - self._params[start]

    def act_bytes_in(self, start: int, stop: int) -> int:
        return self._acts[stop] - self._acts[start]


def transformer(
    num_layers: int = 32,
    hidden: int = 4096,
    seq_len: int = 2048,
    micro_batch: int = 1,
    global_batch: int = 512,
    flops_per_s: float = 400e12,
    bytes_per_act: int = 2,
    act_factor: float = 34.0,
    name: str = "transformer",
) -> Workload:
    """A decoder-only transformer, costed with the usual 12·h² parameters per block and
    6·params·tokens training FLOPs (forward 1/3, backward 2/3).  Activations per layer and
    micro-batch are ``act_factor · s · b · h`` half-precision values' worth of bytes / 2 (34 without
    recomputation, after Korthikanti et al.; lower with selective recomputation).  Good enough
    for planning; calibration corrects it against the real job."""
    params = 12 * hidden * hidden
    tokens = seq_len * micro_batch
    fwd = 2 * params * tokens / flops_per_s
    act = int(act_factor * seq_len * micro_batch * hidden * bytes_per_act / 2)
    out = seq_len * micro_batch * hidden * bytes_per_act
    layer = Layer(params=params, fwd_s=fwd, bwd_s=2 * fwd, act_bytes=act, out_bytes=out)
    return Workload(
        layers=(layer,) * num_layers,
        global_batch=global_batch,
        micro_batch=micro_batch,
        weight_bytes=2,
        grad_bytes=2,
        optim_bytes=12,  # fp32 master copy + two fp32 Adam moments
        name=name,
    )


# -- JSON (the stored form ``chameleon-ft simulate --trace`` reads) -------------------------
def workload_to_json(w: Workload) -> dict:
    return {"layers": [[x.params, x.fwd_s, x.bwd_s, x.act_bytes, x.out_bytes] for x in w.layers],
            "global_batch": w.global_batch, "micro_batch": w.micro_batch, "weight_bytes": w.weight_bytes,
            "grad_bytes": w.grad_bytes, "optim_bytes": w.optim_bytes, "name": w.name, "grad_sync": w.grad_sync}


def workload_from_json(data: dict) -> Workload:
    layers = tuple(Layer(int(p), float(f), float(b), int(a), int(o)) for p, f, b, a, o in data["layers"])
    return Workload(layers, int(data["global_batch"]), int(data["micro_batch"]),
                    int(data.get("weight_bytes", 4)), int(data.get("grad_bytes", 4)),
                    int(data.get("optim_bytes", 8)), data.get("name", "workload"),
                    grad_sync=data.get("grad_sync", "stage"))
