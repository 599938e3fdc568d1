"""Config -> engine arguments: what the Megatron engines and the rollout engine are built and driven with,
computed from the typed config in one place (the workers build them once)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Optional

import torch

from megarl.algorithms.distillation import DistillationSpec
from megarl.algorithms.policy_loss import POLICY_LOSS_ALIASES, get_policy_loss
from megarl.config.lora import resolve_targets
from megarl.config.schema import ActorConfig, LoRAConfig, MegarlConfig, MegatronConfig, OptimConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def megatron_optimizer_config(optim: OptimConfig, m: MegatronConfig):
    from megatron.core.optimizer import OptimizerConfig

    dtype = DTYPES[m.params_dtype]
    return OptimizerConfig(**{
        **dict(optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
               adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
               clip_grad=optim.clip_grad, bf16=dtype == torch.bfloat16, params_dtype=dtype,
               use_distributed_optimizer=m.use_distributed_optimizer),
        **optim.override_optimizer_config,  # megatron's own options, as verl passes them (checked at load)
    })


def lora_spec(lora: LoRAConfig | None, *, seed: int):
    """The adapters a role's engine attaches (None: full-parameter training)."""
    if lora is None:
        return None
    from megarl.models.lora import LoRASpec

    return LoRASpec(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=resolve_targets(lora.target_modules),
                    exclude=tuple(lora.exclude_modules), init_seed=seed)


def lora_serving(lora: LoRAConfig, separate_rollout: bool) -> bool:
    """Whether the rollout engine gets the adapters merged into full weights (True) or serves the adapter itself
    (False: only the adapter's tensors move per sync). ``lora.merge`` decides when set; unset: merged. Why: at 7B
    on one H100 the merged sync took 0.13 s of a 17.2 s step (docs/benchmarks.md, "7B LoRA GRPO with the recompute
    fix"; at 14B 0.26 s), so the most serving could save is ~1%, while vLLM's LoRA kernels run on every decode
    step and a served adapter makes the engine keep its base weights through sleep (a host copy of the whole
    model). Measured at 14B on one H100 (2026-12-08): served 2,667 tokens/s/GPU against merged 3,010 (generation
    12.40 s against 9.61; the sync phase 0.80 s against 0.26, most of it vLLM copying its base back from the host),
    so merged is the default at every size. The choice is logged."""
    import logging

    merged = True if lora.merge is None else bool(lora.merge)
    if separate_rollout and not merged:
        raise ValueError("lora.merge=false (the rollout engine serves the adapter) needs trainer.placement=colocate")
    logging.getLogger(__name__).warning(
        "LoRA rank %d: the rollout engine %s (%s)", lora.rank,
        "gets the merged weights each sync" if merged else "serves the adapter (only it moves per sync)",
        "lora.merge" if lora.merge is not None else "lora.merge unset: merged by default")
    return merged


def lr_schedule(optim: OptimConfig, total_steps: int):
    from megarl.engines.megatron.lr_schedule import LRScheduleConfig

    decay = optim.lr_decay_steps or max(total_steps, optim.lr_warmup_steps + 1)
    return LRScheduleConfig(warmup_steps=optim.lr_warmup_steps, decay_steps=decay,
                            decay_style=optim.lr_decay_style, min_lr=optim.min_lr)


def ddp_config(m: MegatronConfig):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(**{
        **dict(grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=m.use_distributed_optimizer),
        **m.override_ddp_config,
    })


def transformer_overrides(m: MegatronConfig) -> dict:
    """megarl's TransformerConfig settings for a role, then ``override_transformer_config`` (verl's) over them."""
    overrides = {"sequence_parallel": m.sequence_parallel, **m.recompute_settings()}
    given = dict(m.override_transformer_config)
    if isinstance(given.get("attention_backend"), str):  # verl writes megatron's enum by name (flash, local, ...)
        from megatron.core.transformer.enums import AttnBackend

        given["attention_backend"] = AttnBackend[given["attention_backend"]]
    return {**overrides, **given}


