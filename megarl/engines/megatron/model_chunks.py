"""An engine's model: one chunk per virtual pipeline stage of this rank, built by a model provider, LoRA
adapters attached where asked, wrapped in megatron's ``DistributedDataParallel`` when it trains."""

from __future__ import annotations

import itertools
from typing import Callable, Optional

import torch

from megarl.engines.megatron.parallel import device_for_this_process

ModelProvider = Callable[[bool, bool, Optional[int]], torch.nn.Module]


def build_model_chunks(
    *, model_provider: ModelProvider, config, ddp_config=None, wrap_with_ddp: bool = True,
    chunk_hook: Optional[Callable[[torch.nn.Module, bool], None]] = None, one_dtype: Optional[torch.dtype] = None,
    lora=None,
) -> list[torch.nn.Module]:
    """One model per virtual pipeline stage of this rank (megatron-LM ``get_model`` semantics).

    ``lora`` (a :class:`~megarl.models.lora.LoRASpec`): the chunk's parameters frozen and adapters attached,
    before ``chunk_hook(module, post_process)``, which may edit a chunk before DDP wrapping (the critic swaps
    its head, which then trains with the adapters).
    ``one_dtype``: every floating parameter in this dtype (torch's norms make fp32 weights in a bf16 model).
    """
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    vpp = mpu.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp is not None else None
        pre = mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post = mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        module = model_provider(pre, post, stage)
        if lora is not None:
            from megarl.models.lora import attach_lora

            attach_lora(module, lora)
        if chunk_hook is not None:
            chunk_hook(module, post)
        if one_dtype is not None:
            for param in module.parameters():
                if param.is_floating_point() and param.dtype != one_dtype:
                    param.data = param.data.to(one_dtype)
        module.to(device_for_this_process())
        for param in module.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        chunks.append(module)
    if not wrap_with_ddp:
        return chunks
    ddp_config = ddp_config or DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    wrapped = [
        # Only the first chunk gets buckets, as in megatron-LM (later chunks' grads overlap with compute).
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]
    for chunk in wrapped:
        chunk.broadcast_params()  # DP replicas start from identical weights whatever their init RNG did
    return wrapped


def copy_model_weights(source_chunks, target_chunks) -> None:
    """Copy every parameter of one engine's model chunks into another's of the same architecture and layout
    (a reference model that starts as the actor's random initialisation)."""
    from megarl.models.bridge import unwrap_model

    for source, target in itertools.zip_longest(source_chunks, target_chunks):
        if source is None or target is None:
            raise ValueError("copy_model_weights: the two engines have different numbers of model chunks")
        source_params = dict(unwrap_model(source).named_parameters())
        with torch.no_grad():
            for name, param in unwrap_model(target).named_parameters():
                if name not in source_params or source_params[name].shape != param.shape:
                    raise ValueError(f"copy_model_weights: parameter {name!r} has no twin of the same shape")
                param.copy_(source_params[name])
