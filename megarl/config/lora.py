"""Which LoRA adapters a role trains, from either of verl's spellings: the Megatron block
(``actor_rollout_ref.model.lora.*``, ``critic.model.lora.*``) or the shorthand verl's FSDP backend takes
(``actor_rollout_ref.model.lora_rank``, ``lora_alpha``, ``target_modules``, ``exclude_modules``,
``lora_adapter_path``). Names only; the adapters themselves are :mod:`megarl.models.lora`."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megarl.config.errors import ConfigError
from megarl.config.schema import LoRAConfig, ModelConfig

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
# HF projection names a verl FSDP user writes, and the fused megatron linear each belongs to
HF_TARGET_GROUPS = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}


def resolve_targets(target_modules, key: str = "lora.target_modules") -> tuple[str, ...]:
    """verl's ``target_modules`` (megatron names, HF projection names, or ``all-linear``) as megatron linears.

    Megatron fuses q/k/v and gate/up into one linear each, so an HF name list must name every member of a
    fused group it touches."""
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules or [])
    if not names:
        raise ConfigError(f"{key} is empty: name the linears to adapt (or all-linear)")
    if "all-linear" in names:
        if len(names) > 1:
            raise ConfigError(f"{key}: all-linear stands alone, got {names}")
        return TARGETS
    resolved = [name for name in TARGETS if name in names]
    hf_named = {name for name in names if name not in TARGETS}
    for target, members in HF_TARGET_GROUPS.items():
        named = hf_named & set(members)
        if named and named != set(members):
            raise ConfigError(f"{key} names {sorted(named)} but not {sorted(set(members) - named)}: megatron fuses "
                              f"{', '.join(members)} into {target}; name them all (or {target})")
        if named and target not in resolved:
            resolved.append(target)
        hf_named -= named
    if hf_named:
        known = sorted(n for group in HF_TARGET_GROUPS.values() for n in group)
        raise ConfigError(f"{key}: unknown module(s) {sorted(hf_named)}; expected any of {list(TARGETS)}, their HF "
                          f"names {known}, or all-linear")
    return tuple(name for name in TARGETS if name in resolved)


def _checked(lora: LoRAConfig, prefix: str) -> LoRAConfig:
    if lora.type != "lora":
        raise ConfigError(f"{prefix}.type={lora.type!r}: megarl trains plain LoRA (type: lora); dora and "
                          f"canonical_lora are not implemented")
    if lora.alpha <= 0:
        raise ConfigError(f"{prefix}.alpha must be > 0, got {lora.alpha}")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"{prefix}.dropout must be in [0, 1), got {lora.dropout}")
    resolve_targets(lora.target_modules, f"{prefix}.target_modules")
    return lora


def model_lora(model: ModelConfig, prefix: str = "actor_rollout_ref.model") -> Optional[LoRAConfig]:
    """The actor's adapters (None: full-parameter training), whichever spelling set them."""
    block, rank = model.lora, model.lora_rank
    if block.rank < 0 or rank < 0:
        raise ConfigError(f"{prefix}.lora.rank and {prefix}.lora_rank must be >= 0 (0: no LoRA)")
    if block.rank and rank:
        raise ConfigError(f"{prefix}.lora.rank={block.rank} and {prefix}.lora_rank={rank} both ask for LoRA: "
                          f"set one spelling (the lora block, or verl's lora_rank shorthand)")
    if block.rank:
        return _checked(block, f"{prefix}.lora")
    if rank:
        shorthand = dataclasses.replace(block, rank=rank, alpha=model.lora_alpha, target_modules=model.target_modules,
                                        exclude_modules=list(model.exclude_modules or []),
                                        adapter_path=model.lora_adapter_path or block.adapter_path)
        return _checked(shorthand, prefix)
    return None


def block_lora(lora: LoRAConfig, prefix: str) -> Optional[LoRAConfig]:
    """A role's ``model.lora`` block alone (the critic's); None when its rank is 0."""
    if lora.rank < 0:
        raise ConfigError(f"{prefix}.rank must be >= 0 (0: no LoRA), got {lora.rank}")
    return _checked(lora, prefix) if lora.rank else None
