#!/usr/bin/env bash
# GRPO on GSM8K, Qwen2.5-7B-Instruct, one node of 8 x 80 GB GPUs: Megatron TP2 x DP4, vLLM TP2, colocated.
# verl's habit: every key on the command line (no --config); extra a.b.c=value arguments are appended.
#   python -m megarl.data.preprocess gsm8k --input gsm8k/train.jsonl --test-input gsm8k/test.jsonl --output data/gsm8k
#   bash examples/grpo_trainer/run_qwen2_5_7b_megatron.sh trainer.total_epochs=2
# VALIDATE_ONLY=1 loads, checks and plans the run without starting it.
set -euo pipefail
MODEL=${MODEL:-checkpoints/hf/Qwen2.5-7B-Instruct}
python -m megarl.trainer.main ${VALIDATE_ONLY:+--validate-only} \
    algorithm.adv_estimator=grpo \
    data.train_files=[data/gsm8k/train.parquet] data.val_files=[data/gsm8k/test.parquet] \
    data.train_batch_size=256 data.max_prompt_length=512 data.max_response_length=1024 \
    actor_rollout_ref.model.path=$MODEL actor_rollout_ref.model.use_sequence_packing=true \
    actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 actor_rollout_ref.actor.ppo_max_token_len_per_gpu=6144 \
    actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 actor_rollout_ref.actor.megatron.sequence_parallel=true \
    actor_rollout_ref.actor.megatron.param_offload=true actor_rollout_ref.actor.megatron.grad_offload=true \
    actor_rollout_ref.actor.megatron.optimizer_offload=true actor_rollout_ref.ref.param_offload=true \
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
    trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.device=cuda trainer.total_epochs=1 \
    trainer.save_freq=50 trainer.test_freq=10 trainer.project_name=megarl_examples \
    trainer.experiment_name=qwen2_5_7b_gsm8k_grpo_megatron "$@"
