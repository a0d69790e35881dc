"""A batch's results as ``gather`` / ``gather_for_metrics`` handle them: tensors in nested
dicts, lists and tuples (``map_tensors``), and the first rows of each -- the samples -- kept
(``trim_rows``) or dropped (``drop_rows``); lists of other objects are rows themselves."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["tensors_only", "map_tensors", "trim_rows", "drop_rows"]


def tensors_only(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, dict):
        return all(tensors_only(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return len(data) > 0 and all(tensors_only(v) for v in data)
    return False


def map_tensors(fn, data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, dict):
        return type(data)({k: map_tensors(fn, v) for k, v in data.items()})
    if isinstance(data, (list, tuple)) and tensors_only(data):
        return type(data)(map_tensors(fn, v) for v in data)
    return data


def trim_rows(data: Any, n: int) -> Any:
    """The first ``n`` samples of a batch's results (tensors, containers, lists of objects)."""
    if isinstance(data, torch.Tensor):
        return data[:n] if data.ndim else data
    if isinstance(data, dict):
        return type(data)({k: trim_rows(v, n) for k, v in data.items()})
    if isinstance(data, (list, tuple)):
        if tensors_only(data) or all(isinstance(v, dict) for v in data):
            return type(data)(trim_rows(v, n) for v in data)
        return data[:n]
    return data


def drop_rows(data: Any, n: int) -> Any:
    """``data`` without its first ``n`` rows (tensors, containers, lists of objects)."""
    if isinstance(data, torch.Tensor):
        return data[n:] if data.ndim else data
    if isinstance(data, dict):
        return type(data)({k: drop_rows(v, n) for k, v in data.items()})
    if isinstance(data, (list, tuple)):
        if tensors_only(data):
            return type(data)(drop_rows(v, n) for v in data)
        return data[n:]
    return data
