"""vLLM worker mix-in that loads HF-named weight buckets into the running model, on every worker rank.

vLLM injects this class into its worker (`worker_extension_cls=` engine arg) and the driver reaches it
with `LLM.collective_rpc("megarl_<method>", args=...)`, which runs the method on every TP/PP rank. Each
rank receives the full HF tensors and the model's own `load_weights` narrows them to the rank's shard
(and fuses q/k/v and gate/up), so the same path serves TP=1 on CPU and TP>1 on GPU.

A session is vLLM's layerwise in-place reload: `initialize_layerwise_reload` before the first bucket,
`model.load_weights(bucket)` per bucket, `finalize_layerwise_reload` after the last one; a layer is
re-processed (re-fused, re-packed for the CPU GEMM, re-quantized) once all its tensors have arrived.
A module that gets only part of its tensors is rebuilt from uninitialized memory, so the driver side
(`VLLMRolloutEngine`) only finishes sessions that delivered every checkpoint tensor.

Wire format: a bucket travels as one safetensors blob (bytes), which survives every vLLM transport
(engine-core msgpack, the multiproc executor's shared-memory queue) unchanged. Leaves out: zero-copy
CUDA-IPC / NCCL transfer (vLLM's own `weight_transfer` engines are the place for that on GPU).
"""

from __future__ import annotations

import torch


def encode_bucket(named_tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    """Pack (name, tensor) pairs into a safetensors blob; duplicate names are refused."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        if name in tensors:
            raise ValueError(f"weight bucket contains {name!r} twice")
        # clone() breaks storage sharing (tied weights), which safetensors refuses to serialize.
        tensors[name] = tensor.detach().to("cpu").contiguous().clone()
    return save(tensors)


def decode_bucket(blob: bytes) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load

    return list(load(blob).items())


class MegarlWeightUpdateExtension:
    """Methods vLLM mixes into its Worker; `self` is the worker (has `model_runner`, `vllm_config`)."""

    def megarl_start_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())

    def megarl_load_weight_bucket(self, blob: bytes) -> list[str]:
        """Load one bucket; returns the vLLM parameter names it touched (for the driver's bookkeeping)."""
        from vllm.config import set_current_vllm_config

        model = self.model_runner.get_model()
        weights = decode_bucket(blob)
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            loaded = model.load_weights(weights)
        return sorted(loaded) if loaded is not None else []

    def megarl_finish_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)
