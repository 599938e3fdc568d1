"""An FP8 DeepSeek-V3 checkpoint (block-wise scales, an MTP layer that must be skipped) converted end to end to
megatron's torch_dist format like its dequantised twin, and an unmapped tensor refused by name: whole checkpoints
through the real converter (the dequantisation itself: tests/unit/converters/test_fp8.py)."""

import json
import logging
import os

import pytest
import torch

from megarl.checkpoint_io.hf_index import index_hf_safetensors
from megarl.checkpoint_io.safetensors_stream import PlannedTensor, StreamingSafetensorsWriter, read_tensor
from tests.unit.converters.test_fp8 import quantize_blockwise, reference_dequant


def _rewrite(hf_dir, out_dir, transform, config_update):
    """Copy an HF checkpoint into one file, passing every tensor through ``transform(name, t) -> [(n, t)]``."""
    os.makedirs(out_dir)
    tensors = []
    for name, location in sorted(index_hf_safetensors(hf_dir).items()):
        tensors += transform(name, read_tensor(location))
    writer = StreamingSafetensorsWriter(os.path.join(out_dir, "model.safetensors"),
                                        [PlannedTensor(n, t.dtype, tuple(t.shape)) for n, t in tensors],
                                        metadata={"format": "pt"})
    for name, tensor in tensors:
        writer.add(name, tensor)
    writer.close()
    with open(os.path.join(hf_dir, "config.json")) as handle:
        config = json.load(handle)
    config.update(config_update)
    with open(os.path.join(out_dir, "config.json"), "w") as handle:
        json.dump(config, handle)


@pytest.mark.timeout(120)
def test_fp8_deepseek_checkpoint_converts_like_its_dequantised_twin(tmp_path, caplog):
    from megarl.checkpoint_io.hf_to_mcore import CONVERSION_FILE, convert_hf_to_mcore
    from megarl.checkpoint_io.torch_dist_reader import TorchDistReader
    from megarl.models.tiny import save_tiny_hf_checkpoint

    block = (40, 24)  # partial edge blocks on the tiny 64/96/32-wide matrices
    source = save_tiny_hf_checkpoint("deepseek_v3", tmp_path / "bf16", seed=5)
    quantizable = lambda name, t: t.dim() == 2 and "layers." in name and "gate.weight" not in name  # noqa: E731

    def to_fp8(name, tensor):
        if not quantizable(name, tensor):
            return [(name, tensor)]
        q, scale = quantize_blockwise(tensor, block)
        return [(name, q), (name + "_scale_inv", scale)]

    def to_reference(name, tensor):
        if not quantizable(name, tensor):
            return [(name, tensor)]
        q, scale = quantize_blockwise(tensor, block)
        return [(name, reference_dequant(q, scale, block, torch.bfloat16))]

    mtp_layer = 3  # tiny DeepSeek has 3 layers; one MTP layer follows them in the release format
    def with_mtp(transform):
        def wrapped(name, tensor):
            out = transform(name, tensor)
            if name == "model.norm.weight":
                out.append((f"model.layers.{mtp_layer}.enorm.weight", tensor.clone()))
                out.append((f"model.layers.{mtp_layer}.eh_proj.weight", torch.zeros(64, 128)))
            return out
        return wrapped

    quant_config = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                            "weight_block_size": list(block)}, "num_nextn_predict_layers": 1}
    _rewrite(source, tmp_path / "fp8", with_mtp(to_fp8), quant_config)
    _rewrite(source, tmp_path / "ref", with_mtp(to_reference), {"num_nextn_predict_layers": 1})
    with caplog.at_level(logging.INFO):
        convert_hf_to_mcore(tmp_path / "fp8", tmp_path / "td_fp8")
    assert "skipped 2 multi-token-prediction tensor(s)" in caplog.text
    convert_hf_to_mcore(tmp_path / "ref", tmp_path / "td_ref")
    assert json.loads((tmp_path / "td_fp8" / CONVERSION_FILE).read_text())["dequantized_fp8"] is True
    got, want = TorchDistReader(str(tmp_path / "td_fp8")), TorchDistReader(str(tmp_path / "td_ref"))
    assert got.tensors.keys() == want.tensors.keys()
    checked = 0
    for key in want.tensors:
        shape = want.shape(key)
        expected = want.read(key, (0,) * len(shape), shape)
        actual = got.read(key, (0,) * len(shape), shape)
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), key
        checked += expected.dtype == torch.bfloat16
    assert checked > 10  # the dequantised weights really were compared


def test_unmapped_hf_tensor_is_refused_by_name(tmp_path):
    from megarl.checkpoint_io.hf_to_mcore import convert_hf_to_mcore
    from megarl.models.tiny import save_tiny_hf_checkpoint

    source = save_tiny_hf_checkpoint("llama", tmp_path / "hf", seed=1)
    _rewrite(source, tmp_path / "extra", lambda n, t: [(n, t)] + ([("model.rotary.inv_freq", t[:2])]
                                                                  if n == "model.norm.weight" else []), {})
    with pytest.raises(ValueError, match="model.rotary.inv_freq"):
        convert_hf_to_mcore(tmp_path / "extra", tmp_path / "out")
    assert not os.path.exists(tmp_path / "out" / "latest_checkpointed_iteration.txt")