def policy_loss_arguments(actor: ActorConfig) -> dict:
    """The policy loss (``policy_loss.loss_mode``) and its clip bounds as verl means them: PPO-clip (``vanilla``)
    always takes the dual clip (``clip_ratio_c``, 3.0 by default; null turns it off); the other losses have
    none. ``policy_loss_options``: the loss's own settings (KL-Cov's, Clip-Cov's, SAPO's ``tau_pos``/``tau_neg``),
    the ones its function takes."""
    name = POLICY_LOSS_ALIASES.get(actor.policy_loss.loss_mode, actor.policy_loss.loss_mode)
    available = {**dataclasses.asdict(actor.policy_loss), "tau_pos": actor.tau_pos, "tau_neg": actor.tau_neg,
                 "sppo_eta": actor.sppo_eta, "dpo_beta": actor.dpo_beta, "dpo_loss_type": actor.dpo_loss_type,
                 "dpo_label_smoothing": actor.dpo_label_smoothing}
    accepted = inspect.signature(get_policy_loss(name)).parameters
    options = {key: value for key, value in available.items() if key in accepted}
    return dict(policy_loss_name=name, clip_ratio_low=actor.clip_ratio_low, clip_ratio_high=actor.clip_ratio_high,
                clip_ratio_c=actor.clip_ratio_c if name == "ppo_clip" else None, policy_loss_options=options)


def mini_batch_rows(cfg: MegarlConfig, ppo_mini_batch_size: int, dp_size: int) -> int:
    """Rows of one mini-batch on a rank of ``dp_size`` data-parallel replicas: ``ppo_mini_batch_size`` prompts,
    each with its ``rollout.n`` responses (SPIN: its one chosen / rejected pair), split over the replicas."""
    return ppo_mini_batch_size * cfg.responses_trained_per_prompt // dp_size


def distillation_spec(cfg: MegarlConfig) -> Optional[DistillationSpec]:
    """On-policy distillation's loss settings (``distillation.distillation_loss``), or None when it is off."""
    if not cfg.distillation.enabled:
        return None
    d = cfg.distillation.distillation_loss
    return DistillationSpec(
        loss_mode=d.loss_mode, use_policy_gradient=d.use_policy_gradient, use_task_rewards=d.use_task_rewards,
        distillation_loss_coef=d.distillation_loss_coef, loss_max_clamp=d.loss_max_clamp,
        log_prob_min_clamp=d.log_prob_min_clamp,
        clip_ratio_low=d.clip_ratio if d.clip_ratio_low is None else d.clip_ratio_low,
        clip_ratio_high=d.clip_ratio if d.clip_ratio_high is None else d.clip_ratio_high)


def actor_update_arguments(cfg: MegarlConfig, dp_size: int) -> dict:
    """The keyword arguments of ``ActorEngine.update_policy`` for this config, on a rank of ``dp_size``
    data-parallel replicas."""
    a = cfg.actor_rollout_ref.actor
    return dict(ppo_epochs=a.ppo_epochs, mini_batch_size=mini_batch_rows(cfg, a.ppo_mini_batch_size, dp_size),
                **policy_loss_arguments(a), entropy_coeff=a.entropy_coeff, use_kl_loss=a.use_kl_loss,
                kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type, loss_agg_mode=a.loss_agg_mode,
                norm_length=cfg.data.max_response_length, distillation=distillation_spec(cfg),
                replay_routing=a.megatron.router_replay.mode != "disabled")


def critic_update_arguments(cfg: MegarlConfig, dp_size: int) -> dict:
    """The keyword arguments of ``CriticEngine.update_critic`` for this config, on a rank of ``dp_size``
    data-parallel replicas."""
    c = cfg.critic
    return dict(ppo_epochs=c.ppo_epochs, mini_batch_size=mini_batch_rows(cfg, c.ppo_mini_batch_size, dp_size),
                cliprange_value=c.cliprange_value, loss_agg_mode=c.loss_agg_mode,
                replay_routing=c.megatron.router_replay.mode != "disabled")


def routes_with_replay(cfg: MegarlConfig) -> bool:
    """Whether the actor's engine (and its reference) needs its routers replayable: a replay mode, or the
    rollout's routing to compare with (``routing/rollout_mismatch_frac``)."""
    arr = cfg.actor_rollout_ref
    return arr.actor.megatron.router_replay.mode != "disabled" or arr.rollout.enable_rollout_routing_replay
