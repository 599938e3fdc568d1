"""Write a large random Llama-layout HF checkpoint quickly, without building a transformers model.

Used by the peak-memory test and ``bench/convert_bench.py``: a few hundred MB to several GB of plain
random tensors under exactly the names/shapes ``LlamaForCausalLM`` uses, sharded like ``save_pretrained``
does, plus a matching config.json. The weights are random values tiled from a 64 MiB pattern (not a trained
model; a converter's speed does not depend on them); one tensor is made at a time, so writing needs no more
memory than the largest tensor.

:func:`write_synthetic_checkpoint` writes any tensor list the same way; :func:`deepseek_v3_tensors` is
DeepSeek-V3's release layout with its FP8 blocks (the 671B rehearsal, ``bench/convert_671b_rehearsal.py``).

Left out: tokenizer files.
"""

from __future__ import annotations

import json
import os

import torch

from megarl.checkpoint_io.hf_index import INDEX_FILE
from megarl.checkpoint_io.safetensors_stream import PlannedTensor, StreamingSafetensorsWriter


def synthetic_llama_config(*, hidden_size: int, num_layers: int, intermediate_size: int, vocab_size: int,
                           num_heads: int, num_kv_heads: int) -> dict:
    return dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=hidden_size,
                num_hidden_layers=num_layers, intermediate_size=intermediate_size, vocab_size=vocab_size,
                num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                head_dim=hidden_size // num_heads, max_position_embeddings=1024, rms_norm_eps=1e-6,
                rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu", torch_dtype="float32")


