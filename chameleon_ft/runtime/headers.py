"""Collective headers: what each member is about to run, exchanged before the data moves.

The protocol and why it exists are in ``groups.py``'s module docstring ("Collective headers");
this module holds the encoding: a fixed-size int64 header per member whatever the op, its kind,
label, dtype and sizes as codes every process computes alike, and its description in words.
"""

from __future__ import annotations

import zlib
from typing import Optional

import torch

__all__ = ["HEADER_LEN", "AGREED", "FREE_DIMS", "GATHERS", "RUNTIME_KINDS", "CONTROL_KINDS",
           "code_of", "op_name", "encode_header", "describe_header", "header_kind"]

RUNTIME_KINDS = ("step", "sync")
CONTROL_KINDS = ("reduce", "all_gather", "gather_object", "broadcast", "barrier")
GATHERS = ("all_gather", "gather_object")  # shapes may differ between members
_KIND_CODE = {k: i + 1 for i, k in enumerate(RUNTIME_KINDS + CONTROL_KINDS)}
_KIND_NAME = {v: k for k, v in _KIND_CODE.items()}
_CALL = {"step": "the training step's gradient all-reduce", "sync": "a recovery all-reduce"}
_MAGIC = 0x63667468_0001  # "cfth", version 1
# Slots [0, AGREED) must be equal on every member: magic, kind, label, dtype, reduce op or
# broadcast source, numel, ndim, shape code.  Slots from AGREED on are per member (a gather's
# numel and its first FREE_DIMS dims).
HEADER_LEN, AGREED, FREE_DIMS = 16, 8, 7
_NAMES: dict[int, str] = {}  # code -> text, to name a peer's call in a warning


def code_of(text: str, remember: bool = True) -> int:
    """A code for ``text`` that every process computes alike (``hash`` is salted per process)."""
    if not text:
        return 0
    code = zlib.crc32(text.encode())
    if remember:
        _NAMES.setdefault(code, text)
    return code


for _d in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}:
    code_of(str(_d).replace("torch.", ""))
for _o in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM") + tuple(_KIND_CODE):
    code_of(_o)


def op_name(op) -> str:
    return getattr(getattr(op, "op", op), "name", str(op))


def encode_header(kind: str, tensor: Optional[torch.Tensor] = None, label: str = "", arg: int = 0) -> torch.Tensor:
    """This member's header for a ``kind`` collective over ``tensor`` (see module doc)."""
    if kind not in _KIND_CODE:
        raise ValueError(f"unknown collective kind {kind!r}")
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[0], h[1], h[2], h[4] = _MAGIC, _KIND_CODE[kind], code_of(label), int(arg)
    if tensor is not None:
        shape = list(tensor.shape)
        h[3], h[6] = code_of(str(tensor.dtype).replace("torch.", "")), len(shape)
        if kind in GATHERS:
            h[AGREED] = tensor.numel()
            dims = shape[:FREE_DIMS]
            h[AGREED + 1:AGREED + 1 + len(dims)] = torch.tensor(dims, dtype=torch.int64)
        else:
            h[5], h[7] = tensor.numel(), code_of(str(tuple(shape)), remember=False)
    return h


def describe_header(h: torch.Tensor) -> str:
    """A header as words, for warnings: the call, its label, dtype and size."""
    v = [int(x) for x in h.tolist()]
    if v[0] != _MAGIC:
        return "an op without a chameleon-ft header"
    kind = _KIND_NAME.get(v[1], f"unknown kind {v[1]}")
    text = _CALL.get(kind, kind)
    label = _NAMES.get(v[2], "")  # a peer's label this process never used is left out
    if label and label != kind:
        text += f" '{label}'"
    if kind == "reduce":
        text += f" ({_NAMES.get(v[4], v[4])})"
    elif kind == "broadcast":
        text += f" (from rank {v[4]})"
    if v[3]:
        size = v[AGREED] if kind in GATHERS else v[5]
        text += f" of {_NAMES.get(v[3], 'dtype #%d' % v[3])}[{size}]"
    return text


def header_kind(h: torch.Tensor) -> Optional[str]:
    return _KIND_NAME.get(int(h[1])) if int(h[0]) == _MAGIC else None
