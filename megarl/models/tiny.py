"""Tiny random-weight HF models of every supported architecture, for tests and CPU runs.

``tiny_hf_config(arch)`` gives an fp32 config (2-3 layers, hidden 64, GQA with fewer query groups than
heads, vocab 250 so megatron pads it, MoE with 4 experts top-2, DeepSeek with 1 dense + 2 MoE layers,
a shared expert, small q/kv LoRA ranks and YaRN RoPE). ``save_tiny_hf_checkpoint`` writes it with
transformers' ``save_pretrained`` into several safetensors shards plus the index json;
``save_tiny_reward_model`` writes the same decoder as a ``*ForSequenceClassification`` with one label.
Left out: tokenizers (see :mod:`megarl.data.tokenizer`) and any trained weights.
"""

from __future__ import annotations

import os
from typing import Any

import torch

TINY_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")

_COMMON = dict(vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.2,
               torch_dtype="float32", bos_token_id=1, eos_token_id=2, pad_token_id=0)

_SPECS: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], head_dim=16, tie_word_embeddings=False,
                  max_position_embeddings=16384,
                  rope_theta=500000.0,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=8192)),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True,
                  rope_theta=1000000.0, use_sliding_window=False),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=32, tie_word_embeddings=False,
                  rope_theta=1000000.0, attention_bias=False, use_sliding_window=False),
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], head_dim=16,
                      tie_word_embeddings=False, rope_theta=1000000.0, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                      attention_bias=False, use_sliding_window=False),
    "deepseek_v3": dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], num_hidden_layers=3,
                        num_key_value_heads=4, tie_word_embeddings=False, n_routed_experts=4, num_experts_per_tok=2,
                        n_group=2, topk_group=1, first_k_dense_replace=1, moe_intermediate_size=32,
                        n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, topk_method="noaux_tc",
                        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        num_nextn_predict_layers=0, rope_theta=10000.0, rope_interleave=True,
                        rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=64,
                                          beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
}


def tiny_hf_config_dict(arch: str, **overrides: Any) -> dict[str, Any]:
    if arch not in _SPECS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {TINY_ARCHS}")
    return {**_COMMON, **_SPECS[arch], **overrides}


def tiny_hf_config(arch: str, **overrides: Any):
    from megarl.models.hf_config import load_hf_config

    return load_hf_config(tiny_hf_config_dict(arch, **overrides))


def build_tiny_hf_model(arch: str, *, seed: int, **overrides: Any):
    """A random-init HF model; router biases are randomised too (HF initialises them to zero)."""
    import transformers

    config = tiny_hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        # transformers keeps e_score_correction_bias as a (persistent) buffer, so walk buffers too.
        for name, param in [*model.named_parameters(), *model.named_buffers()]:
            # HF init leaves norms at 1 and the DeepSeek expert bias at 0; perturb them so a mapping that
            # mixes up norms or drops the bias cannot pass a logits comparison by accident.
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith("e_score_correction_bias"):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    return model.eval()


# Qwen2.5-VL: the tiny Qwen2 decoder with M-RoPE (sections of the 16-wide head's 8 frequencies: 2 temporal,
# 3 height, 3 width) and a 2-block vision tower (one windowed block, one full), patches of 14 px merged 2 x 2.
TINY_VL_IMAGE_TOKEN_ID = 240  # inside the tiny vocabulary (250); vision start/end/video ids beside it
TINY_VL_VISION_START_ID, TINY_VL_VISION_END_ID = 241, 242


def tiny_vl_config_dict(**text_overrides: Any) -> dict[str, Any]:
    text = {k: v for k, v in _COMMON.items() if k not in ("torch_dtype",)}
    text.update(model_type="qwen2_5_vl_text", head_dim=16, rope_theta=1000000.0, use_sliding_window=False,
                rope_scaling=dict(type="mrope", mrope_section=[2, 3, 3]), **text_overrides)
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=text["hidden_size"],
                  fullatt_block_indexes=[1], window_size=56, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, in_chans=3, initializer_range=0.2)
    return dict(model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"], text_config=text,
                vision_config=vision, image_token_id=TINY_VL_IMAGE_TOKEN_ID,
                vision_start_token_id=TINY_VL_VISION_START_ID, vision_end_token_id=TINY_VL_VISION_END_ID,
                video_token_id=243, tie_word_embeddings=False, torch_dtype="float32")


def save_tiny_vl_checkpoint(out_dir: str | os.PathLike, *, seed: int, max_shard_size: str = "60KB") -> str:
    """A random-init tiny Qwen2.5-VL in the checkpoint layout (``model.layers.*``, ``visual.*``); every weight drawn
    at the scale of the others (HF would leave the vision tower's biases and norms at 0 and 1)."""
    import transformers

    from megarl.models.hf_config import load_hf_config

    config = load_hf_config(tiny_vl_config_dict())
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.float32,
                                                                         attn_implementation="eager")
    norms = ("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")
    _redraw(model, seed, lambda name, shape, g: (1.0 if name.endswith(norms) else 0.0) + 0.1 * torch.randn(shape, generator=g))
    return _save(model, out_dir, max_shard_size)


def _redraw(model, seed: int, draw) -> None:
    """Each parameter for which ``draw(name, shape, generator)`` gives a tensor takes it (None: left as is)."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = draw(name, param.shape, generator)
            if value is not None:
                param.copy_(value)


def _save(model, out_dir: str | os.PathLike, max_shard_size: str) -> str:
    out_dir = os.fspath(out_dir)
    model.eval().save_pretrained(out_dir, max_shard_size=max_shard_size)
    return out_dir


def save_tiny_hf_checkpoint(arch: str, out_dir: str | os.PathLike, *, seed: int, max_shard_size: str = "60KB",
                            **overrides: Any) -> str:
    return _save(build_tiny_hf_model(arch, seed=seed, **overrides), out_dir, max_shard_size)


def save_tiny_reward_model(arch: str, out_dir: str | os.PathLike, *, seed: int, max_shard_size: str = "60KB",
                           **overrides: Any) -> str:
    """A random-init ``<Arch>ForSequenceClassification`` (num_labels=1) of the tiny config, norms perturbed and
    the score head drawn at the scale of the other weights (so scores differ visibly between sequences)."""
    import transformers

    causal = tiny_hf_config_dict(arch)["architectures"][0]
    config = tiny_hf_config(arch, architectures=[causal.replace("ForCausalLM", "ForSequenceClassification")],
                            num_labels=1, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32,
                                                                        attn_implementation="eager")

    def draw(name, shape, generator):
        if name.endswith(("norm.weight", "layernorm.weight")):
            return 1.0 + 0.1 * torch.randn(shape, generator=generator)
        return 0.2 * torch.randn(shape, generator=generator) if name == "score.weight" else None

    _redraw(model, seed, draw)
    return _save(model, out_dir, max_shard_size)
