"""Resume that cannot surprise: a run resumes only the run it continues, and says when there is nothing left.

Each checkpoint keeps the config that wrote it (``trainer_state.json``'s ``config``). Before anything starts, a
run that would resume from a checkpoint (``trainer.resume_mode=auto`` finding one, or a checkpoint directory
given) is compared with it on the keys that make it the same run: the algorithm, the model, the data and the
batch shape, the policy loss, the rewards, the seed. Any difference is refused with every differing key listed;
``trainer.resume_allow_changes=true`` resumes anyway and prints the differences. Performance knobs (layouts,
micro-batches, token budgets, offload, the rollout engine's memory), logging, saving, the LR schedule (which a
resumed run takes from its own config and prints: see the loop) and the total length may change freely.

A run whose checkpoint is already at or past ``trainer.total_training_steps`` is refused too: it would train
nothing and exit 0. Raising the total extends it.

``config.yaml`` in the run folder is the latest run's config; the ones before it are kept in ``config_history/``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from megarl.config.errors import ConfigError
from megarl.config.loader import flatten_dotted, save_config, to_dict
from megarl.config.schema import MegarlConfig

# The keys (and key prefixes, ending in ".") that make a run the same run.
RUN_IDENTITY = (
    "algorithm.", "data.train_files", "data.prompt_key", "data.max_prompt_length", "data.max_response_length",
    "data.train_batch_size", "data.shuffle", "data.seed", "data.apply_chat_template", "data.truncation",
    "data.filter_overlong_prompts", "actor_rollout_ref.model.path", "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.temperature", "actor_rollout_ref.rollout.top_p", "actor_rollout_ref.rollout.top_k",
    "actor_rollout_ref.rollout.multi_turn.", "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_epochs", "actor_rollout_ref.actor.policy_loss.", "actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.actor.loss_agg_mode", "actor_rollout_ref.actor.tau_", "actor_rollout_ref.actor.entropy_coeff",
    "actor_rollout_ref.actor.use_kl_loss", "actor_rollout_ref.actor.kl_loss_", "actor_rollout_ref.actor.load_weight",
    "critic.enable", "critic.model_path", "critic.ppo_mini_batch_size", "critic.cliprange_value",
    "reward_model.enable", "reward_model.model.", "reward_model.custom_function.", "reward_model.rm_weight",
    "reward_model.function_weight", "reward_model.overlong_buffer.", "reward_model.judge.", "reward_model.remote.url",
    "async_training.mode", "trainer.seed",
)


def _is_identity(key: str) -> bool:
    return any(key.startswith(item) if item.endswith(".") else key == item or key.startswith(item + "_")
               or key.startswith(item + ".") for item in RUN_IDENTITY)


def identity_changes(previous: dict, current: dict) -> list[str]:
    """``key: old -> new`` for every run-identity key whose value differs (keys only one side has included)."""
    old, new = flatten_dotted(previous), flatten_dotted(current)
    return [f"{key}: {old.get(key, '<absent>')!r} -> {new.get(key, '<absent>')!r}"
            for key in sorted(set(old) | set(new)) if _is_identity(key) and old.get(key) != new.get(key)]


def resume_point(cfg: MegarlConfig, checkpoints) -> Optional[Path]:
    """The checkpoint directory this run will resume from, or None (``checkpoints``: its CheckpointManager)."""
    mode = cfg.trainer.resume_mode
    if mode == "disable":
        return None
    if mode == "auto":
        step = checkpoints.latest_step()
        return None if step is None else checkpoints.step_dir(step)
    return Path(mode)


def read_trainer_state(root: Path) -> dict:
    """The trainer's state in the checkpoint directory ``root`` (what the loop resumes, and what wrote it)."""
    path = root / "trainer_state.json"
    if not path.is_file():
        raise FileNotFoundError(f"trainer.resume_mode={root}: {path} not found (not a finished checkpoint)")
    return json.loads(path.read_text())


def check_resume(cfg: MegarlConfig, root: Optional[Path], total_steps: int) -> None:
    """Refuse a resume from ``root`` into another run, or into a finished one (see the module docstring)."""
    if root is None:
        return
    trainer_state = read_trainer_state(root)
    step = trainer_state["step"]
    previous = trainer_state.get("config")
    if previous is None:
        print(f"resume: {root} does not record the config that wrote it (an older checkpoint): it is not compared "
              f"with this run's", flush=True)
    else:
        changes = identity_changes(previous, to_dict(cfg))
        if changes and not cfg.trainer.resume_allow_changes:
            raise ConfigError(
                f"trainer.resume_mode={cfg.trainer.resume_mode} would resume {root} (step {step}), which another "
                f"run wrote: " + "; ".join(changes) + ". Use another trainer.default_local_dir (or "
                "trainer.resume_mode=disable to start afresh there), or trainer.resume_allow_changes=true to resume "
                "it with these changes")
        for change in changes:
            print(f"resume with a changed setting (trainer.resume_allow_changes=true): {change}", flush=True)
    if step >= total_steps:
        raise ConfigError(
            f"{root} is step {step} of a run that is done: this run's total is {total_steps} step(s) "
            f"(trainer.total_training_steps / total_epochs). Raise trainer.total_training_steps to train further, "
            f"or use another trainer.default_local_dir")


def save_run_config(cfg: MegarlConfig, out_dir: Path) -> Path:
    """``out_dir/config.yaml`` <- this run's config; a previous one moves to ``config_history/`` first."""
    path = out_dir / "config.yaml"
    if path.is_file():
        history = out_dir / "config_history"
        history.mkdir(parents=True, exist_ok=True)
        index = 1 + max((int(p.stem.split(".")[-1]) for p in history.glob("config.*.yaml")
                         if p.stem.split(".")[-1].isdigit()), default=0)
        path.replace(history / f"config.{index}.yaml")
    out_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, path)
    return path
