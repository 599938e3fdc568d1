"""Group a stream of named tensors into buckets of bounded size, and account for what went through.

Peak extra memory of a sync is about one bucket (plus the one tensor being gathered), whatever the model
size: a bucket is handed to the transport and dropped before the next one fills. A single tensor larger
than the bound travels alone in its own bucket.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

NamedTensors = list[tuple[str, torch.Tensor]]


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def bucketize(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[NamedTensors]:
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: NamedTensors = []
    filled = 0
    for name, tensor in named_tensors:
        size = tensor_bytes(tensor)
        if bucket and filled + size > bucket_bytes:
            yield bucket
            bucket, filled = [], 0
        bucket.append((name, tensor))
        filled += size
    if bucket:
        yield bucket


@dataclass
class SyncStats:
    num_tensors: int = 0
    num_buckets: int = 0
    total_bytes: int = 0
    largest_bucket_bytes: int = 0
    seconds: float = 0.0
    names: list[str] = field(default_factory=list)
    _start: float = field(default_factory=time.perf_counter, repr=False)

    def record(self, bucket: NamedTensors) -> None:
        size = sum(tensor_bytes(t) for _, t in bucket)
        self.num_buckets += 1
        self.num_tensors += len(bucket)
        self.total_bytes += size
        self.largest_bucket_bytes = max(self.largest_bucket_bytes, size)
        self.names.extend(name for name, _ in bucket)

    def finish(self) -> "SyncStats":
        self.seconds = time.perf_counter() - self._start
        return self

    @property
    def gb_per_s(self) -> float:
        return self.total_bytes / 1e9 / self.seconds if self.seconds > 0 else float("inf")

    def as_metrics(self, prefix: str = "weight_sync") -> dict[str, float]:
        return {
            f"{prefix}/bytes": float(self.total_bytes),
            f"{prefix}/buckets": float(self.num_buckets),
            f"{prefix}/largest_bucket_bytes": float(self.largest_bucket_bytes),
            f"{prefix}/seconds": self.seconds,
            f"{prefix}/gb_per_s": self.gb_per_s,
        }
