"""Benchmark models (HF config dicts) and the FLOP count used for MFU.

``qwen2_config(name)`` gives the HF config dict of a Qwen2.5-shaped model ("0.5b", "1.5b", "7b", "14b", "32b", or "tiny"
for CPU dry runs) with random weights implied: nothing is downloaded. ``model_config(name, layers=)`` adds the MoE
shapes ("30b-a3b": Qwen3-30B-A3B's per-layer sizes, 128 experts of which 8 per token; "tiny-moe" for CPU dry runs),
whose depth a benchmark cuts to what one GPU holds. ``matmul_params`` counts the
parameters that take part in a matrix product per token (every linear layer plus the output projection,
which is a matmul even when tied to the embedding; the embedding lookup is not). ``train_flops_per_token``
is the FLOP formula every benchmark here states:

    forward  = 2 * matmul_params + 2 * layers * seq * heads * head_dim       (causal attention: QK^T and PV,
                                                                               each 2*s*d, halved by the mask)
    training = 3 * forward                                                    (backward = 2 x forward)

For rows of different real lengths (padded or packed batches) :func:`train_flops_for_lengths` counts the
useful work only, sequence by sequence: ``L * train_flops_per_token(cfg, L)`` summed over the rows, i.e.

    3 * (2 * matmul_params * sum(L) + 2 * layers * heads * head_dim * sum(L^2))

so padding tokens, and attention across packed neighbours, count for nothing. For ``n`` rows of one
length ``s`` it is ``train_flops_per_token(cfg, s) * n * s``.

Left out: norms, RoPE, softmax and the loss (element-wise, a fraction of a percent at these sizes).
"""

from __future__ import annotations

from typing import Any, Iterable

_QWEN2_COMMON = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=151936,
                     max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     hidden_act="silu", use_sliding_window=False, tie_word_embeddings=True,
                     torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645, initializer_range=0.02)

# Published Qwen2.5 shapes (hidden, ffn, layers, heads, kv heads); weights are random here.
_SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096, bos_token_id=1,
                 eos_token_id=2),
}


def qwen2_config(name: str, **overrides: Any) -> dict[str, Any]:
    if name not in _SHAPES:
        raise ValueError(f"unknown benchmark model {name!r}; choose from {sorted(_SHAPES)}")
    return {**_QWEN2_COMMON, **_SHAPES[name], **overrides}


_QWEN3_MOE_COMMON = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936,
                         max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu",
                         attention_bias=False, tie_word_embeddings=False, norm_topk_prob=True, decoder_sparse_step=1,
                         mlp_only_layers=[], torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645,
                         initializer_range=0.02)

# Published Qwen3-MoE shapes; every layer is an MoE layer (no dense MLP), no shared expert.
_MOE_SHAPES = {
    "30b-a3b": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                    num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                    head_dim=128),
    "tiny-moe": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_experts=8,
                     num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, vocab_size=1024, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2),
}

# Qwen2.5-VL: the published (flat) config.json layout, the text model's fields at the top; "vl-7b" is
# Qwen2.5-VL-7B-Instruct's, "vl-3b" the 3B's (text 2048 x 36 layers, tied embeddings; the same vision tower with
# a 2048-wide merger output), "vl-tiny" a CPU dry run's. FLOP counts below are the language model's: the
# tower's (675M parameters at 3B/7B, frozen by default) run once per image in the forward only.
_VL_TOWER = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                 spatial_merge_size=2, spatial_patch_size=14, temporal_patch_size=2, window_size=112,
                 fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu", in_channels=3, in_chans=3,
                 tokens_per_second=2, model_type="qwen2_5_vl")
_VL_COMMON = dict(model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"], hidden_act="silu",
                  rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=128000, use_sliding_window=False,
                  rope_scaling={"type": "default", "rope_type": "default", "mrope_section": [16, 24, 24]},
                  torch_dtype="bfloat16", initializer_range=0.02, bos_token_id=151643, eos_token_id=151645,
                  vision_start_token_id=151652, vision_end_token_id=151653, vision_token_id=151654,
                  image_token_id=151655, video_token_id=151656)
_VL_SHAPES = {
    "vl-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                  num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
                  vision_config=dict(_VL_TOWER, out_hidden_size=3584)),
    "vl-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                  vision_config=dict(_VL_TOWER, out_hidden_size=2048)),
    "vl-tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=False,
                    rope_scaling={"type": "default", "rope_type": "default", "mrope_section": [8, 12, 12]},
                    vision_config=dict(_VL_TOWER, depth=2, hidden_size=64, intermediate_size=128, num_heads=2,
                                       fullatt_block_indexes=[1], out_hidden_size=128)),
}

