"""The embedded demo models: tiny random-init Qwen2 (and a reward model, a Qwen3-MoE, a Qwen2.5-VL) written
locally as Hugging Face model directories.

`ensure_embedded_model("tiny-qwen2")` builds (once, then reuses) a dir with config.json, model.safetensors,
generation_config.json and the local character tokenizer, so the demo, the tests and vLLM can run with no
model download. `resolve_model_path` turns a model spec (`embedded:<name>` or a local dir) into a checked path.

Left out: any trained weights (the model is seeded random init; it learns only through RL) and hub downloads.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

from megarl.data.cache import default_cache_root
from megarl.data.tokenizer import (EOS_TOKEN, PAD_TOKEN, VISION_TOKENS, build_char_tokenizer, local_tokenizer_size,
                                   write_local_tokenizer)
from megarl.data.vision_inputs import VisionTokens

EMBEDDED_PREFIX = "embedded:"
EMBEDDED_SEED = 1234
# Part of the cache path: bump it whenever what _write_model_dir writes changes, so old caches are not reused.
EMBEDDED_FORMAT = "v4"
# Seeding and drawing the init go through torch's global RNG: two threads building at once would interleave
# draws and get different weights. Processes are safe (own RNG); the rename handles them.
_BUILD_LOCK = threading.Lock()

# Shapes chosen for CPU: head_dim 64 because vLLM's CPU attention refuses 16; 2 kv heads so TP=2 divides them.
_TINY_QWEN2_SHAPE = dict(
    hidden_size=128,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=64,
    num_hidden_layers=2,
    intermediate_size=256,
    max_position_embeddings=512,
    rope_theta=10000.0,
)
_EMBEDDED_SPECS = {
    "tiny-qwen2": _TINY_QWEN2_SHAPE,
    # A reward model for the demo and tests: a Qwen2ForSequenceClassification (one label) of the same shape over
    # the same character tokenizer, random init like the policy (what it prefers is arbitrary but fixed).
    "tiny-qwen2-rm": dict(_TINY_QWEN2_SHAPE, head="score"),
    # A Qwen3-MoE of the same width over the same tokenizer: 8 experts, 2 routed per token, every layer MoE
    # (routing replay and MoE weight sync on CPU).
    "tiny-qwen3-moe": dict(_TINY_QWEN2_SHAPE, family="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=64, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    # A Qwen2.5-VL: the same decoder with M-RoPE (the 32 frequencies of a 64-wide head: 8 temporal, 12 height,
    # 12 width, Qwen2.5-VL's proportions) under a 2-block vision tower, over the tokenizer with image tokens
    # (vision-language RL on CPU: megarl.data.shapes_task).
    "tiny-qwen2-vl": dict(_TINY_QWEN2_SHAPE, family="qwen2_5_vl", rope_scaling=dict(type="mrope",
                                                                                    mrope_section=[8, 12, 12])),
}
# The tiny vision tower: one head of 64 (vLLM's CPU attention takes no narrower), one windowed block and one
# full; images of up to 112 x 112 pixels, i.e. at most 16 image tokens each.
_TINY_VISION = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=1, fullatt_block_indexes=[1],
                    window_size=56, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_chans=3)
_TINY_VISION_PIXELS = dict(min_pixels=56 * 56, max_pixels=112 * 112)


def embedded_model_names() -> list[str]:
    """Names accepted by `ensure_embedded_model` and the `embedded:<name>` model spec."""
    return sorted(_EMBEDDED_SPECS)


def round_up_vocab(size: int, multiple: int = 64) -> int:
    """Round a tokenizer size up to the embedding-table size (a multiple that tensor parallelism can split)."""
    return -(-size // multiple) * multiple


def ensure_embedded_model(name: str = "tiny-qwen2", root: str | Path | None = None) -> Path:
    """Return the dir of embedded model `name`, building it first if absent.

    `root` is the parent dir (default `<cache root>/embedded`). The model is assembled in a temporary sibling dir
    and renamed into place, so a concurrent or interrupted call never leaves a half-written model behind; when two
    callers race, the loser discards its copy and both return the same (identical) dir.
    """
    if name not in _EMBEDDED_SPECS:
        raise ValueError(f"unknown embedded model {name!r}; known: {embedded_model_names()}")
    parent = Path(root) if root is not None else default_cache_root() / "embedded"
    target = parent / f"{name}-{EMBEDDED_FORMAT}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    with _BUILD_LOCK:
        if (target / "model.safetensors").is_file():
            return target
        parent.mkdir(parents=True, exist_ok=True)
        _build_atomically(name, parent, target)
    return target


def _build_atomically(name: str, parent: Path, target: Path) -> None:
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared by other users' jobs.
        _write_model_dir(staging, _EMBEDDED_SPECS[name])
        try:
            os.rename(staging, target)
        except OSError:
            # Another process renamed its copy first (target now exists and is non-empty): keep theirs.
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def resolve_model_path(path: str | Path) -> Path:
    """Map `embedded:<name>` to the built embedded model dir; otherwise check a local HF model dir exists."""
    spec = str(path)
    if spec.startswith(EMBEDDED_PREFIX):
        return ensure_embedded_model(spec[len(EMBEDDED_PREFIX):])
    local = Path(spec).expanduser()
    if not local.is_dir():
        raise FileNotFoundError(
            f"model path {spec!r} is not a directory (expected a local Hugging Face model dir or "
            f"'{EMBEDDED_PREFIX}<name>' with name in {embedded_model_names()}; hub downloads are not done)"
        )
    if not (local / "config.json").is_file():
        raise FileNotFoundError(f"model dir {str(local)!r} has no config.json; it is not a Hugging Face model dir")
    return local


def _write_model_dir(out: Path, spec: dict) -> None:
    # Imported here: torch/transformers are heavy and only needed when a model is actually built.
    import torch
    from safetensors.torch import save_file
    from transformers import (GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification,
                              Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    spec = dict(spec)
    classifier = spec.pop("head", "lm") == "score"
    family = spec.pop("family", "qwen2")
    moe, vision = family == "qwen3_moe", family == "qwen2_5_vl"
    config_class, model_class = ((Qwen2Config, Qwen2ForSequenceClassification) if classifier
                                 else (Qwen3MoeConfig, Qwen3MoeForCausalLM) if moe
                                 else (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration) if vision
                                 else (Qwen2Config, Qwen2ForCausalLM))
    tokenizer = build_char_tokenizer(vision=vision)
    pad_id = tokenizer.token_to_id(PAD_TOKEN)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    text = dict(
        vocab_size=round_up_vocab(local_tokenizer_size(vision=vision)),
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=False,
        use_sliding_window=False,
        bos_token_id=pad_id,  # Qwen convention: <|endoftext|> doubles as bos; the chat template adds no bos.
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
        **spec,
    )
    if vision:  # the decoder's fields are the text model's; the image tokens are the tokenizer's
        start, end, pad, video_pad = (tokenizer.token_to_id(token) for token in VISION_TOKENS)
        text = dict(text_config=text, vision_config=dict(_TINY_VISION, out_hidden_size=text["hidden_size"]),
                    image_token_id=pad, vision_start_token_id=start, vision_end_token_id=end,
                    video_token_id=video_pad,
                    tie_word_embeddings=False, dtype="float32")
    config = config_class(
        # vLLM picks the model class from this field; a bare config.save_pretrained does not fill it in.
        architectures=[model_class.__name__],
        **({"num_labels": 1} if classifier else {}),
        **text,
    )
    # fork_rng keeps the caller's global RNG stream untouched by our fixed seed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(EMBEDDED_SEED + int(classifier))
        model = model_class(config).to(torch.float32)
    config.save_pretrained(out)
    if moe or vision:  # transformers' in-memory names (fused experts, model.language_model.*) are not the
        model.save_pretrained(out)  # checkpoint's; its save writes the checkpoint's
    else:  # save_file directly (no tied weights to dedupe): quiet, one file, the metadata HF loaders check for.
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if vision:  # the pixel bounds vLLM and megarl's dataset read
        tokens = VisionTokens(image_pad_id=config.image_token_id, vision_start_id=config.vision_start_token_id,
                              vision_end_id=config.vision_end_token_id, **_TINY_VISION_PIXELS)
        tokens.image_processor().save_pretrained(out)
    # Only token ids, no sampling defaults: vLLM applies generation_config sampling fields over the caller's.
    # <|endoftext|> also ends generation (as in Qwen): otherwise a policy learns to fill its answer with it,
    # since decoding with skip_special_tokens hides it from the reward.
    GenerationConfig(bos_token_id=pad_id, eos_token_id=[eos_id, pad_id], pad_token_id=pad_id).save_pretrained(out)
    write_local_tokenizer(out, vision=vision)
