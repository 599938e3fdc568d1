#!/usr/bin/env bash
# LoRA GRPO of Qwen2.5-7B on one GPU: rank 32 adapters on every linear, the frozen base off the device while vLLM
# generates, the reference = the base with the adapters off (README "LoRA RL"; a 14B run on one H100:
# docs/benchmarks.md "LoRA RL"). Extra a.b.c=value arguments are appended; VALIDATE_ONLY=1 checks and plans.
set -euo pipefail
MODEL=${MODEL:-checkpoints/hf/Qwen2.5-7B-Instruct}
python -m megarl.trainer.main ${VALIDATE_ONLY:+--validate-only} \
    algorithm.adv_estimator=grpo \
    data.train_files=[data/gsm8k/train.parquet] data.val_files=[data/gsm8k/test.parquet] \
    data.train_batch_size=64 data.max_prompt_length=512 data.max_response_length=1024 \
    actor_rollout_ref.model.path=$MODEL actor_rollout_ref.model.use_sequence_packing=true \
    actor_rollout_ref.model.lora_rank=32 actor_rollout_ref.model.lora_alpha=64 actor_rollout_ref.model.target_modules=all-linear \
    actor_rollout_ref.actor.optim.lr=3e-5 actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192 actor_rollout_ref.actor.use_kl_loss=true \
    actor_rollout_ref.actor.megatron.param_offload=true actor_rollout_ref.actor.megatron.recompute_granularity=full \
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384 actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=16384 \
    trainer.n_gpus_per_node=1 trainer.device=cuda trainer.total_epochs=1 trainer.save_freq=50 trainer.save_hf=true \
    trainer.project_name=megarl_examples trainer.experiment_name=qwen2_5_7b_grpo_lora "$@"
