"""Policy-gradient losses: PPO clip (asymmetric "clip-higher" bounds, optional dual clip) and GSPO; the others
verl has (CISPO, SAPO, GMPO, GPG, KL-Cov, Clip-Cov) are in :mod:`megarl.algorithms.policy_loss_variants`.

Common keyword-only signature, so the trainer picks a loss by name:

    fn(*, log_probs, old_log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high,
       clip_ratio_c=None, loss_agg_mode=..., global_num_tokens=None, global_num_seqs=None, norm_length=None)
       -> (loss, metrics: dict[str, float])

The clip range is [1 - clip_ratio_low, 1 + clip_ratio_high]; DAPO's clip-higher is just clip_ratio_high >
clip_ratio_low. Metrics are local to this call: `pg_clipfrac` (tokens where the clipped branch is active),
`pg_clipfrac_lower` (dual-clip active), `ppo_kl` / `approx_kl_k1` (mean old - new log-prob) and `approx_kl_k3`
(mean of r - 1 - log r, r = new/old: unbiased, non-negative), all over valid tokens.
Leaves out: entropy bonus and KL-to-reference loss terms (see `entropy.py`, `kl.py`); the trainer adds them.
"""

from __future__ import annotations

from typing import Callable

import torch

from megarl.algorithms.aggregation import aggregate_loss
from megarl.algorithms.masked import masked_mean
from megarl.algorithms.registry import Registry

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")
# verl's names for PPO-clip: "vanilla" (verl's loss_mode default) and "dual_clip" (older; PPO-clip always takes the
# dual clip, clip_ratio_c)
POLICY_LOSS_ALIASES = {"vanilla": "ppo_clip", "dual_clip": "ppo_clip"}

# exp() of a log-ratio beyond this is a numerical accident (stale log-probs, a bug), not a signal.
_MAX_LOG_RATIO = 20.0


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    return POLICY_LOSSES.register(name)


def get_policy_loss(name: str) -> PolicyLossFn:
    return POLICY_LOSSES.get(POLICY_LOSS_ALIASES.get(name, name))


def _check_inputs(log_probs, old_log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high):
    for name, t in (("old_log_probs", old_log_probs), ("advantages", advantages), ("response_mask", response_mask)):
        if t.shape != log_probs.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != log_probs shape {tuple(log_probs.shape)}")
    if not (0.0 <= clip_ratio_low < 1.0):
        raise ValueError(f"clip_ratio_low must be in [0, 1), got {clip_ratio_low}")
    if clip_ratio_high < 0.0:
        raise ValueError(f"clip_ratio_high must be >= 0, got {clip_ratio_high}")


def _kl_metrics(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
    log_ratio = log_ratio.detach()
    k1 = masked_mean(-log_ratio, response_mask).item()
    k3 = masked_mean(torch.expm1(log_ratio) - log_ratio, response_mask).item()
    return {"ppo_kl": k1, "approx_kl_k1": k1, "approx_kl_k3": k3}


def _zero_padding(x: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    # Padding log-probs may be anything (even -inf); keep them out of exp() and out of the gradient.
    return torch.where(response_mask.bool(), x, torch.zeros_like(x))


@register_policy_loss("ppo_clip")
def compute_ppo_clip_loss(
    *, log_probs, old_log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high,
    clip_ratio_c=None, loss_agg_mode="token-mean", global_num_tokens=None, global_num_seqs=None, norm_length=None,
    rollout_is_weights=None,
):
    """PPO clipped surrogate (Schulman et al. 2017) per token: max(-A r, -A clip(r)).
    Dual clip (Ye et al. 2020), when `clip_ratio_c` (> 1) is given, bounds the loss of negative-advantage tokens
    by -A * clip_ratio_c so a huge ratio on a bad token cannot dominate the update."""
    _check_inputs(log_probs, old_log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high)
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual clip) must be > 1, got {clip_ratio_c}")
    valid = response_mask.bool()
    advantages = _zero_padding(advantages, response_mask)
    log_ratio = _zero_padding(log_probs - old_log_probs, response_mask).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped)
    metrics = {"pg_clipfrac": masked_mean((clipped > unclipped).float(), response_mask).item()}

    lower_active = torch.zeros_like(valid)
    if clip_ratio_c is not None:
        dual_bound = -advantages * clip_ratio_c
        lower_active = (advantages < 0) & (loss_mat > dual_bound)
        loss_mat = torch.where(advantages < 0, torch.minimum(loss_mat, dual_bound), loss_mat)
    metrics["pg_clipfrac_lower"] = masked_mean(lower_active.float(), response_mask).item()
    metrics.update(_kl_metrics(log_ratio, response_mask))
    if rollout_is_weights is not None:  # rollout correction (megarl.algorithms.rollout_correction); no gradient
        loss_mat = loss_mat * rollout_is_weights.detach()

    loss = aggregate_loss(
        loss_mat, response_mask, loss_agg_mode,
        global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs, norm_length=norm_length,
    )
    return loss, metrics


@register_policy_loss("gspo")
def compute_gspo_loss(
    *, log_probs, old_log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high,
    clip_ratio_c=None, loss_agg_mode="seq-mean-token-mean", global_num_tokens=None, global_num_seqs=None,
    norm_length=None, rollout_is_weights=None,
):
    """GSPO (Zheng et al. 2025): the importance ratio is per sequence, s_i = exp(mean_t log(pi/pi_old)), and
    clipped per sequence (the paper uses tiny ranges, e.g. 3e-4 / 4e-4). The token-wise form
    s_it = sg(s_i) * pi_t / sg(pi_t) has the value s_i and the gradient s_i * grad log pi_t, which lets
    token-level advantages through. The paper's objective is `seq-mean-token-mean`, the default here."""
    _check_inputs(log_probs, old_log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high)
    if clip_ratio_c is not None:
        raise ValueError("gspo has no dual clip: clip_ratio_c must be None (it would be silently ignored)")
    advantages = _zero_padding(advantages, response_mask)
    log_ratio = _zero_padding(log_probs - old_log_probs, response_mask)
    seq_lens = response_mask.to(log_ratio.dtype).sum(-1).clamp(min=1)
    seq_log_ratio = log_ratio.sum(-1) / seq_lens
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + log_probs - log_probs.detach()
    token_log_ratio = _zero_padding(token_log_ratio, response_mask).clamp(max=_MAX_LOG_RATIO)
    ratio = torch.exp(token_log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped)

    metrics = {
        "pg_clipfrac": masked_mean((clipped > unclipped).float(), response_mask).item(),
        "pg_clipfrac_lower": 0.0,
    }
    metrics.update(_kl_metrics(log_ratio, response_mask))
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights.detach()
    loss = aggregate_loss(
        loss_mat, response_mask, loss_agg_mode,
        global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs, norm_length=norm_length,
    )
    return loss, metrics
