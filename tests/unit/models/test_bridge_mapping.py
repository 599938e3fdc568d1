"""Pure name/shape/tensor mapping of the HF <-> megatron bridge (single process, no megatron runtime).

Checks: HF -> mcore -> HF is bit exact for every tensor of every tiny architecture (both specs), the
fused layouts against hand-built expectations (GQA qkv interleave, [gate; up], vocab padding), TP
shard/merge round trips, the TE name table against the module tree megatron's TE spec builds, PP/EP name
translation, and the clear errors for bad configs and checkpoints.
"""

import json
import os

import pytest
import torch

from megarl.models.bridge import ModelBridge
from megarl.models.hf_checkpoint import HFCheckpointReader, check_checkpoint_names
from megarl.models.parallel_layout import ParallelLayout
from megarl.models.tiny import TINY_ARCHS, save_tiny_hf_checkpoint, tiny_hf_config, tiny_hf_config_dict
from megarl.models.weight_mapping import QKVShape, fuse_qkv, split_qkv


@pytest.fixture(scope="module")
def hf_state_dicts(tmp_path_factory):
    """The tensors as saved on disk (per-expert names; transformers 5 fuses experts only in memory)."""
    root = tmp_path_factory.mktemp("tiny_ckpts")
    states = {}
    for arch in TINY_ARCHS:
        reader = HFCheckpointReader(save_tiny_hf_checkpoint(arch, root / arch, seed=1))
        states[arch] = {name: reader.get(name) for name in reader.names()}
    return states


@pytest.mark.parametrize("spec,expert_layout", [("local", "sequential"), ("te", "grouped"), ("te", "sequential")])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_hf_to_mcore_to_hf_is_bit_exact_for_every_tensor(arch, spec, expert_layout, hf_state_dicts):
    state = hf_state_dicts[arch]
    bridge = ModelBridge.from_hf_config(tiny_hf_config(arch), spec=spec, expert_layout=expert_layout)
    needed = set(bridge.iter_hf_names())
    expected = set(state) - ({"lm_head.weight"} if bridge.tied_embeddings else set())
    assert needed == expected, f"bridge needs {sorted(needed ^ expected)} differently from the HF model"
    back = {}
    for name in bridge.iter_global_mcore_names():
        full = bridge.hf_to_mcore(name, {n: state[n] for n in bridge.hf_names_for(name)})
        for hf_name, tensor in bridge.mcore_to_hf(name, full):
            assert hf_name not in back, f"{hf_name} produced twice"
            back[hf_name] = tensor
    assert set(back) == expected
    for hf_name, tensor in back.items():
        assert torch.equal(tensor, state[hf_name]), hf_name


