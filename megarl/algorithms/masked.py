"""Masked reductions over right-padded `[B, T]` tensors: sum, mean, variance, whitening.

Every function only reads positions where `mask` is 1, so the values stored in padding never matter.
Variance is unbiased (Bessel, divide by n - 1) by default, matching `torch.var`; pass `unbiased=False` for the
population variance. Leaves out: distributed (all-reduced) statistics; whitening here uses the local batch.
"""

from __future__ import annotations

import torch


def _check_same_shape(values: torch.Tensor, mask: torch.Tensor) -> None:
    if values.shape != mask.shape:
        raise ValueError(f"values shape {tuple(values.shape)} != mask shape {tuple(mask.shape)}")


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is 1. `torch.where` (not a product) keeps NaN/inf in padding out."""
    _check_same_shape(values, mask)
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over valid positions. With `dim=None` an all-zero mask is an error (there is nothing to average);
    with a `dim`, rows without valid positions give 0 rather than NaN."""
    total = masked_sum(values, mask, dim)
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim=dim)
    if dim is None:
        if count.item() == 0:
            raise ValueError("masked_mean: mask has no valid positions")
        return total / count
    return total / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all valid positions (a scalar). A single valid position has zero (unbiased: undefined)
    spread; we return 0 for it so whitening a one-token batch centres it instead of producing NaN."""
    mean = masked_mean(values, mask)
    count = mask.to(values.dtype).sum()
    sq_dev = masked_sum((values - mean) ** 2, mask)
    if unbiased:
        if count.item() < 2:
            return torch.zeros((), dtype=values.dtype, device=values.device)
        return sq_dev / (count - 1)
    return sq_dev / count


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, unbiased: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """(values - mean) / sqrt(var + eps) over valid positions; padding positions come back as 0.
    With `shift_mean=False` the mean is added back (scale-only whitening).

    Computed in float64 and returned in ``values.dtype``: the mean of equal float32 values is then exact,
    so equal values whiten to exactly 0 instead of their mean's rounding error divided by sqrt(eps)."""
    wide = values.to(torch.float64)
    mean = masked_mean(wide, mask)
    var = masked_var(wide, mask, unbiased=unbiased)
    whitened = (wide - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened)).to(values.dtype)
