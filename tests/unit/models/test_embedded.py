"""The embedded tiny-qwen2 demo model: built locally, loadable by transformers, deterministic, atomic."""

import json
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megarl.data.tokenizer import ALPHABET, build_char_tokenizer
from megarl.models.embedded import EMBEDDED_FORMAT, ensure_embedded_model, resolve_model_path, round_up_vocab

MODEL_FILES = ["config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
               "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_embedded_model("tiny-qwen2", root=tmp_path_factory.mktemp("embedded"))


def test_config_is_the_documented_shape(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    expected = {"model_type": "qwen2", "dtype": "float32", "hidden_size": 128, "num_attention_heads": 2,
                "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 2, "intermediate_size": 256,
                "vocab_size": 64, "tie_word_embeddings": False, "max_position_embeddings": 512,
                "eos_token_id": 2, "pad_token_id": 0}
    assert {k: config[k] for k in expected} == expected
    assert config["rope_parameters"]["rope_theta"] == 10000.0
    assert round_up_vocab(61) == 64 and round_up_vocab(64) == 64 and round_up_vocab(65) == 128
    generation = json.loads((model_dir / "generation_config.json").read_text())
    # No sampling defaults: vLLM would apply them over the caller's sampling params.
    assert not {"temperature", "top_p", "top_k", "do_sample"} & set(generation)


def test_loads_and_runs_a_forward_pass(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert model.dtype == torch.float32
    # transformers routes qwen2 dirs through Qwen2Tokenizer; it must give the local tokenizer's ids.
    text = tokenizer.apply_chat_template([{"role": "user", "content": "copy 37"}], add_generation_prompt=True,
                                         tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == build_char_tokenizer().encode(text).ids
    assert tokenizer.decode(ids) == text and len(tokenizer) == 3 + len(ALPHABET)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 64)
    assert torch.isfinite(logits).all()
    # Random init with std 0.02: the policy starts near uniform, which is what the demo task relies on.
    probs = logits[0, -1].softmax(-1)
    assert probs.max() < 5.0 / 64


def test_two_builds_are_byte_identical(model_dir, tmp_path):
    other = ensure_embedded_model("tiny-qwen2", root=tmp_path)
    assert sorted(p.name for p in other.iterdir()) == MODEL_FILES
    for name in MODEL_FILES:
        assert (other / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_build_does_not_disturb_the_callers_rng(tmp_path):
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    ensure_embedded_model("tiny-qwen2", root=tmp_path)
    assert torch.equal(torch.rand(3), expected)


def test_concurrent_builds_agree_and_leave_no_staging_dirs(model_dir, tmp_path):
    results = []
    threads = [threading.Thread(target=lambda: results.append(ensure_embedded_model(root=tmp_path)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [tmp_path / f"tiny-qwen2-{EMBEDDED_FORMAT}"] * 2
    assert [p.name for p in tmp_path.iterdir()] == [f"tiny-qwen2-{EMBEDDED_FORMAT}"]
    assert (tmp_path / f"tiny-qwen2-{EMBEDDED_FORMAT}" / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()


def test_interrupted_build_leftovers_are_ignored(tmp_path):
    stale = tmp_path / ".tiny-qwen2.tmp-dead"
    stale.mkdir()
    (stale / "config.json").write_text("{half")
    built = ensure_embedded_model(root=tmp_path)
    assert built == tmp_path / f"tiny-qwen2-{EMBEDDED_FORMAT}" and (built / "model.safetensors").is_file()


def test_resolve_model_path(tmp_path, monkeypatch, model_dir):
    monkeypatch.setenv("MEGARL_CACHE", str(tmp_path / "cache"))
    resolved = resolve_model_path("embedded:tiny-qwen2")
    assert resolved == tmp_path / "cache" / "embedded" / f"tiny-qwen2-{EMBEDDED_FORMAT}"
    assert resolve_model_path(str(model_dir)) == model_dir
    with pytest.raises(ValueError, match="unknown embedded model 'nope'"):
        resolve_model_path("embedded:nope")
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        resolve_model_path(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        resolve_model_path(str(tmp_path / "empty"))
