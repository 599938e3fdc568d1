"""Divisibility rules: each broken rule yields an error naming the sizes involved."""

import json
from pathlib import Path

import pytest

from megarl.models.parallel_layout import ParallelLayout
from megarl.plan import LayoutSpec, TrainingSpec, check_layout, read_model_dims, split_pipeline_layers

REFERENCE = Path(__file__).resolve().parents[3] / "megarl" / "models" / "reference_configs"


def dims(name: str):
    return read_model_dims(json.loads((REFERENCE / name / "config.json").read_text()))


TRAIN = TrainingSpec(global_batch_size=64, micro_batch_size=1, max_seq_len=4096)


def errors(name, **layout):
    return check_layout(dims(name), LayoutSpec(**layout), TRAIN)


def test_good_dense_layout_has_no_errors():
    parallel = ParallelLayout(tensor_parallel=8, pipeline_parallel=4)
    assert errors("llama3_1_70b", world_size=32, parallel=parallel, rollout_tp=8) == []


@pytest.mark.parametrize(
    "name, world_size, parallel, expected",
    [
        ("llama3_1_8b", 12, dict(tensor_parallel=8), "world_size=12 is not divisible by tp*pp*cp=8*1*1=8"),
        ("qwen2_5_7b_instruct", 16, dict(tensor_parallel=16), "num_attention_heads=28 is not divisible by tp=16"),
        ("llama3_1_8b", 8, dict(pipeline_parallel=3), "num_layers=32 is not divisible by pp=3"),
        ("llama3_1_8b", 16, dict(pipeline_parallel=4, virtual_pipeline_parallel=3),
         "layers per pipeline stage (8) are not divisible by vpp=3"),
        ("llama3_1_8b", 8, dict(expert_parallel=2), "ep=2 but llama is a dense model"),
        ("qwen3_30b_a3b", 48, dict(expert_parallel=48), "num_experts=128 is not divisible by ep=48"),
        ("qwen3_30b_a3b", 16, dict(tensor_parallel=2, pipeline_parallel=2, expert_parallel=8),
         "world_size=16 is not divisible by etp*ep*pp=2*8*2=32"),
        ("qwen3_8b", 8, dict(context_parallel=3), "world_size=8 is not divisible by tp*pp*cp=1*1*3=3"),
        ("llama3_1_8b", 3, dict(pipeline_parallel=3, first_stage_layers=5),
         "27 layers left after first_stage_layers=5/last_stage_layers=None are not divisible by the 2 middle"),
    ],
)
def test_broken_rule_is_named(name, world_size, parallel, expected):
    found = errors(name, world_size=world_size, parallel=ParallelLayout(**parallel))
    assert any(expected in e for e in found), found


def test_rollout_tp_must_divide_the_heads():
    found = errors("llama3_1_8b", world_size=8, rollout_tp=3)
    assert any("num_attention_heads=32 is not divisible by rollout_tp=3" in e for e in found), found


def test_kv_heads_fewer_than_tp_replicate_only_when_tp_is_a_multiple():
    # Qwen2.5-7B: 28 heads, 4 kv heads. tp=2/4 split kv heads; Megatron replicates them for tp a multiple of 4.
    qwen = dims("qwen2_5_7b_instruct")
    assert check_layout(qwen, LayoutSpec(world_size=4, parallel=ParallelLayout(tensor_parallel=4)), TRAIN) == []
    fake = read_model_dims({**json.loads((REFERENCE / "llama3_1_8b" / "config.json").read_text()),
                            "num_attention_heads": 48, "num_key_value_heads": 8})
    # 8 kv heads, each on 2 ranks
    assert check_layout(fake, LayoutSpec(world_size=16, parallel=ParallelLayout(tensor_parallel=16)), TRAIN) == []
    found = check_layout(fake, LayoutSpec(world_size=12, parallel=ParallelLayout(tensor_parallel=12)), TRAIN)
    assert any("num_key_value_heads=8 must be a multiple or a divisor of tp=12" in e for e in found), found


def test_global_batch_must_split_over_micro_batches_and_dp():
    found = check_layout(dims("llama3_1_8b"), LayoutSpec(world_size=8, parallel=ParallelLayout(tensor_parallel=2)),
                         TrainingSpec(global_batch_size=30, micro_batch_size=2))
    assert found == ["global_batch_size=30 is not divisible by micro_batch_size*dp=2*4=8"]


def test_uneven_pipeline_split_of_deepseek_v3():
    layout = LayoutSpec(world_size=1024,
                        parallel=ParallelLayout(pipeline_parallel=16, first_stage_layers=3, last_stage_layers=2))
    stages, errs = split_pipeline_layers(61, layout)
    assert errs == [] and stages == [3] + [4] * 14 + [2]
    _, errs = split_pipeline_layers(61, LayoutSpec(world_size=1024, parallel=ParallelLayout(pipeline_parallel=16)))
    assert any("set first_stage_layers/last_stage_layers" in e for e in errs)


def test_moe_with_tp_and_ep_needs_sequence_parallel():
    found = errors("qwen3_30b_a3b", world_size=16, parallel=ParallelLayout(tensor_parallel=2, expert_parallel=8),
                   sequence_parallel=False)
    assert any("needs sequence_parallel=True" in e for e in found)
