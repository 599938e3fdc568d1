"""The checks every production rollout engine makes of a weight sync before its tensors reach the model
(megarl/engines/rollout/weight_session.py): names and shapes against the checkpoint, a tied head's alias, nothing
twice, the whole model before the session closes."""

from __future__ import annotations

import pytest
import torch

from megarl.engines.rollout.weight_session import WeightUpdateSession

SHAPES = {"model.embed_tokens.weight": (8, 4), "model.norm.weight": (4,), "model.layers.0.mlp.up_proj.weight": (6, 4)}


def tensors(*names):
    return [(name, torch.zeros(SHAPES.get(name, SHAPES["model.embed_tokens.weight"]))) for name in names]


def test_a_whole_model_in_buckets_closes_the_session():
    session = WeightUpdateSession("Engine", SHAPES, tied=False)
    for bucket in (tensors("model.embed_tokens.weight"), tensors("model.norm.weight", "model.layers.0.mlp.up_proj.weight")):
        session.loaded(session.admit(bucket))
    session.check_complete()
    session.close()
    assert not session.open and not session.names


def test_what_the_checkpoint_does_not_have_is_refused_by_name():
    session = WeightUpdateSession("Engine", SHAPES, tied=False)
    with pytest.raises(KeyError, match="Engine.update_weights: unknown parameter name 'model.bogus'"):
        session.admit([("model.bogus", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"shape mismatch for 'model.norm.weight': got \(5,\), checkpoint has \(4,\)"):
        session.admit([("model.norm.weight", torch.zeros(5))])
    assert not session.open  # a refused bucket opens nothing


def test_nothing_twice_in_one_session_and_nothing_missing_at_its_end():
    session = WeightUpdateSession("Engine", SHAPES, tied=False)
    with pytest.raises(ValueError, match="'model.norm.weight' sent twice"):
        session.admit(tensors("model.norm.weight", "model.norm.weight"))
    session.loaded(session.admit(tensors("model.norm.weight")))
    with pytest.raises(ValueError, match="sent twice"):
        session.admit(tensors("model.norm.weight"))
    with pytest.raises(RuntimeError, match=r"lacks 2 checkpoint tensors"):
        session.check_complete()
    with pytest.raises(RuntimeError, match="without a preceding update_weights"):
        WeightUpdateSession("Engine", SHAPES, tied=False).check_complete()


@pytest.mark.parametrize("order", [("lm_head.weight", "model.embed_tokens.weight"),
                                   ("model.embed_tokens.weight", "lm_head.weight")])
def test_a_tied_head_is_the_embeddings_alias_whichever_comes_first(order):
    session = WeightUpdateSession("Engine", SHAPES, tied=True)
    first = session.admit(tensors(order[0]))
    assert [name for name, _ in first] == ["model.embed_tokens.weight"]
    session.loaded(first)
    assert session.admit(tensors(order[1])) == []  # the second copy is dropped, not refused
    session.loaded(session.admit(tensors("model.norm.weight", "model.layers.0.mlp.up_proj.weight")))
    session.check_complete()
    untied = WeightUpdateSession("Engine", SHAPES, tied=False)
    with pytest.raises(KeyError, match="lm_head.weight"):
        untied.admit(tensors("lm_head.weight"))


def test_a_block_wise_fp8_checkpoint_gets_the_bf16_weights_quantized_with_their_scales():
    """An engine serving a DeepSeek-V3-style FP8 checkpoint: the trainer's bf16 weight arrives as the checkpoint
    holds it (float8_e4m3fn + weight_scale_inv); a weight the checkpoint keeps in bf16, and one sent already in
    FP8 with its scale, go through as they are."""
    from megarl.checkpoint_io.fp8 import dequantize_fp8_blockwise, quantize_fp8_blockwise
    from megarl.engines.rollout.weight_session import fp8_checkpoint_block

    up = "model.layers.0.mlp.up_proj.weight"
    down = "model.layers.0.mlp.down_proj.weight"
    shapes = {"model.norm.weight": (4,), up: (6, 4), up + "_scale_inv": (3, 1), down: (4, 6), down + "_scale_inv": (2, 2)}
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [2, 4]}}
    assert fp8_checkpoint_block(config, shapes) == (2, 4)
    assert fp8_checkpoint_block({}, shapes) is None and fp8_checkpoint_block(config, SHAPES) is None
    with pytest.raises(NotImplementedError, match=r"per-tensor scales \(model.layers.0.mlp.up_proj.weight_scale"):
        fp8_checkpoint_block(config, {up: (6, 4), up + "_scale": ()})
    session = WeightUpdateSession("Engine", shapes, tied=False, fp8_block=(2, 4))
    torch.manual_seed(0)
    up_weight = torch.randn(6, 4).to(torch.bfloat16)
    down_fp8, down_scale = quantize_fp8_blockwise(torch.randn(4, 6), block=(2, 4))
    bucket = session.admit([("model.norm.weight", torch.ones(4, dtype=torch.bfloat16)), (up, up_weight),
                            (down, down_fp8), (down + "_scale_inv", down_scale)])
    session.loaded(bucket)
    session.check_complete()
    loaded = dict(bucket)
    assert [name for name, _ in bucket] == ["model.norm.weight", up, up + "_scale_inv", down, down + "_scale_inv"]
    assert loaded["model.norm.weight"].dtype == torch.bfloat16
    assert loaded[up].dtype == torch.float8_e4m3fn and loaded[up + "_scale_inv"].shape == (3, 1)
    back = dequantize_fp8_blockwise(loaded[up], loaded[up + "_scale_inv"], dtype=torch.float32, block=(2, 4))
    assert (back - up_weight.float()).abs().max() <= 2**-4 * up_weight.float().abs().max()
    assert loaded[down] is down_fp8 and loaded[down + "_scale_inv"] is down_scale


def test_random_weights_for_a_config_naming_an_fp8_checkpoint_are_refused(tmp_path):
    import json

    from megarl.engines.rollout.weight_session import read_checkpoint_shapes

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}))
    with pytest.raises(NotImplementedError, match="random weights .* FP8 checkpoint .*rollout.quantization=fp8"):
        read_checkpoint_shapes(str(tmp_path), weights_on_disk=False)
