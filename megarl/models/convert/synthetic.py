"""Write a large random Llama-layout HF checkpoint quickly, without building a transformers model.

Used by the peak-memory test and ``bench/convert_bench.py``: a few hundred MB to several GB of plain
random tensors under exactly the names/shapes ``LlamaForCausalLM`` uses, sharded like ``save_pretrained``
does, plus a matching config.json. The weights are random normals (not a trained model); one tensor is
generated at a time so writing it needs no more memory than its largest tensor.

Left out: tokenizer files, non-Llama layouts.
"""

from __future__ import annotations

import json
import os

import torch

from megarl.models.convert.hf_index import INDEX_FILE
from megarl.models.convert.safetensors_stream import PlannedTensor, StreamingSafetensorsWriter


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
    os.makedirs(out_dir, exist_ok=True)
    tensors = _llama_tensors(config, dtype)
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    generator = torch.Generator().manual_seed(seed)
    weight_map = {}
    for index, shard in enumerate(shards):
        name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        writer = StreamingSafetensorsWriter(os.path.join(out_dir, name), shard, metadata={"format": "pt"})
        for tensor in shard:
            writer.add(tensor.name, torch.randn(tensor.shape, generator=generator).to(dtype))
            weight_map[tensor.name] = name
        writer.close()
    total = sum(t.nbytes for t in tensors)
    with open(os.path.join(out_dir, INDEX_FILE), "w") as handle:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, handle)
    with open(os.path.join(out_dir, "config.json"), "w") as handle:
        json.dump(config, handle, indent=2)
    return total
