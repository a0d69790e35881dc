"""``ElasticConfig``: the runtime's knobs, one dataclass that every executor and adapter takes.

Plain data; the launcher's flags fill the fields marked (env) through ``WorkerEnv``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from chameleon_ft.runtime.errors import ConfigError

GRAD_COMPRESSIONS = ("fp16", "bf16")  # ElasticConfig.grad_compression: DDP's two compression hooks

__all__ = ["ElasticConfig"]


@dataclass
class ElasticConfig:
    """Knobs of the runtime; the launcher's flags fill the ones marked (env).

    hang_timeout_s: watchdog on every collective (env ``CHAMELEON_FT_HANG_TIMEOUT``); a
        member silent for longer is treated as hung and left out of the next generation.
    min_world_size: below this many survivors the worker gives up (exits for a restart).
    warmup_steps: steps measured before the engine's workload is frozen.
    seed_microbatches: seed torch's RNG per (step, micro-batch) so dropout & co. draw the same
        numbers whichever member runs a micro-batch (same trajectory under rerouting).
    log_samples: write each member's sample ids of every step attempt to the event log (a
        JSON list per step: for exactly-once checks, not for speed); None: the environment's
        ``CHAMELEON_FT_LOG_SAMPLES=1`` turns it on (tests and benchmarks set it), default off.
    allowed_policies: restrict the engine's choices (intersected with what the runtime can
        carry out); None: all of them.
    allow_batch_change: let the engine consider policies that change the global batch.
    mttf_s: fixed expected time to the next failure (``D``) for the engine; ``chameleon-ft run
        --mttf`` (env ``CHAMELEON_FT_MTTF``) takes precedence.  None: estimated.
    straggler_options: the straggler detector's and rebalance check's knobs (see
        ``EngineBridge``); None: the defaults.
    items_per_step: set by an adapter that may merge a worker's share of a step into this
        many loop items (the engine's memory check then counts the merged activations).
    min_replicas: pipeline jobs: a re-plan keeps at least this many pipelines, i.e. copies of
        every block (Oobleck's f + 1 rule), so that the next failure can still be rerouted or
        re-planned in place; 1 lets the engine trade all redundancy for speed (a later failure
        then needs a restart).
    emulate_link: pipeline jobs, accelerator-emulation mode: ``(latency_s, bandwidth_Bps)`` of
        an emulated network -- a message between stages is held until ``latency + bytes /
        bandwidth`` after it was sent (workers of one machine only; for benchmarks and tests).
    overlap_migration: pipeline jobs: a re-plan's (grow's, heal's) migration runs in the background
        while the job trains on the running layout (rerouted around the dead); the workers that
        receive blocks keep them current from the blocks' reduced gradients, and the job switches
        to the new layout at a step boundary once all have them -- the same trajectory.  The
        engine prices the migration as a rerouted phase, not a pause.  Off: the job pauses while
        the state moves (``executors/pipeline/overlap.py``).
    shard_recovery: sharded jobs: the ways back the engine may choose from (``heal``,
        ``recompute``, ``rehabilitate``, ``restart``); None: all of them.
    device_memory_bytes: each device's memory, for the engine's fit checks: a plan whose
        estimated per-device peak (weights, optimizer state, activations in flight) exceeds it
        is never chosen.  The first plan is the user's (``stages``), not checked: before the
        first step the engine's bytes per parameter are a prior.  None: the cluster model's
        default (80 GB).  In accelerator-emulation benchmarks it stands for the memory that
        makes a model need pipeline stages.
    bucket_cap_mb: data parallel: the gradient buckets' size in MiB (DDP's ``bucket_cap_mb``):
        buckets are all-reduced while backward runs (``executors/buckets.py``); the adapters
        take it from the user's DDP settings.
    grad_compression: data parallel: ``"fp16"`` or ``"bf16"`` reduces the gradient buckets in
        that dtype, the commit's tail in full precision (DDP's ``fp16_compress_hook`` /
        ``bf16_compress_hook``; the adapters take it from the user's DDP communication hook;
        ``executors/buckets.py``); None (default): full precision.
    gradient_as_bucket_view: data parallel: DDP's flag of that name, for memory: a
        parameter's gradient is released into its bucket as soon as backward produces it (the
        update reads the buckets' views), so a step holds one gradient copy instead of two (its
        local sum and the buckets).  The price: a member's local sum is gone once its bucket is
        reduced, so after a failed reduction it recomputes its share of the redone step instead
        of keeping it (one step's compute more in the recovery).  The adapters take it from the
        user's DDP settings.  Between the last backward and the step's reduction ``.grad`` is
        None (clip through the adapter's ``clip_grad_norm_``, which runs after the reduction).
    one_microbatch_each: every live member runs at least one micro-batch per step when the
        global batch has that many (set by the Lightning adapter: Lightning logs per
        ``training_step``, so a member with none would skip the epoch-end metric sync).  The
        engine applies it (``planner.at_least_one_each``) to the allocation and the plan it
        keeps, so its estimates and the next Decision start from what runs.
    nonfinite: what a step does when a member's loss is NaN or infinite (its flag rides in the
        commit's tail, so every member decides alike): ``"skip"`` (default) -- the update is
        applied nowhere, the global batch counts as consumed -- or ``"stop"`` (``Diverged``, exit
        1, on every member); ``nonfinite_limit`` such steps in a row stop the job under
        ``"skip"`` too.  Data parallel (``runtime/executors/dp.py``) only.
    """

    hang_timeout_s: Optional[float] = None
    connect_timeout_s: float = 5.0
    view_timeout_s: float = 60.0
    join_timeout_s: float = 120.0
    heartbeat_s: float = 0.1
    min_world_size: int = 1
    warmup_steps: int = 3
    stragglers: bool = True
    seed_microbatches: bool = True
    log_samples: Optional[bool] = None
    mttf_s: Optional[float] = None
    replacement_eta_s: float = 5.0  # prior; a worker measures its own start-up and uses that
    restart_s: float = 60.0
    allowed_policies: Optional[frozenset] = None
    allow_batch_change: bool = False
    straggler_options: Optional[dict] = None
    items_per_step: int = 0
    min_replicas: int = 2
    emulate_link: Optional[tuple[float, float]] = None
    overlap_migration: bool = False
    shard_recovery: Optional[frozenset] = None
    device_memory_bytes: Optional[float] = None
    one_microbatch_each: bool = False
    bucket_cap_mb: float = 25.0
    grad_compression: Optional[str] = None
    gradient_as_bucket_view: bool = False
    nonfinite: str = "skip"
    nonfinite_limit: int = 3

    def __post_init__(self) -> None:
        if self.nonfinite not in ("skip", "stop"):
            raise ConfigError(f"ElasticConfig.nonfinite={self.nonfinite!r}: 'skip' or 'stop'")
        if self.nonfinite_limit < 1:
            raise ConfigError(f"ElasticConfig.nonfinite_limit={self.nonfinite_limit}: at least 1")
        if self.grad_compression is not None and self.grad_compression not in GRAD_COMPRESSIONS:
            raise ConfigError(f"ElasticConfig.grad_compression={self.grad_compression!r}: one of "
                              f"{GRAD_COMPRESSIONS} or None")
