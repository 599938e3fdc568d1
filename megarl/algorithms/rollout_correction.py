"""Rollout correction: the rollout engine samples from slightly different probabilities than the trainer
computes (bf16 kernels, other attention, stale weights). With the rollout engine's own log-probs of the
sampled tokens (``rollout_log_probs``) and the trainer's (``old_log_probs``, before the update), the ratio
r = pi_train / pi_rollout gives two corrections, as verl's ``algorithm.rollout_correction`` defines them
(decoupled mode: PPO's ratio stays pi / pi_old, and these act on top of it):

* importance sampling (``rollout_is``): each token's policy loss is weighted by r (``"token"``) or by the
  product of its sequence's ratios (``"sequence"``); ``rollout_is_threshold`` a number: weights above it are
  truncated to it (TIS); ``"lower_upper"``: weights outside [lower, upper] become 0 (IcePop);
  ``rollout_is_batch_normalize`` rescales the weights to mean 1 over the batch's tokens (token) or sequences
  (sequence). The weights carry no gradient.
* rejection sampling (``rollout_rs``, a comma list): tokens (``token_*``) or whole sequences (``seq_sum_*``,
  ``seq_mean_*``, ``seq_max_*``) whose divergence is out of bounds leave the loss (and its token counts).
  k1 is log r, bounded by ratio thresholds ``"lower_upper"`` (a single number u means [1/u, u]); k2 = (log r)^2 / 2
  and k3 = r - 1 - log r are bounded above by a number. One threshold per option, or one for all.

Pure tensor functions; the whole batch is on the driver, so batch statistics are exact (no per-rank means).
Leaves out: verl's bypass mode (rollout log-probs standing in for old_log_probs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megarl.algorithms.masked import masked_mean

IS_LEVELS = ("token", "sequence")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
_LOG_BOUND = 20.0  # |log r| is clamped here before exp: exp(20) ~ 5e8, finite in fp32


@dataclass
class RolloutCorrection:
    is_weights: Optional[torch.Tensor]  # [B, R], 0 on padding; None without importance sampling
    loss_mask: torch.Tensor  # [B, R] the response tokens the loss keeps
    metrics: dict[str, float]


def parse_bounds(threshold: Union[str, float, int], *, name: str) -> tuple[Optional[float], float]:
    """``(lower, upper)`` from a number (``(None, upper)``) or a ``"lower_upper"`` string."""
    if isinstance(threshold, str) and "_" in threshold:
        low_text, _, high_text = threshold.partition("_")
        try:
            lower, upper = float(low_text), float(high_text)
        except ValueError:
            raise ValueError(f"{name}: expected a number or 'lower_upper', got {threshold!r}") from None
        if not 0 <= lower < upper:
            raise ValueError(f"{name}: 'lower_upper' needs 0 <= lower < upper, got {threshold!r}")
        return lower, upper
    try:
        upper = float(threshold)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a number or 'lower_upper', got {threshold!r}") from None
    if not upper > 0:
        raise ValueError(f"{name}: must be > 0, got {threshold!r}")
    return None, upper


def rs_options(rollout_rs: Optional[str]) -> list[str]:
    if not rollout_rs:
        return []
    options = list(dict.fromkeys(part.strip() for part in rollout_rs.split(",") if part.strip()))
    unknown = [o for o in options if o not in RS_OPTIONS]
    if unknown:
        raise ValueError(f"algorithm.rollout_correction.rollout_rs: unknown option(s) {unknown}; known: {list(RS_OPTIONS)}")
    return options


def rs_thresholds(options: list[str], threshold) -> dict[str, tuple[Optional[float], float]]:
    """Per option ``(lower, upper)``: k1 options as log-ratio bounds, k2/k3 as an upper bound."""
    if not options:
        return {}
    if threshold is None:
        raise ValueError("algorithm.rollout_correction.rollout_rs_threshold is required with rollout_rs")
    values = [v.strip() for v in threshold.split(",")] if isinstance(threshold, str) else [threshold]
    if len(values) not in (1, len(options)):
        raise ValueError(f"algorithm.rollout_correction.rollout_rs_threshold: {len(values)} values for "
                         f"{len(options)} options (give one, or one per option)")
    values = values * len(options) if len(values) == 1 else values
    bounds = {}
    for option, value in zip(options, values):
        lower, upper = parse_bounds(value, name=f"algorithm.rollout_correction.rollout_rs_threshold ({option})")
        if option.endswith("k1"):
            lower = 1.0 / upper if lower is None else lower
            bounds[option] = (math.log(lower) if lower > 0 else -math.inf, math.log(upper))
        else:
            if lower is not None:
                raise ValueError(f"algorithm.rollout_correction.rollout_rs_threshold ({option}): a divergence "
                                 f"takes an upper bound only, got {value!r}")
            bounds[option] = (None, upper)
    return bounds


def check_rollout_correction_settings(*, rollout_is: Optional[str], rollout_is_threshold: Union[str, float],
                                      rollout_rs: Optional[str], rollout_rs_threshold) -> None:
    """``ValueError`` naming the ``algorithm.rollout_correction`` key a run could not correct with (config time)."""
    if rollout_is is not None:
        _require_is_level(rollout_is)
        parse_bounds(rollout_is_threshold, name="algorithm.rollout_correction.rollout_is_threshold")
    rs_thresholds(rs_options(rollout_rs), rollout_rs_threshold)


def _require_is_level(rollout_is: str) -> None:
    if rollout_is not in IS_LEVELS:
        raise ValueError(f"algorithm.rollout_correction.rollout_is must be null, 'token' or 'sequence', "
                         f"got {rollout_is!r}")


def compute_rollout_correction(
    *, old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
    rollout_is: Optional[str] = None, rollout_is_threshold: Union[str, float] = 2.0,
    rollout_is_batch_normalize: bool = False, rollout_rs: Optional[str] = None, rollout_rs_threshold=None,
) -> RolloutCorrection:
    mask = response_mask.bool()
    mask_f = mask.double()
    valid_tokens = max(int(mask.sum()), 1)
    log_ratio = torch.where(mask, old_log_probs.double() - rollout_log_probs.double(), 0.0)
    log_ratio = log_ratio.clamp(-_LOG_BOUND, _LOG_BOUND)
    metrics: dict[str, float] = {
        # rollout-vs-trainer KL (k3 estimate, mean per token) and the perplexity ratio of the two policies
        "rollout_corr/kl": float(masked_mean(torch.expm1(-log_ratio) + log_ratio, mask_f)),
        "rollout_corr/ppl_ratio": float(torch.exp(-masked_mean(log_ratio, mask_f))),
    }

    keep = mask.clone()
    options = rs_options(rollout_rs)
    for option, (lower, upper) in rs_thresholds(options, rollout_rs_threshold).items():
        level, _, kind = option.rpartition("_")
        if kind == "k1":
            stat = log_ratio
        elif kind == "k2":
            stat = 0.5 * log_ratio**2
        else:
            stat = torch.expm1(log_ratio) - log_ratio
        if level == "seq_max":
            stat = torch.where(mask, stat, -math.inf).max(dim=1).values
        elif level != "token":  # seq_sum, seq_mean (log_ratio, hence every stat, is 0 on padding)
            stat = stat.sum(dim=1) / (mask.sum(dim=1).clamp(min=1) if level == "seq_mean" else 1)
        inside = stat <= upper
        if lower is not None:
            inside &= stat >= lower
        if level != "token":
            inside = inside[:, None].expand_as(mask)
        metrics[f"rollout_corr/{option}_masked_fraction"] = float((mask & ~inside).sum()) / valid_tokens
        keep &= inside
    if options:
        metrics["rollout_corr/rs_masked_fraction"] = 1.0 - float(keep.sum()) / valid_tokens

    weights = None
    if rollout_is is not None:
        _require_is_level(rollout_is)
        lower, upper = parse_bounds(rollout_is_threshold, name="algorithm.rollout_correction.rollout_is_threshold")
        if rollout_is == "token":
            log_weight = log_ratio
        else:
            log_weight = log_ratio.sum(dim=1, keepdim=True).clamp(-_LOG_BOUND, _LOG_BOUND).expand_as(log_ratio)
        raw = torch.where(mask, torch.exp(log_weight), 0.0)
        if lower is None:
            weights = raw.clamp(max=upper)
            metrics["rollout_corr/is_truncated_fraction"] = float(masked_mean((raw > upper).double(), mask_f))
        else:
            inside = (raw >= lower) & (raw <= upper)
            weights = torch.where(inside, raw, 0.0)
            metrics["rollout_corr/is_out_of_bounds_fraction"] = float(masked_mean((~inside).double(), mask_f))
        if rollout_is_batch_normalize:
            if rollout_is == "token":
                mean = masked_mean(weights, mask_f)
            else:  # one weight per sequence: their mean
                per_sequence = torch.where(mask, weights, 0.0).amax(dim=1)[mask.any(dim=1)]
                mean = per_sequence.mean() if per_sequence.numel() else weights.new_tensor(1.0)
            if float(mean) > 1e-8:  # all weights ~0 (IcePop rejected everything): nothing to rescale
                weights = weights / mean
        valid = weights[mask]
        metrics.update({
            "rollout_corr/is_weight_mean": float(valid.mean()) if valid.numel() else 1.0,
            "rollout_corr/is_weight_max": float(valid.max()) if valid.numel() else 1.0,
            "rollout_corr/is_weight_min": float(valid.min()) if valid.numel() else 1.0,
        })
        weights = weights.float()
    return RolloutCorrection(is_weights=weights, loss_mask=keep.to(response_mask.dtype), metrics=metrics)
