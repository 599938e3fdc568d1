"""Block-wise FP8 dequantisation against a straightforward per-block reference, and an FP8 DeepSeek-V3
checkpoint converted end to end (with an MTP layer that must be skipped)."""

import json
import logging
import os

import pytest
import torch

from megarl.checkpoint_io.fp8 import dequantize_fp8_blockwise, fp8_block_size
from megarl.checkpoint_io.hf_index import index_hf_safetensors
from megarl.checkpoint_io.safetensors_stream import PlannedTensor, StreamingSafetensorsWriter, read_tensor


def reference_dequant(weight, scale_inv, block, dtype):
    out = torch.empty(weight.shape, dtype=torch.float32)
    br, bc = block
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows, cols = slice(i * br, (i + 1) * br), slice(j * bc, (j + 1) * bc)
            out[rows, cols] = weight[rows, cols].float() * float(scale_inv[i, j])
    return out.to(dtype)


def quantize_blockwise(weight, block):
    """Per-block absmax scaling into float8_e4m3fn (what DeepSeek's release does)."""
    br, bc = block
    rows, cols = weight.shape
    scale = torch.empty(-(-rows // br), -(-cols // bc))
    q = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = weight[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            scale[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


@pytest.mark.parametrize("shape", [(300, 200), (128, 257), (1, 1), (129, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequant_matches_per_block_reference_on_partial_blocks(shape, dtype):
    generator = torch.Generator().manual_seed(sum(shape))
    weight = (torch.randn(shape, generator=generator) * 100).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(-(-shape[0] // 128), -(-shape[1] // 128), generator=generator) + 0.01
    got = dequantize_fp8_blockwise(weight, scale_inv, dtype=dtype)
    expected = reference_dequant(weight, scale_inv, (128, 128), dtype)
    assert got.dtype == dtype
    assert torch.equal(got, expected)
    # the scales really differ per block: block (0, 1) is scaled by scale_inv[0, 1], not scale_inv[0, 0]
    if shape[1] > 128:
        tile = weight[:128, 128:256].float()
        assert torch.equal(got[:128, 128:256], (tile * scale_inv[0, 1]).to(dtype))


def test_dequant_rejects_wrong_scale_shape_and_non_fp8():
    weight = torch.zeros(300, 200).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"w_scale_inv has shape \(2, 2\), expected \(3, 2\)"):
        dequantize_fp8_blockwise(weight, torch.ones(2, 2), dtype=torch.bfloat16, name="w")
    with pytest.raises(ValueError, match="expected an fp8 weight"):
        dequantize_fp8_blockwise(torch.zeros(4, 4), torch.ones(1, 1), dtype=torch.bfloat16)
    assert fp8_block_size({"quant_method": "fp8", "weight_block_size": [64, 32]}) == (64, 32)
    with pytest.raises(ValueError, match="quant_method='gptq'"):
        fp8_block_size({"quant_method": "gptq"})


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
