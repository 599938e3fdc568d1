"""Comparisons whose tolerance follows from the numerics, not from the machine that ran them.

Two fp32 computations of the same quantity that differ only in the order of their sums (another kernel,
another tensor-parallel split, another CPU vector width: AVX2 and AVX-512 block reductions differently)
differ by about sqrt(n) * 2**-24 of the summed terms' magnitude, so the bound is relative to the tensor's
own scale (its largest entry), not an absolute number that holds for one tensor size on one machine.
"""

from __future__ import annotations

import torch

# fp32 results of reordered sums over up to ~1e4 terms: ~sqrt(1e4) * 6e-8 = 6e-6 of the terms' scale, times
# ~10 for cancellation; 1e-4 of the largest entry is still ~1e3x below what a wrong mask, scale or shard gives.
FP32_REORDERED = 1e-4
# fp32 against an fp64 reference of the same formula (only fp32's own rounding on one side)
FP32_VS_FP64 = 1e-5


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, relative: float, what: str = "") -> None:
    """max |actual - expected| <= relative * max |expected| (compared in fp64)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = expected.double().abs().max()
    error = (actual.double() - expected.double()).abs().max()
    assert error <= relative * scale, f"{what}: max error {error:.3g} > {relative:g} x max |expected| {scale:.3g}"


def untimed(metrics: dict) -> dict:
    """``metrics`` without wall-time entries (``*_s``, e.g. ``optimizer_step_s``): what two runs of the same
    computation must agree on exactly."""
    return {key: value for key, value in metrics.items() if not key.endswith("_s")}


def aggregate_by_loops(per_token: dict, mask, mode: str, norm_length: int):
    """A reference of megarl.algorithms.aggregation by loops: ``per_token[(row, t)]`` over the mask's valid
    positions, reduced as the loss aggregation ``mode`` is defined (rows without a valid token not counted)."""
    rows = [[per_token[(i, t)] for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]
    rows = [r for r in rows if r]
    if mode == "token-mean":
        return sum(v for r in rows for v in r) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    return sum(sum(r) for r in rows) / (len(rows) * norm_length)
