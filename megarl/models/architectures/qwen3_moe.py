"""Qwen3-MoE: Qwen3 attention (q/k norm, no bias) + softmax top-k routed experts, no shared expert.

``norm_topk_prob=True`` (renormalise the top-k softmax) is megatron's ``moe_router_pre_softmax=False``
(top-k over logits, then softmax over the k); ``False`` is ``pre_softmax=True`` (softmax over all
experts, keep k). Dense layers come from ``mlp_only_layers`` / ``decoder_sparse_step``.
Left out: the router aux loss value (forward-identical; set ``moe_aux_loss_coeff`` via overrides).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megarl.models.architectures.base import DecoderDims, require_field
from megarl.models.architectures.llama import Qwen3Architecture, dense_transformer_kwargs


def moe_router_kwargs(*, num_experts: int, topk: int, moe_ffn: int, moe_layers: tuple[bool, ...]) -> dict[str, Any]:
    return dict(
        num_moe_experts=num_experts, moe_router_topk=topk, moe_ffn_hidden_size=moe_ffn,
        moe_layer_freq=[int(x) for x in moe_layers], moe_router_dtype="fp32",
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_permute_fusion=False,
    )


class Qwen3MoeArchitecture(Qwen3Architecture):
    hf_architecture = "Qwen3MoeForCausalLM"

    @property
    def has_moe(self) -> bool:
        return True

    def read_dims(self, hf: Any) -> DecoderDims:
        dims = super().read_dims(hf)
        step = getattr(hf, "decoder_sparse_step", 1) or 1
        dense_only = set(getattr(hf, "mlp_only_layers", None) or [])
        num_experts = require_field(hf, "num_experts")
        moe_layers = tuple(i not in dense_only and num_experts > 0 and (i + 1) % step == 0
                           for i in range(dims.num_layers))
        return dataclasses.replace(dims, moe_layers=moe_layers, num_experts=num_experts,
                                   moe_ffn_hidden_size=require_field(hf, "moe_intermediate_size"))

    def transformer_config_kwargs(self, hf: Any) -> dict[str, Any]:
        dims = self.read_dims(hf)
        kwargs = dense_transformer_kwargs(hf, dims)
        kwargs.update(moe_router_kwargs(num_experts=dims.num_experts, topk=require_field(hf, "num_experts_per_tok"),
                                        moe_ffn=dims.moe_ffn_hidden_size, moe_layers=dims.moe_layers))
        kwargs.update(moe_router_score_function="softmax",
                      moe_router_pre_softmax=not bool(getattr(hf, "norm_topk_prob", True)))
        return kwargs
