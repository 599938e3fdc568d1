"""What every supported decoder shares: its dimensions, and the GLOBAL megatron parameter table.

An architecture module (llama.py, qwen3_moe.py, ...) checks that a Hugging Face config asks for nothing it
leaves out, reads it into the shared :class:`~megarl.models.model_dims.ModelDims`, and turns it into megatron
``TransformerConfig`` fields. From the dims, :func:`build_param_rules` lists every parameter of the whole model
(all layers, all experts) as :class:`~megarl.models.weight_mapping.ParamRule` s, for either megatron layer spec:

* ``local``: ``input_layernorm`` / ``pre_mlp_layernorm`` are separate modules; MoE experts are a
  ``SequentialMLP`` (``mlp.experts.local_experts.<e>.linear_fc1.weight``). The local spec's grouped-GEMM
  option builds the legacy ``GroupedMLP`` (one ``weight1`` for all experts), which is not supported here.
* ``te``: the norm before a linear is fused into it (``self_attention.linear_qkv.layer_norm_weight``,
  ``mlp.linear_fc1.layer_norm_weight``, MLA ``linear_q_up_proj.layer_norm_weight``); MoE layers keep
  ``pre_mlp_layernorm``; experts are ``TEGroupedMLP`` (``mlp.experts.linear_fc1.weight<e>``) with grouped
  GEMM, or ``SequentialMLP`` without; MLA down-projections are duplicated (not TP-split) ``TELinear``.

Left out: multi-token-prediction layers (skipped by the bridge), biases on dense linears, sliding window.
"""

from __future__ import annotations

from typing import Any

from megarl.models.model_dims import ModelDims, read_model_dims
from megarl.models.weight_mapping import ParamRule, QKVShape

SPECS = ("local", "te")
EXPERT_LAYOUTS = ("sequential", "grouped")


class Architecture:
    """One HF ``architectures`` entry. Subclasses fill the hooks."""

    hf_architecture: str = ""
    model_type: str = ""  # config.json's model_type for this architecture

    def read_dims(self, hf: Any) -> ModelDims:
        """The shared dims, after refusing what this architecture does not build."""
        found = getattr(hf, "model_type", None)
        if found != self.model_type:
            raise ValueError(f"{self.hf_architecture} config has model_type {found!r}, expected {self.model_type!r}")
        self.refuse_unsupported(hf)
        return read_model_dims(hf, source=self.hf_architecture)

    def refuse_unsupported(self, hf: Any) -> None:
        """Raise ``ValueError`` naming a config field whose value this architecture does not build."""

    def transformer_config_kwargs(self, hf: Any) -> dict[str, Any]:
        """TransformerConfig fields that follow from the HF config (no parallelism, no dtype)."""
        raise NotImplementedError

    def gpt_model_kwargs(self, hf: Any) -> dict[str, Any]:
        """GPTModel constructor arguments beyond config/spec/vocab (rope, max length)."""
        raise NotImplementedError

    @property
    def uses_mla(self) -> bool:
        return False

    def extra_param_rules(self, dims: ModelDims) -> list[ParamRule]:
        """Parameters outside the decoder's table (a vision tower's), as rules."""
        return []

    def build_model(self, hf: Any, *, params_dtype, **gpt_kwargs):
        """The megatron model: a ``GPTModel`` unless the architecture has more than a decoder."""
        from megatron.core.models.gpt import GPTModel

        return GPTModel(**gpt_kwargs)

    @property
    def has_moe(self) -> bool:
        return False


def build_param_rules(dims: ModelDims, *, spec: str, expert_layout: str) -> list[ParamRule]:
    if spec not in SPECS:
        raise ValueError(f"spec must be one of {SPECS}, got {spec!r}")
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {expert_layout!r}")
    if spec == "local" and expert_layout == "grouped":
        raise ValueError("the local spec with grouped GEMM builds the legacy GroupedMLP, which is not supported; "
                         "use expert_layout='sequential' (SequentialMLP) or the TE spec")
    rules = [ParamRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), fusion="vocab",
                       tp_kind="vocab", vocab_size=dims.vocab_size)]
    for layer in range(dims.num_layers):
        rules += _attention_rules(dims, layer, spec)
        rules += _mlp_rules(dims, layer, spec, expert_layout)
    rules.append(ParamRule("decoder.final_layernorm.weight", ("model.norm.weight",)))
    if not dims.tie_word_embeddings:
        rules.append(ParamRule("output_layer.weight", ("lm_head.weight",), fusion="vocab", tp_kind="vocab",
                               vocab_size=dims.vocab_size))
    return rules


