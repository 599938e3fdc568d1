#!/usr/bin/env bash
# Full-parameter GRPO of Qwen2.5-7B on ONE 80 GB GPU: most of Adam's state and the fp32 master weights on the host
# (megatron's HybridDeviceOptimizer), full activation recompute, grads dropped while vLLM generates. Measured on an
# H100: docs/benchmarks.md, "7B on one GPU". Extra a.b.c=value arguments are appended; VALIDATE_ONLY=1 checks and plans.
set -euo pipefail
MODEL=${MODEL:-checkpoints/hf/Qwen2.5-7B-Instruct}
A=actor_rollout_ref.actor
python -m megarl.trainer.main ${VALIDATE_ONLY:+--validate-only} \
    algorithm.adv_estimator=grpo \
    data.train_files=[data/gsm8k/train.parquet] data.val_files=[data/gsm8k/test.parquet] \
    data.train_batch_size=16 data.max_prompt_length=256 data.max_response_length=512 \
    actor_rollout_ref.model.path=$MODEL actor_rollout_ref.model.use_sequence_packing=true \
    $A.ppo_mini_batch_size=16 $A.ppo_max_token_len_per_gpu=4096 $A.optim.lr=1e-6 \
    $A.megatron.use_distributed_optimizer=true $A.megatron.recompute_granularity=full $A.megatron.grad_offload=true \
    $A.megatron.override_ddp_config.grad_reduce_in_fp32=false \
    $A.optim.override_optimizer_config.optimizer_cpu_offload=true \
    $A.optim.override_optimizer_config.optimizer_offload_fraction=0.75 \
    $A.optim.override_optimizer_config.overlap_cpu_optimizer_d2h_h2d=true \
    $A.optim.override_optimizer_config.use_precision_aware_optimizer=true \
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.gpu_memory_utilization=0.42 \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=8192 \
    trainer.n_gpus_per_node=1 trainer.device=cuda trainer.total_epochs=1 trainer.save_freq=50 \
    trainer.project_name=megarl_examples trainer.experiment_name=qwen2_5_7b_grpo_one_gpu "$@"
