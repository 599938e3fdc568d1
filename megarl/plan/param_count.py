"""Count the parameters of a decoder model from its HF config, split the way parallelism shards them.

Every decoder layer is reported as a :class:`LayerParams` with three buckets: weights Megatron splits
over tensor parallelism (attention projections, dense MLP, shared experts), weights every TP rank keeps
whole (norms, router, expert score bias), and routed experts (split over expert parallelism). The
memory planner multiplies these by bytes and divides by the parallel sizes.

A vision-language model's vision tower (Qwen2.5-VL's: patch embedding, blocks, merger) is ``vision_tower``, in
``total`` but not in ``active`` (it runs once per image, not per token); every TP rank holds it whole.

DeepSeek multi-token-prediction (MTP) modules are counted apart from ``total``: DeepSeek's 671B excludes
them, its 685B checkpoint includes them together with the MTP module's own copies of the embedding and
output head (``mtp`` counts those copies, ``mtp_unique`` does not).
Leaves out: vocab padding (the planner adds it per layout), buffers such as rotary tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from megarl.models.model_dims import ModelDims, read_model_dims


@dataclass(frozen=True)
class LayerParams:
    is_moe: bool
    tp_sharded: int
    replicated: int
    routed_experts: int  # all routed experts of the layer
    routed_active: int  # the experts_per_token experts one token runs through

    @property
    def total(self) -> int:
        return self.tp_sharded + self.replicated + self.routed_experts

    @property
    def active(self) -> int:
        return self.tp_sharded + self.replicated + self.routed_active


@dataclass(frozen=True)
class ParamCount:
    total: int  # decoder + embedding + head + final norm, no MTP
    active: int  # per token: routed experts counted top-k only
    embedding: int
    output_head: int  # 0 when tied to the embedding
    final_norm: int
    per_layer: tuple[LayerParams, ...]
    mtp_layer: LayerParams | None  # the decoder block of one MTP module (plus its projection and norms)
    mtp_unique: int  # all MTP modules, without their copies of embedding and head
    mtp: int  # all MTP modules as stored in the HF checkpoint (with those copies)
    vision_tower: int = 0  # a vision-language model's tower (in total, not in active)

    @property
    def total_with_mtp(self) -> int:
        return self.total + self.mtp


def _count_attention(dims: ModelDims) -> tuple[int, int]:
    """(tp_sharded, replicated) parameters of one attention block, its input norm included."""
    h = dims.hidden_size
    replicated = h  # input_layernorm
    if dims.mla is not None:
        m = dims.mla
        qk_head = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank is None:
            q = h * dims.num_heads * qk_head
        else:
            # q_a_proj and its layernorm are small and sit before the head split; Megatron keeps them
            # whole on every TP rank, so they are counted as replicated.
            replicated += h * m.q_lora_rank + m.q_lora_rank
            q = m.q_lora_rank * dims.num_heads * qk_head
        replicated += h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank  # kv_a_proj_with_mqa + norm
        kv_b = m.kv_lora_rank * dims.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
        o = dims.num_heads * m.v_head_dim * h
        return q + kv_b + o, replicated
    q_width = dims.num_heads * dims.head_dim
    kv_width = dims.num_kv_heads * dims.head_dim
    sharded = h * q_width + 2 * h * kv_width + q_width * h
    if dims.qkv_bias:
        sharded += q_width + 2 * kv_width
    if dims.o_bias:
        replicated += h  # row-parallel bias is added after the reduce, kept whole
    if dims.qk_norm:
        replicated += 2 * dims.head_dim
    return sharded, replicated


def _count_swiglu(hidden: int, width: int, bias: bool) -> int:
    weights = 3 * hidden * width
    return weights + (2 * width + hidden if bias else 0)


def _count_layer(dims: ModelDims, is_moe: bool) -> LayerParams:
    attn_sharded, attn_replicated = _count_attention(dims)
    h = dims.hidden_size
    replicated = attn_replicated + h  # post_attention_layernorm
    if not is_moe:
        return LayerParams(
            is_moe=False,
            tp_sharded=attn_sharded + _count_swiglu(h, dims.intermediate_size, dims.mlp_bias),
            replicated=replicated,
            routed_experts=0,
            routed_active=0,
        )
    moe = dims.moe
    assert moe is not None
    one_expert = _count_swiglu(h, moe.expert_intermediate_size, False)
    shared = _count_swiglu(h, moe.shared_expert_intermediate_size, False) if moe.shared_expert_intermediate_size else 0
    replicated += h * moe.num_experts  # router
    if moe.has_expert_bias:
        replicated += moe.num_experts
    return LayerParams(
        is_moe=True,
        tp_sharded=attn_sharded + shared,
        replicated=replicated,
        routed_experts=moe.num_experts * one_expert,
        routed_active=moe.experts_per_token * one_expert,
    )


def count_parameters(hf_config: Mapping[str, Any] | ModelDims) -> ParamCount:
    """Count parameters of the model ``hf_config`` describes (a config.json dict or parsed dims)."""
    dims = hf_config if isinstance(hf_config, ModelDims) else read_model_dims(hf_config)
    per_layer = tuple(_count_layer(dims, is_moe) for is_moe in dims.moe_layers)
    embedding = dims.vocab_size * dims.hidden_size
    head = 0 if dims.tie_word_embeddings else embedding
    final_norm = dims.hidden_size
    vision_tower = _count_vision_tower(dims.vision) if dims.vision is not None else 0
    total = embedding + head + final_norm + sum(layer.total for layer in per_layer) + vision_tower
    active = embedding + head + final_norm + sum(layer.active for layer in per_layer)

    mtp_layer = None
    mtp_unique = mtp = 0
    if dims.mtp_layers:
        h = dims.hidden_size
        block = _count_layer(dims, is_moe=dims.moe is not None)
        # enorm + hnorm + shared_head.norm are replicated; eh_proj (2h -> h) is TP-sharded.
        mtp_layer = LayerParams(
            is_moe=block.is_moe,
            tp_sharded=block.tp_sharded + 2 * h * h,
            replicated=block.replicated + 3 * h,
            routed_experts=block.routed_experts,
            routed_active=block.routed_active,
        )
        mtp_unique = dims.mtp_layers * mtp_layer.total
        mtp = mtp_unique + dims.mtp_layers * (embedding + (head or embedding))
    return ParamCount(
        total=total,
        active=active,
        embedding=embedding,
        output_head=head,
        final_norm=final_norm,
        per_layer=per_layer,
        mtp_layer=mtp_layer,
        mtp_unique=mtp_unique,
        mtp=mtp,
        vision_tower=vision_tower,
    )


def _count_vision_tower(vision) -> int:
    """Qwen2.5-VL's tower: a bias-free patch convolution, blocks of (norm, qkv, proj, norm, gated MLP, all linears
    with biases), and the merger (norm, then an MLP from merge^2 patches to the language model's width)."""
    h, w = vision.hidden_size, vision.intermediate_size
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2 * h
    block = 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * (h * w + w) + (w * h + h)
    merged = h * vision.spatial_merge_size ** 2
    merger = h + (merged * merged + merged) + (merged * vision.out_hidden_size + vision.out_hidden_size)
    return patch + vision.depth * block + merger