def test_gqa_qkv_fusion_interleaves_query_groups():
    shape = QKVShape(num_heads=4, num_query_groups=2, head_dim=2)
    # Row r of q belongs to head r // 2; label rows so the fused order can be read off.
    q = torch.arange(8.0).unsqueeze(1)
    k = 100 + torch.arange(4.0).unsqueeze(1)
    v = 200 + torch.arange(4.0).unsqueeze(1)
    fused = fuse_qkv(q, k, v, shape)
    expected = [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    assert fused.squeeze(1).tolist() == expected
    for a, b in zip(split_qkv(fused, shape), (q, k, v)):
        assert torch.equal(a, b)
    bias = fuse_qkv(q.squeeze(1), k.squeeze(1), v.squeeze(1), shape)
    assert bias.tolist() == expected


def test_gate_up_fusion_and_vocab_padding():
    bridge = ModelBridge.from_hf_config(tiny_hf_config("llama"), spec="local")
    gate, up = torch.randn(96, 64), torch.randn(96, 64)
    fc1 = bridge.hf_to_mcore("decoder.layers.0.mlp.linear_fc1.weight",
                             {"model.layers.0.mlp.gate_proj.weight": gate, "model.layers.0.mlp.up_proj.weight": up})
    assert torch.equal(fc1, torch.cat([gate, up]))
    embed = torch.randn(250, 64)
    padded = bridge.hf_to_mcore("embedding.word_embeddings.weight", {"model.embed_tokens.weight": embed})
    assert padded.shape == (256, 64) and torch.equal(padded[:250], embed) and not padded[250:].any()
    assert bridge.padded_vocab_size(1) == 256 and bridge.padded_vocab_size(4) == 512
    (name, unpadded), = bridge.mcore_to_hf("embedding.word_embeddings.weight", padded)
    assert name == "model.embed_tokens.weight" and torch.equal(unpadded, embed)


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_shard_merge_round_trip_and_layout(arch, tp_size, hf_state_dicts):
    state = hf_state_dicts[arch]
    # Divisor 100: TP=1 pads 250 -> 300, TP=2 -> 400, TP=4 -> 400, so shard_tp must re-pad.
    bridge = ModelBridge.from_hf_config(tiny_hf_config(arch), spec="local", make_vocab_size_divisible_by=100)
    for name in bridge.iter_global_mcore_names():
        full = bridge.hf_to_mcore(name, {n: state[n] for n in bridge.hf_names_for(name)})
        dim = bridge.tp_partition_dim(name)
        try:
            shards = [bridge.shard_tp(name, full, r, tp_size) for r in range(tp_size)]
        except ValueError as error:  # tiny dims that do not split over 4 ranks must say so
            assert tp_size == 4 and "does not split" in str(error), error
            continue
        if dim is None:
            assert all(s is full for s in shards), f"{name} must be replicated"
        elif bridge.rule(name).tp_kind != "vocab":
            assert sum(s.shape[dim] for s in shards) == full.shape[dim], name
        assert torch.equal(bridge.merge_tp(name, shards), full), name
        if bridge.rule(name).tp_kind == "gate_up":
            gate, up = torch.chunk(full, 2)
            rows = gate.shape[0] // tp_size
            assert torch.equal(shards[1], torch.cat([gate[rows:2 * rows], up[rows:2 * rows]])), name
        if "word_embeddings" in name or name == "output_layer.weight":
            assert sum(s.shape[0] for s in shards) == bridge.padded_vocab_size(tp_size)


def test_partition_dims_follow_megatron_parallel_linears():
    llama = ModelBridge.from_hf_config(tiny_hf_config("llama"), spec="local")
    assert llama.tp_partition_dim("decoder.layers.1.self_attention.linear_qkv.weight") == 0
    assert llama.tp_partition_dim("decoder.layers.1.self_attention.linear_proj.weight") == 1
    assert llama.tp_partition_dim("decoder.layers.1.mlp.linear_fc2.weight") == 1
    assert llama.tp_partition_dim("decoder.layers.1.input_layernorm.weight") is None
    assert llama.tp_partition_dim("output_layer.weight") == 0
    ds_local = ModelBridge.from_hf_config(tiny_hf_config("deepseek_v3"), spec="local")
    ds_te = ModelBridge.from_hf_config(tiny_hf_config("deepseek_v3"), spec="te")
    down = "decoder.layers.0.self_attention.linear_kv_down_proj.weight"
    assert ds_local.tp_partition_dim(down) == 0  # ColumnParallelLinear in the local MLA spec
    assert ds_te.tp_partition_dim(down) is None  # duplicated TELinear in the TE MLA spec
    assert ds_local.tp_partition_dim("decoder.layers.1.mlp.router.weight") is None
    assert ds_local.is_expert_param("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight")
    assert not ds_local.is_expert_param("decoder.layers.1.mlp.shared_experts.linear_fc1.weight")


# The module tree get_gpt_layer_with_transformer_engine_spec (megatron/core/models/gpt/gpt_layer_specs.py)
# builds, written out independently of the bridge: TELayerNormColumnParallelLinear owns `weight` and
# `layer_norm_weight`; TENorm / TEColumnParallelLinear / TERowParallelLinear / TELinear own `weight`;
# TEGroupedMLP owns linear_fc1.weight<e> / linear_fc2.weight<e>; IdentityOp owns nothing.
_TE_PARAMS = {"TELayerNormColumnParallelLinear": ("weight", "layer_norm_weight"), "TENorm": ("weight",),
              "TEColumnParallelLinear": ("weight",), "TERowParallelLinear": ("weight",), "TELinear": ("weight",)}


def _te_layer_tree(*, moe: bool, mla: bool, qk_norm: bool, qkv_bias: bool, shared: bool, expert_bias: bool,
                   num_experts: int):
    tree = []
    if mla:
        tree += [("input_layernorm", "TENorm"), ("self_attention.linear_q_down_proj", "TELinear"),
                 ("self_attention.linear_q_up_proj", "TELayerNormColumnParallelLinear"),
                 ("self_attention.linear_kv_down_proj", "TELinear"),
                 ("self_attention.linear_kv_up_proj", "TELayerNormColumnParallelLinear"),
                 ("self_attention.linear_proj", "TERowParallelLinear")]
    else:
        tree += [("self_attention.linear_qkv", "TELayerNormColumnParallelLinear"),
                 ("self_attention.linear_proj", "TERowParallelLinear")]
        if qk_norm:
            tree += [("self_attention.q_layernorm", "TENorm"), ("self_attention.k_layernorm", "TENorm")]
    if not moe:
        tree += [("mlp.linear_fc1", "TELayerNormColumnParallelLinear"), ("mlp.linear_fc2", "TERowParallelLinear")]
    else:
        tree += [("pre_mlp_layernorm", "TENorm")]
        if shared:
            tree += [("mlp.shared_experts.linear_fc1", "TEColumnParallelLinear"),
                     ("mlp.shared_experts.linear_fc2", "TERowParallelLinear")]
    names = {f"{path}.{p}" for path, cls in tree for p in _TE_PARAMS[cls]}
    if qkv_bias:
        names.add("self_attention.linear_qkv.bias")
    if moe:
        names.add("mlp.router.weight")
        if expert_bias:
            names.add("mlp.router.expert_bias")
        names |= {f"mlp.experts.linear_fc{i}.weight{e}" for i in (1, 2) for e in range(num_experts)}
    return names


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_te_spec_names_match_the_te_module_tree(arch):
    bridge = ModelBridge.from_hf_config(tiny_hf_config(arch), spec="te")
    assert bridge.expert_layout == "grouped"
    d = bridge.dims
    expected = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight"}
    if not d.tie_word_embeddings:
        expected.add("output_layer.weight")
    for layer in range(d.num_layers):
        expected |= {f"decoder.layers.{layer}.{n}" for n in _te_layer_tree(
            moe=d.is_moe_layer(layer), mla=d.mla is not None, qk_norm=d.qk_norm, qkv_bias=d.qkv_bias,
            shared=bool(d.moe and d.moe.shared_expert_intermediate_size),
            expert_bias=bool(d.moe and d.moe.has_expert_bias), num_experts=d.num_experts)}
    assert set(bridge.iter_global_mcore_names()) == expected


def test_local_and_te_names_differ_only_where_te_fuses_norms():
    local = ModelBridge.from_hf_config(tiny_hf_config("qwen3"), spec="local")
    te = ModelBridge.from_hf_config(tiny_hf_config("qwen3"), spec="te")
    local_by_hf = {tuple(local.hf_names_for(n)): n for n in local.iter_global_mcore_names()}
    te_by_hf = {tuple(te.hf_names_for(n)): n for n in te.iter_global_mcore_names()}
    assert local_by_hf.keys() == te_by_hf.keys()
    renamed = {local_by_hf[k]: te_by_hf[k] for k in local_by_hf if local_by_hf[k] != te_by_hf[k]}
    assert renamed == {
        f"decoder.layers.{i}.{a}": f"decoder.layers.{i}.{b}" for i in range(2) for a, b in (
            ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
            ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"))}


def test_pp_and_ep_name_translation():
    bridge = ModelBridge.from_hf_config(tiny_hf_config("qwen3_moe"), spec="local")
    g = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    kwargs = dict(layer_offset=1, num_layers_this_stage=1, num_local_experts=2)
    assert bridge.global_to_local_name(g, ep_rank=1, **kwargs) == "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    assert bridge.global_to_local_name(g, ep_rank=0, **kwargs) is None  # expert 3 lives on EP rank 1
    assert bridge.global_to_local_name("decoder.layers.0.mlp.router.weight", ep_rank=1, **kwargs) is None  # stage 0
    assert bridge.global_to_local_name("embedding.word_embeddings.weight", pre_process=False, **kwargs) is None
    assert bridge.global_to_local_name("output_layer.weight", post_process=True, **kwargs) == "output_layer.weight"
    assert bridge.local_to_global_name("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight",
                                       layer_offset=1, ep_rank=1, num_local_experts=2) == g
    grouped = ModelBridge.from_hf_config(tiny_hf_config("qwen3_moe"), spec="te")
    assert grouped.global_to_local_name("decoder.layers.1.mlp.experts.linear_fc2.weight3", ep_rank=1,
                                        **kwargs) == "decoder.layers.0.mlp.experts.linear_fc2.weight1"
    assert grouped.local_to_global_name("decoder.layers.0.mlp.experts.linear_fc2.weight1", layer_offset=1,
                                        ep_rank=1, num_local_experts=2) == "decoder.layers.1.mlp.experts.linear_fc2.weight3"
    for name in bridge.iter_global_mcore_names():  # round trip over every name and every EP rank that holds it
        for ep_rank in range(2):
            local = bridge.global_to_local_name(name, layer_offset=0, num_layers_this_stage=2, ep_rank=ep_rank,
                                                num_local_experts=2)
            if local is not None:
                assert bridge.local_to_global_name(local, layer_offset=0, ep_rank=ep_rank, num_local_experts=2) == name
    tied = ModelBridge.from_hf_config(tiny_hf_config("qwen2"), spec="local")
    assert "output_layer.weight" not in set(tied.iter_global_mcore_names())
    assert tied.local_to_global_name("output_layer.weight", layer_offset=1) == "embedding.word_embeddings.weight"
    with pytest.raises(KeyError, match="not a parameter"):
        bridge.local_to_global_name("decoder.layers.0.self_attention.bogus.weight", layer_offset=0)


def test_router_semantics_map_to_megatron_flags():
    moe = ModelBridge.from_hf_config(tiny_hf_config("qwen3_moe"), spec="local").architecture
    assert moe.transformer_config_kwargs(tiny_hf_config("qwen3_moe"))["moe_router_pre_softmax"] is False
    assert moe.transformer_config_kwargs(tiny_hf_config("qwen3_moe", norm_topk_prob=False))["moe_router_pre_softmax"]
    ds_cfg = tiny_hf_config("deepseek_v3")
    ds = ModelBridge.from_hf_config(ds_cfg, spec="local")
    kwargs = ds.architecture.transformer_config_kwargs(ds_cfg)
    assert kwargs["moe_layer_freq"] == [0, 1, 1]
    assert kwargs["moe_router_score_function"] == "sigmoid" and kwargs["moe_router_enable_expert_bias"]
    assert (kwargs["moe_router_num_groups"], kwargs["moe_router_group_topk"]) == (2, 1)
    assert kwargs["moe_router_topk_scaling_factor"] == 2.5 and kwargs["moe_shared_expert_intermediate_size"] == 32
    assert kwargs["rope_type"] == "yarn" and kwargs["rotary_scaling_factor"] == 4.0
    llama = ModelBridge.from_hf_config(tiny_hf_config("llama"), spec="local")
    assert llama.architecture.gpt_model_kwargs(llama.hf_config)["rope_scaling_factor"] == 8.0


def test_bad_configs_raise_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match="unsupported HF architecture 'GPT2LMHeadModel'"):
        ModelBridge.from_hf_config({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    bad_rope = dict(rope_type="llama3", factor=8.0, low_freq_factor=2.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
    bridge = ModelBridge.from_hf_config(tiny_hf_config("llama", rope_scaling=bad_rope), spec="local")
    with pytest.raises(ValueError, match="low_freq_factor"):
        bridge.architecture.gpt_model_kwargs(bridge.hf_config)
    ds = ModelBridge.from_hf_config(tiny_hf_config("deepseek_v3", num_experts_per_tok=4), spec="local")
    with pytest.raises(ValueError, match="topk_group"):
        ds.architecture.transformer_config_kwargs(ds.hf_config)
    with pytest.raises(ValueError, match="spec must be one of"):
        ModelBridge.from_hf_config(tiny_hf_config("qwen3"), spec="fast")
    with pytest.raises(ValueError, match="legacy GroupedMLP"):
        ModelBridge.from_hf_config(tiny_hf_config("qwen3_moe"), spec="local", expert_layout="grouped")
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config_dict("qwen3")))
    assert ModelBridge.from_hf_config(str(tmp_path), spec="local").hf_architecture == "Qwen3ForCausalLM"
    with pytest.raises(FileNotFoundError, match="no HF config"):
        ModelBridge.from_hf_config(str(tmp_path / "missing"))


def test_checkpoint_check_names_missing_and_unexpected_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt = save_tiny_hf_checkpoint("qwen3", tmp_path / "ok", seed=0)
    files = [f for f in os.listdir(ckpt) if f.endswith(".safetensors")]
    assert len(files) > 1 and os.path.isfile(os.path.join(ckpt, "model.safetensors.index.json"))
    bridge = ModelBridge.from_hf_config(ckpt, spec="local")
    reader = HFCheckpointReader(ckpt)
    check_checkpoint_names(bridge, reader)
    assert reader.get("model.norm.weight").shape == (64,)
    # Drop one tensor and add a stranger to the same shard.
    index = json.load(open(os.path.join(ckpt, "model.safetensors.index.json")))
    victim = "model.layers.1.self_attn.k_norm.weight"
    shard = index["weight_map"].pop(victim)
    tensors = load_file(os.path.join(ckpt, shard))
    tensors.pop(victim)
    tensors["model.layers.1.self_attn.rogue.weight"] = torch.zeros(2)
    index["weight_map"]["model.layers.1.self_attn.rogue.weight"] = shard
    save_file(tensors, os.path.join(ckpt, shard))
    json.dump(index, open(os.path.join(ckpt, "model.safetensors.index.json"), "w"))
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\).*k_norm.*unexpected 1 tensor\(s\).*rogue"):
        check_checkpoint_names(bridge, HFCheckpointReader(ckpt))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        HFCheckpointReader(tmp_path / "empty")


def test_deepseek_mtp_layers_are_skipped(caplog):
    with caplog.at_level("INFO"):
        bridge = ModelBridge.from_hf_config(tiny_hf_config("deepseek_v3", num_nextn_predict_layers=1), spec="local")
    assert "multi-token-prediction" in caplog.text
    assert bridge.is_skipped_hf_name("model.layers.3.eh_proj.weight")
    assert bridge.mcore_name_for_hf("model.layers.3.mlp.experts.0.up_proj.weight") is None
    assert not bridge.is_skipped_hf_name("model.layers.2.mlp.gate.weight")
    assert not any(n.startswith("decoder.layers.3.") for n in bridge.iter_global_mcore_names())


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_fused_kernels_follow_cuda_and_every_architecture_accepts_them(arch):
    """What a GPU worker builds (megatron's fused SwiGLU + bias-dropout-add) must pass megatron's own config
    checks for every architecture; on this GPU-less machine the default leaves them off."""
    bridge = ModelBridge.from_hf_config(tiny_hf_config(arch), spec="local")
    fused = bridge.transformer_config(layout=ParallelLayout(), fused_kernels=True)
    assert fused.bias_activation_fusion and fused.bias_dropout_fusion
    default = bridge.transformer_config(layout=ParallelLayout())
    assert default.bias_activation_fusion is torch.cuda.is_available()
    assert not default.apply_rope_fusion and not default.masked_softmax_fusion  # need TE/apex


def test_the_run_configs_layout_reaches_megatrons_config_uneven_pipeline_included():
    """One layout from the run config: the engines' process groups, the bridge's TransformerConfig and the planner
    read the same ParallelLayout (DeepSeek-V3's uneven split: the dense layer alone on the first stage)."""
    from megarl.config.schema import MegatronConfig

    megatron = MegatronConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                              expert_model_parallel_size=2, expert_tensor_parallel_size=1,
                              num_layers_in_first_pipeline_stage=1)
    layout = ParallelLayout.from_megatron_config(megatron)
    assert (layout.tensor_parallel, layout.pipeline_parallel, layout.expert_parallel) == (2, 2, 2)
    assert layout.effective_expert_tensor_parallel == 1 and layout.first_stage_layers == 1
    assert layout.last_stage_layers is None and ParallelLayout(tensor_parallel=4).effective_expert_tensor_parallel == 4
    config = ModelBridge.from_hf_config(tiny_hf_config("deepseek_v3"), spec="local").transformer_config(layout=layout)
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size) == (2, 2)
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (2, 1)
    assert config.num_layers_in_first_pipeline_stage == 1 and config.num_layers_in_last_pipeline_stage is None


def test_an_architecture_refuses_a_config_of_another_model_type():
    data = tiny_hf_config_dict("llama")
    data["model_type"] = "qwen2"
    with pytest.raises(ValueError, match="LlamaForCausalLM config has model_type 'qwen2', expected 'llama'"):
        ModelBridge.from_hf_config(data, spec="local")
