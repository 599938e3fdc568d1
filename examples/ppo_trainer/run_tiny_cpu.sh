#!/usr/bin/env bash
# PPO (GAE, a critic) on the CPU demo task with the embedded tiny model, every key on the command line the way verl's
# example scripts set them (configs/ppo_tiny.yaml is the YAML form of the same demo). VALIDATE_ONLY=1 checks and plans it.
set -euo pipefail
python -m megarl.trainer.main ${VALIDATE_ONLY:+--validate-only} \
    algorithm.adv_estimator=gae algorithm.gamma=1.0 algorithm.lam=1.0 \
    data.train_files="['embedded:digits?num_digits=1']" data.val_files="['embedded:digits?num_digits=1']" \
    data.max_prompt_length=32 data.max_response_length=4 data.train_batch_size=16 \
    actor_rollout_ref.model.path=embedded:tiny-qwen2 \
    actor_rollout_ref.actor.ppo_mini_batch_size=4 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.actor.optim.lr=2e-3 actor_rollout_ref.actor.optim.weight_decay=0.0 \
    actor_rollout_ref.actor.megatron.params_dtype=float32 actor_rollout_ref.actor.megatron.use_distributed_optimizer=false \
    actor_rollout_ref.rollout.name=hf actor_rollout_ref.rollout.dtype=float32 actor_rollout_ref.rollout.n=8 \
    critic.megatron.params_dtype=float32 critic.ppo_mini_batch_size=16 critic.ppo_micro_batch_size_per_gpu=64 \
    critic.optim.lr=1e-3 critic.optim.weight_decay=0.0 \
    trainer.device=cpu trainer.n_gpus_per_node=1 trainer.total_training_steps=60 trainer.test_freq=10 \
    trainer.project_name=megarl_examples trainer.experiment_name=ppo_tiny_cpu "$@"
