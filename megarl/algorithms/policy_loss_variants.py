"""verl's other policy losses, by verl's names (``actor_rollout_ref.actor.policy_loss.loss_mode``): CISPO, SAPO,
GMPO (``geo_mean``), GPG, KL-Cov (``kl_cov``) and Clip-Cov (``clip_cov``). Same calling convention as
:mod:`megarl.algorithms.policy_loss` (keyword-only, ``(loss, metrics)``, a micro-batch's share of the step loss
under the global token/sequence counts), plus each loss's own options, named as verl names them.

What each one is, from its paper (verl's ``core_algos`` agrees with these):

* **CISPO** (MiniMax-M1, arXiv 2506.13585): REINFORCE weighted by the clipped importance ratio, which carries
  no gradient: ``-sg(clip(r, 1 - low, 1 + high)) * A * log pi``. No token is ever dropped from the gradient.
* **SAPO** (arXiv 2511.20347): a smooth gate instead of a clip, ``f(r) = sigmoid(tau (r - 1)) * 4 / tau`` with
  ``tau = tau_pos`` for A > 0 and ``tau_neg`` otherwise; the loss ``-f(r) A`` is averaged per sequence then over
  sequences (``seq-mean-token-mean``, whatever ``loss_agg_mode`` says, as verl does).
* **GMPO** (``geo_mean``, arXiv 2507.20673): the geometric mean of the token ratios per sequence, each log-ratio
  clipped to ``[-low, high]`` on the side the advantage's sign makes pessimistic; the loss ``-A_seq * r_seq`` is
  averaged over sequences (its own aggregation; ``loss_agg_mode`` does not apply).
* **GPG** (arXiv 2504.02546): plain policy gradient, ``-A log pi``, no ratio and no clip.
* **Clip-Cov** and **KL-Cov** (Cui et al., "The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617):
  tokens whose covariance ``(A - mean A)(log pi - mean log pi)`` is high are the ones that collapse entropy.
  Clip-Cov takes PPO's clipped loss and cuts the gradient of ``clip_cov_ratio`` of the valid tokens, picked at
  random among those with covariance in ``(clip_cov_lb, clip_cov_ub)`` and not already clipped. KL-Cov takes the
  unclipped ``-A r`` and adds ``ppo_kl_coef * |log r|`` on the ``kl_cov_ratio`` of tokens with the largest
  covariance. Both compute their statistics over the micro-batch, as verl does.

Metrics: ``pg_clipfrac`` is the fraction of valid tokens the loss treated specially (CISPO: ratio clipped; GMPO:
log-ratio clipped with A > 0, ``pg_clipfrac_lower`` with A < 0; Clip-Cov: gradient cut; KL-Cov: penalised), 0
for SAPO and GPG, which have no such tokens; ``ppo_kl`` / ``approx_kl_*`` as for PPO.
"""

from __future__ import annotations

import torch

from megarl.algorithms.aggregation import aggregate_loss
from megarl.algorithms.masked import masked_mean
from megarl.algorithms.policy_loss import (_MAX_LOG_RATIO, _check_inputs, _kl_metrics, _zero_padding,
                                           register_policy_loss)


def _log_ratio(log_probs, old_log_probs, response_mask):
    return _zero_padding(log_probs - old_log_probs, response_mask).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def _covariance_loss_inputs(name, ratio_option, ratio, log_probs, old_log_probs, advantages, response_mask):
    """What Clip-Cov and KL-Cov both start from: their option checked, the valid tokens, the advantages and
    log-ratio with padding zeroed, and each token's covariance."""
    if not ratio > 0:
        raise ValueError(f"{name}: policy_loss.{ratio_option} must be > 0, got {ratio}")
    advantages = _zero_padding(advantages, response_mask)
    return (response_mask.bool(), advantages, _log_ratio(log_probs, old_log_probs, response_mask),
            _covariance(advantages, log_probs, response_mask))


def _weighted(loss_mat, rollout_is_weights):
    """Rollout correction's importance weights (megarl.algorithms.rollout_correction): no gradient."""
    return loss_mat if rollout_is_weights is None else loss_mat * rollout_is_weights.detach()


def _mean_over_sequences(seq_loss, present, global_num_seqs, name: str) -> torch.Tensor:
    """A per-sequence loss's share of the step's mean over sequences (rows without a valid token left out; the
    step's sequence count when micro-batched)."""
    num_seqs = int(present.sum()) if global_num_seqs is None else global_num_seqs
    if num_seqs <= 0:
        raise ValueError(f"{name}: no sequence with valid tokens (global_num_seqs or count is 0)")
    return torch.where(present, seq_loss, torch.zeros_like(seq_loss)).sum() / num_seqs


