"""Divisibility rules: each broken rule yields an error naming the sizes involved."""

import json
from pathlib import Path

import pytest

from megarl.plan import LayoutSpec, TrainingSpec, check_layout, read_model_dims, split_pipeline_layers

REFERENCE = Path(__file__).resolve().parents[3] / "megarl" / "models" / "reference_configs"


def dims(name: str):
    return read_model_dims(json.loads((REFERENCE / name / "config.json").read_text()))


TRAIN = TrainingSpec(global_batch_size=64, micro_batch_size=1, max_seq_len=4096)


def errors(name, **layout):
    return check_layout(dims(name), LayoutSpec(**layout), TRAIN)


def test_good_dense_layout_has_no_errors():
    assert errors("llama3_1_70b", world_size=32, tp=8, pp=4, rollout_tp=8) == []


@pytest.mark.parametrize(
    "name, layout, expected",
    [
        ("llama3_1_8b", dict(world_size=12, tp=8), "world_size=12 is not divisible by tp*pp*cp=8*1*1=8"),
        ("qwen2_5_7b_instruct", dict(world_size=16, tp=16), "num_attention_heads=28 is not divisible by tp=16"),
        ("llama3_1_8b", dict(world_size=8, pp=3, tp=1), "num_layers=32 is not divisible by pp=3"),
        ("llama3_1_8b", dict(world_size=16, pp=4, vpp=3), "layers per pipeline stage (8) are not divisible by vpp=3"),
        ("llama3_1_8b", dict(world_size=8, ep=2), "ep=2 but llama is a dense model"),
        ("qwen3_30b_a3b", dict(world_size=48, ep=48), "num_experts=128 is not divisible by ep=48"),
        ("qwen3_30b_a3b", dict(world_size=16, tp=2, pp=2, ep=8), "world_size=16 is not divisible by etp*ep*pp=2*8*2=32"),
        ("qwen3_8b", dict(world_size=8, cp=3), "world_size=8 is not divisible by tp*pp*cp=1*1*3=3"),
        ("llama3_1_8b", dict(world_size=8, rollout_tp=3), "num_attention_heads=32 is not divisible by rollout_tp=3"),
        ("llama3_1_8b", dict(world_size=3, pp=3, first_stage_layers=5),
         "27 layers left after first_stage_layers=5/last_stage_layers=None are not divisible by the 2 middle"),
    ],
)
def test_broken_rule_is_named(name, layout, expected):
    found = errors(name, **layout)
    assert any(expected in e for e in found), found


def test_kv_heads_fewer_than_tp_replicate_only_when_tp_is_a_multiple():
    # Qwen2.5-7B: 28 heads, 4 kv heads. tp=2/4 split kv heads; Megatron replicates them for tp a multiple of 4.
    qwen = dims("qwen2_5_7b_instruct")
    assert check_layout(qwen, LayoutSpec(world_size=4, tp=4), TRAIN) == []
    fake = read_model_dims({**json.loads((REFERENCE / "llama3_1_8b" / "config.json").read_text()),
                            "num_attention_heads": 48, "num_key_value_heads": 8})
    assert check_layout(fake, LayoutSpec(world_size=16, tp=16), TRAIN) == []  # 8 kv heads, each on 2 ranks
    found = check_layout(fake, LayoutSpec(world_size=12, tp=12), TRAIN)
    assert any("num_key_value_heads=8 must be a multiple or a divisor of tp=12" in e for e in found), found


def test_global_batch_must_split_over_micro_batches_and_dp():
    found = check_layout(dims("llama3_1_8b"), LayoutSpec(world_size=8, tp=2),
                         TrainingSpec(global_batch_size=30, micro_batch_size=2))
    assert found == ["global_batch_size=30 is not divisible by micro_batch_size*dp=2*4=8"]


def test_uneven_pipeline_split_of_deepseek_v3():
    layout = LayoutSpec(world_size=1024, pp=16, first_stage_layers=3, last_stage_layers=2)
    stages, errs = split_pipeline_layers(61, layout)
    assert errs == [] and stages == [3] + [4] * 14 + [2]
    _, errs = split_pipeline_layers(61, LayoutSpec(world_size=1024, pp=16))
    assert any("set first_stage_layers/last_stage_layers" in e for e in errs)


def test_moe_with_tp_and_ep_needs_sequence_parallel():
    found = errors("qwen3_30b_a3b", world_size=16, tp=2, ep=8, sequence_parallel=False)
    assert any("needs sequence_parallel=True" in e for e in found)
