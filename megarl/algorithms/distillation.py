"""On-policy distillation's loss: a teacher's log-probs of the student's own sampled tokens, turned into a
training signal for the student (verl's ``distillation.distillation_loss`` with verl's meanings).

Per token, a single-sample estimate of KL(student || teacher) from the two log-probs of the sampled token
(``loss_mode``: any estimator of :mod:`megarl.algorithms.kl`; ``k1`` is the plain log-ratio, ``k3`` the
low-variance one), after both log-probs are clamped below at ``log_prob_min_clamp`` and the estimate to
``[-loss_max_clamp, loss_max_clamp]``. Then either

* ``use_policy_gradient`` (the default; Thinking Machines' on-policy distillation, NeMo-RL's reverse KL): the
  negated estimate is each token's advantage in a PPO-clip loss against the rollout's old log-probs -- with
  ``k1`` this is REINFORCE on the per-token reverse KL; or
* the estimate itself, aggregated by ``loss_agg_mode``, is the loss (GKD, arXiv 2306.13649; ``k3``). ``k1`` is
  refused there: its gradient does not depend on the teacher.

:class:`DistillationSpec` carries these settings into the engine, which adds the result to the task's policy
loss (``use_task_rewards``, weighted by ``distillation_loss_coef``) or trains on it alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megarl.algorithms.aggregation import aggregate_loss
from megarl.algorithms.kl import KL_ESTIMATORS, kl_penalty
from megarl.algorithms.masked import masked_mean
from megarl.algorithms.policy_loss import compute_ppo_clip_loss

# verl's vanilla policy loss takes its dual clip at this bound when the distillation config names none
_DUAL_CLIP = 3.0


@dataclass(frozen=True)
class DistillationSpec:
    loss_mode: str = "k3"
    use_policy_gradient: bool = True
    use_task_rewards: bool = True
    distillation_loss_coef: float = 1.0
    loss_max_clamp: Optional[float] = 10.0
    log_prob_min_clamp: Optional[float] = -10.0
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2

    def __post_init__(self):
        if self.loss_mode not in KL_ESTIMATORS.names():
            raise ValueError(f"distillation.distillation_loss.loss_mode={self.loss_mode!r}: megarl's estimators are "
                             f"{', '.join(KL_ESTIMATORS.names())} (forward_kl_topk, which needs the teacher's top-k "
                             f"distribution, is not in megarl)")
        if self.loss_mode in ("k1", "kl") and not self.use_policy_gradient:
            raise ValueError("distillation.distillation_loss.loss_mode=k1 with use_policy_gradient=false: the "
                             "gradient of k1 does not depend on the teacher; use k3, or use_policy_gradient=true")

    @property
    def task_weight(self) -> float:
        """How much of the task's policy loss the student trains on (none with ``use_task_rewards`` off)."""
        return 1.0 if self.use_task_rewards else 0.0

    @property
    def weight(self) -> float:
        """The distillation loss's weight: ``distillation_loss_coef`` beside the task's loss, else 1."""
        return self.distillation_loss_coef if self.use_task_rewards else 1.0


def per_token_distillation(log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                           spec: DistillationSpec) -> torch.Tensor:
    """The clamped per-token KL estimate (module docstring); differentiable in ``log_probs``."""
    student, teacher = log_probs, teacher_log_probs.detach()
    if spec.log_prob_min_clamp is not None:
        student = student.clamp(min=spec.log_prob_min_clamp)
        teacher = teacher.clamp(min=spec.log_prob_min_clamp)
    estimate = kl_penalty(student, teacher, spec.loss_mode)
    if spec.loss_max_clamp is not None:
        estimate = estimate.clamp(-spec.loss_max_clamp, spec.loss_max_clamp)
    return estimate


def distillation_loss(*, log_probs, teacher_log_probs, old_log_probs, response_mask, spec: DistillationSpec,
                      loss_agg_mode="token-mean", global_num_tokens=None, global_num_seqs=None, norm_length=None,
                      rollout_is_weights=None) -> tuple[torch.Tensor, dict[str, float]]:
    """This micro-batch's share of the distillation loss, and its metrics (``distillation/*``)."""
    if teacher_log_probs.shape != log_probs.shape:
        raise ValueError(f"teacher_log_probs shape {tuple(teacher_log_probs.shape)} != log_probs shape "
                         f"{tuple(log_probs.shape)}")
    valid = response_mask.bool()
    estimate = per_token_distillation(log_probs, torch.where(valid, teacher_log_probs, log_probs.detach()), spec)
    estimate = torch.where(valid, estimate, torch.zeros_like(estimate))
    counts = dict(global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs, norm_length=norm_length)
    metrics = {"distillation/abs_loss": masked_mean(estimate.detach().abs(), response_mask).item(),
               "distillation/loss_max": float(estimate.detach()[valid].max()) if valid.any() else 0.0}
    if spec.use_policy_gradient:
        loss, pg_metrics = compute_ppo_clip_loss(
            log_probs=log_probs, old_log_probs=old_log_probs, advantages=-estimate.detach(),
            response_mask=response_mask, clip_ratio_low=spec.clip_ratio_low, clip_ratio_high=spec.clip_ratio_high,
            clip_ratio_c=_DUAL_CLIP, loss_agg_mode=loss_agg_mode, rollout_is_weights=rollout_is_weights, **counts)
        metrics.update({f"distillation/{name}": value for name, value in pg_metrics.items()
                        if name in ("pg_clipfrac", "ppo_kl")})
    else:
        loss = aggregate_loss(estimate, response_mask, loss_agg_mode, **counts)
    return loss, metrics
