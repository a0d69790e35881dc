"""Carry out a migration: move whole blocks' state between workers, point to point, in rounds.

A migration is the migration plan's transfers ``(src, dst, first block, stop block)`` grouped into
rounds in which no worker appears twice (``engine.migration.schedule_rounds``).  Every member walks the
rounds in order and takes part in the transfers that name it: the sender encodes each block's
weights, optimizer state and scheduler state (``state.encode``: a JSON skeleton and raw tensor
bytes, nothing pickled), the receiver materialises the block and loads it.  Transfers of one
round run at once on different pairs; a member with nothing in a round goes on to the next, and
the tags keep messages of different rounds apart.  Under an emulated network
(``ElasticConfig.emulate_link``) the receiver first tells the sender it is ready, and both are
then held for latency + bytes / bandwidth (a link carries one transfer at a time, and starts it
when both ends are free -- the engine's ``critical_path``).

A failure during a migration (a peer dies) raises ``CollectiveFailure`` like any collective; the
recovery protocol then gathers what every survivor holds *now* (blocks received so far count,
old blocks are only dropped after the migration) and plans the transfers again from there.
"""

from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist

from chameleon_ft.runtime import codec as run_state

__all__ = ["blocks_tree", "confirm", "encode_tree", "recv_tree", "run", "send_encoded", "walk"]

_NOMINAL_BPS = 1e6  # fault injection only (see run)
_BASE_TAG = 1 << 30  # above every tag a pipeline step uses (gloo tags are C ints)


class _Port:
    """Point-to-point ops and their wait, on the generation's group (``GroupManager``: fail
    fast) -- ``overlap.py`` has another, on a group captured for a background thread."""

    def __init__(self, gm, timeout_s: float):
        self.gm, self.timeout_s = gm, timeout_s

    def send(self, t, dst: int, tag: int):
        return self.gm.send(t, dst, tag)

    def recv(self, t, src: int, tag: int):
        return self.gm.recv(t, src, tag)

    def wait(self, works: list) -> None:
        self.gm.wait_p2p(works, self.timeout_s)


