"""Run one worker's part of a pipeline step: its hops' forwards and backwards, in its order.

``run_step`` takes the schedule's routes and this worker's task order and moves activations
forward and gradients back with point-to-point sends and receives on the generation's group
(``GroupManager.send/recv/wait_p2p``: sends are asynchronous, receives block but fail fast on
an abort or a dead peer).  A message is a fixed-size header (dtype, shape, send time) and the
tensor: the first between two workers on a tag in a generation goes as two messages (the
receiver learns the size), later ones as one buffer of header + bytes whose size both sides
know from the previous one (``wire``: one receive and one wait per hop instead of two).  A
sender whose tensor's shape changed sends a header-only marker of the expected size first, then
the two-message form; sizes always agree, which gloo requires (a mismatch aborts the process).
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

What it measures for calibration (``StepResult``): each block's forward seconds (timed around
the block) and backward seconds (a gradient hook on every block output inside a hop stamps when
the next block's backward is done), its output bytes, and the cost of a hop for messages whose
receiver was already waiting: from the sender's send (a wall-clock time in the header) to the
tensor's arrival, i.e. the send call, the wire, the receiver's wake-up and hand-off -- nothing
of the sender's compute.  With ``link_delay`` (accelerator-emulation mode's network on one
machine) the receiver holds a message until ``sent + link_delay(bytes)``.

Limits: one tensor flows between hops (a block's output is the next block's only input); at
most ``_MAX_DIMS`` dimensions; send times are wall clocks: a hop's measured cost across machines
is only as good as their clock sync.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from chameleon_ft.engine.schedule import Route, Task

__all__ = ["run_step", "StepResult", "probe_links", "probe_size", "link_pairs", "PROBE_STEP"]

_MAX_DIMS = 6
_HEADER = 3 + _MAX_DIMS  # dtype, ndim, send time (float64 bits), shape
_HEAD_BYTES = _HEADER * 8
_CHANGED = 255  # header dtype code of a marker: the shape changed, the two-message form follows
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]


def _tag(slot: int, hop: int, backward: bool, part: int) -> int:
    return ((slot * 256 + hop) * 2 + int(backward)) * 2 + part


class StepResult:
    def __init__(self) -> None:
        self.loss = 0.0  # sum over this worker's last hops of loss * weight
        self.compute_s = 0.0
        self.microbatches = 0  # distinct micro-batches this worker computed a hop of
        self.block_times: dict[int, list] = {}  # block -> [forward s, backward s, micro-batches]
        self.out_bytes: dict[int, int] = {}  # block -> bytes of its output per micro-batch
        self.p2p: list[tuple[int, float]] = []  # (bytes, transfer seconds) of waited-for messages
        self.probes: list[tuple[int, float]] = []  # the link probe's samples (``probe_links``)
        self.tasks = 0
        # Seconds of this worker's tasks spent neither computing blocks nor waiting for a
        # message (header) or on the wire (tensor): the per-task software cost.
        self.task_overhead_s = 0.0
        self.waited_s = 0.0  # waiting for the sender (header), this step


_WAITED_S = 1e-3  # a receive that waited this long for the header: the sender sent just then


def _size(spec: tuple[int, tuple[int, ...]]) -> int:
    """Bytes of a tensor of ``(dtype code, shape)``."""
    n = 1
    for d in spec[1]:
        n *= d
    return n * torch.empty(0, dtype=_DTYPES[spec[0]]).element_size()


def _split_backward(lo: int, hi: int, t0: float, t1: float, stamps: dict, fwd: dict) -> dict[int, float]:
    """Backward seconds per block of a hop from the gradient-hook stamps (``stamps[b]``: the
    gradient of block ``b``'s output is ready, i.e. block ``b + 1``'s backward is done); in
    proportion to the forward times where a stamp is missing."""
    if all(b in stamps for b in range(lo, hi - 1)):
        edges = [t0] + [stamps[b] for b in range(hi - 2, lo - 1, -1)] + [t1]
        return {hi - 1 - i: max(0.0, edges[i + 1] - edges[i]) for i in range(hi - lo)}
    total = sum(fwd.get(b, 0.0) for b in range(lo, hi)) or 1.0
    return {b: (t1 - t0) * fwd.get(b, 1.0 / (hi - lo)) / total for b in range(lo, hi)}


def _hold(sent: float, nbytes: int, link_delay: Callable[[int], float] | None) -> None:
    """Emulated network: hold a received message until ``sent + link_delay(nbytes)``."""
    if link_delay is not None:
        wait = sent + link_delay(nbytes) - time.time()
        if wait > 0:
            time.sleep(wait)


_PROBE_TAG = 2 ** 30  # above every step tag (``_tag``) of a plan with < 2**20 micro-batch slots


def probe_links(gm, rank_of: dict[int, int], me: int, pairs: Sequence[tuple[int, int]], nbytes: int,
                timeout_s: float, link_delay: Callable[[int], float] | None = None) -> list[tuple[int, float]]:
    """One message of ``nbytes`` over each (sender, receiver) pair this worker is part of; the
    receiver's (bytes, send-to-arrival seconds) samples.  The steps' messages are all of one
    size (a micro-batch's activations), from which latency and bandwidth cannot be told apart,
    and a migration moves far larger blocks: one message of another size, once, anchors the
    fit (``engine.calibrate.fit_p2p``).  The receiver first says it is ready (a small message),
    so that the time is the transfer's, not a late receiver's.  Every member calls it at the
    same point with the same ``pairs`` (the plan's consecutive hops); a dead peer raises like a
    step's receive."""
    works, out = [], []
    for src, dst in pairs:
        if dst == me:
            ready = torch.ones(1, dtype=torch.int64)
            works.append((gm.send(ready, rank_of[src], _PROBE_TAG + 1), ready))
    for src, dst in pairs:
        if src == me:
            gm.wait_p2p([gm.recv(torch.zeros(1, dtype=torch.int64), rank_of[dst], _PROBE_TAG + 1)], timeout_s)
            buf = torch.zeros(_HEAD_BYTES + nbytes, dtype=torch.uint8)
            buf[:8] = torch.tensor([time.time()], dtype=torch.float64).view(torch.uint8)
            works.append((gm.send(buf, rank_of[dst], _PROBE_TAG), buf))
    for src, dst in pairs:
        if dst == me:
            buf = torch.empty(_HEAD_BYTES + nbytes, dtype=torch.uint8)
            gm.wait_p2p([gm.recv(buf, rank_of[src], _PROBE_TAG)], timeout_s)
            sent = float(buf[:8].view(torch.float64)[0])
            _hold(sent, nbytes, link_delay)
            out.append((nbytes, max(0.0, time.time() - sent)))
    gm.wait_p2p([w for w, _ in works], timeout_s)
    return out


PROBE_STEP = 2  # the step before which every member probes the links (once a job)


def probe_size(block_numel: Sequence[int], element_size: int = 4) -> int:
    """The probe's bytes: the largest block's parameters (what a migration moves, before its
    optimizer state) within [64 KiB, 4 MiB] -- the same figure on every member."""
    return int(min(4 << 20, max(64 << 10, max(block_numel, default=0) * element_size)))


def link_pairs(rs: Sequence[Route]) -> list[tuple[int, int]]:
    """The (sender, receiver) of every hop to the next one on the step's routes, once each."""
    return sorted({(a.worker, b.worker) for r in rs for a, b in zip(r.hops, r.hops[1:]) if a.worker != b.worker})


def run_step(gm, rank_of: dict[int, int], me: int, blocks: Sequence[torch.nn.Module],
             rs: Sequence[Route], order: Sequence[Task], batch_of: Callable[[int], object],
             input_fn: Callable, loss_fn: Callable, weight_of: Callable[[int], float],
             seed_of: Callable[[int, int], int], seed_fn: Callable[[int], None],
             timeout_s: float, device: torch.device, on_task: Callable[[Task], None] | None = None,
             link_delay: Callable[[int], float] | None = None, wire: dict | None = None) -> StepResult:
    """Run ``order`` (this worker's tasks); returns what it computed.  ``batch_of(slot)`` loads
    a micro-batch; ``seed_of(slot, block)`` gives the per-block seed, ``seed_fn`` applies it;
    ``rank_of`` maps worker ids to ranks of ``gm``'s group.  ``wire``: (peer, tag) -> the
    size of the last message exchanged there, kept by the caller for the generation (empty at
    its start on every member: both ends of a pair then agree on every size)."""
    wire = {} if wire is None else wire
    by_slot = {r.slot: r for r in rs}
    res = StepResult()
    stash: dict[tuple[int, int], tuple] = {}
    batches: dict[int, object] = {}
    sends: list = []

    def send(t: torch.Tensor, dst: int, tag: int) -> None:
        t = t.detach().contiguous().cpu()
        head = torch.zeros(_HEADER, dtype=torch.int64)
        head[0], head[1] = _DTYPES.index(t.dtype), t.ndim
        head[2] = torch.tensor([time.time()], dtype=torch.float64).view(torch.int64)[0]
        head[3:3 + t.ndim] = torch.tensor(t.shape, dtype=torch.int64)
        nbytes, key, r = t.numel() * t.element_size(), (dst, tag), rank_of[dst]
        expected = wire.get(key)
        if expected is not None:
            same = expected == (head[0].item(), tuple(t.shape))
            buf = torch.empty(_HEAD_BYTES + (nbytes if same else _size(expected)), dtype=torch.uint8)
            buf[:_HEAD_BYTES] = head.view(torch.uint8)
            if same:
                buf[_HEAD_BYTES:] = t.reshape(-1).view(torch.uint8)
                sends.append((gm.send(buf, r, tag + 1), buf))
                return
            buf[:8] = torch.tensor([_CHANGED], dtype=torch.int64).view(torch.uint8)
            sends.append((gm.send(buf, r, tag + 1), buf))
        wire[key] = (head[0].item(), tuple(t.shape))
        sends.append((gm.send(head, r, tag), head))
        sends.append((gm.send(t, r, tag + 1), t))

    def post(src: int, tag: int):
        """Post the one-buffer receive of a message whose size is known (None: not known)."""
        expected = wire.get((src, tag))
        if expected is None:
            return None
        buf = torch.empty(_HEAD_BYTES + _size(expected), dtype=torch.uint8)
        return gm.recv(buf, rank_of[src], tag + 1), buf, expected

    def source_of(task: Task):
        """(sender, tag) of the message ``task`` receives; None when it receives none."""
        r = by_slot[task.slot]
        if task.kind == "F" and task.hop > 0:
            return r.hops[task.hop - 1].worker, _tag(task.slot, task.hop, False, 0)
        if task.kind == "B" and task.hop < len(r.hops) - 1:
            return r.hops[task.hop + 1].worker, _tag(task.slot, task.hop, True, 0)
        return None

    # Every receive of a known size is posted now: gloo completes a send only once its
    # receive is posted, so a message then moves while this worker computes something else.
    # (Each (sender, tag) is received once a step, so no size becomes known later in it.)
    posted = {}
    for task in order:
        at = source_of(task)
        got = post(*at) if at is not None else None
        if got is not None:
            posted[at] = got

    def recv(src: int, tag: int) -> torch.Tensor:
        key, r = (src, tag), rank_of[src]
        t_post = time.perf_counter()
        head = None
        pending = posted.pop(key, None)
        if pending is not None:
            work, buf, expected = pending
            gm.wait_p2p([work], timeout_s)
            head = buf[:_HEAD_BYTES].view(torch.int64)
            if int(head[0]) == _CHANGED:
                head = None
            else:
                t = buf[_HEAD_BYTES:].view(_DTYPES[expected[0]]).view(expected[1])
        t_head = time.perf_counter()
        if head is None:
            head = torch.zeros(_HEADER, dtype=torch.int64)
            gm.wait_p2p([gm.recv(head, r, tag)], timeout_s)
            t_head = time.perf_counter()
            ndim = int(head[1])
            t = torch.empty([int(x) for x in head[3:3 + ndim]], dtype=_DTYPES[int(head[0])])
            gm.wait_p2p([gm.recv(t, r, tag + 1)], timeout_s)
            wire[key] = (int(head[0]), tuple(t.shape))
        nbytes = t.numel() * t.element_size()
        sent = float(head[2:3].view(torch.float64)[0])
        _hold(sent, nbytes, link_delay)
        t_done = time.perf_counter()
        res.waited_s += t_head - t_post
        wire_s[0] += t_done - t_head
        if t_head - t_post > _WAITED_S:
            # The receiver was waiting: send to arrival is the hop's cost (wall clocks, so
            # only as good as the workers' clock sync; exact on one machine).
            res.p2p.append((nbytes, max(0.0, time.time() - sent)))
        return t.to(device)

    def batch(slot: int):
        if slot not in batches:
            batches[slot] = batch_of(slot)
        return batches[slot]

    seen: set[int] = set()
    wire_s = [0.0]  # tensor transfer seconds of this task's receive
    for task in order:
        if on_task is not None:
            on_task(task)
        t_task, waited0, compute0, wire_s[0] = time.perf_counter(), res.waited_s, res.compute_s, 0.0
        r = by_slot[task.slot]
        hop = r.hops[task.hop]
        last = task.hop == len(r.hops) - 1
        if task.kind == "F":
            if task.hop == 0:
                x = input_fn(batch(task.slot))
            else:
                x = recv(*source_of(task))
                if x.is_floating_point():
                    x.requires_grad_(True)
            t0 = time.perf_counter()
            out = x
            fwd: dict[int, float] = {}
            stamps: dict[int, float] = {}
            for b in range(hop.lo, hop.hi):
                seed_fn(seed_of(task.slot, b))
                tb = time.perf_counter()
                out = out_b = blocks[b](out)
                if last and b == hop.hi - 1:
                    out = loss_fn(out, batch(task.slot)) * weight_of(task.slot)
                    res.loss += float(out.detach())
                fwd[b] = time.perf_counter() - tb
                if b not in res.out_bytes:
                    res.out_bytes[b] = out_b.numel() * out_b.element_size()
                if b < hop.hi - 1 and out.requires_grad:
                    out.register_hook(lambda g, b=b: stamps.__setitem__(b, time.perf_counter()))
            res.compute_s += time.perf_counter() - t0
            if not last:
                send(out, r.hops[task.hop + 1].worker, _tag(task.slot, task.hop + 1, False, 0))
            stash[(task.slot, task.hop)] = (x, out, fwd, stamps)
            if task.slot not in seen:
                seen.add(task.slot)
                res.microbatches += 1
        else:
            x, out, fwd, stamps = stash.pop((task.slot, task.hop))
            grad = None if last else recv(*source_of(task))
            t0 = time.perf_counter()
            out.backward(grad)
            t1 = time.perf_counter()
            res.compute_s += t1 - t0
            for b, sec in _split_backward(hop.lo, hop.hi, t0, t1, stamps, fwd).items():
                acc = res.block_times.setdefault(b, [0.0, 0.0, 0])
                acc[0] += fwd[b]
                acc[1] += sec
                acc[2] += 1
            if task.hop > 0:
                send(x.grad, r.hops[task.hop - 1].worker, _tag(task.slot, task.hop - 1, True, 0))
        res.tasks += 1
        res.task_overhead_s += max(0.0, time.perf_counter() - t_task - (res.waited_s - waited0)
                                   - (res.compute_s - compute0) - wire_s[0])
    gm.wait_p2p([w for w, _ in sends], timeout_s)
    return res
