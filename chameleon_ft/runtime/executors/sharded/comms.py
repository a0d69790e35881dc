"""FSDP2's collectives on the runtime's gloo group, and the no-communication world its device
mesh is built on.

**Collectives that fail fast.**  FSDP's all-gathers and reduce-scatters run through our
generation's gloo group (``set_custom_all_gather`` / ``set_custom_reduce_scatter``,
``FsdpComms``), so a dead or hung peer ends them within the abort poll like every other
collective of the runtime.  Fully sharded, the all-gather writes straight into FSDP's buffer.
The reduce-scatter is an all-reduce over all members followed by a slice (gloo's own
reduce-scatter never reports completion to a polling waiter, and measured no faster: 25.9 vs
23.7 ms for 4 x 64 kB on 4 processes); it sums over the replica groups too.

**The no-communication world.**  ``init_device_mesh`` and ``fully_shard`` take their ranks and
sub-groups from the default process group, which cannot be re-formed after a death; so every
generation re-creates it (``no_comm_world``) on a process group that carries nothing
(``_NoCommGroup``, registered as the ``chameleon_nocomm`` backend).  Every collective run on it
raises ``NoCommunication``: FsdpComms carry the data, and a torch code path that bypassed them
would be a bug.  Two exceptions, by design: HSDP's all-reduce over the replica group of the
buffer our reduce-scatter has just filled (already summed over every member) is the identity;
FsdpComms arms it for that one buffer.  With one shard per replica group (an (R, 1) mesh, e.g.
``sharding="hybrid"`` on two workers) FSDP runs no reduce-scatter at all and that all-reduce is
the whole gradient sum: FsdpComms routes it onto the gloo group.  (torch's fake group, used
before, made it a no-op: such a job trained each replica on its own share, silently.)

Limits: CPU tensors (gloo).  Checked on torch 2.13: the ``dist.*`` collectives, functional
collectives and ``DTensor.full_tensor`` all raise ours; a collective method that a later torch
adds to ``ProcessGroup`` (not in ``_COLLECTIVES``) fails with torch's own "no backend" error.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from chameleon_ft.runtime.errors import ConfigError
from chameleon_ft.runtime.groups import CollectiveFailure
from chameleon_ft.runtime.torch_private import allgather_base, fsdp_comm_bases


def _fsdp():
    """FSDP2's ``init_device_mesh``, ``fully_shard`` and comm bases (``AllGather``,
    ``ReduceScatter``); a ``ConfigError`` on a torch without them."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
    except ImportError as exc:  # pragma: no cover - torch builds without distributed
        raise ConfigError(f"sharded training needs torch's FSDP2 (torch>=2.6): {exc}") from None
    return (init_device_mesh, fully_shard, *fsdp_comm_bases())


# ---------------------------------------------------------------- the no-communication world
_BACKEND = "chameleon_nocomm"
_registered = False

# torch's ProcessGroup collectives (names an older torch lacks are skipped): all refused.
_COLLECTIVES = (
    "allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "_allgather_base",
    "allgather_into_tensor_coalesced", "all_gather_single", "all_gather_single_coalesced",
    "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single", "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base", "all_to_all_single", "broadcast",
    "reduce", "gather", "scatter", "barrier", "monitored_barrier", "send", "recv", "recv_anysource")


class NoCommunication(RuntimeError):
    """A collective ran on the no-communication process group: some torch code path went
    around our comms (they carry all the data), so its result would have been made up."""


