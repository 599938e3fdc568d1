"""The architecture numbers of a Hugging Face decoder, read once from its config: one :class:`ModelDims`
for the bridge (parameter names and shapes, megatron's ``TransformerConfig``), the engines and the planner
(parameter count, memory).

Covers the decoder families megarl builds and plans for: Llama / Qwen2 / Qwen3 / Mistral dense GQA models,
Qwen3-MoE, DeepSeek-V2/V3 (MLA attention, routed + shared experts, dense first layers, MTP), and Qwen2.5-VL
(its language model is a Qwen2 decoder read from ``text_config``; its vision tower's sizes from
``vision_config`` go in :class:`VisionDims`). Leaves out
what neither the parameter table nor the arithmetic uses (rope scaling, eps, token ids: the architecture
modules read those where they build megatron's config).

The config may be a dict loaded from config.json or an object with attributes (a transformers config, or
:class:`~megarl.models.hf_config.ConfigFields`); an absent or ``None`` field takes the same default either way.
An unknown ``model_type`` or a missing required field raises ``ValueError`` naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from megarl.models.hf_config import config_field

DENSE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
QWEN_MOE_MODEL_TYPES = ("qwen3_moe",)
DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
VISION_LANGUAGE_MODEL_TYPES = ("qwen2_5_vl",)
KNOWN_MODEL_TYPES = DENSE_MODEL_TYPES + QWEN_MOE_MODEL_TYPES + DEEPSEEK_MODEL_TYPES + VISION_LANGUAGE_MODEL_TYPES


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
class VisionDims:
    """A Qwen2.5-VL vision tower: ``depth`` blocks of ``hidden_size`` (gated MLP of ``intermediate_size``), patches
    of ``patch_size`` pixels x ``temporal_patch_size`` frames, and a merger that turns each
    ``spatial_merge_size`` x ``spatial_merge_size`` square of patches into one language-model token."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int


@dataclass(frozen=True)
class ModelDims:
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # megatron's num_query_groups
    head_dim: int  # MLA: the q/k head (nope + rope); the value head is mla.v_head_dim
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
    vision: VisionDims | None = None  # a vision-language model's vision tower (its language model is the rest)

    @property
    def num_experts(self) -> int:
        return self.moe.num_experts if self.moe is not None else 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe_layers[layer]


def _field(hf: Any, name: str, default: Any = None) -> Any:
    if isinstance(hf, Mapping):
        return config_field(hf, name, default)
    value = getattr(hf, name, None)
    return default if value is None else value


def _positive_int(hf: Any, key: str, where: str) -> int:
    value = _field(hf, key)
    if value is None:
        raise ValueError(f"{where}: HF config has no '{key}' (model_type={_field(hf, 'model_type')!r})")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{where}: HF config '{key}' must be a positive integer, got {value!r}")
    return value


