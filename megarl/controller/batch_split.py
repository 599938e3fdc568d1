"""Split a batch into data-parallel chunks along dim 0 and concatenate chunks back, generically.

Understands torch tensors, numpy arrays, lists, tuples, dicts and dataclasses whose fields are any of these
(recursively, via `dataclasses.fields`, so a `RolloutBatch` defined elsewhere works without registering it).
Scalars and None (ints, floats, strings, bools) are metadata: they are copied into every chunk when splitting
and must agree across chunks when concatenating. Leaves out: uneven splits (the batch size must be divisible
by the number of chunks, as DP training expects equal micro-batch counts per rank), padding tensors of
different trailing shapes, and any knowledge of what the fields mean.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

_METADATA_TYPES = (int, float, str, bool, bytes, type(None))


class BatchSplitError(ValueError):
    """A batch cannot be split or concatenated; the message names the offending field path."""


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def count_batch_rows(batch: Any, *, path: str = "batch") -> int | None:
    """Return the dim-0 size shared by every splittable leaf of `batch`, or None if it has no such leaf."""
    sizes: dict[str, int] = {}
    _collect_sizes(batch, path, sizes)
    if not sizes:
        return None
    distinct = set(sizes.values())
    if len(distinct) > 1:
        listing = ", ".join(f"{name}={size}" for name, size in sizes.items())
        raise BatchSplitError(f"{path}: fields disagree on the batch size (dim 0): {listing}")
    return distinct.pop()


def _collect_sizes(value: Any, path: str, sizes: dict[str, int]) -> None:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim == 0:
            raise BatchSplitError(f"{path}: 0-d tensor/array has no batch dimension to split")
        sizes[path] = int(value.shape[0])
    elif isinstance(value, (list, tuple)):
        sizes[path] = len(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            _collect_sizes(item, f"{path}[{key!r}]", sizes)
    elif _is_dataclass_instance(value):
        for field in dataclasses.fields(value):
            _collect_sizes(getattr(value, field.name), f"{path}.{field.name}", sizes)
    elif not isinstance(value, _METADATA_TYPES):
        raise BatchSplitError(
            f"{path}: cannot split a value of type {type(value).__name__}; "
            "supported: torch.Tensor, numpy array, list, tuple, dict, dataclass, scalars"
        )


def split_batch(batch: Any, num_chunks: int, *, path: str = "batch") -> list[Any]:
    """Split `batch` into `num_chunks` equal chunks along dim 0; chunk i holds rows [i*n/k, (i+1)*n/k)."""
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    rows = count_batch_rows(batch, path=path)
    if rows is not None and rows % num_chunks != 0:
        raise BatchSplitError(
            f"{path}: batch size {rows} is not divisible into {num_chunks} data-parallel chunks; "
            f"make the global batch a multiple of the DP size"
        )
    chunk_rows = 0 if rows is None else rows // num_chunks
    return [_take_rows(batch, i * chunk_rows, (i + 1) * chunk_rows) for i in range(num_chunks)]


def _take_rows(value: Any, start: int, stop: int) -> Any:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        # A view would pin the whole parent storage when the chunk is pickled to another process.
        return value[start:stop].copy() if isinstance(value, np.ndarray) else value[start:stop].clone()
    if isinstance(value, list):
        return value[start:stop]
    if isinstance(value, tuple):
        return tuple(value[start:stop])
    if isinstance(value, dict):
        return {key: _take_rows(item, start, stop) for key, item in value.items()}
    if _is_dataclass_instance(value):
        return _rebuild_dataclass(value, {f.name: _take_rows(getattr(value, f.name), start, stop)
                                          for f in dataclasses.fields(value)})
    return value


def _rebuild_dataclass(template: Any, values: dict[str, Any]) -> Any:
    init_values = {f.name: values[f.name] for f in dataclasses.fields(template) if f.init}
    rebuilt = dataclasses.replace(template, **init_values)
    for field in dataclasses.fields(template):
        if not field.init:
            # object.__setattr__ so frozen dataclasses with init=False fields work too.
            object.__setattr__(rebuilt, field.name, values[field.name])
    return rebuilt


def concat_batches(parts: list[Any], *, path: str = "batch") -> Any:
    """Concatenate chunks produced by the DP ranks (in dp order) back into one batch along dim 0."""
    if not parts:
        raise BatchSplitError(f"{path}: nothing to concatenate (no parts)")
    first = parts[0]
    kinds = {type(part) for part in parts}
    if len(kinds) > 1:
        names = sorted(kind.__name__ for kind in kinds)
        raise BatchSplitError(f"{path}: parts have different types {names}")
    if isinstance(first, torch.Tensor):
        trailing = {tuple(part.shape[1:]) for part in parts}
        if first.ndim == 0 or len(trailing) > 1:
            shapes = [tuple(part.shape) for part in parts]
            raise BatchSplitError(f"{path}: cannot concatenate tensors of shapes {shapes} along dim 0")
        return torch.cat(parts, dim=0)
    if isinstance(first, np.ndarray):
        try:
            return np.concatenate(parts, axis=0)
        except ValueError as err:
            raise BatchSplitError(f"{path}: cannot concatenate arrays: {err}") from err
    if isinstance(first, list):
        return [item for part in parts for item in part]
    if isinstance(first, tuple):
        return tuple(item for part in parts for item in part)
    if isinstance(first, dict):
        keys = list(first)
        for index, part in enumerate(parts):
            if list(part) != keys:
                raise BatchSplitError(f"{path}: part {index} has keys {list(part)}, part 0 has {keys}")
        return {key: concat_batches([part[key] for part in parts], path=f"{path}[{key!r}]") for key in keys}
    if _is_dataclass_instance(first):
        values = {
            f.name: concat_batches([getattr(part, f.name) for part in parts], path=f"{path}.{f.name}")
            for f in dataclasses.fields(first)
        }
        return _rebuild_dataclass(first, values)
    if isinstance(first, _METADATA_TYPES):
        if any(part != first for part in parts):
            raise BatchSplitError(
                f"{path}: scalar values differ across parts {[part for part in parts]}; "
                "scalars are metadata and must agree (collect per-rank values with Collect.ALL instead)"
            )
        return first
    raise BatchSplitError(f"{path}: cannot concatenate values of type {type(first).__name__}")
