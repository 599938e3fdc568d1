"""One weight sync: gather HF tensors from the Megatron shards, bucket them, push them through a transport.

``sync_weights`` is called on every rank of the training world at the same time (the gather is
collective). Ranks that hold a rollout engine pass a transport into it; the others pass
:class:`DiscardTransport`. The returned :class:`SyncStats` (bytes, buckets, largest bucket, seconds,
GB/s) is the headline cost metric of the hybrid engine.
"""

from __future__ import annotations

from typing import Optional

import torch

from megarl.weight_sync.buckets import SyncStats, bucketize
from megarl.weight_sync.gather import iter_hf_tensors
from megarl.weight_sync.transport import WeightTransport


def sync_weights(
    model_chunks: list[torch.nn.Module], bridge, transport: WeightTransport, *, bucket_bytes: int,
    dtype: Optional[torch.dtype] = None, num_local_experts: Optional[int] = None,
) -> SyncStats:
    stats = SyncStats()
    with torch.no_grad():
        tensors = iter_hf_tensors(model_chunks, bridge, num_local_experts=num_local_experts, dtype=dtype)
        for bucket in bucketize(tensors, bucket_bytes):
            stats.record(bucket)
            transport.send(bucket)
            del bucket
    transport.finish()
    return stats.finish()


def sync_adapter(model_chunks, bridge, engine, config_of, *, dtype: Optional[torch.dtype] = None,
                 num_local_experts: Optional[int] = None) -> SyncStats:
    """LoRA served by the rollout engine: only the adapters move, as one PEFT-named set
    (:mod:`megarl.weight_sync.adapters`). Collective like :func:`sync_weights`; ``engine`` None on ranks
    without a rollout engine. ``config_of(named)`` gives the adapter's ``adapter_config.json`` dict."""
    from megarl.weight_sync.adapters import gather_peft_adapter

    stats = SyncStats()
    named = gather_peft_adapter(model_chunks, bridge, num_local_experts=num_local_experts, dtype=dtype)
    stats.record(named)
    if engine is not None:
        engine.load_adapter(named, config_of(named))
    return stats.finish()
