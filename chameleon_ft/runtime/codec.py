"""Run state as tensors plus plain JSON: moved between replicas and written to checkpoints.

A worker's whole training state (model, optimizer, LR scheduler, sampler, step counters, RNG)
is a nested tree of dicts, lists, tuples, numbers, strings and tensors.  ``encode`` splits such
a tree into a JSON-able skeleton and a list of tensors; ``decode`` puts it back together.  The
skeleton tags what JSON cannot say (tuples, dicts with non-string keys, tensor slots), so
optimizer state keyed by parameter index and Adam's ``betas`` tuple survive exactly.

Three uses:

* ``broadcast_tree`` sends a tree from one member of a generation's gloo group to all others:
  the JSON skeleton goes as a uint8 tensor and all tensors as *one* uint8 buffer (their raw
  bytes, so any dtype arrives bit for bit), in one broadcast when they are small.  Nothing received from a peer is unpickled.
* ``send_tree`` / ``recv_tree`` send a tree point to point to the members that need it (a
  recovery's state goes only to the members behind): the skeleton, then the tensors' bytes
  from their own memory (small ones joined), each message with its own tag.  Several holders
  of the same tree (``layout_digest`` equal: data-parallel replicas' parameters and optimizer
  state) can share the sending: each sends the messages ``_shares`` gives it.
* ``save_checkpoint`` / ``load_checkpoint`` write ``{"format", "meta", "tensors"}`` with
  ``torch.save`` and read it back with ``torch.load(weights_only=True)``; anything wrong with
  the file is reported as ``CheckpointError`` naming the path.

Limits, honestly: tensors are copied to CPU and must be dense (no sparse or quantized
tensors); objects other than the types above (e.g. a custom class in a scheduler's state)
raise ``TypeError`` naming where they sit; floats go through JSON, which round-trips Python
floats exactly (NaN/inf included, as Python's non-standard JSON tokens).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import zlib
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from chameleon_ft.runtime.errors import CheckpointError  # defined with the other outcomes

log = logging.getLogger(__name__)

__all__ = ["encode", "decode", "broadcast_tree", "send_tree", "recv_tree", "save_checkpoint", "load_checkpoint",
           "CheckpointError", "CHECKPOINT_FORMAT", "layout_digest", "split_tree", "merge_tree", "SHARED_TAG"]

CHECKPOINT_FORMAT = "chameleon-ft/run-state/1"


def encode(tree: Any, host: bool = True) -> tuple[Any, list[torch.Tensor]]:
    """Split ``tree`` into a JSON-able skeleton and its tensors (in skeleton order): copies on
    the host (``_host``), or with ``host=False`` the tensors themselves (detached)."""
    tensors: list[torch.Tensor] = []

    def enc(x: Any, where: str) -> Any:
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, torch.Tensor):
            tensors.append(_host(x) if host else x.detach())
            return {"__x": len(tensors) - 1}
        if isinstance(x, list):
            return [enc(v, f"{where}[{i}]") for i, v in enumerate(x)]
        if isinstance(x, tuple):
            return {"__t": [enc(v, f"{where}[{i}]") for i, v in enumerate(x)]}
        if isinstance(x, dict):
            return {"__d": [[enc(k, f"{where} key"), enc(v, f"{where}[{k!r}]")]
                            for k, v in x.items()]}
        raise TypeError(f"cannot encode {type(x).__name__} at {where or 'top level'}: only "
                        "tensors, numbers, strings, None, lists, tuples and dicts travel")

    return enc(tree, ""), tensors


def decode(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of ``encode``."""

    def dec(x: Any) -> Any:
        if isinstance(x, list):
            return [dec(v) for v in x]
        if isinstance(x, dict):
            if "__x" in x:
                return tensors[x["__x"]]
            if "__t" in x:
                return tuple(dec(v) for v in x["__t"])
            if "__d" in x:
                return {_hashable(dec(k)): dec(v) for k, v in x["__d"]}
            raise ValueError(f"bad state skeleton node {list(x)[:3]}")
        return x

    return dec(skeleton)


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def layout_digest(tree: Any) -> int:
    """A 63-bit digest of ``tree``'s skeleton (numbers and strings included) and its tensors'
    dtypes and shapes, not their values (nothing is copied off a device): two holders of a
    replicated tree with the same digest send the same messages (``send_tree``'s ``share``)."""
    skeleton, tensors = encode(tree, host=False)
    text = json.dumps([skeleton, _specs(tensors)], separators=(",", ":")).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> 1