def _attention_rules(dims: ModelDims, layer: int, spec: str) -> list[ParamRule]:
    m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
    if dims.mla is not None:
        return _mla_rules(dims, m, h, spec)
    qkv = QKVShape(dims.num_heads, dims.num_kv_heads, dims.head_dim)
    norm = "self_attention.linear_qkv.layer_norm_weight" if spec == "te" else "input_layernorm.weight"
    attn = h + "self_attn."
    rules = [
        ParamRule(m + norm, (h + "input_layernorm.weight",)),
        ParamRule(m + "self_attention.linear_qkv.weight",
                  (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
                  fusion="qkv", tp_kind="column", qkv=qkv),
    ]
    if dims.qkv_bias:
        rules.append(ParamRule(m + "self_attention.linear_qkv.bias",
                               (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
                               fusion="qkv", tp_kind="column", qkv=qkv))
    if dims.qk_norm:
        rules.append(ParamRule(m + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",)))
        rules.append(ParamRule(m + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",)))
    rules.append(ParamRule(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), tp_kind="row"))
    return rules


def _mla_rules(dims: ModelDims, m: str, h: str, spec: str) -> list[ParamRule]:
    attn, sa = h + "self_attn.", m + "self_attention."
    # The local spec builds the down-projections as ColumnParallelLinear (split, then gathered);
    # TE builds them as duplicated TELinear, so every TP rank holds all of it.
    down_kind = "replicated" if spec == "te" else "column"
    rules = [ParamRule(m + "input_layernorm.weight", (h + "input_layernorm.weight",))]
    if dims.mla.q_lora_rank is None:
        rules.append(ParamRule(sa + "linear_q_proj.weight", (attn + "q_proj.weight",), tp_kind="column"))
    else:
        q_norm = "linear_q_up_proj.layer_norm_weight" if spec == "te" else "q_layernorm.weight"
        rules += [
            ParamRule(sa + "linear_q_down_proj.weight", (attn + "q_a_proj.weight",), tp_kind=down_kind),
            ParamRule(sa + q_norm, (attn + "q_a_layernorm.weight",)),
            ParamRule(sa + "linear_q_up_proj.weight", (attn + "q_b_proj.weight",), tp_kind="column"),
        ]
    kv_norm = "linear_kv_up_proj.layer_norm_weight" if spec == "te" else "kv_layernorm.weight"
    rules += [
        ParamRule(sa + "linear_kv_down_proj.weight", (attn + "kv_a_proj_with_mqa.weight",), tp_kind=down_kind),
        ParamRule(sa + kv_norm, (attn + "kv_a_layernorm.weight",)),
        ParamRule(sa + "linear_kv_up_proj.weight", (attn + "kv_b_proj.weight",), tp_kind="column"),
        ParamRule(sa + "linear_proj.weight", (attn + "o_proj.weight",), tp_kind="row"),
    ]
    return rules


def _gated_mlp_rules(m_prefix: str, h_prefix: str, *, is_expert: bool = False,
                     fc1: str = "linear_fc1.weight", fc2: str = "linear_fc2.weight") -> list[ParamRule]:
    return [
        ParamRule(m_prefix + fc1, (h_prefix + "gate_proj.weight", h_prefix + "up_proj.weight"),
                  fusion="gate_up", tp_kind="gate_up", is_expert=is_expert),
        ParamRule(m_prefix + fc2, (h_prefix + "down_proj.weight",), tp_kind="row", is_expert=is_expert),
    ]


def _mlp_rules(dims: ModelDims, layer: int, spec: str, expert_layout: str) -> list[ParamRule]:
    m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
    post_norm = (h + "post_attention_layernorm.weight",)
    if not dims.is_moe_layer(layer):
        norm = "mlp.linear_fc1.layer_norm_weight" if spec == "te" else "pre_mlp_layernorm.weight"
        return [ParamRule(m + norm, post_norm)] + _gated_mlp_rules(m + "mlp.", h + "mlp.")
    rules = [ParamRule(m + "pre_mlp_layernorm.weight", post_norm),
             ParamRule(m + "mlp.router.weight", (h + "mlp.gate.weight",))]
    if dims.moe.has_expert_bias:
        rules.append(ParamRule(m + "mlp.router.expert_bias", (h + "mlp.gate.e_score_correction_bias",)))
    for e in range(dims.num_experts):
        hf_expert = f"{h}mlp.experts.{e}."
        if expert_layout == "grouped":
            rules += _gated_mlp_rules(m + "mlp.experts.", hf_expert, is_expert=True,
                                      fc1=f"linear_fc1.weight{e}", fc2=f"linear_fc2.weight{e}")
        else:
            rules += _gated_mlp_rules(f"{m}mlp.experts.local_experts.{e}.", hf_expert, is_expert=True)
    if dims.moe.shared_expert_intermediate_size:
        rules += _gated_mlp_rules(m + "mlp.shared_experts.", h + "mlp.shared_experts.")
    return rules
