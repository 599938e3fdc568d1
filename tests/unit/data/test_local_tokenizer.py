"""The local character tokenizer: ids, exact round trips, the ChatML template, loading through transformers."""

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from megarl.data.tokenizer import (
    ALPHABET,
    EOS_TOKEN,
    IM_START_TOKEN,
    PAD_TOKEN,
    build_char_tokenizer,
    local_tokenizer_size,
    unsupported_characters,
    write_local_tokenizer,
)

DEMO_STRINGS = [
    "copy 37",
    "reverse 120",
    "add 12 34",
    "a\nb  c\n\n d",
    "what's 3+4? let's think. #### 7",
    "  x  ",
    "(a) [b] {c} <d> = e_f * g / h - i, j; k: l! \"m\" #",
]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(write_local_tokenizer(tmp_path_factory.mktemp("tok")))


def test_vocab_layout():
    tok = build_char_tokenizer()
    assert local_tokenizer_size() == 64 == tok.get_vocab_size()
    assert [tok.token_to_id(t) for t in (PAD_TOKEN, IM_START_TOKEN, EOS_TOKEN)] == [0, 1, 2]


@pytest.mark.parametrize("text", DEMO_STRINGS)
def test_one_id_per_character_and_exact_round_trip(hf_tokenizer, text):
    ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    # Independent expectation: specials take 0..2, then the alphabet in order.
    assert ids == [3 + ALPHABET.index(ch) for ch in text]
    assert hf_tokenizer.decode(ids) == text
    assert build_char_tokenizer().encode(text).ids == ids


def test_special_tokens_and_chat_template(hf_tokenizer):
    assert (hf_tokenizer.pad_token, hf_tokenizer.pad_token_id) == (PAD_TOKEN, 0)
    assert (hf_tokenizer.eos_token, hf_tokenizer.eos_token_id) == (EOS_TOKEN, 2)
    messages = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "copy 37"}]
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nbe brief.<|im_end|>\n<|im_start|>user\ncopy 37<|im_end|>\n<|im_start|>assistant\n"
    )
    no_gen = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_gen + "<|im_start|>assistant\n" == text
    ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(1) == 3 and ids.count(2) == 2  # special tokens are single ids, not spelled out
    assert hf_tokenizer.decode(ids) == text
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == "system\nbe brief.\nuser\ncopy 37\nassistant\n"


def test_written_files_are_deterministic(tmp_path):
    a, b = write_local_tokenizer(tmp_path / "a"), write_local_tokenizer(tmp_path / "b")
    names = sorted(p.name for p in a.iterdir())
    assert names == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert Tokenizer.from_file(str(a / "tokenizer.json")).encode("copy 37").ids == [17, 29, 30, 39, 3, 8, 12]


def test_unsupported_characters_are_reported():
    assert unsupported_characters("copy 37<|im_end|>") == []
    assert unsupported_characters("Hello, World\t!") == ["H", "W", "\t"]