def _metrics(log_ratio, response_mask, clipfrac=0.0, clipfrac_lower=0.0) -> dict[str, float]:
    return {"pg_clipfrac": float(clipfrac), "pg_clipfrac_lower": float(clipfrac_lower),
            **_kl_metrics(log_ratio, response_mask)}


@register_policy_loss("cispo")
def compute_cispo_loss(
    *, log_probs, old_log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high,
    clip_ratio_c=None, loss_agg_mode="token-mean", global_num_tokens=None, global_num_seqs=None, norm_length=None,
    rollout_is_weights=None,
):
    """CISPO: ``-sg(clip(r)) * A * log pi`` (see the module docstring)."""
    _check_inputs(log_probs, old_log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high)
    advantages = _zero_padding(advantages, response_mask)
    log_ratio = _log_ratio(log_probs, old_log_probs, response_mask)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = -clipped.detach() * advantages * _zero_padding(log_probs, response_mask)
    loss = aggregate_loss(_weighted(loss_mat, rollout_is_weights), response_mask, loss_agg_mode,
                          global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
                          norm_length=norm_length)
    return loss, _metrics(log_ratio, response_mask, masked_mean((clipped != ratio).float(), response_mask).item())


@register_policy_loss("sapo")
def compute_sapo_loss(
    *, log_probs, old_log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high,
    clip_ratio_c=None, loss_agg_mode="seq-mean-token-mean", global_num_tokens=None, global_num_seqs=None,
    norm_length=None, rollout_is_weights=None, tau_pos=1.0, tau_neg=1.05,
):
    """SAPO: ``-sigmoid(tau (r - 1)) * 4 / tau * A``, per sequence then over sequences (module docstring)."""
    _check_inputs(log_probs, old_log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high)
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO's temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    advantages = _zero_padding(advantages, response_mask)
    log_ratio = _log_ratio(log_probs, old_log_probs, response_mask)
    tau = torch.where(advantages > 0, torch.full_like(advantages, tau_pos), torch.full_like(advantages, tau_neg))
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    loss_mat = -gate * advantages
    loss = aggregate_loss(_weighted(loss_mat, rollout_is_weights), response_mask, "seq-mean-token-mean",
                          global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
                          norm_length=norm_length)
    return loss, _metrics(log_ratio, response_mask)


@register_policy_loss("geo_mean")
def compute_gmpo_loss(
    *, log_probs, old_log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high,
    clip_ratio_c=None, loss_agg_mode="token-mean", global_num_tokens=None, global_num_seqs=None, norm_length=None,
    rollout_is_weights=None,
):
    """GMPO: ``-A_seq * exp(mean_t clip(log r_t))`` averaged over sequences (module docstring). Rollout
    correction weights enter as their geometric mean per sequence."""
    _check_inputs(log_probs, old_log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high)
    mask = response_mask.to(log_probs.dtype)
    advantages = _zero_padding(advantages, response_mask)
    log_ratio = _zero_padding(log_probs - old_log_probs, response_mask)
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -clip_ratio_low, clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)
    lengths = mask.sum(-1)
    present = lengths > 0
    denominator = lengths.clamp(min=1)
    seq_ratio = torch.exp((pessimistic * mask).sum(-1) / denominator)
    seq_advantage = (advantages * mask).sum(-1) / denominator
    seq_loss = -seq_advantage * seq_ratio
    if rollout_is_weights is not None:
        log_weights = torch.log(rollout_is_weights.detach().clamp(min=1e-10))
        seq_loss = seq_loss * torch.exp((log_weights * mask).sum(-1) / denominator)
    loss = _mean_over_sequences(seq_loss, present, global_num_seqs, "geo_mean")
    clipped = (log_ratio != clamped) & response_mask.bool()
    return loss, _metrics(log_ratio, response_mask,
                          masked_mean((clipped & (advantages > 0)).float(), response_mask).item(),
                          masked_mean((clipped & (advantages < 0)).float(), response_mask).item())


