"""The interface every weight-sync transport implements, and the colocated (same-process) transport.

A transport receives HF-named buckets on the trainer side and gets them into a rollout engine. The
colocated transport is the hybrid-engine case: the rollout engine lives in the same worker process as
the Megatron shard, so a bucket is handed to ``engine.update_weights`` directly. Between processes
(separate placement) the controller's transports carry buckets over a broadcast group
(:mod:`megarl.weight_sync.broadcast`) or Ray's object store.
"""

from __future__ import annotations

import abc

from megarl.weight_sync.buckets import NamedTensors


class WeightTransport(abc.ABC):
    @abc.abstractmethod
    def send(self, bucket: NamedTensors) -> None:
        """Deliver one bucket (called once per bucket, in order)."""

    def finish(self) -> None:
        """Called after the last bucket (engines may reset caches here)."""


class ColocatedTransport(WeightTransport):
    def __init__(self, engine):
        self.engine = engine

    def send(self, bucket: NamedTensors) -> None:
        self.engine.update_weights(bucket)

    def finish(self) -> None:
        finish = getattr(self.engine, "finish_weight_update", None)
        if finish is not None:
            finish()


class DiscardTransport(WeightTransport):
    """Ranks that gather (collectives need them) but hold no rollout engine, and benchmarks."""

    def send(self, bucket: NamedTensors) -> None:
        del bucket
