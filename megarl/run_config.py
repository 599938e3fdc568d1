"""A run's config, loaded and checked in full.

:mod:`megarl.config` reads it (YAML + ``a.b.c=value`` overrides, typed, interpolated) and fills its derived
defaults; :func:`validate_config` then checks it without changing it: the config's own consistency rules
(:func:`megarl.config.validate.check_config`); every name that picks a function out of a registry of
:mod:`megarl.algorithms` (advantage estimator, policy loss, KL estimator, loss aggregation) against that
registry itself; and the settings a component checks for itself (the remote reward client's, rollout
correction's) by that component's own check, before anything starts. An estimator registered there
(``register_advantage("mine", uses_groups=True)``) is a valid ``algorithm.adv_estimator`` at once, with its
needs checked; no copy of the names or of a component's rules is kept anywhere.

The config package sits below the algorithms (docs/design.md) and cannot read their registries, so a run's
config is loaded here: :func:`load_config`.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Iterable, Optional

from megarl.algorithms.advantages import ADVANTAGE_ESTIMATORS, GROUP_ESTIMATORS
from megarl.algorithms.aggregation import LOSS_AGG_MODES
from megarl.algorithms.kl import KL_ESTIMATORS
from megarl.algorithms.policy_loss import POLICY_LOSS_ALIASES, POLICY_LOSSES
from megarl.algorithms.rollout_correction import check_rollout_correction_settings
from megarl.config.defaults import fill_derived_defaults
from megarl.config.errors import ConfigError
from megarl.config.loader import read_config
from megarl.config.schema import MegarlConfig
from megarl.config.validate import check_choice, check_config
from megarl.rewards.remote import check_remote_settings


def check_registered_names(cfg: MegarlConfig) -> None:
    """Raise :class:`ConfigError` for a name no registry holds, or an estimator whose needs are not met."""
    alg, actor, n = cfg.algorithm, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout.n
    policy_losses = POLICY_LOSSES.names() + sorted(POLICY_LOSS_ALIASES)
    for value, registered, key in (
        (alg.adv_estimator, ADVANTAGE_ESTIMATORS.names(), "algorithm.adv_estimator"),
        (alg.kl_penalty, KL_ESTIMATORS.names(), "algorithm.kl_penalty"),
        (actor.policy_loss.loss_mode, policy_losses, "actor_rollout_ref.actor.policy_loss.loss_mode"),
        (actor.loss_agg_mode, LOSS_AGG_MODES, "actor_rollout_ref.actor.loss_agg_mode"),
        (actor.kl_loss_type, KL_ESTIMATORS.names(), "actor_rollout_ref.actor.kl_loss_type"),
        (cfg.distillation.distillation_loss.loss_mode, KL_ESTIMATORS.names(),
         "distillation.distillation_loss.loss_mode"),
        (cfg.critic.loss_agg_mode, LOSS_AGG_MODES, "critic.loss_agg_mode"),
    ):
        check_choice(value, registered, key)
    if alg.adv_estimator in GROUP_ESTIMATORS and n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={alg.adv_estimator} compares responses to the same prompt and needs "
            f"actor_rollout_ref.rollout.n >= 2, got {n}"
        )


def check_component_settings(cfg: MegarlConfig) -> None:
    """Raise :class:`ConfigError` with a component's own words for settings it would refuse at run time."""
    correction, remote = cfg.algorithm.rollout_correction, cfg.reward_model.remote
    try:
        check_rollout_correction_settings(
            rollout_is=correction.rollout_is, rollout_is_threshold=correction.rollout_is_threshold,
            rollout_rs=correction.rollout_rs, rollout_rs_threshold=correction.rollout_rs_threshold)
        if remote.url is not None:
            check_remote_settings(url=remote.url, batch_size=remote.batch_size,
                                  max_concurrency=remote.max_concurrency, timeout_s=remote.timeout_s,
                                  max_retries=remote.max_retries, backoff_s=remote.backoff_s)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _refuse_unknown_fields(key: str, names, megatron_cls) -> None:
    """Every name in ``names`` is a field of the megatron-core dataclass ``megatron_cls``; else the closest one is
    named."""
    known = {f.name for f in dataclasses.fields(megatron_cls)}
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{key}.{name}: megatron-core's {megatron_cls.__name__} has no field {name!r}{hint}")


def check_megatron_overrides(cfg: MegarlConfig) -> None:
    """``*.optim.override_optimizer_config``, ``*.megatron.override_ddp_config`` and ``override_transformer_config``
    name megatron-core's own
    fields: an unknown name, or values megatron refuses, fail at load with the key, not at the first step."""
    roles = (("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor), ("critic", cfg.critic))
    megatrons = (("actor_rollout_ref.actor.megatron", cfg.actor_rollout_ref.actor.megatron),
                 ("critic.megatron", cfg.critic.megatron), ("reward_model.megatron", cfg.reward_model.megatron))
    if not any(role.optim.override_optimizer_config or role.megatron.override_ddp_config for _, role in roles) and \
            not any(megatron.override_transformer_config for _, megatron in megatrons):
        return  # nothing to check: loading a config does not import megatron-core (seconds) for nothing
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    for prefix, role in roles:
        for key, overrides, megatron_cls in (
                (f"{prefix}.optim.override_optimizer_config", role.optim.override_optimizer_config, OptimizerConfig),
                (f"{prefix}.megatron.override_ddp_config", role.megatron.override_ddp_config,
                 DistributedDataParallelConfig)):
            _refuse_unknown_fields(key, overrides, megatron_cls)
            try:  # with the base megarl gives it (engine_specs), which megatron's own checks may need
                megatron_cls(**{"use_distributed_optimizer": role.megatron.use_distributed_optimizer, **overrides})
            except (AssertionError, ValueError) as exc:
                raise ConfigError(f"{key}: megatron-core refuses {overrides}: {exc}") from exc
            except TypeError:  # megatron-core 0.16's own check trips without Transformer Engine: it decides at build
                pass
        if role.optim.override_optimizer_config.get("optimizer_cpu_offload") and cfg.trainer.device == "cpu":
            raise ConfigError(f"{prefix}.optim.override_optimizer_config.optimizer_cpu_offload=true moves the "
                              f"optimizer from the GPU to the host: trainer.device=cpu has no GPU to move it from")
    for prefix, megatron in megatrons:
        _refuse_unknown_fields(f"{prefix}.override_transformer_config", megatron.override_transformer_config,
                               TransformerConfig)


def validate_config(cfg: MegarlConfig) -> MegarlConfig:
    """Fill the derived defaults of ``cfg`` in place, then raise :class:`ConfigError` on its first fault."""
    fill_derived_defaults(cfg)
    check_registered_names(cfg)
    check_component_settings(cfg)
    check_megatron_overrides(cfg)
    check_config(cfg)
    return cfg


def load_config(path: Optional[str | Path] = None, overrides: Iterable[str] = ()) -> MegarlConfig:
    """Defaults <- YAML file (if given) <- overrides, type-checked, interpolated, filled and validated."""
    return validate_config(read_config(path, overrides))