@register_policy_loss("gpg")
def compute_gpg_loss(
    *, log_probs, old_log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high,
    clip_ratio_c=None, loss_agg_mode="token-mean", global_num_tokens=None, global_num_seqs=None, norm_length=None,
    rollout_is_weights=None,
):
    """GPG: ``-A log pi`` (module docstring)."""
    _check_inputs(log_probs, old_log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high)
    loss_mat = -_zero_padding(advantages, response_mask) * _zero_padding(log_probs, response_mask)
    loss = aggregate_loss(_weighted(loss_mat, rollout_is_weights), response_mask, loss_agg_mode,
                          global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
                          norm_length=norm_length)
    return loss, _metrics(_log_ratio(log_probs, old_log_probs, response_mask), response_mask)


def _covariance(advantages, log_probs, response_mask) -> torch.Tensor:
    """``(A - mean A)(log pi - mean log pi)`` per token, means over the valid tokens; no gradient."""
    advantages, log_probs = advantages.detach(), log_probs.detach()
    return ((advantages - masked_mean(advantages, response_mask))
            * (log_probs - masked_mean(log_probs, response_mask)))


def _selection_generator(response_mask: torch.Tensor, candidates: int) -> torch.Generator:
    """The random choice among candidate tokens must be the same on every tensor-parallel rank of a replica
    (they compute the same loss and must take the same gradient): seeded from the micro-batch, not the RNG
    state, which ranks do not share."""
    return torch.Generator().manual_seed(int(response_mask.sum()) * 1_000_003 + candidates)


@register_policy_loss("clip_cov")
def compute_clip_cov_loss(
    *, log_probs, old_log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high,
    clip_ratio_c=None, loss_agg_mode="token-mean", global_num_tokens=None, global_num_seqs=None, norm_length=None,
    rollout_is_weights=None, clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0,
):
    """Clip-Cov: PPO's clipped loss with the gradient of a few high-covariance tokens cut (module docstring)."""
    _check_inputs(log_probs, old_log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high)
    valid, advantages, log_ratio, covariance = _covariance_loss_inputs(
        "clip_cov", "clip_cov_ratio", clip_cov_ratio, log_probs, old_log_probs, advantages, response_mask)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    candidates = (valid & ~(clipped > unclipped) & (covariance > clip_cov_lb) & (covariance < clip_cov_ub)).nonzero()
    wanted = max(int(clip_cov_ratio * int(valid.sum())), 1)
    keep = torch.ones_like(advantages)
    if len(candidates):
        order = torch.randperm(len(candidates), generator=_selection_generator(response_mask, len(candidates)))
        chosen = candidates[order[:wanted].to(candidates.device)]
        keep[chosen[:, 0], chosen[:, 1]] = 0.0
    loss_mat = torch.maximum(unclipped, clipped) * keep
    loss = aggregate_loss(_weighted(loss_mat, rollout_is_weights), response_mask, loss_agg_mode,
                          global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
                          norm_length=norm_length)
    return loss, _metrics(log_ratio, response_mask, masked_mean((keep == 0).float(), response_mask).item())


@register_policy_loss("kl_cov")
def compute_kl_cov_loss(
    *, log_probs, old_log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high,
    clip_ratio_c=None, loss_agg_mode="token-mean", global_num_tokens=None, global_num_seqs=None, norm_length=None,
    rollout_is_weights=None, kl_cov_ratio=0.0002, ppo_kl_coef=0.1,
):
    """KL-Cov: ``-A r``, plus ``ppo_kl_coef |log r|`` on the highest-covariance tokens (module docstring)."""
    _check_inputs(log_probs, old_log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high)
    valid, advantages, log_ratio, covariance = _covariance_loss_inputs(
        "kl_cov", "kl_cov_ratio", kl_cov_ratio, log_probs, old_log_probs, advantages, response_mask)
    loss_mat = -advantages * torch.exp(log_ratio)
    valid_positions = valid.nonzero()
    penalised = torch.zeros_like(valid)
    if len(valid_positions):
        count = max(1, int(len(valid_positions) * kl_cov_ratio))
        top = torch.topk(covariance[valid], count, largest=True).indices
        chosen = valid_positions[top]
        penalised[chosen[:, 0], chosen[:, 1]] = True
    loss_mat = torch.where(penalised, loss_mat + ppo_kl_coef * log_ratio.abs(), loss_mat)
    loss = aggregate_loss(_weighted(loss_mat, rollout_is_weights), response_mask, loss_agg_mode,
                          global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
                          norm_length=norm_length)
    return loss, _metrics(log_ratio, response_mask, masked_mean(penalised.float(), response_mask).item())


