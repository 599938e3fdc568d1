"""A small character-level tokenizer built locally, for the embedded demo model and tests.

One token per character over a fixed alphabet (space, newline, digits, lowercase letters, a few punctuation
marks) plus three ChatML special tokens (and, for a vision-language model, Qwen2.5-VL's image tokens after the
alphabet, so a text model's ids stay as they are), written as a Hugging Face tokenizer directory that
`transformers.AutoTokenizer.from_pretrained` and vLLM load like any hub tokenizer (a fast tokenizer with a
Qwen-style ChatML `chat_template`). Nothing is downloaded.

Left out: byte fallback and an unknown token. A character outside the alphabet is dropped by the byte-level BPE
(the Qwen2 pipeline has no unknown token), so data meant for this tokenizer is checked with
`unsupported_characters` before it is written.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

PAD_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START_TOKEN, EOS_TOKEN)
# Qwen2.5-VL's: an image is <|vision_start|> + its <|image_pad|> tokens + <|vision_end|> (megarl.data.vision_inputs);
# the video pad too (no prompt here holds a video, but vLLM's Qwen2.5-VL processor looks both pads up)
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

PUNCTUATION = ".,:;!?'\"()[]{}+-*/=#<>_"
ALPHABET = " \n" + "0123456789" + "abcdefghijklmnopqrstuvwxyz" + PUNCTUATION

# Qwen-style ChatML without a default system message: the demo prompts stay short.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

MODEL_MAX_LENGTH = 512

# transformers' Qwen2 pre-tokenization split (see build_char_tokenizer for why we must match it).
QWEN_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def build_char_tokenizer(*, vision: bool = False) -> Tokenizer:
    """Return the `tokenizers.Tokenizer`: special tokens take ids 0..2, then one id per alphabet character, then
    (``vision``) the image tokens.

    The pipeline is the one transformers' `Qwen2Tokenizer` rebuilds around a vocab (NFC, the Qwen split regex,
    byte-level mapping, byte-level BPE) with an empty merge list, so every character stays its own token. It has
    to be that pipeline: transformers 5 loads any `model_type: qwen2` dir through `Qwen2Tokenizer`, keeping only
    vocab and merges from tokenizer.json, and vLLM loads through it too; the same ids result either way.
    """
    symbols = [_byte_level_symbol(ch) for ch in ALPHABET]
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + tuple(symbols))}
    if len(vocab) != local_tokenizer_size():
        raise AssertionError("duplicate character in the tokenizer alphabet")
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[],
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _special_tokens(vision)])
    return tokenizer


def _special_tokens(vision: bool) -> tuple[str, ...]:
    return SPECIAL_TOKENS + (VISION_TOKENS if vision else ())


def unsupported_characters(text: str) -> list[str]:
    """Characters of `text` outside the alphabet, in order of first appearance.

    The byte-level BPE has no unknown token, so such characters would vanish from the ids without an error;
    callers that build data for this tokenizer check with this first.
    """
    allowed = set(ALPHABET)
    for special in SPECIAL_TOKENS + VISION_TOKENS:
        text = text.replace(special, "")
    return list(dict.fromkeys(ch for ch in text if ch not in allowed))


def _byte_level_symbol(ch: str) -> str:
    # GPT-2 byte-to-unicode table: printable ASCII maps to itself, space to "Ġ", newline to "Ċ".
    (piece,) = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(ch)
    return piece[0]


def write_local_tokenizer(out_dir: str | Path, *, vision: bool = False) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir`; return it
    (``vision``: with the image tokens of :func:`build_char_tokenizer`).

    The files are written directly (not through `save_pretrained`) so their content does not depend on the
    installed transformers version and two builds are byte-identical.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer(vision=vision)
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    added_tokens_decoder = {
        str(tokenizer.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in _special_tokens(vision)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added_tokens_decoder,
        "additional_special_tokens": [IM_START_TOKEN],
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "padding_side": "left",
    }
    _write_json(out / "tokenizer_config.json", config)
    special_map = {"additional_special_tokens": [IM_START_TOKEN], "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    _write_json(out / "special_tokens_map.json", special_map)
    return out


def local_tokenizer_size(*, vision: bool = False) -> int:
    """Number of token ids of the local tokenizer (special tokens included)."""
    return len(_special_tokens(vision)) + len(ALPHABET)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
