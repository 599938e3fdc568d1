"""PPO critic loss with value clipping.

loss_it = 0.5 * max((v - R)^2, (v_old + clip(v - v_old, -c, c) - R)^2), aggregated like the policy loss.
Leaves out: value-head / critic model code; this only scores predictions.
"""

from __future__ import annotations

import torch

from megarl.algorithms.aggregation import aggregate_loss
from megarl.algorithms.masked import masked_mean


def compute_value_loss(
    *, values, old_values, returns, response_mask, cliprange_value, loss_agg_mode="token-mean",
    global_num_tokens=None, global_num_seqs=None, norm_length=None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Returns (loss, {"vf_clipfrac", "vpred_mean"}); `vf_clipfrac` is the share of valid tokens where the
    clipped error is the larger one (so its branch carries the gradient)."""
    for name, t in (("old_values", old_values), ("returns", returns), ("response_mask", response_mask)):
        if t.shape != values.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != values shape {tuple(values.shape)}")
    if cliprange_value < 0:
        raise ValueError(f"cliprange_value must be >= 0, got {cliprange_value}")
    valid = response_mask.bool()
    zeros = torch.zeros_like(values)
    values_v, old_v, returns_v = (torch.where(valid, t, zeros) for t in (values, old_values, returns))
    # Inside the trust region the clipped prediction *is* the prediction: old + (v - old) would differ from
    # v by rounding and flip the clipfrac comparison at random.
    inside = (values_v - old_v).abs() <= cliprange_value
    clipped_values = torch.where(
        inside, values_v, old_v + torch.clamp(values_v - old_v, -cliprange_value, cliprange_value))
    err_unclipped = (values_v - returns_v).square()
    err_clipped = (clipped_values - returns_v).square()
    loss_mat = 0.5 * torch.maximum(err_unclipped, err_clipped)
    loss = aggregate_loss(
        loss_mat, response_mask, loss_agg_mode,
        global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs, norm_length=norm_length,
    )
    metrics = {
        "vf_clipfrac": masked_mean((err_clipped > err_unclipped).float(), response_mask).item(),
        "vpred_mean": masked_mean(values.detach(), response_mask).item(),
    }
    return loss, metrics


value_loss = compute_value_loss
