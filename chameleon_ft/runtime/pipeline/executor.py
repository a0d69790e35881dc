"""Run one worker's part of a pipeline step: its hops' forwards and backwards, in its order.

``run_step`` takes the schedule's routes and this worker's task order and moves activations
forward and gradients back with point-to-point sends and receives on the generation's group
(``GroupManager.send/recv/wait_p2p``: sends are asynchronous, receives block but fail fast on
an abort or a dead peer).  Each message is a fixed-size header (dtype, shape) and the tensor.
The first hop of a route builds its input from the batch (``input_fn``), the last computes
``loss_fn(output, batch) * weight`` (the micro-batch's share of the global batch's samples) and
starts the backward; gradients accumulate in the blocks' ``.grad`` as in data parallelism.

Before each block's forward the RNG is seeded per (step, slot, block), so dropout draws the same
numbers whichever worker runs the block of that micro-batch and however the blocks are split
into stages (same trajectory under rerouting and re-planning).

Not ``torch.distributed.pipelining``: its stages and schedules assume one fixed stage graph on
a c10d group registered with ``init_process_group``; rerouted micro-batches cross pipelines and
our groups are rebuilt per membership generation.  Tensors live on the blocks' device; only the
wire buffers are CPU (gloo) -- a NCCL group would take them as they are.

Limits: one tensor flows between hops (a block's output is the next block's only input); at
most ``_MAX_DIMS`` dimensions.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from chameleon_ft.runtime.pipeline.schedule import Route, Task

__all__ = ["run_step", "StepResult"]

_MAX_DIMS = 6
_HEADER = 2 + _MAX_DIMS
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]


def _tag(slot: int, hop: int, backward: bool, part: int) -> int:
    return ((slot * 256 + hop) * 2 + int(backward)) * 2 + part


class StepResult:
    def __init__(self) -> None:
        self.loss = 0.0  # sum over this worker's last hops of loss * weight
        self.compute_s = 0.0
        self.microbatches = 0  # distinct micro-batches this worker computed a hop of


def run_step(gm, rank_of: dict[int, int], me: int, blocks: Sequence[torch.nn.Module],
             rs: Sequence[Route], order: Sequence[Task], batch_of: Callable[[int], object],
             input_fn: Callable, loss_fn: Callable, weight_of: Callable[[int], float],
             seed_of: Callable[[int, int], int], seed_fn: Callable[[int], None],
             timeout_s: float, device: torch.device, on_task: Callable[[Task], None] | None = None) -> StepResult:
    """Run ``order`` (this worker's tasks); returns what it computed.  ``batch_of(slot)`` loads
    a micro-batch; ``seed_of(slot, block)`` gives the per-block seed, ``seed_fn`` applies it;
    ``rank_of`` maps worker ids to ranks of ``gm``'s group."""
    by_slot = {r.slot: r for r in rs}
    res = StepResult()
    stash: dict[tuple[int, int], tuple] = {}
    batches: dict[int, object] = {}
    sends: list = []

    def send(t: torch.Tensor, dst: int, tag: int) -> None:
        t = t.detach().contiguous().cpu()
        head = torch.zeros(_HEADER, dtype=torch.int64)
        head[0], head[1] = _DTYPES.index(t.dtype), t.ndim
        head[2:2 + t.ndim] = torch.tensor(t.shape, dtype=torch.int64)
        sends.append((gm.send(head, rank_of[dst], tag), head))
        sends.append((gm.send(t, rank_of[dst], tag + 1), t))

    def recv(src: int, tag: int) -> torch.Tensor:
        head = torch.zeros(_HEADER, dtype=torch.int64)
        gm.wait_p2p([gm.recv(head, rank_of[src], tag)], timeout_s)
        ndim = int(head[1])
        t = torch.empty([int(x) for x in head[2:2 + ndim]], dtype=_DTYPES[int(head[0])])
        gm.wait_p2p([gm.recv(t, rank_of[src], tag + 1)], timeout_s)
        return t.to(device)

    def batch(slot: int):
        if slot not in batches:
            batches[slot] = batch_of(slot)
        return batches[slot]

    seen: set[int] = set()
    for task in order:
        if on_task is not None:
            on_task(task)
        r = by_slot[task.slot]
        hop = r.hops[task.hop]
        last = task.hop == len(r.hops) - 1
        if task.kind == "F":
            if task.hop == 0:
                x = input_fn(batch(task.slot))
            else:
                x = recv(r.hops[task.hop - 1].worker, _tag(task.slot, task.hop, False, 0))
                if x.is_floating_point():
                    x.requires_grad_(True)
            t0 = time.perf_counter()
            out = x
            for b in range(hop.lo, hop.hi):
                seed_fn(seed_of(task.slot, b))
                out = blocks[b](out)
            if last:
                out = loss_fn(out, batch(task.slot)) * weight_of(task.slot)
                res.loss += float(out.detach())
            res.compute_s += time.perf_counter() - t0
            if not last:
                send(out, r.hops[task.hop + 1].worker, _tag(task.slot, task.hop + 1, False, 0))
            stash[(task.slot, task.hop)] = (x, out)
            if task.slot not in seen:
                seen.add(task.slot)
                res.microbatches += 1
        else:
            x, out = stash.pop((task.slot, task.hop))
            grad = None if last else recv(r.hops[task.hop + 1].worker, _tag(task.slot, task.hop, True, 0))
            t0 = time.perf_counter()
            out.backward(grad)
            res.compute_s += time.perf_counter() - t0
            if task.hop > 0:
                send(x.grad, r.hops[task.hop - 1].worker, _tag(task.slot, task.hop - 1, True, 0))
    gm.wait_p2p([w for w, _ in sends], timeout_s)
    return res