SHAPES = tuple(_SHAPES) + tuple(_MOE_SHAPES) + tuple(_VL_SHAPES)


def is_vision_language(name: str) -> bool:
    return name in _VL_SHAPES


def model_config(name: str, *, layers: int | None = None, **overrides: Any) -> dict[str, Any]:
    """Any benchmark shape, dense or MoE; ``layers`` keeps the per-layer sizes and cuts (or grows) the depth."""
    if name in _MOE_SHAPES:
        cfg = {**_QWEN3_MOE_COMMON, **_MOE_SHAPES[name], **overrides}
    elif name in _VL_SHAPES:
        cfg = {**_VL_COMMON, **_VL_SHAPES[name], **overrides}
    elif name in _SHAPES:
        cfg = qwen2_config(name, **overrides)
    else:
        raise ValueError(f"unknown benchmark model {name!r}; choose from {sorted(SHAPES)}")
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        cfg["num_hidden_layers"] = layers
    return cfg


def _dims(cfg: dict[str, Any]) -> tuple[int, int, int, int, int, int, int]:
    hidden, ffn, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    return hidden, ffn, layers, heads, kv_heads, head_dim, cfg["vocab_size"]


def _mlp_params(cfg: dict[str, Any]) -> tuple[int, int]:
    """(parameters a token multiplies by, parameters stored) of one layer's MLP: an MoE layer's token goes
    through its top-k experts and the router, and the layer stores all of its experts."""
    hidden, ffn = cfg["hidden_size"], cfg["intermediate_size"]
    if "num_experts" not in cfg:
        return 3 * hidden * ffn, 3 * hidden * ffn
    expert, experts = 3 * hidden * cfg["moe_intermediate_size"], cfg["num_experts"]
    router = hidden * experts
    return cfg["num_experts_per_tok"] * expert + router, experts * expert + router


def matmul_params(cfg: dict[str, Any]) -> int:
    hidden, ffn, layers, heads, kv_heads, head_dim, vocab = _dims(cfg)
    attn = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    return layers * (attn + _mlp_params(cfg)[0]) + vocab * hidden


def total_params(cfg: dict[str, Any]) -> int:
    """All parameters as the model stores them (tied embedding counted once; biases and norms included); a
    vision-language model's language model only."""
    hidden, ffn, layers, heads, kv_heads, head_dim, vocab = _dims(cfg)
    if cfg["model_type"] in ("qwen2", "qwen2_5_vl"):
        extra = heads * head_dim + 2 * kv_heads * head_dim  # Qwen2's q/k/v biases
    else:
        extra = 2 * head_dim  # Qwen3's q/k norms, no biases
    per_layer = (hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
                 + extra + _mlp_params(cfg)[1] + 2 * hidden)
    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    return layers * per_layer + embeddings + hidden


def train_flops_per_token(cfg: dict[str, Any], seq_len: int) -> float:
    hidden, ffn, layers, heads, kv_heads, head_dim, vocab = _dims(cfg)
    forward = 2 * matmul_params(cfg) + 2 * layers * seq_len * heads * head_dim
    return 3.0 * forward


def forward_flops_per_token(cfg: dict[str, Any], seq_len: int) -> float:
    return train_flops_per_token(cfg, seq_len) / 3.0


def train_flops_for_lengths(cfg: dict[str, Any], lengths: Iterable[int], *, frozen_weights: bool = False) -> float:
    """Useful training FLOPs of one pass over sequences of these real lengths (module docstring).
    ``frozen_weights``: the matmuls' weights take no gradient (LoRA's frozen base; its adapters are a rounding
    error): their backward is the input's gradient alone, twice their forward instead of three times in all;
    attention's backward (the gradients of q, k and v) is the same either way."""
    _, _, layers, heads, _, head_dim, _ = _dims(cfg)
    lengths = [int(n) for n in (lengths.tolist() if hasattr(lengths, "tolist") else lengths)]
    if any(n < 0 for n in lengths):
        raise ValueError(f"sequence lengths must be >= 0, got {lengths}")
    # Integers until the end: the sums are exact, so equal lengths reproduce the per-token formula.
    matmuls = 2 * matmul_params(cfg) * sum(lengths)
    attention = 2 * layers * heads * head_dim * sum(n * n for n in lengths)
    return (2.0 if frozen_weights else 3.0) * matmuls + 3.0 * attention


def forward_flops_for_lengths(cfg: dict[str, Any], lengths: Iterable[int]) -> float:
    return train_flops_for_lengths(cfg, lengths) / 3.0
