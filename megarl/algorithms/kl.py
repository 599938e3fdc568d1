"""KL estimators between the policy and a reference, KL-in-reward shaping, and KL coefficient controllers.

Estimators of KL(pi || pi_ref) per token from log-probs of sampled tokens (Schulman's "Approximating KL"):
  k1            logp - ref_logp                        unbiased, can be negative
  k2 / mse      0.5 * (logp - ref_logp)^2
  k3 / low_var_kl  exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10]   unbiased, >= 0, low variance
  abs           |logp - ref_logp|
Controllers: `FixedKLController` and `AdaptiveKLController` (Ziegler et al. 2019), both checkpointable.
Leaves out: a KL loss term (the trainer aggregates `kl_penalty(...)` with `aggregate_loss`).
"""

from __future__ import annotations

from typing import Callable

import torch

from megarl.algorithms.masked import masked_mean
from megarl.algorithms.registry import Registry

KLEstimatorFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: Registry[KLEstimatorFn] = Registry("kl estimator")

_K3_CLAMP = 10.0
_K3_LOG_RATIO_CLAMP = 20.0  # keeps exp() finite before the final clamp


def register_kl_estimator(name: str) -> Callable[[KLEstimatorFn], KLEstimatorFn]:
    return KL_ESTIMATORS.register(name)


def estimate_kl_k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return log_probs - ref_log_probs


def estimate_kl_k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_probs - ref_log_probs).square()


def estimate_kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    log_ratio = (ref_log_probs - log_probs).clamp(-_K3_LOG_RATIO_CLAMP, _K3_LOG_RATIO_CLAMP)
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-_K3_CLAMP, _K3_CLAMP)


@register_kl_estimator("abs")
def estimate_kl_abs(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return (log_probs - ref_log_probs).abs()


for _alias in ("k1", "kl"):  # "kl" is verl's name for the plain log-ratio
    register_kl_estimator(_alias)(estimate_kl_k1)
for _alias in ("k2", "mse"):
    register_kl_estimator(_alias)(estimate_kl_k2)
for _alias in ("k3", "low_var_kl"):
    register_kl_estimator(_alias)(estimate_kl_k3)


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of the given `kind` (see the module docstring); same shape as the inputs."""
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(
            f"log_probs shape {tuple(log_probs.shape)} != ref_log_probs shape {tuple(ref_log_probs.shape)}"
        )
    return KL_ESTIMATORS.get(kind)(log_probs, ref_log_probs)


# ----------------------------------------------------------------------------------------------- controllers


class FixedKLController:
    """Constant KL coefficient; `update` is a no-op so both controllers are interchangeable."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. 2019: beta <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if init_kl_coef < 0 or target_kl <= 0 or horizon <= 0:
            raise ValueError(
                f"AdaptiveKLController needs init_kl_coef >= 0, target_kl > 0, horizon > 0; "
                f"got {init_kl_coef}, {target_kl}, {horizon}"
            )
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "target_kl": self.target_kl, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.target_kl = float(state["target_kl"])
        self.horizon = int(state["horizon"])


KLController = FixedKLController | AdaptiveKLController


def apply_kl_in_reward(
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    kl_ctrl: KLController,
    kind: str = "k1",
) -> tuple[torch.Tensor, dict[str, float]]:
    """rewards = scores - beta * KL per valid token, then feed the batch KL (mean over sequences of the per-
    sequence token-mean KL) to `kl_ctrl.update(kl, n_steps=B)`. Metrics report the beta that was applied."""
    if token_level_scores.shape != mask.shape:
        raise ValueError(
            f"token_level_scores shape {tuple(token_level_scores.shape)} != mask shape {tuple(mask.shape)}"
        )
    valid = mask.bool()
    kld = torch.where(valid, kl_penalty(old_log_probs, ref_log_probs, kind), torch.zeros_like(old_log_probs))
    beta = kl_ctrl.value
    rewards = torch.where(valid, token_level_scores - beta * kld, torch.zeros_like(token_level_scores))
    current_kl = masked_mean(kld, mask, dim=-1).mean().item()
    kl_ctrl.update(current_kl, n_steps=token_level_scores.shape[0])
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
