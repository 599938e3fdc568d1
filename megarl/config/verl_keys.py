"""verl keys that megarl does not take, each with the reason and megarl's way to the same end.

A verl user's command line is checked against the schema as a whole: every unknown key is reported at once
(:func:`megarl.config.loader.read_config`), and a key listed here is explained instead of guessed at. Keys are
matched in full, or by their last part for the ones verl has under several sections (``LEAF``). The README's
table "verl keys megarl answers differently" is this table (tests/unit/config/test_verl_keys.py keeps them in step).
"""

from __future__ import annotations

from typing import Optional

FULL = {
    "custom_reward_function.path": "megarl's key is reward_model.custom_function.path",
    "custom_reward_function.name": "megarl's key is reward_model.custom_function.name",
    "trainer.critic_warmup": "not supported: the critic trains from step 1 (verl's default, 0, is what megarl does)",
    "actor_rollout_ref.rollout.mode": ("verl's sync/async rollout servers: megarl's rollout engines run inside the "
                                       "workers; asynchronous training is async_training.mode=one_step_off or "
                                       "fully_async"),
    "actor_rollout_ref.hybrid_engine": ("always on: colocated actor and rollout by default, trainer.placement=separate "
                                        "for their own GPUs"),
    "actor_rollout_ref.actor.ppo_micro_batch_size": "use actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.checkpoint.save_contents": ("megarl's checkpoints always hold the model, optimizer and "
                                                         "RNG state (exact resume); trainer.save_hf=true adds a "
                                                         "Hugging Face copy of the policy"),
    "actor_rollout_ref.actor.fsdp_config": "megarl trains with Megatron: actor_rollout_ref.actor.megatron.*",
}
LEAF = {
    "enable_gradient_checkpointing": ("activation recompute is Megatron's: actor_rollout_ref.actor.megatron."
                                      "recompute_granularity=full (or selective)"),
    "use_remove_padding": "megarl's key is actor_rollout_ref.model.use_sequence_packing=true",
    "use_dynamic_bsz": ("megarl: actor_rollout_ref.model.use_sequence_packing=true with the *_max_token_len_per_gpu "
                        "budgets (verl's names)"),
    "trust_remote_code": ("not supported: megarl builds the model from its HF config through its own bridge (Llama 3, "
                          "Qwen2/2.5/3, Qwen3-MoE, DeepSeek-V3) and loads tokenizers without remote code"),
    "use_mbridge": "not needed: megarl's own bridge (megarl.models.bridge) always maps HF <-> Megatron",
}


def explain(key: str) -> Optional[str]:
    """Why megarl does not take the verl key ``key`` and what to use instead; None for a key verl lacks too."""
    if key in FULL:
        return FULL[key]
    for prefix, reason in FULL.items():
        if key.startswith(prefix + "."):
            return reason
    return LEAF.get(key.rsplit(".", 1)[-1])


# What a verl user's command line almost always sets; a run that leaves one to megarl's default says which, with
# the value it got, at start-up (megarl.trainer.main): the defaults are production-sized, not the run's.
USUALLY_SET = (
    "data.train_files", "data.val_files", "data.max_prompt_length", "data.max_response_length",
    "data.train_batch_size", "actor_rollout_ref.model.path", "actor_rollout_ref.actor.optim.lr",
    "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.rollout.name", "actor_rollout_ref.rollout.n",
    "algorithm.adv_estimator", "trainer.experiment_name", "trainer.total_epochs", "trainer.save_freq",
    "trainer.n_gpus_per_node",
)


def defaulted_usual_keys(cfg, given: set[str]) -> list[str]:
    """``key=value`` for each of :data:`USUALLY_SET` that neither the YAML file nor the command line gave
    (``trainer.total_epochs`` counts as given with ``trainer.total_training_steps``)."""
    given = set(given) | ({"trainer.total_epochs"} if "trainer.total_training_steps" in given else set())
    out = []
    for key in USUALLY_SET:
        if key in given:
            continue
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        out.append(f"{key}={node}")
    return out
