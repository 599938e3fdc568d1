"""Builds a tiny random-init Qwen2 HF model dir with a local character tokenizer, for rollout-engine tests.

Shapes satisfy vLLM's CPU backend (fp32, head_dim 64). Leaves out trained weights and hub downloads.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

PAD, EOS = "<pad>", "<eos>"
CHARS = string.ascii_lowercase + string.digits + " +-=.,?!"


def write_char_tokenizer(out: Path) -> int:
    """Write a character-level fast tokenizer (tokenizer.json + config) to `out`; return its size."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, **{ch: i + 2 for i, ch in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS)
    fast.save_pretrained(out)
    return len(vocab)


def build_tiny_qwen2(out: Path, *, seed: int = 0, tie_word_embeddings: bool = False, vocab_size: int = 64,
                     num_kv_heads: int = 1) -> Path:
    """Write config, fp32 safetensors weights, generation config and tokenizer of a 2-layer Qwen2 to `out`."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_size = write_char_tokenizer(out)
    assert vocab_size >= tokenizer_size
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=num_kv_heads, head_dim=64, max_position_embeddings=256,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=0, eos_token_id=1, pad_token_id=0, dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
        # Random init has std 0.02: logits would be near-uniform and greedy ties would be common. Larger
        # weights give peaked, tie-free distributions, so token-for-token comparisons are meaningful.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() > 1:
                    param.normal_(0.0, 0.15)
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=0).save_pretrained(out)
    return out


def random_hf_state(model_dir: Path, *, seed: int) -> dict[str, torch.Tensor]:
    """Fresh random tensors with the names/shapes of the checkpoint in `model_dir` (norm weights near 1)."""
    from safetensors.torch import load_file

    state = load_file(str(Path(model_dir) / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    new = {}
    for name, tensor in state.items():
        if tensor.dim() > 1:
            new[name] = torch.randn(tensor.shape, generator=gen) * 0.15
        elif "norm" in name:
            new[name] = 1.0 + 0.1 * torch.randn(tensor.shape, generator=gen)
        else:  # attention biases
            new[name] = 0.1 * torch.randn(tensor.shape, generator=gen)
    return new


def copy_model_with_state(src: Path, out: Path, state: dict[str, torch.Tensor], **config_overrides) -> Path:
    """Copy model dir `src` to `out`, replacing its weights by `state` and patching config.json fields."""
    import json
    import shutil

    from safetensors.torch import save_file

    src, out = Path(src), Path(out)
    shutil.copytree(src, out)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    for name in ("config.json", "generation_config.json") if config_overrides else ():
        data = json.loads((out / name).read_text())
        data.update(config_overrides)
        (out / name).write_text(json.dumps(data))
    return out