class _Done(dist.Work):
    """A finished ``Work``: HSDP's replica all-reduce, already done by our reduce-scatter."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _NoCommGroup(dist.ProcessGroup):
    """A process group that carries nothing: it gives the device mesh and FSDP their ranks and
    sizes.  Every collective raises ``NoCommunication``, except the armed replica all-reduce."""

    # FSDP runs HSDP's all-reduce over the replica group itself, on the buffer our reduce-scatter
    # has just filled with the sum over every member: the identity.  One per process, by identity.
    summed: Optional[torch.Tensor] = None
    # HSDP with one shard per replica group, an (R, 1) mesh: FSDP runs no reduce-scatter and its
    # replica all-reduce is the whole gradient sum, so it must really run: over our gloo group
    # (the replica group is every member then).  Set by FsdpComms for such a mesh.
    replica_sum = None

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self._where = f"rank {rank} of {size}"
        self._name: Optional[str] = None

    # A Python group holds no C++ backend, which is where torch keeps a group's name.
    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> Optional[str]:
        return self._name

    def getBackendName(self) -> str:
        return _BACKEND

    def allreduce(self, tensors, *args, **kwargs):
        armed, opts = _NoCommGroup.summed, (args[0] if args else kwargs.get("opts"))
        if (armed is not None and isinstance(tensors, list) and len(tensors) == 1 and tensors[0] is armed
                and isinstance(opts, dist.AllreduceOptions) and opts.reduceOp == dist.ReduceOp.SUM):
            _NoCommGroup.summed = None
            return _Done()
        route = _NoCommGroup.replica_sum
        if (route is not None and isinstance(tensors, list) and len(tensors) == 1
                and isinstance(opts, dist.AllreduceOptions) and opts.reduceOp == dist.ReduceOp.SUM):
            route(tensors[0])
            return _Done()
        self._refuse("allreduce")

    def _refuse(self, name: str):
        raise NoCommunication(
            f"chameleon-ft: torch ran {name} on the no-communication process group ({self._where}); it "
            "only gives FSDP's device mesh its ranks, FsdpComms carry the data (a code path that bypasses them)")


def _refusing(name: str):
    def refuse(self, *args, **kwargs):
        self._refuse(name)
    refuse.__name__ = name
    return refuse


for _name in _COLLECTIVES:
    if hasattr(dist.ProcessGroup, _name) and _name not in vars(_NoCommGroup):
        setattr(_NoCommGroup, _name, _refusing(_name))


def no_comm_world(rank: int, world: int) -> None:
    """This process's default process group for a generation: ``world`` ranks on a group that
    never communicates (FSDP's device mesh takes its ranks from it; our comms carry the data)."""
    global _registered
    if not _registered:  # torch's public extension point for a backend written in Python
        dist.Backend.register_backend(_BACKEND, lambda store, rank, size, timeout: _NoCommGroup(rank, size),
                                      devices=["cpu", "cuda"])
        _registered = True
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(_BACKEND, rank=rank, world_size=world, store=dist.HashStore())


class FsdpComms:
    """FSDP2's all-gather and reduce-scatter over one generation's gloo group, failing fast
    like every collective of the runtime (a dead or hung peer ends them within the abort
    poll).  ``install`` sets them on every ``FSDPModule`` of a module, with sum reduction and
    no division (the step's weights make the mean).  ``failure``: the last one that failed
    (FSDP may wrap the exception it raised).

    ``give_way``: for a loop that is the user's (an exception would end it), a failed
    collective raises nothing; it and every later one of the step run locally instead (the
    all-gather fills the peers' shards with zeros, the reduce-scatter keeps this member's own
    gradient slice), so the loop reaches its ``optimizer.step()``, where ``failure`` is seen
    and the step is redone.  What the forward computed meanwhile is meaningless; nothing of
    it is committed."""

    def __init__(self, gm, world: int, shards: int, rank: int, timeout_s: float):
        self.gm, self.world, self.shards, self.rank = gm, world, shards, rank
        self.row = rank % shards
        self.timeout_s = timeout_s
        self.failure: Optional[CollectiveFailure] = None
        self.give_way = False
        _, _, all_gather_cls, reduce_scatter_cls = _fsdp()
        comms = self

        class _AG(all_gather_cls):
            def allocate(self, size, *, dtype, device):
                return torch.empty(*size, dtype=dtype, device=device)

            def __call__(self, output_tensor, input_tensor, group, async_op=False):
                comms.all_gather(output_tensor, input_tensor)

        class _RS(reduce_scatter_cls):
            def allocate(self, size, *, dtype, device):
                return torch.empty(*size, dtype=dtype, device=device)

            def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
                comms.reduce_scatter(output_tensor, input_tensor)

        self._ag, self._rs = _AG(), _RS()
        # An (R, 1) mesh: the replica all-reduce is the gradient sum (see _NoCommGroup).
        _NoCommGroup.replica_sum = self.replica_sum if (shards == 1 and world > 1) else None

    def replica_sum(self, tensor: torch.Tensor) -> None:
        """HSDP with one shard per replica group: FSDP's replica all-reduce, in place, over the
        generation's gloo group (every member holds a whole replica)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        host = tensor if tensor.device.type == "cpu" else tensor.detach().cpu()
        self._run(lambda pg: pg.allreduce([host], opts))
        if host is not tensor:
            tensor.copy_(host)

    def install(self, module: torch.nn.Module) -> list:
        """Our collectives on every FSDP unit of ``module``; returns the units."""
        from torch.distributed.fsdp import FSDPModule
        units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            unit.set_custom_all_gather(self._ag)
            unit.set_custom_reduce_scatter(self._rs)
            unit.set_force_sum_reduction_for_comms(True)
            unit.set_gradient_divide_factor(1.0)
        return units

    def _run(self, fn) -> bool:
        """Run a collective; False when it did not run (it failed, or an earlier one of the
        step did, with ``give_way``): the caller fills its output locally."""
        if self.give_way and self.failure is not None:
            return False
        try:
            self.gm.collective(fn, self.timeout_s)
        except CollectiveFailure as exc:
            self.failure = exc
            if self.give_way:
                return False
            raise
        return True

    # Gloo gathers only host tensors: a shard on an accelerator goes through host memory here
    # (the NCCL path, where there is one, needs none of this: docs/gpu.md).
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        n, s = self.world, self.shards
        host_in = inp.detach().contiguous().cpu()
        if n == s:  # one shard group: gather straight into FSDP's buffer (or a host copy of it)
            host_out = out if out.device.type == "cpu" else torch.empty(out.shape, dtype=out.dtype)
            if not self._run(lambda pg: allgather_base(pg, host_out, host_in)):
                out.zero_()
                return
            if host_out is not out:
                out.copy_(host_out)
            return
        parts = [torch.empty_like(host_in) for _ in range(n)]
        if not self._run(lambda pg: pg.allgather([parts], [host_in])):
            out.zero_()
            return
        base = (self.rank // s) * s
        for i, chunk in enumerate(out.chunk(s)):
            chunk.copy_(parts[base + i])

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        buf = inp.detach().to("cpu", copy=True)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self._run(lambda pg: pg.allreduce([buf], opts))  # (not run: the local slice, discarded)
        out.copy_(buf.chunk(self.shards)[self.row])
        if self.world != self.shards:  # HSDP: FSDP's replica all-reduce of ``out`` is the identity
            _NoCommGroup.summed = out
