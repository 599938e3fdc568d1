"""Stream full HF-layout tensors out of TP/PP/EP-sharded Megatron model chunks, one tensor at a time.

A collective generator: every rank of a model-parallel replica iterates it in the same order and each
receives every HF tensor of the whole model. For each pipeline stage in turn, the ranks of that stage
all-gather a parameter's tensor-parallel shards (and, for experts, the expert-parallel shards), the
bridge turns the full megatron tensor into HF tensors, and those are broadcast to the other stages. The
shapes are agreed beforehand from meta tensors, so receivers allocate exactly once per tensor. Memory:
one full parameter (plus its HF pieces) at a time. Data-parallel replicas gather independently.

LoRA: adapted linears' weights leave merged (``W + alpha/r * B A`` on each rank's shard, one at a time), the
adapters themselves not at all (:mod:`megarl.weight_sync.adapters` exports them as a PEFT adapter).

Leaves out: bucketing and delivery (:mod:`megarl.weight_sync.buckets`, transports) and context
parallelism (parameters are replicated across CP ranks, so CP needs nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megarl.models.bridge import unwrap_model
from megarl.models.lora import is_adapter_param, iter_adapters, merged_weight


@dataclass(frozen=True)
class _Entry:
    """One local parameter of a stage, described identically on every rank of the replica."""

    chunk: int
    local_name: str
    layer_offset: int
    is_expert: bool
    hf_outputs: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]  # (hf_name, shape, dtype) per output


def _local_tensors(chunk: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    module = unwrap_model(chunk)
    # LoRA adapters are not HF tensors: the rollout engine gets them merged into their linears' weights
    tensors = [(name, p) for name, p in module.named_parameters() if not is_adapter_param(name)]
    # The sigmoid router's load-balancing bias is a buffer but part of the model (DeepSeek-V3).
    tensors += [(name, b) for name, b in module.named_buffers() if name.endswith("expert_bias")]
    return tensors


def _layer_offset(chunk: torch.nn.Module, vp_stage: Optional[int]) -> int:
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(unwrap_model(chunk).config, vp_stage=vp_stage)


class _Groups:
    def __init__(self):
        from megatron.core import parallel_state as mpu

        self.tp_group = mpu.get_tensor_model_parallel_group()
        self.tp_size = mpu.get_tensor_model_parallel_world_size()
        self.pp_group = mpu.get_pipeline_model_parallel_group()
        self.pp_size = mpu.get_pipeline_model_parallel_world_size()
        self.pp_rank = mpu.get_pipeline_model_parallel_rank()
        self.pp_ranks = dist.get_process_group_ranks(self.pp_group) if self.pp_size > 1 else [dist.get_rank()]
        self.ep_group = mpu.get_expert_model_parallel_group()
        self.ep_size = mpu.get_expert_model_parallel_world_size()
        self.ep_rank = mpu.get_expert_model_parallel_rank()
        self.etp_group = mpu.get_expert_tensor_parallel_group()
        self.etp_size = mpu.get_expert_tensor_parallel_world_size()
        vpp = mpu.get_virtual_pipeline_model_parallel_world_size()
        self.vpp = vpp if vpp and vpp > 1 else None


def local_experts(bridge, g: _Groups, given: Optional[int] = None) -> int:
    """Experts per EP rank: ``given``, else the model's experts over the EP size (1 for a dense model)."""
    if given is not None:
        return given
    total = getattr(bridge.dims, "num_experts", 0) or 0
    return max(total // g.ep_size, 1) if total else 1


def _all_gather(tensor: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    if size == 1:
        return [tensor]
    tensor = tensor.detach().contiguous()
    out = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(out, tensor, group=group)
    return out


def _global_names(bridge, entry: _Entry, g: _Groups, ep_ranks: range, num_local_experts: int) -> list[str]:
    return [
        bridge.local_to_global_name(
            entry.local_name, layer_offset=entry.layer_offset, ep_rank=ep, num_local_experts=num_local_experts
        )
        for ep in ep_ranks
    ]


def _meta_gather(tensor: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    return [tensor] * size


def _full_tensors(bridge, entry: _Entry, local: torch.Tensor, g: _Groups, num_local_experts: int,
                  gather=_all_gather) -> list[tuple[str, torch.Tensor]]:
    """(global_name, full tensor) pairs for one local parameter; collectives within this stage.

    With ``gather=_meta_gather`` and a meta ``local`` it computes only the shapes.
    """
    if entry.is_expert:
        names = _global_names(bridge, entry, g, range(g.ep_size), num_local_experts)
        if bridge.tp_partition_dim(names[0]) is not None and g.etp_size > 1:
            local = bridge.merge_tp(names[0], gather(local, g.etp_group, g.etp_size))
        return list(zip(names, gather(local.detach(), g.ep_group, g.ep_size)))
    (name,) = _global_names(bridge, entry, g, range(g.ep_rank, g.ep_rank + 1), num_local_experts)
    if bridge.tp_partition_dim(name) is None or g.tp_size == 1:
        return [(name, local.detach())]
    return [(name, bridge.merge_tp(name, gather(local, g.tp_group, g.tp_size)))]


def _describe_stage(bridge, model_chunks, g: _Groups, num_local_experts: int) -> list[_Entry]:
    """This stage's entries with HF output shapes, computed on meta tensors (no data moves)."""
    entries: list[_Entry] = []
    seen: set[str] = set()
    for index, chunk in enumerate(model_chunks):
        offset = _layer_offset(chunk, index if g.vpp else None)
        for local_name, tensor in _local_tensors(chunk):
            probe = _Entry(index, local_name, offset, False, ())
            first_name = _global_names(bridge, probe, g, range(g.ep_rank, g.ep_rank + 1), num_local_experts)[0]
            if first_name in seen:  # the last stage's copy of a tied embedding
                continue
            seen.add(first_name)
            is_expert = bridge.is_expert_param(first_name)
            probe = _Entry(index, local_name, offset, is_expert, ())
            meta_local = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
            outputs = []
            for global_name, full in _full_tensors(bridge, probe, meta_local, g, num_local_experts, _meta_gather):
                outputs += [(n, tuple(t.shape), t.dtype) for n, t in bridge.mcore_to_hf(global_name, full)]
            entries.append(_Entry(index, local_name, offset, is_expert, tuple(outputs)))
    return entries


def iter_hf_tensors(
    model_chunks: list[torch.nn.Module], bridge, *, num_local_experts: Optional[int] = None,
    dtype: Optional[torch.dtype] = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for the whole model on every rank of this model-parallel replica.

    Must be iterated to the end on all ranks of the replica (it issues collectives). ``dtype`` casts the
    yielded tensors (e.g. to the rollout engine's dtype).
    """
    g = _Groups()
    num_local_experts = local_experts(bridge, g, num_local_experts)
    mine = _describe_stage(bridge, model_chunks, g, num_local_experts)
    adapted = {(index, name): module for index, name, module in iter_adapters(model_chunks)}
    for stage in range(g.pp_size):
        if g.pp_size > 1:
            holder = [mine if stage == g.pp_rank else None]
            dist.broadcast_object_list(holder, src=g.pp_ranks[stage], group=g.pp_group)
            entries = holder[0]
        else:
            entries = mine
        local_by_chunk = (
            [dict(_local_tensors(chunk)) for chunk in model_chunks] if stage == g.pp_rank else None
        )
        for entry in entries:
            if stage == g.pp_rank:
                local = local_by_chunk[entry.chunk][entry.local_name]
                module_name, _, param_name = entry.local_name.rpartition(".")
                if (entry.chunk, module_name) in adapted:  # one merged weight at a time, on this rank's shard
                    local = merged_weight(adapted[entry.chunk, module_name], param_name, local)
                pieces = [
                    piece
                    for global_name, full in _full_tensors(bridge, entry, local, g, num_local_experts)
                    for piece in bridge.mcore_to_hf(global_name, full)
                ]
            else:
                pieces = None
            for index, (hf_name, shape, tensor_dtype) in enumerate(entry.hf_outputs):
                if g.pp_size > 1:
                    if stage == g.pp_rank:
                        tensor = pieces[index][1].contiguous()
                    else:
                        tensor = torch.empty(shape, dtype=tensor_dtype, device=_device_of(model_chunks))
                    dist.broadcast(tensor, src=g.pp_ranks[stage], group=g.pp_group)
                else:
                    tensor = pieces[index][1]
                yield hf_name, (tensor.to(dtype) if dtype is not None else tensor.detach())


def _device_of(model_chunks) -> torch.device:
    for chunk in model_chunks:
        for p in chunk.parameters():
            return p.device
    return torch.device("cpu")