def read_model_dims(hf_config: Any, *, source: str = "hf_config") -> ModelDims:
    """Parse ``hf_config`` into :class:`ModelDims`; ``source`` names it in errors."""
    if isinstance(hf_config, (str, bytes, int, float, list, tuple)) or hf_config is None:
        raise ValueError(f"{source}: expected a config (a dict loaded from config.json or a config object), "
                         f"got {type(hf_config).__name__}")
    model_type = _field(hf_config, "model_type")
    if model_type not in KNOWN_MODEL_TYPES:
        raise ValueError(f"{source}: unsupported model_type {model_type!r}; "
                         f"megarl knows {', '.join(KNOWN_MODEL_TYPES)}")
    if model_type in VISION_LANGUAGE_MODEL_TYPES:
        return _read_vision_language_dims(hf_config, model_type, source)

    hidden = _positive_int(hf_config, "hidden_size", source)
    layers = _positive_int(hf_config, "num_hidden_layers", source)
    heads = _positive_int(hf_config, "num_attention_heads", source)
    kv_heads = _field(hf_config, "num_key_value_heads", heads)
    vocab = _positive_int(hf_config, "vocab_size", source)
    intermediate = _positive_int(hf_config, "intermediate_size", source)
    head_dim = _field(hf_config, "head_dim") or hidden // heads
    if heads % kv_heads != 0:
        raise ValueError(f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")

    moe: MoEDims | None = None
    mla: MLADims | None = None
    moe_layers = tuple(False for _ in range(layers))
    mtp_layers = 0
    attention_bias = bool(_field(hf_config, "attention_bias", False))
    # Qwen2 always carries q/k/v biases (no flag in its config); Llama/Qwen3 say so with attention_bias.
    qkv_bias = model_type == "qwen2" or attention_bias
    o_bias = model_type != "qwen2" and attention_bias

    if model_type in QWEN_MOE_MODEL_TYPES:
        step = _field(hf_config, "decoder_sparse_step", 1)
        dense_only = set(_field(hf_config, "mlp_only_layers", ()))
        moe_layers = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(layers))
        moe = MoEDims(
            num_experts=_positive_int(hf_config, "num_experts", source),
            experts_per_token=_positive_int(hf_config, "num_experts_per_tok", source),
            expert_intermediate_size=_positive_int(hf_config, "moe_intermediate_size", source),
            shared_expert_intermediate_size=0,
            has_expert_bias=False,
        )
    elif model_type in DEEPSEEK_MODEL_TYPES:
        first_dense = _field(hf_config, "first_k_dense_replace", 0)
        freq = _field(hf_config, "moe_layer_freq", 1)
        moe_layers = tuple(i >= first_dense and i % freq == 0 for i in range(layers))
        expert_width = _positive_int(hf_config, "moe_intermediate_size", source)
        # DeepSeek-V3 configs may leave topk_method out (transformers' class has none): V3 routes with it.
        topk_method = _field(hf_config, "topk_method", "noaux_tc" if model_type == "deepseek_v3" else "greedy")
        moe = MoEDims(
            num_experts=_positive_int(hf_config, "n_routed_experts", source),
            experts_per_token=_positive_int(hf_config, "num_experts_per_tok", source),
            expert_intermediate_size=expert_width,
            shared_expert_intermediate_size=_field(hf_config, "n_shared_experts", 0) * expert_width,
            has_expert_bias=topk_method == "noaux_tc",
        )
        mla = MLADims(
            q_lora_rank=_field(hf_config, "q_lora_rank"),
            kv_lora_rank=_positive_int(hf_config, "kv_lora_rank", source),
            qk_nope_head_dim=_positive_int(hf_config, "qk_nope_head_dim", source),
            qk_rope_head_dim=_positive_int(hf_config, "qk_rope_head_dim", source),
            v_head_dim=_positive_int(hf_config, "v_head_dim", source),
        )
        head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        kv_heads = heads  # MLA decompresses a full set of k/v heads from the latent
        mtp_layers = _field(hf_config, "num_nextn_predict_layers", 0)

    return ModelDims(
        model_type=model_type,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        vocab_size=vocab,
        tie_word_embeddings=bool(_field(hf_config, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(_field(hf_config, "mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        moe_layers=moe_layers,
        moe=moe,
        mla=mla,
        mtp_layers=mtp_layers,
    )


def _section(hf_config: Any, name: str, source: str) -> Any:
    section = _field(hf_config, name)
    if section is None:
        raise ValueError(f"{source}: HF config has no '{name}' (model_type={_field(hf_config, 'model_type')!r})")
    return section


def _read_vision_language_dims(hf_config: Any, model_type: str, source: str) -> ModelDims:
    """Qwen2.5-VL: a Qwen2 language model (``text_config``, or the top-level fields in the flat layout of the
    published config.json) and a vision tower (``vision_config``)."""
    text = _field(hf_config, "text_config") or hf_config
    fields = dict(text) if isinstance(text, Mapping) else text.to_dict()
    fields.pop("vision_config", None)
    tied = _field(hf_config, "tie_word_embeddings", fields.get("tie_word_embeddings", False))
    language = read_model_dims({**fields, "model_type": "qwen2", "tie_word_embeddings": tied},
                               source=f"{source} text_config")
    vision = _section(hf_config, "vision_config", source)
    where = f"{source} vision_config"
    dims = VisionDims(
        depth=_positive_int(vision, "depth", where), hidden_size=_positive_int(vision, "hidden_size", where),
        intermediate_size=_positive_int(vision, "intermediate_size", where),
        num_heads=_positive_int(vision, "num_heads", where),
        out_hidden_size=_positive_int(vision, "out_hidden_size", where),
        patch_size=_positive_int(vision, "patch_size", where),
        temporal_patch_size=_positive_int(vision, "temporal_patch_size", where),
        spatial_merge_size=_positive_int(vision, "spatial_merge_size", where),
        in_channels=_field(vision, "in_channels", _field(vision, "in_chans", 3)),
    )
    if dims.out_hidden_size != language.hidden_size:
        raise ValueError(f"{where}: out_hidden_size {dims.out_hidden_size} must equal the language model's "
                         f"hidden_size {language.hidden_size} (the merger's output is the LM's input)")
    return replace(language, model_type=model_type, vision=dims)
