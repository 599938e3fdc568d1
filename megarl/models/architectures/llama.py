"""Llama (2, 3.x) and the dense Qwen2 / Qwen3 families: GQA attention + SwiGLU MLP + RMSNorm.

Llama 3.x ``llama3`` RoPE scaling maps to megatron's ``rope_scaling`` flag; megatron hard-codes
low_freq_factor=1, high_freq_factor=4, original_max_position_embeddings=8192 (Llama 3.1/3.2 values),
so other values are refused rather than silently changed. Qwen2 adds q/k/v biases; Qwen3 adds per-head
q/k RMSNorm and drops the biases. Left out: sliding-window attention, biases on o_proj / MLP.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

from megarl.models.architectures.base import Architecture
from megarl.models.hf_config import read_rope
from megarl.models.model_dims import ModelDims

_MCORE_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def check_silu(hf: Any) -> None:
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (only SwiGLU 'silu')")


def dense_transformer_kwargs(hf: Any, dims: ModelDims) -> dict[str, Any]:
    check_silu(hf)
    return dict(
        num_layers=dims.num_layers, hidden_size=dims.hidden_size, num_attention_heads=dims.num_heads,
        num_query_groups=dims.num_kv_heads, kv_channels=dims.head_dim, ffn_hidden_size=dims.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=getattr(hf, "rms_norm_eps", 1e-6),
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=dims.qkv_bias,
        qk_layernorm=dims.qk_norm,
    )


def rope_model_kwargs(hf: Any) -> dict[str, Any]:
    rope = read_rope(hf)
    kwargs: dict[str, Any] = dict(position_embedding_type="rope", rotary_base=rope["rope_theta"],
                                  max_sequence_length=getattr(hf, "max_position_embeddings", 4096))
    if rope["rope_type"] == "llama3":
        for key, mcore_value in _MCORE_LLAMA3_FIXED.items():
            if key in rope and float(rope[key]) != float(mcore_value):
                raise ValueError(f"rope_scaling {key}={rope[key]} is not supported: megatron-core's llama3 RoPE "
                                 f"scaling hard-codes {key}={mcore_value}")
        kwargs.update(rope_scaling=True, rope_scaling_factor=float(rope["factor"]))
    elif rope["rope_type"] != "default":
        raise ValueError(f"rope type {rope['rope_type']!r} is not supported for {type(hf).__name__} "
                         "(supported: default, llama3)")
    return kwargs


class LlamaArchitecture(Architecture):
    hf_architecture = "LlamaForCausalLM"
    model_type = "llama"
    has_qkv_bias = False

    def refuse_unsupported(self, hf: Any) -> None:
        if getattr(hf, "attention_bias", False) and not self.has_qkv_bias:
            raise ValueError("attention_bias=True (biases on q/k/v and o_proj) is not supported")
        if getattr(hf, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        if getattr(hf, "use_sliding_window", False):
            raise ValueError("use_sliding_window=True is not supported")

    def transformer_config_kwargs(self, hf: Any) -> dict[str, Any]:
        return dense_transformer_kwargs(hf, self.read_dims(hf))

    def gpt_model_kwargs(self, hf: Any) -> dict[str, Any]:
        return rope_model_kwargs(hf)


class Qwen2Architecture(LlamaArchitecture):
    hf_architecture = "Qwen2ForCausalLM"
    model_type = "qwen2"
    has_qkv_bias = True  # in every Qwen2 checkpoint, with no flag: the dims read it from model_type


class Qwen3Architecture(LlamaArchitecture):
    hf_architecture = "Qwen3ForCausalLM"
    model_type = "qwen3"

    def refuse_unsupported(self, hf: Any) -> None:
        if getattr(hf, "attention_bias", False):
            raise ValueError("Qwen3 with attention_bias=True is not supported")
        super().refuse_unsupported(hf)