@register_policy_loss("sppo")
def compute_sppo_loss(
    *, log_probs, old_log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high,
    clip_ratio_c=None, loss_agg_mode="token-mean", global_num_tokens=None, global_num_seqs=None, norm_length=None,
    rollout_is_weights=None, sppo_eta=1.0,
):
    """SPPO (arXiv 2405.00675; verl's recipe): ``(log pi(y)/pi_old(y) - sppo_eta * A)^2`` per sequence, the log-ratio
    summed over the response and ``A`` the ``sppo`` estimator's win rate - 1/2, averaged over sequences (its own
    aggregation, as verl's recipe; ``loss_agg_mode`` does not apply)."""
    _check_inputs(log_probs, old_log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high)
    mask = response_mask.to(log_probs.dtype)
    log_ratio = _zero_padding(log_probs - old_log_probs, response_mask)
    present = mask.sum(-1) > 0
    seq_log_ratio = (log_ratio * mask).sum(-1)
    target = sppo_eta * (_zero_padding(advantages, response_mask) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    seq_loss = (seq_log_ratio - target.detach()).square()
    if rollout_is_weights is not None:  # the sequence's mean weight
        seq_loss = seq_loss * (rollout_is_weights.detach() * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    loss = _mean_over_sequences(seq_loss, present, global_num_seqs, "sppo")
    return loss, _metrics(log_ratio, response_mask)


@register_policy_loss("dpo")
def compute_dpo_loss(
    *, log_probs, old_log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high,
    clip_ratio_c=None, loss_agg_mode="token-mean", global_num_tokens=None, global_num_seqs=None, norm_length=None,
    rollout_is_weights=None, ref_log_probs=None, dpo_beta=0.1, dpo_loss_type="sigmoid", dpo_label_smoothing=0.0,
):
    """DPO over online pairs (SPIN as verl's recipe runs it; Rafailov et al. 2023): rows come as (chosen,
    rejected) pairs, ``advantages`` +1 / -1 (the ``spin`` estimator). With ``x = (log pi(c) - log pi(r)) -
    (log ref(c) - log ref(r))``, sequence log-probs summed over the response, a pair's loss is
    ``-(1 - eps) log sigmoid(beta x) - eps log sigmoid(-beta x)`` (``dpo_loss_type=sigmoid``, label smoothing eps) or
    ``(x - 1 / (2 beta))^2`` (``ipo``), averaged over the step's pairs (its own aggregation; ``loss_agg_mode`` does not
    apply). ``pg_clipfrac`` reports the fraction of pairs the policy does not yet rank the chosen one higher."""
    _check_inputs(log_probs, old_log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high)
    if ref_log_probs is None:
        raise ValueError("dpo: the reference's log-probs are needed (the engine passes batch.ref_log_probs)")
    if dpo_loss_type not in ("sigmoid", "ipo"):
        raise ValueError(f"dpo: actor_rollout_ref.actor.dpo_loss_type={dpo_loss_type!r}: sigmoid or ipo")
    rows = log_probs.shape[0]
    mask = response_mask.to(log_probs.dtype)
    label = (_zero_padding(advantages, response_mask) * mask).sum(-1)
    if rows % 2 or not (bool((label[0::2] > 0).all()) and bool((label[1::2] < 0).all())):
        raise ValueError(f"dpo: the {rows} rows here are not whole (chosen, rejected) pairs in order: pairs must not "
                         f"be split (actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu even, no token-budget "
                         f"packing)")
    policy = (_zero_padding(log_probs, response_mask) * mask).sum(-1)
    reference = (_zero_padding(ref_log_probs, response_mask).detach() * mask).sum(-1)
    margin = (policy[0::2] - policy[1::2]) - (reference[0::2] - reference[1::2])
    if dpo_loss_type == "sigmoid":
        pair_loss = (-(1 - dpo_label_smoothing) * torch.nn.functional.logsigmoid(dpo_beta * margin)
                     - dpo_label_smoothing * torch.nn.functional.logsigmoid(-dpo_beta * margin))
    else:
        pair_loss = (margin - 1 / (2 * dpo_beta)).square()
    num_pairs = rows // 2 if global_num_seqs is None else global_num_seqs / 2
    loss = pair_loss.sum() / num_pairs
    log_ratio = _log_ratio(log_probs, old_log_probs, response_mask)
    misranked = float((policy[0::2] <= policy[1::2]).float().mean())
    return loss, _metrics(log_ratio, response_mask, misranked)
