"""Read the architecture numbers the planner needs out of a Hugging Face ``config.json`` dict.

Covers the decoder families megarl plans for: Llama / Qwen2 / Qwen3 / Mistral dense GQA models,
Qwen3-MoE, and DeepSeek-V2/V3 (MLA attention, routed + shared experts, dense first layers, MTP).
Leaves out anything the parameter and memory arithmetic does not use (rope scaling, eps, token ids).
An unknown ``model_type`` or a missing key raises ``ValueError`` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from megarl.models.hf_config import config_field

DENSE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
QWEN_MOE_MODEL_TYPES = ("qwen3_moe",)
DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


@dataclass(frozen=True)
class MLADims:
    """Multi-head latent attention sizes (DeepSeek-V2/V3)."""

    q_lora_rank: int | None  # None: plain q projection (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class MoEDims:
    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    shared_expert_intermediate_size: int  # 0 without shared experts; n_shared * moe_intermediate otherwise
    has_expert_bias: bool  # DeepSeek-V3 aux-loss-free balancing keeps a per-expert score bias


@dataclass(frozen=True)
class ModelDims:
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (dense layers of MoE models included)
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3 per-head RMSNorm on q and k
    moe_layers: tuple[bool, ...]  # per decoder layer: True when its MLP is a mixture of experts
    moe: MoEDims | None
    mla: MLADims | None
    mtp_layers: int  # DeepSeek multi-token-prediction modules stored after the decoder layers


def _require(cfg: Mapping[str, Any], key: str, where: str) -> Any:
    value = config_field(cfg, key)
    if value is None:
        raise ValueError(f"{where}: HF config has no '{key}' (model_type={cfg.get('model_type')!r})")
    return value


def _positive_int(cfg: Mapping[str, Any], key: str, where: str) -> int:
    value = _require(cfg, key, where)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{where}: HF config '{key}' must be a positive integer, got {value!r}")
    return value


def read_model_dims(hf_config: Mapping[str, Any], *, source: str = "hf_config") -> ModelDims:
    """Parse ``hf_config`` (a loaded config.json) into :class:`ModelDims`; ``source`` names it in errors."""
    if not isinstance(hf_config, Mapping):
        raise ValueError(f"{source}: expected a dict loaded from config.json, got {type(hf_config).__name__}")
    model_type = hf_config.get("model_type")
    known = DENSE_MODEL_TYPES + QWEN_MOE_MODEL_TYPES + DEEPSEEK_MODEL_TYPES
    if model_type not in known:
        raise ValueError(f"{source}: unsupported model_type {model_type!r}; the planner knows {', '.join(known)}")

    hidden = _positive_int(hf_config, "hidden_size", source)
    layers = _positive_int(hf_config, "num_hidden_layers", source)
    heads = _positive_int(hf_config, "num_attention_heads", source)
    kv_heads = hf_config.get("num_key_value_heads") or heads
    vocab = _positive_int(hf_config, "vocab_size", source)
    intermediate = _positive_int(hf_config, "intermediate_size", source)
    head_dim = hf_config.get("head_dim") or hidden // heads
    if heads % kv_heads != 0:
        raise ValueError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")

    moe: MoEDims | None = None
    mla: MLADims | None = None
    moe_layers = tuple(False for _ in range(layers))
    mtp_layers = 0
    # Qwen2 always carries q/k/v biases (no flag in its config); Llama/Qwen3 say so with attention_bias.
    qkv_bias = model_type == "qwen2" or bool(hf_config.get("attention_bias", False))
    o_bias = model_type != "qwen2" and bool(hf_config.get("attention_bias", False))
    mlp_bias = bool(hf_config.get("mlp_bias", False))

    if model_type in QWEN_MOE_MODEL_TYPES:
        num_experts = _positive_int(hf_config, "num_experts", source)
        step = hf_config.get("decoder_sparse_step", 1) or 1
        dense_only = set(hf_config.get("mlp_only_layers") or [])
        moe_layers = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(layers))
        moe = MoEDims(
            num_experts=num_experts,
            experts_per_token=_positive_int(hf_config, "num_experts_per_tok", source),
            expert_intermediate_size=_positive_int(hf_config, "moe_intermediate_size", source),
            shared_expert_intermediate_size=0,
            has_expert_bias=False,
        )
    elif model_type in DEEPSEEK_MODEL_TYPES:
        num_experts = _positive_int(hf_config, "n_routed_experts", source)
        first_dense = hf_config.get("first_k_dense_replace", 0) or 0
        freq = hf_config.get("moe_layer_freq", 1) or 1
        moe_layers = tuple(i >= first_dense and i % freq == 0 for i in range(layers))
        expert_width = _positive_int(hf_config, "moe_intermediate_size", source)
        moe = MoEDims(
            num_experts=num_experts,
            experts_per_token=_positive_int(hf_config, "num_experts_per_tok", source),
            expert_intermediate_size=expert_width,
            shared_expert_intermediate_size=(hf_config.get("n_shared_experts") or 0) * expert_width,
            has_expert_bias=hf_config.get("topk_method") == "noaux_tc",
        )
        mla = MLADims(
            q_lora_rank=hf_config.get("q_lora_rank"),
            kv_lora_rank=_positive_int(hf_config, "kv_lora_rank", source),
            qk_nope_head_dim=_positive_int(hf_config, "qk_nope_head_dim", source),
            qk_rope_head_dim=_positive_int(hf_config, "qk_rope_head_dim", source),
            v_head_dim=_positive_int(hf_config, "v_head_dim", source),
        )
        head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        kv_heads = heads  # MLA decompresses a full set of k/v heads from the latent
        mtp_layers = hf_config.get("num_nextn_predict_layers", 0) or 0

    return ModelDims(
        model_type=model_type,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        vocab_size=vocab,
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        moe_layers=moe_layers,
        moe=moe,
        mla=mla,
        mtp_layers=mtp_layers,
    )
