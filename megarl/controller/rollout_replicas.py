"""Rollout replicas that span several ranks (rollout tensor parallelism inside the colocated worker group).

With ``actor_rollout_ref.rollout.tensor_model_parallel_size = T > 1`` every T consecutive ranks of the actor
worker group form one rollout replica: each rank runs one vLLM engine started with
``distributed_executor_backend="external_launcher"``, which joins the already-initialised torch.distributed
world and shards the model over those T ranks (vLLM groups consecutive ranks into TP groups, like here).
vLLM then needs every rank of a replica to submit the *same* requests, and gives each of them the same
outputs.

The driver keeps dispatching one share of prompts per rank (so the trainer does not know about replicas):
:func:`generate_in_replica` gathers the shares of the replica's ranks, generates them together with one
seed per replica, and hands each rank back the outputs for its own share, re-indexed to it.
Weight sync needs nothing special: every rank hands its engine full HF tensors and vLLM's weight loaders
keep each rank's shard.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch.distributed as dist


@dataclass(frozen=True)
class RolloutReplica:
    """This rank's rollout replica: ``index`` among ``world // size`` replicas, ``group`` its ranks (gloo)."""

    index: int
    size: int
    group: Optional[dist.ProcessGroup]


def form_rollout_replicas(tensor_parallel_size: int) -> RolloutReplica:
    """Collective over the whole world (every rank calls it, in the same order)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tensor_parallel_size:
        raise ValueError(f"rollout tensor_model_parallel_size={tensor_parallel_size} must divide the {world} ranks")
    if tensor_parallel_size == 1:
        return RolloutReplica(index=rank, size=1, group=None)
    mine = None
    for start in range(0, world, tensor_parallel_size):
        # gloo whatever the training backend: only small Python lists of prompt ids travel here
        group = dist.new_group(list(range(start, start + tensor_parallel_size)), backend="gloo")
        if start <= rank < start + tensor_parallel_size:
            mine = group
    return RolloutReplica(index=rank // tensor_parallel_size, size=tensor_parallel_size, group=mine)


def replica_seed(sampling, replica_index: int):
    """A seeded request gets a distinct, reproducible stream per replica (the same on its ranks)."""
    if sampling.seed is None:
        return sampling
    return replace(sampling, seed=sampling.seed * 7919 + replica_index)


def generate_in_replica(engine, prompt_token_ids: list[list[int]], sampling, replica: RolloutReplica,
                        multi_modal_inputs: Optional[list] = None):
    """This rank's share of prompts generated together with the other shares of its replica (with their images,
    a vision-language model's ``multi_modal_inputs``, if given)."""
    if replica.group is None:
        if not prompt_token_ids:
            return []
        return engine.generate(prompt_token_ids, replica_seed(sampling, replica.index),
                               **_with_images(multi_modal_inputs))
    shares: list = [None] * replica.size
    share = (list(prompt_token_ids), sampling.prompt_seeds, multi_modal_inputs or [None] * len(prompt_token_ids))
    dist.all_gather_object(shares, share, group=replica.group)
    merged = [prompt for prompts, _, _ in shares for prompt in prompts]
    if not merged:
        return []
    if sampling.prompt_seeds:  # per-prompt seeds travel with their prompts (already distinct per prompt)
        sampling = replace(sampling, prompt_seeds=tuple(seed for _, seeds, _ in shares for seed in seeds))
    images = [inputs for _, _, share_inputs in shares for inputs in share_inputs]
    outputs = engine.generate(merged, replica_seed(sampling, replica.index), **_with_images(images))
    start = sum(len(prompts) for prompts, _, _ in shares[: dist.get_rank(replica.group)])
    end = start + len(prompt_token_ids)
    return [replace(out, prompt_index=out.prompt_index - start) for out in outputs if start <= out.prompt_index < end]


def _with_images(multi_modal_inputs: Optional[list]) -> dict:
    """The engine's keyword for images when any prompt has some: a text-only engine is called as before."""
    return {"multi_modal_inputs": multi_modal_inputs} if multi_modal_inputs and any(multi_modal_inputs) else {}
