"""Block-wise FP8 dequantisation and quantisation against a straightforward per-block reference. FP8 checkpoints
converted end to end: tests/distributed/converters/test_fp8_conversion.py."""

import pytest
import torch

from megarl.checkpoint_io.fp8 import dequantize_fp8_blockwise, fp8_block_size, quantize_fp8_blockwise


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


@pytest.mark.parametrize("shape,block", [((300, 200), (128, 128)), ((130, 70), (64, 32)), ((128, 256), (128, 128))])
def test_quantize_is_the_per_block_reference_bit_for_bit(shape, block):
    torch.manual_seed(0)
    weight = torch.randn(shape) * torch.logspace(-2, 1, shape[1])  # blocks of very different magnitudes
    quantized, scale_inv = quantize_fp8_blockwise(weight, block=block)
    want_q, want_scale = quantize_blockwise(weight, block)
    assert quantized.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32
    assert torch.equal(scale_inv, want_scale)
    assert torch.equal(quantized.view(torch.uint8), want_q.view(torch.uint8))


def test_quantize_round_trip_is_within_e4m3_rounding():
    """Each element is rounded once to e4m3 after scaling by its block's amax / 448: relative error at most 2**-4
    (half a unit in the last of 3 mantissa bits) for normal values, and at most half the smallest subnormal step
    (2**-10 of the scale) for elements below e4m3's normal range. An all-zero block stays exactly zero."""
    torch.manual_seed(1)
    weight = (torch.randn(300, 200, dtype=torch.float64) * torch.logspace(-4, 1, 200, dtype=torch.float64))
    weight[:128, :128] = 0
    quantized, scale_inv = quantize_fp8_blockwise(weight)
    back = dequantize_fp8_blockwise(quantized, scale_inv, dtype=torch.float64)
    scale = scale_inv.double().repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    assert ((back - weight).abs() <= 2**-4 * weight.abs() + 2**-10 * scale).all()
    assert scale_inv[0, 0] == 1 and not back[:128, :128].any()