def encode_tree(tree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tree`` as the three messages of a transfer (sizes, JSON skeleton, raw tensor bytes):
    a copy, so a snapshot of state that goes on changing."""
    skeleton, tensors = run_state.encode(tree)
    blob = json.dumps({"tree": skeleton, "specs": run_state._specs(tensors)}).encode()
    body = run_state._pack(tensors)
    meta = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    return torch.tensor([meta.numel(), body.numel()], dtype=torch.int64), meta, body


def send_encoded(port, dst_rank: int, tag: int, enc) -> int:
    sizes, meta, body = enc
    works = [port.send(sizes, dst_rank, tag), port.send(meta, dst_rank, tag + 1)]
    if body.numel():
        works.append(port.send(body, dst_rank, tag + 2))
    port.wait(works)
    return int(body.numel())


def recv_tree(port, src_rank: int, tag: int):
    sizes = torch.zeros(2, dtype=torch.int64)
    port.wait([port.recv(sizes, src_rank, tag)])
    meta = torch.empty(int(sizes[0]), dtype=torch.uint8)
    body = torch.empty(int(sizes[1]), dtype=torch.uint8)
    works = [port.recv(meta, src_rank, tag + 1)]
    if body.numel():
        works.append(port.recv(body, src_rank, tag + 2))
    port.wait(works)
    info = json.loads(bytes(meta.numpy()).decode())
    return run_state.decode(info["tree"], run_state._unpack(body, info["specs"])), int(body.numel())


def run(ctx, rounds: list, timeout_s: float) -> dict:
    """Take part in ``rounds`` (lists of ``[src, dst, lo, hi]``) as ``ctx.worker_id``; returns
    what this member moved: ``state_bytes`` (weights + optimizer state shaped like them, as
    the migration plan counts them; summed over the member's sends), ``wire_bytes`` and
    ``transfers`` (sent); ``durations``: seconds of each transfer it took part in, by its
    position in the flattened rounds, from the moment this end started it (``confirm``)."""
    out = {"state_bytes": 0, "wire_bytes": 0, "transfers": 0, "durations": {}}
    t0 = time.perf_counter()
    try:
        _rounds(ctx, rounds, timeout_s, out)
    except Exception as exc:
        # Who broke off, where and why: the recovery that follows plans again from what every
        # survivor holds now, and its own records do not say what ended this one.
        if getattr(ctx, "log", None):
            ctx.log.write("migration", step=ctx.step, phase="interrupted", seconds=time.perf_counter() - t0,
                          reason=f"{type(exc).__name__}: {exc}"[:300],
                          **{k: v for k, v in out.items() if k != "durations"})
        raise
    return out


def blocks_tree(ctx, lo: int, hi: int) -> dict:
    """Blocks ``lo``..``hi - 1`` as a transfer sends them (each held block's ``block_state``)."""
    missing = [b for b in range(lo, hi) if b not in ctx.held]
    if missing:
        raise RuntimeError(f"worker {ctx.worker_id} was asked to send blocks {missing} it does not hold")
    return {str(b): ctx.block_state(b) for b in range(lo, hi)}


def _rounds(ctx, rounds: list, timeout_s: float, out: dict) -> None:
    port = _Port(ctx.gm, timeout_s)

    def received(lo: int, hi: int, tree: dict) -> None:
        for b in range(lo, hi):
            ctx.put_block(b, tree[str(b)])
    walk(ctx, port, rounds, _BASE_TAG, lambda lo, hi, dst: encode_tree(blocks_tree(ctx, lo, hi)), received, out,
         lambda lo, hi, dst: sum(ctx.state_bytes(b) for b in range(lo, hi)), lambda s: _hold(ctx.gm, s))


def walk(ctx, port, rounds: list, base_tag: int, encoded, received, out: dict, state_bytes, hold,
         members=None) -> None:
    """Walk ``rounds`` as ``ctx.worker_id`` (module doc): a sender sends ``encoded(lo, hi, dst)``, a
    receiver hands the tree to ``received(lo, hi, tree)``; ``hold(seconds)``: the emulated
    link's time; ``members``: the generation's (default ``ctx.view``'s).  Counts into ``out``
    (see ``run``)."""
    me = ctx.worker_id
    rank_of = {w: i for i, w in enumerate(members or ctx.view.members)}
    delay = getattr(ctx, "_link_delay", None)  # the emulated network (ElasticConfig.emulate_link)
    ready = torch.zeros(1, dtype=torch.int64)
    flat = 0
    for k, rnd in enumerate(rounds):
        for i, (src, dst, lo, hi) in enumerate(rnd):
            tag = base_tag + (k * 4096 + i) * 4
            flat += 1
            if me not in (src, dst):
                continue
            if src == me:
                enc = encoded(lo, hi, dst)
                if delay is not None:
                    # An emulated link carries a transfer once both ends are free: wait for the
                    # receiver (gloo's send of a block can complete into socket buffers while
                    # the receiver is still busy, and the hold would overlap its other transfer).
                    port.wait([port.recv(ready, rank_of[dst], tag + 3)])
                began = time.perf_counter()
                nbytes = send_encoded(port, rank_of[dst], tag, enc)
                out["wire_bytes"] += nbytes
                out["state_bytes"] += state_bytes(lo, hi, dst)
                out["transfers"] += 1
            else:
                if delay is not None:
                    port.wait([port.send(ready, rank_of[src], tag + 3)])
                began = time.perf_counter()
                tree, nbytes = recv_tree(port, rank_of[src], tag)
            if delay is not None:  # the emulated link is busy for both ends
                hold(delay(nbytes))
            # A ``slow`` fault at this phase stretches the transfer by a multiple of its nominal
            # time at _NOMINAL_BPS (not of the measured time: that includes waiting for a
            # partner that may be stretched too, and would compound).
            ctx.faults.at(ctx.step, "migrate", nbytes / _NOMINAL_BPS)
            out["durations"][flat - 1] = time.perf_counter() - began  # the link's part, not the load below
            if dst == me:
                received(lo, hi, tree)


def _hold(gm, seconds: float) -> None:
    """The emulated link's time, ended early when a member ends the generation (a transfer in
    flight is abandoned at once, as a real one would be: held through, a join that interrupted
    a re-plan waited up to a whole transfer -- 8 s on the ``slowlink`` trace -- for the others)."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        time.sleep(min(left, 0.05))
        gm.raise_if_aborted()


def confirm(ctx, rounds: list, moved: dict, timeout_s: float) -> list:
    """Confirm that every member has its blocks (before anyone drops the old ones) and share
    how long each transfer took: the shorter of its two ends' clocks (a MIN all-reduce), i.e.
    from when the later end started it -- the other end's clock also holds the wait for a late
    partner (a replacement still starting up took 2.6 s longer to reach its first transfer, on
    the ``slowlink`` trace, 2026-12-03: calibrated as bandwidth, that priced every later re-plan's
    migration 1.7x too long).  Returns the rounds as ``[src, dst, lo, hi, seconds]``."""
    n = sum(len(r) for r in rounds)
    secs = torch.full((max(1, n),), float("inf"), dtype=torch.float64)
    for j, s in moved["durations"].items():
        secs[j] = s
    secs = ctx._store_op(lambda: ctx.gm.allreduce(secs, dist.ReduceOp.MIN, timeout_s=timeout_s,
                                                  header="sync", label="migrated"))
    it = iter(secs.tolist())
    return [[[*t, next(it)] for t in r] for r in rounds]
