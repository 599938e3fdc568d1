"""Qwen3-MoE: Qwen3 attention (q/k norm, no bias) + softmax top-k routed experts, no shared expert.

``norm_topk_prob=True`` (renormalise the top-k softmax) is megatron's ``moe_router_pre_softmax=False``
(top-k over logits, then softmax over the k); ``False`` is ``pre_softmax=True`` (softmax over all
experts, keep k). Dense layers come from ``mlp_only_layers`` / ``decoder_sparse_step``.
Left out: the router aux loss value (forward-identical; set ``moe_aux_loss_coeff`` via overrides).
"""

from __future__ import annotations

from typing import Any

from megarl.models.architectures.llama import Qwen3Architecture, dense_transformer_kwargs
from megarl.models.model_dims import ModelDims


def moe_router_kwargs(dims: ModelDims) -> dict[str, Any]:
    return dict(
        num_moe_experts=dims.moe.num_experts, moe_router_topk=dims.moe.experts_per_token,
        moe_ffn_hidden_size=dims.moe.expert_intermediate_size,
        moe_layer_freq=[int(x) for x in dims.moe_layers], moe_router_dtype="fp32",
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_permute_fusion=False,
    )


class Qwen3MoeArchitecture(Qwen3Architecture):
    hf_architecture = "Qwen3MoeForCausalLM"
    model_type = "qwen3_moe"

    @property
    def has_moe(self) -> bool:
        return True

    def transformer_config_kwargs(self, hf: Any) -> dict[str, Any]:
        dims = self.read_dims(hf)
        kwargs = dense_transformer_kwargs(hf, dims)
        kwargs.update(moe_router_kwargs(dims))
        kwargs.update(moe_router_score_function="softmax",
                      moe_router_pre_softmax=not bool(getattr(hf, "norm_topk_prob", True)))
        return kwargs
