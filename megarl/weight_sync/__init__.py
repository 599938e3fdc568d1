"""Resharding weight sync: Megatron TP/PP/EP shards -> HF-layout tensors -> rollout engine, in bounded buckets."""

from megarl.weight_sync.buckets import SyncStats, bucketize
from megarl.weight_sync.gather import iter_hf_tensors
from megarl.weight_sync.sync import sync_weights
from megarl.weight_sync.transport import ColocatedTransport, DiscardTransport, WeightTransport

__all__ = ["ColocatedTransport", "DiscardTransport", "SyncStats", "WeightTransport", "bucketize", "iter_hf_tensors", "sync_weights"]
