"""What the GPU tests of megarl's production rollout engines (vLLM's, SGLang's) share: a small random Qwen2 written
to disk (4 layers, GQA, untied head), prompts of several lengths, perturbed copies of its weights on the device,
greedy generation with log-probs (deterministic for a fixed batch: "exact" compares token ids and log-probs), a
weight sync in several buckets, and the device's used bytes."""

from __future__ import annotations

from pathlib import Path

import torch

CONFIG = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=4096, hidden_size=512,
              intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
              max_position_embeddings=2048, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
              use_sliding_window=False, initializer_range=0.05, bos_token_id=1, eos_token_id=2,
              torch_dtype="bfloat16")
PROMPTS = [[3 + (7 * i + 11 * j) % 4000 for j in range(20 + 9 * i)] for i in range(16)]


def write_model(out: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**CONFIG)).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return out


def original_and_perturbed(model_dir: Path) -> tuple[dict, dict]:
    """The checkpoint's tensors on the device, and a copy with every tensor moved by noise of 0.02."""
    from safetensors.torch import load_file

    original = {name: t.cuda() for name, t in load_file(str(model_dir / "model.safetensors")).items()}
    generator = torch.Generator(device="cuda").manual_seed(1)
    perturbed = {name: (t.float() + 0.02 * torch.randn(t.shape, device="cuda", generator=generator)).to(t.dtype)
                 for name, t in original.items()}
    return original, perturbed


def greedy(engine) -> list[tuple[list[int], list[float]]]:
    from megarl.engines.rollout.base import SamplingConfig

    outputs = engine.generate(PROMPTS, SamplingConfig.greedy(max_tokens=48, logprobs=True, ignore_eos=True))
    return [(o.token_ids, o.log_probs) for o in outputs]


def push(engine, tensors: dict, bucket_bytes: int) -> None:
    """A whole weight sync of ``tensors`` in buckets of ``bucket_bytes`` (at least two)."""
    from megarl.weight_sync.buckets import bucketize

    buckets = list(bucketize(sorted(tensors.items()), bucket_bytes))
    assert len(buckets) >= 2
    for bucket in buckets:
        engine.update_weights(bucket)
    engine.finish_weight_update()


def device_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def check_greedy_generation(engine) -> None:
    """Every prompt gets its 48 tokens, each with a finite log-prob <= 0."""
    outputs = greedy(engine)
    assert len(outputs) == len(PROMPTS)
    for tokens, log_probs in outputs:
        assert len(tokens) == 48 and all(-1e4 < lp <= 0 for lp in log_probs)


def check_updates_are_exact(engine, original: dict, perturbed: dict) -> list:
    """Perturbed weights change the output; the original ones restore it exactly; the perturbed ones again (other
    bucket bound) reproduce the first update exactly. Ends on the original weights; returns the perturbed output."""
    before = greedy(engine)
    push(engine, perturbed, bucket_bytes=8 << 20)
    after = greedy(engine)
    assert after != before, "the pushed weights did not change the output"
    push(engine, original, bucket_bytes=8 << 20)
    assert greedy(engine) == before
    push(engine, perturbed, bucket_bytes=20 << 20)
    assert greedy(engine) == after
    push(engine, original, bucket_bytes=8 << 20)
    return after
