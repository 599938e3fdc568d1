"""Parameter counts of the reference configs against the published model sizes and a hand count."""

import json
from pathlib import Path

import pytest

from megarl.plan import count_parameters, read_model_dims

REFERENCE = Path(__file__).resolve().parents[3] / "megarl" / "models" / "reference_configs"


def load(name: str) -> dict:
    return json.loads((REFERENCE / name / "config.json").read_text())


@pytest.mark.parametrize(
    "name, published_total",
    [
        ("qwen2_5_7b_instruct", 7.62e9),
        ("qwen2_5_vl_7b_instruct", 8.29e9),  # its vision tower: 0.68B
        ("llama3_1_8b", 8.03e9),
        ("llama3_1_70b", 70.6e9),
        ("qwen3_8b", 8.19e9),
        ("qwen3_30b_a3b", 30.5e9),
        ("deepseek_v3", 671e9),
    ],
)
def test_total_matches_published_size(name, published_total):
    assert count_parameters(load(name)).total == pytest.approx(published_total, rel=0.005)


def test_deepseek_v3_active_and_mtp():
    count = count_parameters(load("deepseek_v3"))
    assert 36.5e9 < count.active < 38.0e9  # "37B activated"
    assert count.mtp == pytest.approx(14e9, rel=0.05)  # DeepSeek: "685B = 671B main + 14B MTP"
    assert count.total_with_mtp == pytest.approx(685e9, rel=0.005)
    assert count.mtp_unique == count.mtp - 2 * count.embedding  # the MTP module's own embedding + head copies
    assert sum(not layer.is_moe for layer in count.per_layer) == 3


def test_qwen3_30b_a3b_active():
    assert count_parameters(load("qwen3_30b_a3b")).active == pytest.approx(3.3e9, rel=0.02)  # "3.3B activated"


def test_deepseek_v3_layer_by_hand():
    """One MoE layer of DeepSeek-V3 written out tensor by tensor from the checkpoint's names."""
    h, heads = 7168, 128
    mla = (
        h * 1536 + 1536  # q_a_proj, q_a_layernorm
        + 1536 * heads * (128 + 64)  # q_b_proj
        + h * (512 + 64) + 512  # kv_a_proj_with_mqa, kv_a_layernorm
        + 512 * heads * (128 + 128)  # kv_b_proj
        + heads * 128 * h  # o_proj
    )
    expert = 3 * h * 2048
    moe = 256 * expert + expert + 256 * h + 256  # routed, shared, gate, e_score_correction_bias
    layer = count_parameters(load("deepseek_v3")).per_layer[3]
    assert layer.total == mla + moe + 2 * h
    assert layer.routed_active == 8 * expert


def test_qwen2_layer_by_hand_includes_qkv_bias():
    h, f, kv = 3584, 18944, 4 * 128
    attention = h * h + h + 2 * (h * kv + kv) + h * h
    layer = count_parameters(load("qwen2_5_7b_instruct")).per_layer[0]
    assert layer.total == attention + 3 * h * f + 2 * h


def test_tied_embedding_is_counted_once():
    config = load("qwen3_8b") | {"tie_word_embeddings": True}
    tied, untied = count_parameters(config), count_parameters(load("qwen3_8b"))
    assert untied.total - tied.total == 151936 * 4096
    assert tied.output_head == 0


def test_unknown_model_type_and_missing_key_are_named():
    with pytest.raises(ValueError, match="unsupported model_type 'gpt_neox'"):
        read_model_dims({"model_type": "gpt_neox"})
    config = load("llama3_1_8b")
    del config["intermediate_size"]
    with pytest.raises(ValueError, match="'intermediate_size'"):
        count_parameters(config)


def test_a_vision_language_models_tower_is_in_total_not_in_active():
    vl, text = count_parameters(load("qwen2_5_vl_7b_instruct")), count_parameters(load("qwen2_5_7b_instruct"))
    assert vl.total - vl.vision_tower == text.total and vl.active == text.active  # the same language model
    # 14 x 14 x 2 x 3 patch conv, 32 blocks of width 1280 (gated MLP of 3420, biases), merger 5120 -> 3584
    block = 2 * 1280 + (1280 * 3840 + 3840) + (1280 * 1280 + 1280) + 2 * (1280 * 3420 + 3420) + (3420 * 1280 + 1280)
    merger = 1280 + (5120 * 5120 + 5120) + (5120 * 3584 + 3584)
    assert vl.vision_tower == 3 * 2 * 14 * 14 * 1280 + 32 * block + merger
