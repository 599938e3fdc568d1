"""DeepSeek-V3: multi-latent attention + sigmoid-routed MoE with shared experts and expert bias.

HF -> megatron: q_lora_rank/kv_lora_rank/qk_nope/qk_rope/v_head_dim -> MLATransformerConfig;
``e_score_correction_bias`` -> the router's ``expert_bias`` buffer (kept frozen by default:
``moe_router_bias_update_rate=0``); n_group/topk_group -> group-limited top-k (megatron ranks groups
by the sum of their top ``topk // topk_group`` scores, HF by their top 2, so we require
``topk // topk_group == 2``); routed_scaling_factor -> ``moe_router_topk_scaling_factor``; the first
``first_k_dense_replace`` layers are dense. HF's interleaved RoPE (``rope_interleave=True``) is what
megatron's MLA RoPE does. YaRN scaling maps to ``rope_type='yarn'``.
Left out: the ``num_nextn_predict_layers`` MTP layers (the bridge skips them and says so), fp8 weights.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

from megarl.models.architectures.base import Architecture
from megarl.models.architectures.llama import check_silu
from megarl.models.architectures.qwen3_moe import moe_router_kwargs
from megarl.models.hf_config import read_rope


class DeepseekV3Architecture(Architecture):
    hf_architecture = "DeepseekV3ForCausalLM"
    model_type = "deepseek_v3"

    @property
    def uses_mla(self) -> bool:
        return True

    @property
    def has_moe(self) -> bool:
        return True

    def refuse_unsupported(self, hf: Any) -> None:
        if getattr(hf, "attention_bias", False):
            raise ValueError("DeepSeek-V3 with attention_bias=True is not supported")
        method = getattr(hf, "topk_method", "noaux_tc")
        if method != "noaux_tc":
            raise ValueError(f"topk_method={method!r} is not supported (only 'noaux_tc')")

    def transformer_config_kwargs(self, hf: Any) -> dict[str, Any]:
        check_silu(hf)
        dims = self.read_dims(hf)
        topk = dims.moe.experts_per_token
        if not getattr(hf, "norm_topk_prob", True) and topk > 1:
            raise ValueError("norm_topk_prob=False is not supported: megatron's sigmoid router always "
                             "renormalises the top-k scores")
        n_group, topk_group = getattr(hf, "n_group", 1) or 1, getattr(hf, "topk_group", 1) or 1
        if n_group > 1 and topk // topk_group != 2:
            raise ValueError(f"num_experts_per_tok // topk_group = {topk} // {topk_group} must be 2: HF ranks expert "
                             "groups by their top-2 scores, megatron by their top (topk // topk_group)")
        kwargs: dict[str, Any] = dict(
            num_layers=dims.num_layers, hidden_size=dims.hidden_size, num_attention_heads=dims.num_heads,
            num_query_groups=dims.num_kv_heads, ffn_hidden_size=dims.intermediate_size, kv_channels=dims.mla.v_head_dim,
            normalization="RMSNorm", layernorm_epsilon=getattr(hf, "rms_norm_eps", 1e-6),
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
            qk_layernorm=True,
            q_lora_rank=dims.mla.q_lora_rank, kv_lora_rank=dims.mla.kv_lora_rank,
            qk_head_dim=dims.mla.qk_nope_head_dim, qk_pos_emb_head_dim=dims.mla.qk_rope_head_dim,
            v_head_dim=dims.mla.v_head_dim,
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=0.0,
            moe_router_topk_scaling_factor=float(getattr(hf, "routed_scaling_factor", 1.0) or 1.0),
            moe_router_num_groups=n_group if n_group > 1 else None,
            moe_router_group_topk=topk_group if n_group > 1 else None,
            moe_shared_expert_intermediate_size=dims.moe.shared_expert_intermediate_size or None,
            moe_shared_expert_overlap=False,
        )
        kwargs.update(moe_router_kwargs(dims))
        kwargs.update(self._rope_kwargs(hf))
        return kwargs

    def _rope_kwargs(self, hf: Any) -> dict[str, Any]:
        if getattr(hf, "rope_interleave", True) is False:
            raise ValueError("rope_interleave=False is not supported: megatron's MLA applies interleaved RoPE")
        rope = read_rope(hf)
        kwargs: dict[str, Any] = dict(rotary_base=rope["rope_theta"])
        if rope["rope_type"] == "default":
            # MLATransformerConfig defaults to YaRN x40; an unscaled model needs factor 1 (mscale 1).
            kwargs.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=1.0)
        elif rope["rope_type"] == "yarn":
            kwargs.update(
                rope_type="yarn", rotary_scaling_factor=float(rope["factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                beta_fast=float(rope.get("beta_fast", 32)), beta_slow=float(rope.get("beta_slow", 1)),
                mscale=float(rope.get("mscale", 1.0)), mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)),
            )
        else:
            raise ValueError(f"rope type {rope['rope_type']!r} is not supported for DeepSeek-V3 (default, yarn)")
        return kwargs

    def gpt_model_kwargs(self, hf: Any) -> dict[str, Any]:
        # MLA builds its own rotary embedding from the config; GPTModel must not add one.
        return dict(position_embedding_type="rope", rotary_base=read_rope(hf)["rope_theta"],
                    max_sequence_length=getattr(hf, "max_position_embeddings", 4096))
