"""Weight buckets to rollout workers in other processes over a process group of their own.

The group is the trainer's rank 0 (the root, group rank 0) plus every rollout worker (group ranks 1..N),
made apart from the training world with a TCP store hosted by the root, as vLLM and verl make their
weight-update groups: the rollout workers never join the trainers' torch.distributed world. NCCL on GPUs
(device to device, no host copy), gloo on CPU.

A bucket travels as one flat byte buffer per broadcast; its layout (:class:`TensorSlot` per tensor) goes
ahead of it by RPC, so a receiver allocates the buffer and hands the engine views into it.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megarl.weight_sync.buckets import NamedTensors, tensor_bytes


@dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes into the bucket's buffer
    nbytes: int


def bucket_layout(bucket: NamedTensors) -> list[TensorSlot]:
    """Where each tensor of ``bucket`` sits in its flat buffer (offsets aligned for every dtype)."""
    slots, offset = [], 0
    for name, tensor in bucket:
        offset = -(-offset // 16) * 16
        slots.append(TensorSlot(name, tensor.dtype, tuple(tensor.shape), offset, tensor_bytes(tensor)))
        offset += tensor_bytes(tensor)
    return slots


def buffer_bytes(layout: list[TensorSlot]) -> int:
    return max((slot.offset + slot.nbytes for slot in layout), default=0)


def pack_bucket(bucket: NamedTensors, layout: list[TensorSlot], device) -> torch.Tensor:
    buffer = torch.empty(buffer_bytes(layout), dtype=torch.uint8, device=device)
    for (_, tensor), slot in zip(bucket, layout):
        buffer[slot.offset:slot.offset + slot.nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
    return buffer


def unpack_bucket(buffer: torch.Tensor, layout: list[TensorSlot]) -> NamedTensors:
    """Views into ``buffer`` shaped as the sender's tensors."""
    return [(slot.name, buffer[slot.offset:slot.offset + slot.nbytes].view(slot.dtype).reshape(slot.shape))
            for slot in layout]


def host_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store on a port the system picks as it binds (a port chosen first and bound later can be
    taken in between by any process on the node)."""
    return dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def create_group(host: str, port: int, rank: int, world_size: int, device: str, timeout_s: float,
                 store: dist.TCPStore | None = None) -> dist.ProcessGroup:
    """Join the weight group whose store rank 0 hosts at ``host:port`` (rank 0 passes its ``store``). Returns
    once every rank joined."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, wait_for_workers=False, timeout=timeout)
    if device == "cuda":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def start_broadcast(group: dist.ProcessGroup, buffer: torch.Tensor):
    """Start broadcasting ``buffer`` from group rank 0; returns the collective's work handle (poll
    ``is_completed()``, or ``wait()``; on CUDA ``wait`` makes the current stream wait for it)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([buffer], options)


def broadcast_from_root(group: dist.ProcessGroup, buffer: torch.Tensor) -> None:
    start_broadcast(group, buffer).wait()


def receive_bucket(group: dist.ProcessGroup, layout: list[TensorSlot], device) -> NamedTensors:
    """On a receiving rank: the bucket the root broadcasts next, as views into a fresh buffer on ``device``."""
    buffer = torch.empty(buffer_bytes(layout), dtype=torch.uint8, device=device)
    broadcast_from_root(group, buffer)
    return unpack_bucket(buffer, layout)
