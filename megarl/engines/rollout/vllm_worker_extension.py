"""vLLM worker mix-in that loads HF-named weight buckets into the running model, on every worker rank.

vLLM injects this class into its worker (`worker_extension_cls=` engine arg) and the driver reaches it
with `LLM.collective_rpc("megarl_<method>", args=...)`, which runs the method on every TP/PP rank. Each
rank receives the full HF tensors and the model's own `load_weights` narrows them to the rank's shard
(and fuses q/k/v and gate/up), so the same path serves TP=1 on CPU and TP>1 on GPU.

A session is `model.load_weights(bucket)` per bucket, applied in one of two ways chosen when it starts:
* a direct load: nothing else. The loaders copy into the existing parameters; exact where no module
  re-processes its weights after loading (:func:`~megarl.engines.rollout.vllm_compat.loads_in_place`:
  unquantized dense models on CUDA), which mode ``auto`` (the default) checks once per engine.
* ``layerwise``: vLLM's in-place layerwise reload: `initialize_layerwise_reload` before the first bucket,
  `finalize_layerwise_reload` after the last one; a layer is re-processed (re-fused, re-packed for the CPU
  GEMM, re-quantized) once all its tensors have arrived. It moves every layer to the meta device and back,
  a fixed cost of tens of milliseconds per sync even for a small model. A module that gets only part of its
  tensors is rebuilt from uninitialized memory, so the driver side (`VLLMRolloutEngine`) only finishes
  sessions that delivered every checkpoint tensor.

Two ways in: `megarl_load_weights` takes the (name, tensor) pairs themselves, which only an engine core in
the caller's process can receive (collective_rpc then calls the worker directly: device tensors stay
where they are); `megarl_load_weight_blob` takes one safetensors blob (bytes), which survives every vLLM
transport to an engine core in another process (engine-core msgpack, the multiproc executor's
shared-memory queue) at the price of a host round trip.
"""

from __future__ import annotations

import torch

from megarl.engines.rollout.vllm_compat import (WEIGHT_RELOAD_MODES, ServedAdapter, layerwise_reload,
                                                loads_in_place, lora_base_layer_names)


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

    def megarl_start_weight_update(self, mode: str = "auto") -> str:
        """Open a session (``mode``: auto | layerwise); returns how it loads: direct | layerwise."""
        from vllm.config import set_current_vllm_config

        if mode not in WEIGHT_RELOAD_MODES:
            raise ValueError(f"weight reload mode {mode!r} is not one of {WEIGHT_RELOAD_MODES}")
        model = self.model_runner.get_model()
        if mode == "auto":
            if getattr(self, "_megarl_loads_in_place", None) is None:  # the model's modules do not change
                self._megarl_loads_in_place = loads_in_place(model)
            mode = "direct" if self._megarl_loads_in_place else "layerwise"
        self._megarl_reload_mode = mode
        if mode == "layerwise":
            initialize, _ = layerwise_reload()
            with set_current_vllm_config(self.vllm_config):
                initialize(model)
        # how checkpoint names reach the linears that vLLM wrapped for LoRA (unchanged where nothing is wrapped);
        # vLLM wraps them when the engine starts, never later: one walk of the model per engine, not per sync
        if getattr(self, "_megarl_checkpoint_name", None) is None:
            self._megarl_checkpoint_name = lora_base_layer_names(model)
        return mode

    def megarl_load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket handed over in process (the tensors may live on the device)."""
        from vllm.config import set_current_vllm_config

        model = self.model_runner.get_model()
        rename = self._megarl_checkpoint_name
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            model.load_weights([(rename(name), tensor) for name, tensor in named_tensors])

    def megarl_load_weight_blob(self, blob: bytes) -> None:
        """Load one bucket serialized by :func:`encode_bucket` (engine core in another process)."""
        self.megarl_load_weights(decode_bucket(blob))

    def megarl_load_adapter(self, lora_id: int, named_tensors: list[tuple[str, torch.Tensor]], config: dict) -> None:
        """Serve a LoRA adapter given as PEFT-named tensors (in process: they may live on the device)."""
        if getattr(self, "_megarl_served_adapter", None) is None:
            self._megarl_served_adapter = ServedAdapter()
        self._megarl_served_adapter.load(self.model_runner.lora_manager, lora_id, dict(named_tensors), config)

    def megarl_load_adapter_blob(self, lora_id: int, blob: bytes, config: dict) -> None:
        self.megarl_load_adapter(lora_id, decode_bucket(blob), config)

    def megarl_finish_weight_update(self) -> None:
        from vllm.config import set_current_vllm_config

        if getattr(self, "_megarl_reload_mode", "layerwise") == "direct":
            return
        _, finalize = layerwise_reload()
        with set_current_vllm_config(self.vllm_config):
            finalize(self.model_runner.get_model(), self.vllm_config.model_config)