def _llama_tensors(config: dict, dtype: torch.dtype) -> list[PlannedTensor]:
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    tensors = [PlannedTensor("model.embed_tokens.weight", dtype, (v, h))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors += [
            PlannedTensor(p + "input_layernorm.weight", dtype, (h,)),
            PlannedTensor(p + "self_attn.q_proj.weight", dtype, (q, h)),
            PlannedTensor(p + "self_attn.k_proj.weight", dtype, (kv, h)),
            PlannedTensor(p + "self_attn.v_proj.weight", dtype, (kv, h)),
            PlannedTensor(p + "self_attn.o_proj.weight", dtype, (h, q)),
            PlannedTensor(p + "post_attention_layernorm.weight", dtype, (h,)),
            PlannedTensor(p + "mlp.gate_proj.weight", dtype, (f, h)),
            PlannedTensor(p + "mlp.up_proj.weight", dtype, (f, h)),
            PlannedTensor(p + "mlp.down_proj.weight", dtype, (h, f)),
        ]
    return tensors + [PlannedTensor("model.norm.weight", dtype, (h,)), PlannedTensor("lm_head.weight", dtype, (v, h))]


def write_synthetic_llama_checkpoint(out_dir: str, *, hidden_size: int = 512, num_layers: int = 64,
                                     intermediate_size: int = 2048, vocab_size: int = 4096, num_heads: int = 8,
                                     num_kv_heads: int = 4, dtype: torch.dtype = torch.float32,
                                     shard_bytes: int = 256 * 2**20, seed: int = 0) -> int:
    """Write the checkpoint; returns its total tensor bytes."""
    config = synthetic_llama_config(hidden_size=hidden_size, num_layers=num_layers,
                                    intermediate_size=intermediate_size, vocab_size=vocab_size,
                                    num_heads=num_heads, num_kv_heads=num_kv_heads)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    return write_synthetic_checkpoint(out_dir, config, _llama_tensors(config, dtype), shard_bytes=shard_bytes,
                                      seed=seed)


# ------------------------------------------------------------------------------- any architecture, FP8 blocks
_PATTERN_BYTES = 64 * 2**20


def _pattern(dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """64 MiB of random values of ``dtype`` (FP8 without NaN codes), tiled into every tensor: how fast a
    converter moves bytes does not depend on their values, and generating 10+ GB of normals would cost more
    than the conversion measured."""
    if dtype == torch.float8_e4m3fn:
        raw = torch.randint(0, 256, (_PATTERN_BYTES,), dtype=torch.uint8, generator=generator)
        raw[(raw & 0x7F) == 0x7F] = 0  # e4m3fn's NaN encodings
        return raw.view(torch.float8_e4m3fn)
    count = _PATTERN_BYTES // torch.empty((), dtype=dtype).element_size()
    values = torch.randn(count, generator=generator) * 0.02
    return values.abs() + 1e-3 if dtype == torch.float32 else values.to(dtype)


def _tiled(pattern: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    numel = 1
    for size in shape:
        numel *= size
    repeats = -(-numel // pattern.numel())
    flat = pattern if repeats == 1 else pattern.repeat(repeats)
    return flat[:numel].view(shape)


def deepseek_v3_tensors(config: dict, dtype: torch.dtype = torch.bfloat16,
                        fp8_block: tuple[int, int] | None = (128, 128)) -> list[PlannedTensor]:
    """DeepSeek-V3's tensors as its release checkpoint names them (per-expert weights; no MTP layers), for
    ``config``; with ``fp8_block`` every 2-D decoder weight but the router's is float8_e4m3fn + its
    ``weight_scale_inv``."""
    import math

    h, v, heads = config["hidden_size"], config["vocab_size"], config["num_attention_heads"]
    q_lora, kv_lora, rope = config["q_lora_rank"], config["kv_lora_rank"], config["qk_rope_head_dim"]
    nope, v_dim = config["qk_nope_head_dim"], config["v_head_dim"]
    dense_ffn, expert_ffn = config["intermediate_size"], config["moe_intermediate_size"]
    shared_ffn = expert_ffn * config.get("n_shared_experts", 1)
    tensors = [PlannedTensor("model.embed_tokens.weight", dtype, (v, h))]

    def weight(name: str, shape: tuple[int, int]) -> None:
        if fp8_block is None:
            tensors.append(PlannedTensor(name, dtype, shape))
            return
        tensors.append(PlannedTensor(name, torch.float8_e4m3fn, shape))
        tensors.append(PlannedTensor(name + "_scale_inv", torch.float32,
                                     (math.ceil(shape[0] / fp8_block[0]), math.ceil(shape[1] / fp8_block[1]))))

    def mlp(prefix: str, ffn: int) -> None:
        weight(prefix + "gate_proj.weight", (ffn, h))
        weight(prefix + "up_proj.weight", (ffn, h))
        weight(prefix + "down_proj.weight", (h, ffn))

    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors += [PlannedTensor(p + "input_layernorm.weight", dtype, (h,)),
                    PlannedTensor(p + "post_attention_layernorm.weight", dtype, (h,)),
                    PlannedTensor(p + "self_attn.q_a_layernorm.weight", dtype, (q_lora,)),
                    PlannedTensor(p + "self_attn.kv_a_layernorm.weight", dtype, (kv_lora,))]
        weight(p + "self_attn.q_a_proj.weight", (q_lora, h))
        weight(p + "self_attn.q_b_proj.weight", (heads * (nope + rope), q_lora))
        weight(p + "self_attn.kv_a_proj_with_mqa.weight", (kv_lora + rope, h))
        weight(p + "self_attn.kv_b_proj.weight", (heads * (nope + v_dim), kv_lora))
        weight(p + "self_attn.o_proj.weight", (h, heads * v_dim))
        if i < config["first_k_dense_replace"]:
            mlp(p + "mlp.", dense_ffn)
            continue
        tensors += [PlannedTensor(p + "mlp.gate.weight", dtype, (config["n_routed_experts"], h)),
                    PlannedTensor(p + "mlp.gate.e_score_correction_bias", torch.float32, (config["n_routed_experts"],))]
        for expert in range(config["n_routed_experts"]):
            mlp(p + f"mlp.experts.{expert}.", expert_ffn)
        mlp(p + "mlp.shared_experts.", shared_ffn)
    return tensors + [PlannedTensor("model.norm.weight", dtype, (h,)), PlannedTensor("lm_head.weight", dtype, (v, h))]


def write_synthetic_checkpoint(out_dir: str, config: dict, tensors: list[PlannedTensor], *,
                               shard_bytes: int = 4 * 10**9, seed: int = 0) -> int:
    """``tensors`` (e.g. :func:`deepseek_v3_tensors`) filled with tiled random values, sharded, with an index and
    ``config`` as config.json. Returns the bytes written."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    generator = torch.Generator().manual_seed(seed)
    patterns: dict[torch.dtype, torch.Tensor] = {}
    os.makedirs(out_dir, exist_ok=True)
    weight_map = {}
    for index, shard in enumerate(shards):
        name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        writer = StreamingSafetensorsWriter(os.path.join(out_dir, name), shard, metadata={"format": "pt"})
        for tensor in shard:
            if tensor.dtype not in patterns:
                patterns[tensor.dtype] = _pattern(tensor.dtype, generator)
            writer.add(tensor.name, _tiled(patterns[tensor.dtype], tensor.shape))
            weight_map[tensor.name] = name
        writer.close()
    total = sum(t.nbytes for t in tensors)
    with open(os.path.join(out_dir, INDEX_FILE), "w") as handle:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, handle)
    with open(os.path.join(out_dir, "config.json"), "w") as handle:
        json.dump(config, handle, indent=2)
    return total
