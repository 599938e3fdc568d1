"""A rollout replica over several ranks whose engine lives in the replica's first rank and drives all of the
replica's GPUs itself (SGLang: ``tp_size`` starts one TP worker process per GPU), where a vLLM replica runs one
shard in each rank's process (:mod:`megarl.controller.rollout_replicas`).

Every rank of the replica holds a :class:`ReplicaServedByFirstRank` and makes the same calls on it as on an engine
of its own, in the same order (the worker group is SPMD); each call is a collective over the replica's group:

* ``generate``: the first rank generates what :func:`~megarl.controller.rollout_replicas.generate_in_replica`
  merged from the replica's shares, every rank gets the outputs (as every rank of a vLLM replica does);
* ``update_weights``: each rank has the bucket's full tensors on its own GPU (the weight sync's export) and hands
  them over as handles (``serialize_bucket``), gathered to the first rank, whose engine loads rank i's copy into
  its worker on rank i's GPU (``update_weights_from_replica``); the tensors stay referenced until it has;
* ``sleep`` / ``wake_up`` / ``finish_weight_update``: the first rank's engine acts for all the replica's GPUs; the
  others return when it has, so no rank trains in memory its GPU's worker has not released yet.

What the first rank's engine raises, every rank of the replica raises (a peer would otherwise wait in the next
collective until the group's timeout).
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable, Optional

import torch.distributed as dist

from megarl.controller.rollout_replicas import RolloutReplica


class ReplicaServedByFirstRank:
    """This rank's face of a replica served by its first rank (``engine`` there, None on the others)."""

    def __init__(self, engine, replica: RolloutReplica, *, sleeps: bool,
                 serialize_bucket: Callable[[list], list]):
        self.engine = engine
        self.replica = replica
        self.supports_sleep = sleeps
        self._serialize_bucket = serialize_bucket
        self._first = dist.get_global_rank(replica.group, 0)
        self.is_first = dist.get_rank(replica.group) == 0

    def generate(self, prompt_token_ids, sampling, multi_modal_inputs=None):
        images = {"multi_modal_inputs": multi_modal_inputs} if multi_modal_inputs is not None else {}
        return self._on_first_rank("generate", lambda: self.engine.generate(prompt_token_ids, sampling, **images))

    def update_weights(self, named_tensors) -> None:
        bucket = [(name, tensor.contiguous()) for name, tensor in named_tensors]  # the handles' storage, kept below
        payloads = [None] * self.replica.size if self.is_first else None
        dist.gather_object(self._serialize_bucket(bucket), payloads, dst=self._first, group=self.replica.group)
        self._on_first_rank("update_weights", lambda: self.engine.update_weights_from_replica(bucket, payloads))
        del bucket  # every rank's copies are loaded once the first rank's call has returned

    def finish_weight_update(self) -> None:
        self._on_first_rank("finish_weight_update", lambda: self.engine.finish_weight_update())

    def sleep(self, *, discard_weights: bool = False) -> None:
        self._on_first_rank("sleep", lambda: self.engine.sleep(discard_weights=discard_weights))

    def wake_up(self, *, weights_only: bool = False) -> None:
        self._on_first_rank("wake_up", lambda: self.engine.wake_up(weights_only=weights_only))

    def shutdown(self) -> None:  # not a collective: a peer may already be gone
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def _on_first_rank(self, what: str, call: Callable[[], Any]) -> Any:
        outcome: list = [None]
        if self.is_first:
            try:
                outcome[0] = ("ok", call())
            except Exception as exc:  # sent to the peers, then raised here as it was
                outcome[0] = ("error", f"{type(exc).__name__}: {exc}")
                dist.broadcast_object_list(outcome, src=self._first, group=self.replica.group)
                raise
        dist.broadcast_object_list(outcome, src=self._first, group=self.replica.group)
        status, value = outcome[0]
        if status == "error":
            raise RuntimeError(f"rollout replica {self.replica.index}: its first rank (rank {self._first}) failed "
                               f"in {what}: {value}")
        return value


def serve_from_first_rank(replica: RolloutReplica, build_engine: Callable[[list[str]], Any], *, sleeps: bool,
                          serialize_bucket: Callable[[list], list],
                          local_device_index: Optional[int]) -> ReplicaServedByFirstRank:
    """Collective over the replica's group: the first rank builds the engine with ``build_engine(visible_devices)``
    (the replica's GPUs as CUDA_VISIBLE_DEVICES entries, in rank order), which must all be on its host."""
    here = (socket.gethostname(), physical_device(local_device_index))
    placed: list = [None] * replica.size
    dist.all_gather_object(placed, here, group=replica.group)
    hosts = {host for host, _ in placed}
    if len(hosts) > 1:
        raise ValueError(f"rollout replica {replica.index} spans hosts {sorted(hosts)} (ranks' (host, GPU): {placed}):"
                         f" an engine serving it from its first rank sees that host's GPUs only; "
                         f"actor_rollout_ref.rollout.tensor_model_parallel_size must divide trainer.n_gpus_per_node")
    face = ReplicaServedByFirstRank(None, replica, sleeps=sleeps, serialize_bucket=serialize_bucket)

    def start() -> None:  # the engine stays in the first rank; only the outcome travels
        face.engine = build_engine([device for _, device in placed])

    face._on_first_rank("start", start)
    return face


def physical_device(local_device_index: Optional[int]) -> str:
    """This process's GPU as an entry of the host's CUDA_VISIBLE_DEVICES namespace: Ray narrows each worker's list
    to its own GPU (index 0 then), or leaves all of them visible (the index is the GPU's)."""
    if local_device_index is None:
        raise ValueError("a rollout replica served by its first rank needs GPUs (trainer.device=cuda)")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[local_device_index] if visible else str(local_device_index)
