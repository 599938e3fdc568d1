"""Defaults that follow from other keys, filled in place before a config is checked (verl's meanings).

``critic.enable`` (None: on exactly when the advantage estimator needs values, i.e. gae),
``actor.clip_ratio_low`` / ``clip_ratio_high`` (None: ``clip_ratio``), ``critic.use_sequence_packing`` (None:
the actor's ``model.use_sequence_packing``). Leaves out every check (:mod:`megarl.config.validate`).
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
    return cfg