def split_tree(tree: dict, part: dict) -> dict:
    """``tree`` without ``part`` (a sub-tree of it, two levels deep at most: whole top-level
    keys, or some keys of a top-level dict); ``merge_tree`` puts it back."""
    rest = dict(tree)
    for k, v in part.items():
        if isinstance(v, dict) and isinstance(tree.get(k), dict) and v is not tree[k]:
            rest[k] = {kk: vv for kk, vv in tree[k].items() if kk not in v}
        else:
            rest.pop(k, None)
    return rest


def merge_tree(rest: dict, part: dict) -> dict:
    """Inverse of ``split_tree``."""
    out = dict(rest)
    for k, v in part.items():
        out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _hashable(k: Any) -> Any:
    return tuple(k) if isinstance(k, list) else k


def _specs(tensors: list[torch.Tensor]) -> list[list]:
    return [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    # State travels over the control group (gloo, host memory): a tensor on an accelerator is
    # copied to the host here, and ``load_state_dict`` puts it back on the receiver's device.
    parts = [t.detach().reshape(-1).cpu().view(torch.uint8) for t in tensors if t.numel()]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def _unpack(buf: torch.Tensor, specs: list[list], copy: bool = True) -> list[torch.Tensor]:
    """The tensors ``specs`` describe, laid end to end in ``buf`` (copies, or with
    ``copy=False`` views of ``buf``)."""
    out, at = [], 0
    for spec in specs:
        nbytes = _nbytes(spec)
        part = buf[at:at + nbytes]
        out.append((part.clone() if copy else part).view(getattr(torch, spec[0])).reshape(spec[1]))
        at += nbytes
    if at != buf.numel():
        raise ValueError(f"state buffer has {buf.numel()} bytes, specs describe {at}")
    return out


# Bytes of ``broadcast_tree``'s first broadcast beyond its two sizes: a skeleton (and tensors)
# that fit travel in it, so a recovery's payload (6-11 kB of JSON for a 4-worker
# data-parallel job) takes one collective instead of two or three.
INLINE_BYTES = 16 * 1024


def broadcast_tree(collective: Callable[[Callable], object], root: int, rank: int,
                   tree: Optional[Any] = None) -> Any:
    """Send ``tree`` from ``root`` to every member; returns the tree on every member.

    ``collective`` is ``GroupManager.collective`` (so a dying peer raises
    ``CollectiveFailure`` rather than hanging).  One broadcast of a fixed ``INLINE_BYTES``
    buffer carries the skeleton's and the tensors' sizes and whatever of the skeleton (JSON as
    uint8) and the tensors' bytes fits; the skeleton, then all tensor bytes in one buffer, go
    in broadcasts of their own when they do not fit (every member knows which from the sizes).
    """

    def bcast(t: torch.Tensor) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        collective(lambda pg: pg.broadcast([t], opts))
        return t

    first = torch.zeros(16 + INLINE_BYTES, dtype=torch.uint8)
    sizes = first[:16].view(torch.int64)
    if rank == root:
        skeleton, tensors = encode(tree)
        blob = json.dumps({"tree": skeleton, "specs": _specs(tensors)}).encode()
        body = _pack(tensors)
        sizes[0], sizes[1] = len(blob), body.numel()
        if len(blob) <= INLINE_BYTES:
            first[16:16 + len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
            if len(blob) + body.numel() <= INLINE_BYTES and body.numel():
                first[16 + len(blob):16 + len(blob) + body.numel()] = body
    bcast(first)
    n_meta, n_body = int(sizes[0]), int(sizes[1])
    meta_inline = n_meta <= INLINE_BYTES
    body_inline = meta_inline and n_meta + n_body <= INLINE_BYTES
    if meta_inline:
        meta_t = first[16:16 + n_meta]
    else:
        meta_t = bcast(torch.frombuffer(bytearray(blob), dtype=torch.uint8) if rank == root
                       else torch.empty(n_meta, dtype=torch.uint8))
    if rank != root:
        if body_inline:
            body = first[16 + n_meta:16 + n_meta + n_body].clone()
        else:
            body = torch.empty(n_body, dtype=torch.uint8)
    if n_body and not body_inline:
        bcast(body)
    if rank == root:
        return tree
    meta = json.loads(bytes(meta_t.numpy()).decode())
    return decode(meta["tree"], _unpack(body, meta["specs"]))


# Point-to-point state transfer (``send_tree`` / ``recv_tree``): message k of a transfer goes
# with tag ``tag + k`` (``_TREE_TAG``, or ``SHARED_TAG`` for the part several holders send),
# above every tag the executors use; tensors smaller than ``_SMALL_BYTES`` travel together in
# one message, each larger one in a message of its own.
_TREE_TAG = (1 << 31) - (1 << 16)
SHARED_TAG = _TREE_TAG + (1 << 15)
_SMALL_BYTES = 64 * 1024


def _nbytes(spec: list) -> int:
    dtype_name, shape = spec
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {dtype_name!r} in state")
    numel = 1
    for d in shape:
        numel *= int(d)
    return numel * torch.empty(0, dtype=dtype).element_size()


def _messages(specs: list[list]) -> list[list[int]]:
    """The tensors' indices grouped into messages (both sides compute it from the specs):
    consecutive small tensors together, a large one alone, empty ones in none."""
    groups: list[list[int]] = []
    small: list[int] = []
    held = 0
    for i, spec in enumerate(specs):
        size = _nbytes(spec)
        if not size:
            continue
        if size < _SMALL_BYTES:
            small.append(i)
            held += size
            if held >= _SMALL_BYTES:
                groups.append(small)
                small, held = [], 0
        else:
            groups.append([i])
    if small:
        groups.append(small)
    if len(groups) + 2 > (1 << 15):
        raise ValueError(f"a state of {len(groups)} messages: more than a transfer's tags allow")
    return groups


def _shares(specs: list[list], groups: list[list[int]], holders: int) -> list[int]:
    """Which of ``holders`` senders sends each message (both sides compute it from the
    specs): the largest first, each to the least loaded so far (ties: the lower index)."""
    sizes = [sum(_nbytes(specs[i]) for i in g) for g in groups]
    load, who = [0] * holders, [0] * len(groups)
    for k in sorted(range(len(groups)), key=lambda k: -sizes[k]):
        h = min(range(holders), key=lambda j: load[j])
        who[k], load[h] = h, load[h] + sizes[k]
    return who


def send_tree(send: Callable[[torch.Tensor, int, int], object], wait: Callable[[list], None],
              tree: Any, dsts: list[int], *, tag: int = _TREE_TAG, share: tuple[int, int] = (0, 1)) -> int:
    """Send ``tree`` point to point to each rank in ``dsts`` (``recv_tree`` on each); returns
    the bytes one of them receives (from every holder together).  ``send(tensor, dst, tag)``
    starts a send and ``wait(works)`` waits (``GroupManager.send`` / ``wait_p2p``: a dying peer
    raises ``CollectiveFailure``).  A large tensor is sent from its own memory (CPU tensors are
    not copied); only tensors under 64 KiB are joined into shared messages: no whole-state
    buffer on the sender.  ``share=(i, h)``: this sender is holder ``i`` of ``h`` that hold the
    same tree (the same ``layout_digest``) and send it together: holder 0 sends the skeleton,
    each holder the messages ``_shares`` gives it (the receiver names the holders in order)."""
    skeleton, tensors = encode(tree, host=False)
    specs = _specs(tensors)
    blob = json.dumps({"tree": skeleton, "specs": specs}).encode()
    head = [torch.tensor([len(blob)], dtype=torch.int64), torch.frombuffer(bytearray(blob), dtype=torch.uint8)]
    groups = _messages(specs)
    who = _shares(specs, groups, share[1])
    msgs = list(enumerate(head)) if share[0] == 0 else []
    for k, group in enumerate(groups):
        if who[k] == share[0]:
            msgs.append((2 + k, _host(tensors[group[0]]).reshape(-1).view(torch.uint8) if len(group) == 1
                         else _pack([tensors[i] for i in group])))
    works = [send(m, dst, tag + k) for dst in dsts for k, m in msgs]
    wait(works)
    return sum(m.numel() * m.element_size() for m in head) + sum(_nbytes(spec) for spec in specs)


def recv_tree(recv: Callable[[torch.Tensor, int, int], object], wait: Callable[[list], None], src: int, *,
              tag: int = _TREE_TAG, holders: Optional[list[int]] = None) -> Any:
    """Receive a tree that ``send_tree`` sends from rank ``src`` -- or, with ``holders``, that
    those ranks send together (``share=(holders.index(rank), len(holders))``)."""
    holders = holders or [src]
    head = torch.zeros(1, dtype=torch.int64)
    wait([recv(head, holders[0], tag)])
    meta_t = torch.empty(int(head[0]), dtype=torch.uint8)
    wait([recv(meta_t, holders[0], tag + 1)])
    meta = json.loads(bytes(meta_t.numpy()).decode())
    specs = meta["specs"]
    groups = _messages(specs)
    who = _shares(specs, groups, len(holders))
    bufs = [torch.empty(sum(_nbytes(specs[i]) for i in g), dtype=torch.uint8) for g in groups]
    wait([recv(b, holders[who[k]], tag + 2 + k) for k, b in enumerate(bufs)])
    tensors: list[Optional[torch.Tensor]] = [None] * len(specs)
    for g, buf in zip(groups, bufs):
        for i, t in zip(g, _unpack(buf, [specs[i] for i in g], copy=len(g) > 1)):
            tensors[i] = t
    for i, spec in enumerate(specs):
        if tensors[i] is None:  # empty: in no message
            tensors[i] = _unpack(torch.empty(0, dtype=torch.uint8), [spec])[0]
    return decode(meta["tree"], tensors)


def atomic_save(obj: Any, path: str | os.PathLike, keep_previous: bool = False,
                midway: Optional[Callable[[], None]] = None) -> None:
    """``torch.save(obj)`` to ``path`` so that no interruption -- a kill, a crash, a full disk
    -- leaves a file there that is not a whole one: written to a temporary file, flushed to the
    disk (``fsync``), then renamed over ``path`` and the rename itself made durable (the
    folder's ``fsync``).  ``keep_previous``: the file it replaces is kept as ``<path>.prev``
    (``previous_of``), so that a checkpoint found damaged later has one to fall back on.
    ``midway`` (tests, the chaos trials' ``kill_save``): called once the temporary file holds
    the data, before it is flushed and renamed -- where a kill tears a write."""
    path = os.fspath(path)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            if midway is not None:
                midway()
            f.flush()
            os.fsync(f.fileno())
        if keep_previous and os.path.exists(path):
            os.replace(path, previous_of(path))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # a file system without directory fsync: the rename is still atomic
        pass


def previous_of(path: str | os.PathLike) -> str:
    """Where ``save_checkpoint`` keeps the checkpoint it replaced."""
    return f"{os.fspath(path)}.prev"


def _checksum(meta: str, tensors: list) -> int:
    """CRC-32 of the skeleton and every tensor's bytes (any dtype: read as bytes)."""
    crc = zlib.crc32(meta.encode())
    for t in tensors:
        crc = zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy(), crc)
    return crc


def save_checkpoint(path: str | os.PathLike, tree: Any, midway: Optional[Callable[[], None]] = None) -> None:
    """Write ``tree`` with its checksum (``atomic_save``, ``midway`` passed on), keeping the
    checkpoint it replaces as ``previous_of(path)``."""
    skeleton, tensors = encode(tree)
    tensors = [t.detach().cpu() for t in tensors]  # a checkpoint loads on any device
    meta = json.dumps(skeleton)
    atomic_save({"format": CHECKPOINT_FORMAT, "meta": meta, "tensors": tensors, "crc32": _checksum(meta, tensors)},
                path, keep_previous=True, midway=midway)


def model_file(path: str | os.PathLike) -> str:
    """Where the plain model ``state_dict`` of the checkpoint at ``path`` goes, beside it:
    ``ckpt.pt`` -> ``ckpt.model.pt``.  ``model.load_state_dict(torch.load(model_file(path),
    weights_only=True))`` reads it (no chameleon-ft needed); resuming reads ``path``."""
    root, ext = os.path.splitext(os.fspath(path))
    return f"{root}.model{ext or '.pt'}"


def save_model(path: str | os.PathLike, state_dict: dict) -> None:
    """Write a plain ``state_dict`` (name -> tensor) atomically (``atomic_save``)."""
    atomic_save({k: v.detach().clone() for k, v in state_dict.items()}, path)


def load_checkpoint(path: str | os.PathLike, fallback: bool = True) -> Any:
    """Read a tree written by ``save_checkpoint``; ``CheckpointError`` if it is not one.  A
    damaged checkpoint (unreadable, or its checksum does not match) is refused, saying why,
    and with ``fallback`` the one it replaced (``previous_of``) is read instead, with a
    warning naming both."""
    try:
        return _load_checkpoint(os.fspath(path))
    except CheckpointError as exc:
        prev = previous_of(path)
        if not fallback or "does not exist" in str(exc) or not os.path.exists(prev):
            raise
        try:
            tree = _load_checkpoint(prev)
        except CheckpointError as again:
            raise CheckpointError(f"{exc}; the previous one is damaged too: {again}") from exc
        log.warning("%s: reading the previous checkpoint %s instead", exc, prev)
        return tree


def _load_checkpoint(path: str) -> Any:
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # unpickling errors, truncated zip, wrong magic...
        raise CheckpointError(f"checkpoint {path} is corrupt or not a checkpoint: {exc}") from exc
    if not isinstance(raw, dict) or raw.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"checkpoint {path} is not a {CHECKPOINT_FORMAT} file")
    if "crc32" in raw and _checksum(raw.get("meta", ""), list(raw.get("tensors", []))) != raw["crc32"]:
        raise CheckpointError(f"checkpoint {path} is damaged: its checksum does not match its contents")
    try:
        return decode(json.loads(raw["meta"]), list(raw["tensors"]))
    except (KeyError, ValueError, IndexError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {path} has a damaged skeleton: {exc}") from exc
