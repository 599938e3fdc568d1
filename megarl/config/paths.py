"""Relative paths of a config made absolute once, on the driver, against its working directory.

Workers run in other directories (a Ray worker starts in its node's session directory, a node started by hand
in whatever directory ``ray start`` ran), so a relative ``trainer.default_local_dir`` meant a different place on
the driver and on the workers: a committed checkpoint without its model shards, seen under real Slurm. Every
path field is rewritten before anything is sent to a worker: the output directory always; data files, model
and tokenizer paths and the custom reward file when they start with ``./``, ``../`` or name something that
exists here (a bare ``org/name`` that exists nowhere stays as it is: it may be a hub id). ``embedded:`` names
are left alone. Pure: it only reads the given base directory's entries.
"""

from __future__ import annotations

import copy
from pathlib import Path

from megarl.config.schema import MegarlConfig


def _absolute(value, base: Path, *, always: bool = False):
    if not value or not isinstance(value, str) or value.startswith("embedded:") or Path(value).is_absolute():
        return value
    candidate = base / value
    if always or value.startswith(("./", "../")) or candidate.exists():
        return str(candidate.resolve())
    return value


def with_absolute_paths(cfg: MegarlConfig, base: str | Path) -> MegarlConfig:
    """A copy of ``cfg`` whose relative paths point where they point from ``base``."""
    base = Path(base)
    cfg = copy.deepcopy(cfg)
    cfg.trainer.default_local_dir = _absolute(cfg.trainer.default_local_dir, base, always=True)
    cfg.data.train_files = [_absolute(f, base) for f in cfg.data.train_files]
    cfg.data.val_files = [_absolute(f, base) for f in cfg.data.val_files]
    model = cfg.actor_rollout_ref.model
    model.path = _absolute(model.path, base)
    model.tokenizer_path = _absolute(model.tokenizer_path, base)
    cfg.critic.model_path = _absolute(cfg.critic.model_path, base)
    model.lora.adapter_path = _absolute(model.lora.adapter_path, base)
    model.lora_adapter_path = _absolute(model.lora_adapter_path, base)
    actor_megatron = cfg.actor_rollout_ref.actor.megatron
    actor_megatron.dist_checkpointing_path = _absolute(actor_megatron.dist_checkpointing_path, base)
    custom = cfg.reward_model.custom_function
    custom.path = _absolute(custom.path, base)
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    multi_turn.tool_config_path = _absolute(multi_turn.tool_config_path, base)
    for teacher in cfg.distillation.teacher_models.values():
        teacher.model_path = _absolute(teacher.model_path, base)
    if cfg.trainer.resume_mode not in ("auto", "disable"):
        cfg.trainer.resume_mode = _absolute(cfg.trainer.resume_mode, base, always=True)
    return cfg
