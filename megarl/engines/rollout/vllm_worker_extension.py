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

Two ways in: `megarl_load_weights` takes the (name, tensor) pairs themselves, which only an engine core in
the caller's process can receive (collective_rpc then calls the worker directly: device tensors stay
where they are); `megarl_load_weight_blob` takes one safetensors blob (bytes), which survives every vLLM
transport to an engine core in another process (engine-core msgpack, the multiproc executor's
shared-memory queue) at the price of a host round trip.
"""

from __future__ import annotations

import torch

from megarl.engines.rollout.vllm_compat import layerwise_reload


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

        initialize, _ = layerwise_reload()
        with set_current_vllm_config(self.vllm_config):
            initialize(self.model_runner.get_model())

    def megarl_load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket handed over in process (the tensors may live on the device)."""
        from vllm.config import set_current_vllm_config

        model = self.model_runner.get_model()
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            model.load_weights(named_tensors)

    def megarl_load_weight_blob(self, blob: bytes) -> None:
        """Load one bucket serialized by :func:`encode_bucket` (engine core in another process)."""
        self.megarl_load_weights(decode_bucket(blob))

    def megarl_finish_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config

        _, finalize = layerwise_reload()
        with set_current_vllm_config(self.vllm_config):
            finalize(self.model_runner.get_model(), self.vllm_config.model_config)
