"""Block-wise FP8 (the DeepSeek-V3 checkpoint format): dequantisation, and quantisation back into it.

DeepSeek-V3 stores most linear weights as ``weight`` (float8_e4m3fn, [out, in]) plus
``weight_scale_inv`` (float32, [ceil(out/128), ceil(in/128)]): the real weight of block (i, j) is
``float(weight[block]) * weight_scale_inv[i, j]``. Edge blocks are partial when out/in are not
multiples of the block size. We compute in float32 (the product is exact to fp32 rounding, which is
what the reference inference code does) and round once to the requested dtype, one band of block rows
at a time so that the float32 temporary is a band, not the whole matrix.

Quantisation (:func:`quantize_fp8_blockwise`, what a bf16 weight sync into an engine serving such a checkpoint
needs) takes each block's scale from its largest magnitude: ``weight_scale_inv = amax / 448`` (the largest
float8_e4m3fn), so no element saturates and each is rounded once, to e4m3's 3 mantissa bits.

Left out: other quantisation schemes (per-tensor FP8, MXFP4, GPTQ ...): they raise upstream.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_SUFFIX = "_scale_inv"


def fp8_block_size(quantization_config: dict | None) -> tuple[int, int]:
    """(rows, cols) of one scale block from an HF ``quantization_config`` (default 128x128)."""
    if not quantization_config:
        return (128, 128)
    method = quantization_config.get("quant_method", "fp8")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method={method!r} is not supported (only block-wise 'fp8')")
    block = quantization_config.get("weight_block_size") or [128, 128]
    if len(block) != 2:
        raise ValueError(f"quantization_config.weight_block_size must have two entries, got {block!r}")
    return int(block[0]), int(block[1])


def dequantize_fp8_blockwise(weight: torch.Tensor, scale_inv: torch.Tensor, *, dtype: torch.dtype,
                             block: tuple[int, int] = (128, 128), name: str = "weight") -> torch.Tensor:
    if weight.dtype not in FP8_DTYPES:
        raise ValueError(f"{name}: expected an fp8 weight, got {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"{name}: block-wise fp8 needs a 2-D weight, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    br, bc = block
    expected = (-(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"{name}{SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}, expected {expected} for a "
                         f"{rows}x{cols} weight in {br}x{bc} blocks")
    scale = scale_inv.to(torch.float32)
    out = torch.empty((rows, cols), dtype=dtype)
    for i in range(expected[0]):
        r0, r1 = i * br, min(rows, (i + 1) * br)
        # One band of block rows: expand its scales along columns, trimmed to the real width.
        band_scale = scale[i].repeat_interleave(bc)[:cols]
        out[r0:r1] = (weight[r0:r1].to(torch.float32) * band_scale).to(dtype)
    return out


def quantize_fp8_blockwise(weight: torch.Tensor, *, block: tuple[int, int] = (128, 128),
                           name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] -> (float8_e4m3fn weight, float32 ``weight_scale_inv`` [ceil(out/br), ceil(in/bc)]),
    the inverse of :func:`dequantize_fp8_blockwise` up to e4m3's rounding. On ``weight``'s device, one band of
    block rows at a time in float32; an all-zero block gets scale 1."""
    if weight.dim() != 2:
        raise ValueError(f"{name}: block-wise fp8 needs a 2-D weight, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    br, bc = block
    block_rows, block_cols = -(-rows // br), -(-cols // bc)
    quantized = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=weight.device)
    scale_inv = torch.empty((block_rows, block_cols), dtype=torch.float32, device=weight.device)
    padded_cols = block_cols * bc
    for i in range(block_rows):
        r0, r1 = i * br, min(rows, (i + 1) * br)
        band = torch.zeros((br, padded_cols), dtype=torch.float32, device=weight.device)
        band[: r1 - r0, :cols] = weight[r0:r1].to(torch.float32)
        amax = band.view(br, block_cols, bc).abs().amax(dim=(0, 2))
        scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        scale_inv[i] = scales
        scaled = band.view(br, block_cols, bc) / scales[None, :, None]
        quantized[r0:r1] = scaled.view(br, padded_cols)[: r1 - r0, :cols].to(torch.float8_e4m3fn)
    return quantized, scale_inv
