"""Pure tensor RL algorithms: advantage estimators, policy/value losses, KL, entropy bonus, loss aggregation.

Nothing here imports Ray, Megatron or the config package; functions take explicit keyword arguments and the
trainer maps its config onto them. Families are looked up by name through registries.
"""

from megarl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    GROUP_ESTIMATORS,
    compute_dr_grpo_advantages,
    compute_gae_advantages,
    compute_grpo_advantages,
    compute_opo_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_reinforce_plus_plus_baseline_advantages,
    compute_remax_advantages,
    compute_rloo_advantages,
    compute_spin_advantages,
    compute_sppo_advantages,
    get_advantage_estimator,
    register_advantage,
)
from megarl.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss
from megarl.algorithms.dynamic_sampling import first_groups, overlong_penalty, rows_of_informative_groups
from megarl.algorithms.entropy import add_entropy_bonus, entropy_from_logits
from megarl.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_in_reward,
    kl_penalty,
    register_kl_estimator,
)
from megarl.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from megarl.algorithms.policy_loss import (
    POLICY_LOSS_ALIASES,
    POLICY_LOSSES,
    compute_gspo_loss,
    compute_ppo_clip_loss,
    get_policy_loss,
    register_policy_loss,
)
from megarl.algorithms.policy_loss_variants import (  # registered under verl's names
    compute_cispo_loss,
    compute_clip_cov_loss,
    compute_dpo_loss,
    compute_gmpo_loss,
    compute_gpg_loss,
    compute_kl_cov_loss,
    compute_sapo_loss,
    compute_sppo_loss,
)
from megarl.algorithms.registry import Registry
from megarl.algorithms.value_loss import compute_value_loss, value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "GROUP_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "POLICY_LOSS_ALIASES",
    "AdaptiveKLController",
    "FixedKLController",
    "Registry",
    "add_entropy_bonus",
    "aggregate_loss",
    "apply_kl_in_reward",
    "compute_cispo_loss",
    "compute_clip_cov_loss",
    "compute_dpo_loss",
    "compute_dr_grpo_advantages",
    "compute_gae_advantages",
    "compute_grpo_advantages",
    "compute_gmpo_loss",
    "compute_gpg_loss",
    "compute_gspo_loss",
    "compute_kl_cov_loss",
    "compute_opo_advantages",
    "compute_ppo_clip_loss",
    "compute_reinforce_plus_plus_advantages",
    "compute_reinforce_plus_plus_baseline_advantages",
    "compute_remax_advantages",
    "compute_rloo_advantages",
    "compute_sapo_loss",
    "compute_spin_advantages",
    "compute_sppo_advantages",
    "compute_sppo_loss",
    "compute_value_loss",
    "entropy_from_logits",
    "first_groups",
    "get_advantage_estimator",
    "get_policy_loss",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "register_advantage",
    "register_kl_estimator",
    "register_policy_loss",
    "rows_of_informative_groups",
    "value_loss",
]
