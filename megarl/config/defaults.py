"""Defaults that follow from other keys, filled in place before a config is checked (verl's meanings).

``critic.enable`` (None: on exactly when the advantage estimator needs values, i.e. gae),
``actor.clip_ratio_low`` / ``clip_ratio_high`` (None: ``clip_ratio``), ``critic.use_sequence_packing`` (None:
the actor's ``model.use_sequence_packing``), ``algorithm.rollout_correction.rollout_is`` (token-level TIS under
``rollout.quantization=fp8`` unless rollout correction is configured; ``none``: none), ``global_profiler.save_path``
(``<trainer.default_local_dir>/profile``). Leaves out every check (:mod:`megarl.config.validate`).
"""

from __future__ import annotations

from megarl.config.schema import MegarlConfig


def fill_derived_defaults(cfg: MegarlConfig) -> MegarlConfig:
    actor = cfg.actor_rollout_ref.actor
    if cfg.critic.enable is None:
        cfg.critic.enable = cfg.algorithm.adv_estimator == "gae"
    if actor.clip_ratio_low is None:
        actor.clip_ratio_low = actor.clip_ratio
    if actor.clip_ratio_high is None:
        actor.clip_ratio_high = actor.clip_ratio
    if cfg.critic.use_sequence_packing is None:
        cfg.critic.use_sequence_packing = cfg.actor_rollout_ref.model.use_sequence_packing
    if cfg.global_profiler.save_path is None:
        cfg.global_profiler.save_path = f"{cfg.trainer.default_local_dir}/profile"
    correction = cfg.algorithm.rollout_correction
    if correction.rollout_is == "none":  # asked for explicitly: none, even under FP8 rollout
        correction.rollout_is = None
    elif cfg.actor_rollout_ref.rollout.quantization == "fp8" and not correction.enabled:
        # FP8 generation moves the rollout's log-probs away from the bf16 trainer's: token-level TIS corrects
        # for it (what verl, slime and NeMo-RL pair with FP8 rollout)
        correction.rollout_is = "token"
    return cfg
