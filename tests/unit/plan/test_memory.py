"""Memory plan: hand-computed components, the 671B layouts public recipes use, and over-budget messages."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from megarl.models.parallel_layout import ParallelLayout
from megarl.plan import LayoutSpec, TrainingSpec, count_parameters, layer_activation_bytes, plan_layout, read_model_dims
from megarl.plan.memory import GIB, rollout_kv_bytes_per_token

REFERENCE = Path(__file__).resolve().parents[3] / "megarl" / "models" / "reference_configs"


def load(name: str) -> dict:
    return json.loads((REFERENCE / name / "config.json").read_text())


def phase(report, name):
    return next(p for p in report.phases if p.phase == name)


def test_llama_8b_training_state_by_hand():
    # 128256 is a multiple of 128, so no vocab padding at tp=1: every GPU holds the whole model.
    total = count_parameters(load("llama3_1_8b")).total
    report = plan_layout(load("llama3_1_8b"), LayoutSpec(world_size=8), TrainingSpec(global_batch_size=64), 80)
    train = phase(report, "actor train").components
    assert train["actor params (bf16)"] == 2 * total
    assert train["actor main grads (fp32)"] == 4 * total
    assert train["actor optimizer (fp32 master+m+v)"] == pytest.approx(12 * total / 8)
    unsharded = plan_layout(load("llama3_1_8b"), LayoutSpec(world_size=8, distributed_optimizer=False),
                            TrainingSpec(global_batch_size=64), 80)
    assert phase(unsharded, "actor train").components["actor optimizer (fp32 master+m+v)"] == 12 * total


def test_a_frozen_vision_tower_has_weights_but_no_grads_or_optimizer_state():
    config, layout = load("qwen2_5_vl_7b_instruct"), LayoutSpec(world_size=8)
    tower = count_parameters(config).vision_tower
    frozen, trained = (phase(plan_layout(config, layout, TrainingSpec(global_batch_size=64, train_vision_tower=t),
                                         80), "actor train").components for t in (False, True))
    assert frozen["actor params (bf16)"] == trained["actor params (bf16)"]  # the tower's weights either way
    assert trained["actor main grads (fp32)"] - frozen["actor main grads (fp32)"] == 4 * tower
    assert trained["actor optimizer (fp32 master+m+v)"] - frozen["actor optimizer (fp32 master+m+v)"] == \
        pytest.approx(12 * tower / 8)


def test_llama_8b_layer_activation_by_hand():
    dims = read_model_dims(load("llama3_1_8b"))
    T, h, f = 4096, 4096, 14336
    # tp=1: norm input + qkv input (h each), Q (32*128) K V (8*128 each), core output (32*128); fp32 lse per head.
    attention = 2 * T * (2 * h + 2 * 4096 + 2 * 1024) + 4 * T * 32
    mlp = 2 * T * (2 * h + 3 * f)
    assert layer_activation_bytes(dims, LayoutSpec(world_size=1), T, False, "none") == attention + mlp
    # tp=4 with sequence parallel divides every term by 4 (8 kv heads split 2 per rank).
    tp4 = LayoutSpec(world_size=4, parallel=ParallelLayout(tensor_parallel=4))
    sp = layer_activation_bytes(dims, tp4, T, False, "none")
    assert sp == pytest.approx((attention + mlp) / 4)


def test_pipeline_first_stage_holds_pp_micro_batches():
    config, train = load("llama3_1_8b"), TrainingSpec(global_batch_size=64, max_seq_len=2048)
    dims = read_model_dims(config)
    pp4 = LayoutSpec(world_size=4, parallel=ParallelLayout(pipeline_parallel=4))
    per_layer = layer_activation_bytes(dims, pp4, 2048, False, "none")
    report = plan_layout(config, pp4, train, 80)
    stage0 = [p for p in report.phases if p.phase == "actor train"][0]
    # Worst stage is 0 (4 in flight x 8 layers) or 3 (1 x 8 layers + logits); 0 wins for this model.
    assert stage0.stage == 0
    assert stage0.components["actor activations"] == pytest.approx(4 * 8 * per_layer)
    # Interleaved, vpp=2 on stage 0: 2*(pp-1) + (vpp-1)*pp + 1 = 11 chunks of half a stage.
    interleaved = LayoutSpec(world_size=4, parallel=ParallelLayout(pipeline_parallel=4, virtual_pipeline_parallel=2))
    report = plan_layout(config, interleaved, train, 80)
    assert phase(report, "actor train").components["actor activations"] == pytest.approx(11 / 2 * 8 * per_layer)
    full = plan_layout(config, replace(pp4, recompute="full"), train, 80)
    # Recompute shrinks stage 0 so the last stage (1 micro-batch in flight, plus logits) becomes the worst:
    # layer inputs of 8 layers + one layer's working set; the logits apart, per (token, vocab) entry of one
    # micro-batch at TP = 1: bf16 model logits (2 B), their grad and the log-prob function's grad (2 + 2 B), and
    # its fp32 chunk (4 B: 2048 x 128256 entries are under the chunk's 2**28).
    stored = 8 * 2 * 2048 * 4096 + per_layer
    assert phase(full, "actor train").stage == 3
    assert phase(full, "actor train").components["actor activations"] == pytest.approx(stored)
    assert phase(full, "actor train").components["actor logits + log-prob buffers"] == 10 * 2048 * 128256


def test_kv_cache_bytes_per_token():
    llama = read_model_dims(load("llama3_1_8b"))
    assert rollout_kv_bytes_per_token(llama, 1, 2) == 2 * 32 * 8 * 128 * 2
    assert rollout_kv_bytes_per_token(llama, 8, 2) == 2 * 32 * 1 * 128 * 2
    assert rollout_kv_bytes_per_token(llama, 16, 2) == 2 * 32 * 1 * 128 * 2  # kv heads replicated past 8
    deepseek = read_model_dims(load("deepseek_v3"))
    assert rollout_kv_bytes_per_token(deepseek, 16, 2) == 61 * (512 + 64) * 2


def test_qwen_7b_on_one_node_fits():
    layout = LayoutSpec(world_size=8, parallel=ParallelLayout(tensor_parallel=2), rollout_tp=2)
    report = plan_layout(load("qwen2_5_7b_instruct"), layout,
                         TrainingSpec(global_batch_size=256, micro_batch_size=2, max_seq_len=4096), 80)
    assert report.fits, report.table()
    assert "FITS" in report.table()


def test_llama_70b_on_one_node_is_over_with_amount():
    layout = LayoutSpec(world_size=8, parallel=ParallelLayout(tensor_parallel=8), rollout_tp=8)
    report = plan_layout(load("llama3_1_70b"), layout,
                         TrainingSpec(global_batch_size=64, max_seq_len=4096), 80)
    assert not report.fits
    train = phase(report, "actor train")
    over = (train.total - 80 * GIB) / GIB
    message = next(e for e in report.errors if e.startswith("actor train"))
    assert f"over by {over:.2f} GiB" in message and "actor optimizer" in message
    assert "DOES NOT FIT" in report.table()


def test_deepseek_v3_public_layout_fits_on_1024_gpus():
    # Megatron-style DeepSeek-V3 recipe: 128 nodes x 8 H800 (80 GB), TP2 PP16 EP64 ETP1, 3+4*14+2 layers.
    parallel = ParallelLayout(tensor_parallel=2, pipeline_parallel=16, expert_parallel=64, expert_tensor_parallel=1,
                              first_stage_layers=3, last_stage_layers=2)
    layout = LayoutSpec(world_size=1024, parallel=parallel, recompute="full", rollout_tp=32)
    training = TrainingSpec(global_batch_size=512, max_seq_len=8192, rollout_weight_bytes=1)
    report = plan_layout(load("deepseek_v3"), layout, training, 80)
    assert report.fits, report.table()
    assert report.stage_layers == [3] + [4] * 14 + [2]
    assert report.dp == 32 and report.expert_dp == 1


def test_deepseek_v3_on_64_h200_is_rejected():
    parallel = ParallelLayout(tensor_parallel=8, pipeline_parallel=8, expert_parallel=8, expert_tensor_parallel=1,
                              last_stage_layers=5)
    layout = LayoutSpec(world_size=64, parallel=parallel, recompute="full", rollout_tp=8)
    report = plan_layout(load("deepseek_v3"), layout, TrainingSpec(global_batch_size=64, max_seq_len=4096), 141)
    assert not report.fits
    assert any("over by" in e and "GPU has 141.00 GiB" in e for e in report.errors), report.errors
    assert any("rollout engine: weights need" in e for e in report.errors), report.errors  # 1.3 TB over 8 GPUs


def test_colocation_without_offload_counts_training_state_during_rollout():
    config = load("qwen2_5_7b_instruct")
    layout = LayoutSpec(world_size=8, parallel=ParallelLayout(tensor_parallel=2), rollout_tp=2)
    offloaded = plan_layout(config, layout, TrainingSpec(global_batch_size=64), 141)
    resident = plan_layout(config, layout, TrainingSpec(global_batch_size=64, offload_train_state=False), 141)
    state = sum(v for k, v in phase(resident, "actor train").components.items() if k.startswith("actor ")
                and "activations" not in k and "logits" not in k) + phase(resident, "actor train").components["reference params"]
    assert phase(resident, "rollout").total - phase(offloaded, "rollout").total == pytest.approx(state)
    separate = plan_layout(config, replace(layout, placement="separate", rollout_gpus=4),
                           TrainingSpec(global_batch_size=64), 80)
    assert [p.phase for p in separate.phases][0] == "rollout (rollout GPUs)"
    assert "rollout" not in [p.phase for p in separate.phases]


def test_critic_adds_a_training_phase():
    report = plan_layout(load("llama3_1_8b"), LayoutSpec(world_size=8), TrainingSpec(global_batch_size=64,
                         use_critic=True), 141)
    assert "critic train" in [p.phase for p in report.phases]
    actor, critic = phase(report, "actor train").components, phase(report, "critic train").components
    # pp=1: the critic drops the 128256 x 4096 output head and gains a 4096 -> 1 value head.
    assert actor["actor params (bf16)"] - critic["critic params (bf16)"] == 2 * (128256 * 4096 - 4096)


def test_rollout_weights_larger_than_gpu_are_rejected():
    layout = LayoutSpec(world_size=8, parallel=ParallelLayout(tensor_parallel=8), rollout_tp=1)
    report = plan_layout(load("llama3_1_70b"), layout,
                         TrainingSpec(global_batch_size=64), 80)
    assert any("rollout engine" in e and "raise rollout_tp" in e for e in report.errors)


def test_full_recompute_keeps_group_inputs_or_the_blocks_left_whole():
    from megarl.plan.memory import _full_recompute_bytes

    layers, layer_input, units = [10.0, 20.0, 30.0, 40.0], 1.0, 2
    full = LayoutSpec(world_size=1, recompute="full")
    # uniform groups of n: each group's input in flight, one group rebuilt at a time
    assert _full_recompute_bytes(full, layers, layer_input, units) == 2 * 4 * 1 + 40
    assert _full_recompute_bytes(replace(full, recompute_num_layers=2), layers, layer_input, units) == 2 * 2 + 70
    # block: the first n layers of each virtual chunk recomputed, the others kept whole
    block = replace(full, recompute_method="block")
    assert _full_recompute_bytes(replace(block, recompute_num_layers=1), layers, layer_input, units) == 2 * 91 + 10
    assert _full_recompute_bytes(replace(block, recompute_num_layers=4), layers, layer_input, units) == 2 * 4 + 40
    vpp2 = replace(block, recompute_num_layers=1, parallel=ParallelLayout(virtual_pipeline_parallel=2))
    assert _full_recompute_bytes(vpp2, layers, layer_input, units) == 2 * (2 + 20 + 40) + 30


def test_block_recompute_over_every_layer_plans_like_full_recompute():
    config, train = load("llama3_1_8b"), TrainingSpec(global_batch_size=64, max_seq_len=2048)
    full = LayoutSpec(world_size=1, recompute="full")
    every = plan_layout(config, replace(full, recompute_method="block", recompute_num_layers=32), train, 80)
    half = plan_layout(config, replace(full, recompute_method="block", recompute_num_layers=16), train, 80)
    none = plan_layout(config, replace(full, recompute="none"), train, 80)
    train_of = lambda report: phase(report, "actor train").components["actor activations"]  # noqa: E731
    assert train_of(every) == pytest.approx(train_of(plan_layout(config, full, train, 80)))
    assert train_of(every) < train_of(half) < train_of(none)
