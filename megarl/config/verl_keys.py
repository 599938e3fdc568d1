"""verl keys that megarl does not take, each with the reason and megarl's way to the same end.

A verl user's command line is checked against the schema as a whole: every unknown key is reported at once
(:func:`megarl.config.loader.read_config`), and a key listed here is explained instead of guessed at. Keys are
matched in full or by a section prefix (``FULL``, the most specific first), by a section name anywhere in the key
(``SEGMENT``: ``*.profiler.*``), or by their last part for the ones verl has under several sections (``LEAF``).
Every one of verl 0.9.1's ppo_trainer / ppo_megatron_trainer keys is either megarl's own with verl's meaning or
explained here (tests/unit/config/verl_0_9_1_keys.txt, tests/unit/config/test_verl_keys.py). docs/verl_keys.md is
this table (:func:`markdown_table`), and the README shows the most common rows.
"""

from __future__ import annotations

from typing import Optional

FULL = {
    "custom_reward_function.path": "megarl's key is reward_model.custom_function.path",
    "custom_reward_function.name": "megarl's key is reward_model.custom_function.name",
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
    "actor_rollout_ref.actor.policy_loss.dro_beta": ("the DRO policy loss it configures is not in megarl; "
                                                     "actor_rollout_ref.actor.policy_loss.loss_mode names the ones "
                                                     "that are"),
    # whole sections of verl 0.9 (ppo_trainer / ppo_megatron_trainer) that megarl answers another way
    "actor_rollout_ref.ref.megatron": ("the reference shares the actor's layout (actor_rollout_ref.actor.megatron.*); "
                                       "actor_rollout_ref.ref.param_offload is its own offload knob"),
    "actor_rollout_ref.ref.megatron.router_replay": ("the reference replays what the actor's mode replays "
                                                     "(actor_rollout_ref.actor.megatron.router_replay.mode)"),
    "actor_rollout_ref.ref.strategy": "megarl's reference is always a Megatron engine (or, with LoRA, the base)",
    "actor_rollout_ref.ref.use_torch_compile": "megarl compiles its own small kernels on CUDA (MEGARL_COMPILE=0 off)",
    "actor_rollout_ref.ref.log_prob_micro_batch_size": "use actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": ("megarl: actor_rollout_ref.model.use_sequence_packing=true with "
                                                      "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"),
    "actor_rollout_ref.ref.entropy_from_logits_with_chunking": "megarl's fused vocab-parallel log-prob never "
                                                               "materialises full logits: nothing to chunk",
    "actor_rollout_ref.ref.entropy_checkpointing": "megarl's fused vocab-parallel log-prob keeps no logits copy",
    "actor_rollout_ref.ref.fsdp_config": "megarl's reference is a Megatron engine: actor_rollout_ref.actor.megatron.*",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": ("megarl splits long sequences with Megatron's context "
                                                             "parallelism: actor_rollout_ref.actor.megatron."
                                                             "context_parallel_size"),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": ("use actor_rollout_ref.rollout."
                                                            "log_prob_micro_batch_size_per_gpu"),
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": ("megarl: actor_rollout_ref.model.use_sequence_packing=true "
                                                          "with actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"),
    "actor_rollout_ref.rollout.update_weights_bucket_megabytes": ("megarl's key is actor_rollout_ref.rollout."
                                                                  "weight_sync_bucket_mb"),
    "actor_rollout_ref.rollout.prompt_length": "megarl reads data.max_prompt_length (verl's default does the same)",
    "actor_rollout_ref.rollout.response_length": "megarl reads data.max_response_length (verl's default does the same)",
    "actor_rollout_ref.rollout.do_sample": ("sampling is temperature > 0 (temperature 0 is greedy); "
                                            "actor_rollout_ref.rollout.val_kwargs.do_sample exists for validation"),
    "actor_rollout_ref.rollout.calculate_log_probs": ("the rollout engine's log-probs are always taken "
                                                      "(rollout/log_prob_diff_* and algorithm.rollout_correction)"),
    "actor_rollout_ref.rollout.engine_kwargs.trtllm": "TensorRT-LLM is not a megarl rollout engine",
    "actor_rollout_ref.rollout.agent": ("verl's agent-loop servers: megarl's multi-turn tool loop is "
                                        "actor_rollout_ref.rollout.multi_turn.*"),
    "actor_rollout_ref.rollout.trace": "rollout traces to trackers are not in megarl yet",
    "actor_rollout_ref.rollout.prometheus": "vLLM's Prometheus export is not wired in megarl",
    "actor_rollout_ref.rollout.checkpoint_engine": ("megarl's weight sync is its own: in process when colocated, "
                                                    "actor_rollout_ref.rollout.weight_sync_transport otherwise"),
    "actor_rollout_ref.rollout.disaggregation": "prefill/decode disaggregation is not in megarl",
    "actor_rollout_ref.rollout.mtp": "speculative decoding (MTP) in the rollout is not in megarl",
    "actor_rollout_ref.rollout.quantization_config_file": ("megarl's FP8 rollout is vLLM's own online FP8 "
                                                           "(actor_rollout_ref.rollout.quantization=fp8); block-wise "
                                                           "FP8 configs are not taken yet"),
    "actor_rollout_ref.rollout.skip_tokenizer_init": "megarl's vLLM engine always skips detokenisation without stop strings",
    "actor_rollout_ref.rollout.over_sample_rate": "not in megarl: every requested sample is generated",
    "actor_rollout_ref.rollout.multi_stage_wake_up": ("megarl always wakes vLLM in stages: weights for the sync, then "
                                                      "the KV cache for generation"),
    "actor_rollout_ref.rollout.layered_summon": "an FSDP option; megarl's Megatron gather streams per parameter",
    "actor_rollout_ref.rollout.data_parallel_size": ("vLLM replicas are data parallel over the ranks by construction "
                                                     "(world size / actor_rollout_ref.rollout.tensor_model_parallel_size)"),
    "actor_rollout_ref.rollout.expert_parallel_size": "vLLM expert parallelism is not set by megarl",
    "actor_rollout_ref.rollout.pipeline_model_parallel_size": "vLLM pipeline parallelism is not used by megarl",
    "actor_rollout_ref.model.override_config": "megarl builds the model from its config.json as it is",
    "actor_rollout_ref.model.external_lib": "not supported: megarl's bridge knows its architectures",
    "actor_rollout_ref.model.custom_chat_template": "the tokenizer's own chat template is used (data.apply_chat_template)",
    "actor_rollout_ref.model.use_shm": "not in megarl: models load from the given directory",
    "actor_rollout_ref.model.use_liger": "an FSDP/HF kernel option: megarl trains with Megatron",
    "actor_rollout_ref.model.use_fused_kernels": "megarl fuses its log-prob and norm kernels always (on CUDA)",
    "actor_rollout_ref.model.fused_kernel_options": "megarl fuses its log-prob and norm kernels always (on CUDA)",
    "actor_rollout_ref.model.enable_activation_offload": ("use Megatron's activation recompute: actor_rollout_ref.actor."
                                                          "megatron.recompute_granularity"),
    "actor_rollout_ref.model.tiled_mlp": "an FSDP option: megarl trains with Megatron",
    "actor_rollout_ref.model.hf_config_path": "the model directory's config.json is used",
    "actor_rollout_ref.model.mtp": "multi-token prediction training is not in megarl",
    "actor_rollout_ref.model.lora.dropout_position": "megarl applies LoRA dropout to the adapter's input (pre)",
    "actor_rollout_ref.model.lora.lora_A_init_method": "megarl: A kaiming-uniform (as PEFT), B zero",
    "actor_rollout_ref.model.lora.lora_B_init_method": "megarl: A kaiming-uniform (as PEFT), B zero",
    "actor_rollout_ref.model.lora.dtype": "the adapters take the model's params_dtype",
    "actor_rollout_ref.model.lora.a2a_experimental": "not in megarl",
    "actor_rollout_ref.model.lora.freeze_vision_model": "megarl's adapters are on the language model; under LoRA "
                                                        "the vision tower and its merger stay frozen",
    "actor_rollout_ref.model.lora.freeze_vision_projection": "megarl's adapters are on the language model; under "
                                                             "LoRA the vision tower and its merger stay frozen",
    "actor_rollout_ref.model.lora.freeze_language_model": "not in megarl: LoRA adapts the language model",
    "actor_rollout_ref.nccl_timeout": "megarl's key is trainer.worker_timeout_s (every collective and worker call)",
    "critic.model": ("the critic's model is critic.model_path (default: the actor's) and its adapters "
                     "critic.model.lora.*; the rest of verl's model section is the actor's"),
    "critic.strategy": "megarl's critic is always a Megatron engine",
    "critic.rollout_n": "megarl reads actor_rollout_ref.rollout.n",
    "critic.ppo_micro_batch_size": "use critic.ppo_micro_batch_size_per_gpu",
    "critic.forward_micro_batch_size": "critic.ppo_micro_batch_size_per_gpu is used for value passes too",
    "critic.forward_micro_batch_size_per_gpu": "critic.ppo_micro_batch_size_per_gpu is used for value passes too",
    "critic.forward_max_token_len_per_gpu": "critic.ppo_max_token_len_per_gpu is used for value passes too",
    "critic.grad_clip": "megarl's key is critic.optim.clip_grad",
    "critic.shuffle": "not in megarl: mini-batches are taken in order",
    "critic.data_loader_seed": "megarl's key is data.seed",
    "critic.nccl_timeout": "megarl's key is trainer.worker_timeout_s",
    "critic.ulysses_sequence_parallel_size": "megarl's key is critic.megatron.context_parallel_size",
    "critic.loss_scale_factor": "not in megarl: critic.loss_agg_mode sets the normalisation",
    "critic.fsdp": "megarl's critic trains with Megatron: critic.megatron.*",
    "reward": ("verl's newer reward section: megarl's reward model is reward_model.* and custom scoring "
               "reward_model.custom_function.*"),
    "reward_model.rollout": "generative reward models (an LLM judge with its own rollout) use reward_model.remote.url",
    "global_profiler.profile_continuous_steps": "megarl writes one trace per profiled step (global_profiler.steps)",
    "global_profiler.relocate_results": "megarl writes the traces under global_profiler.save_path directly",
    "global_profiler.finish_hook_cmd": "megarl runs no command after profiling: the trace paths are printed",
    "global_profiler.finish_hook_ranks": "megarl runs no command after profiling: the trace paths are printed",
    "global_profiler.finish_hook_all_ranks": "megarl runs no command after profiling: the trace paths are printed",
    "global_profiler.global_tool_config": ("megarl's torch tool records CPU and CUDA activity with no schedule (the "
                                           "whole step); nsys takes its options on the nsys command line"),
    "transfer_queue": "verl's transfer queue: megarl moves batches by Ray RPC and torch.distributed",
    "ray_kwargs": "megarl starts Ray itself or attaches with trainer.ray_address",
    "skip": "not in megarl: every step generates",
    "algorithm.use_pf_ppo": "PF-PPO reweighting is not in megarl",
    "algorithm.pf_ppo": "PF-PPO reweighting is not in megarl",
    "trainer.v1": "verl's new trainer's options: megarl has one trainer",
    "trainer.use_v1": "verl's new trainer's options: megarl has one trainer",
    "trainer.balance_batch": "not in megarl: each DP rank gets an equal number of rows",
    "trainer.esi_redundant_time": "not in megarl: checkpoints follow trainer.save_freq and SIGTERM/SIGUSR1",
    "trainer.resume_from_path": "megarl's key is trainer.resume_mode=<checkpoint dir>",
    "trainer.del_local_ckpt_after_load": "not in megarl: checkpoints are kept per trainer.max_ckpt_to_keep",
    "trainer.default_hdfs_dir": "not in megarl: checkpoints go to trainer.default_local_dir (a shared filesystem)",
    "trainer.max_actor_ckpt_to_keep": "megarl's key is trainer.max_ckpt_to_keep (every role's together)",
    "trainer.max_critic_ckpt_to_keep": "megarl's key is trainer.max_ckpt_to_keep (every role's together)",
    "trainer.ray_wait_register_center_timeout": "megarl's key is trainer.worker_timeout_s",
    "data.tokenizer": "megarl's key is actor_rollout_ref.model.tokenizer_path",
    "data.use_shm": "not in megarl: data loads from the given files",
    "data.train_max_samples": "not in megarl: give a parquet file of the rows to use",
    "data.val_max_samples": "not in megarl: give a parquet file of the rows to use",
    "data.reward_fn_key": "megarl reads each row's data_source column",
    "data.tool_config_path": "megarl's key is actor_rollout_ref.rollout.multi_turn.tool_config_path",
    "data.return_raw_input_ids": "megarl's dataset decides its own outputs",
    "data.return_raw_chat": "megarl's dataset decides its own outputs",
    "data.return_full_prompt": "megarl's dataset decides its own outputs",
    "data.return_multi_modal_inputs": "megarl gives a vision-language model's batches their pixels always",
    "data.dataloader_num_workers": "megarl tokenises once and caches the result; no loader workers",
    "data.filter_overlong_prompts_workers": "megarl tokenises once and caches the result",
    "data.validation_shuffle": "validation runs in file order",
    "data.video_key": "videos are not in megarl yet (issue 42)",
    "data.audio_key": "multimodal data is not in megarl",
    "data.image_patch_size": "megarl takes the patch size from the model's config.json (vision_config)",
    "data.mm_processor_kwargs": "megarl takes min/max pixels from the model's preprocessor_config.json",
    "data.custom_cls": "not in megarl: the dataset reads verl's parquet layout",
    "data.apply_chat_template_kwargs": "not in megarl: data.apply_chat_template uses the tokenizer's template as is",
    "data.gen_batch_size": "megarl's DAPO rounds draw data.train_batch_size prompts at a time",
    "data.function_tool_path": "megarl's tools come from actor_rollout_ref.rollout.multi_turn.tool_config_path",
    "actor_rollout_ref.rollout.qat": "quantization-aware training is not in megarl",
    "actor_rollout_ref.rollout.val_kwargs.top_k": "validation samples with actor_rollout_ref.rollout.top_k",
    "sandbox_fusion": "code execution is not built in: reward_model.custom_function.path",
    "trainer.checkpoint_callback_class": "not in megarl",
    "trainer.val_only": "not in megarl: validation runs every trainer.test_freq steps and before training "
                        "(trainer.val_before_train)",
}
# A section's name anywhere in a key: the same answer in every role
SEGMENT = {
    "profiler": ("megarl profiles every rank of every role in the global_profiler.steps with global_profiler.tool "
                 "(torch | nsys)"),
    "fsdp_config": "megarl trains with Megatron: the role's megatron.* keys",
    "checkpoint": ("megarl's checkpoints always hold the model, optimizer and RNG state (exact resume; with LoRA the "
                   "adapters); trainer.save_hf=true adds a Hugging Face copy"),
    "qat": "quantization-aware training is not in megarl",
    "inference": ("megarl's distillation teachers are frozen Megatron engines scoring the student's tokens, not "
                  "inference servers: distillation.teacher_models.<name>.megatron.* (layout, param_offload), "
                  "micro_batch_size_per_gpu, use_sequence_packing"),
}
LEAF = {
    "record_file": ("megarl's routing travels with the batch (router_replay.mode R2 records it in the old-log-prob "
                    "pass), not through files"),
    "replay_file": "megarl's routing travels with the batch (R3: from the rollout engine), not through files",
    "num_replicas": ("a teacher is one worker group over its pool's ranks (distillation.n_gpus_per_node / nnodes, or "
                     "a share of the actor's); its data parallelism follows from its megatron layout"),
    "enable_gradient_checkpointing": ("activation recompute is Megatron's: actor_rollout_ref.actor.megatron."
                                      "recompute_granularity=full (or selective)"),
    "use_remove_padding": "megarl's key is actor_rollout_ref.model.use_sequence_packing=true",
    "use_dynamic_bsz": ("megarl: actor_rollout_ref.model.use_sequence_packing=true with the *_max_token_len_per_gpu "
                        "budgets (verl's names)"),
    "trust_remote_code": ("not supported: megarl builds the model from its HF config through its own bridge (Llama 3, "
                          "Qwen2/2.5/3, Qwen3-MoE, DeepSeek-V3) and loads tokenizers without remote code"),
    "use_mbridge": "not needed: megarl's own bridge (megarl.models.bridge) always maps HF <-> Megatron",
    "vanilla_mbridge": "not needed: megarl's own bridge (megarl.models.bridge) always maps HF <-> Megatron",
    # Megatron engine options
    "dtype": "megarl's key is <role>.megatron.params_dtype (bfloat16 | float32)",
    "dist_checkpointing_prefix": "megarl reads megatron's torch_dist layout as written (converters/hf_to_mcore.py)",
    "dist_ckpt_optim_fully_reshardable": "megarl's checkpoints always store the optimizer reshardable (dp_reshardable)",
    "distrib_optim_fully_reshardable_mem_efficient": "megarl's checkpoints always store the optimizer reshardable",
    "dynamic_context_parallel": "megarl's context parallelism is static: <role>.megatron.context_parallel_size",
    "max_seqlen_per_dp_cp_rank": "megarl's packed micro-batches take *_max_token_len_per_gpu budgets",
    "forward_only": "megarl decides per engine: the reference and reward model are forward-only",
    "override_mcore_model_config": "megarl builds GPTModel from the HF config; transformer fields: "
                                   "<role>.megatron.override_transformer_config",
    "pad_bshd_to_minibatch_max": "megarl pads rows to the longest row of the micro-batch, or packs them",
    "pad_to_length": "megarl pads rows to the longest row of the micro-batch, or packs them",
    "pad_to_length_bucket": "megarl pads rows to the longest row of the micro-batch, or packs them",
    "use_megatron_fsdp": "megarl uses Megatron's distributed optimizer: <role>.megatron.use_distributed_optimizer",
    "entropy_from_logits_chunk_size": "megarl's fused vocab-parallel log-prob never materialises full logits",
    "entropy_from_logits_with_chunking": "megarl's fused vocab-parallel log-prob never materialises full logits",
    "entropy_checkpointing": "megarl's fused vocab-parallel log-prob keeps no logits copy",
    # optimizer options
    "betas": "megarl's keys are <role>.optim.adam_beta1 and adam_beta2",
    "optimizer": "megarl's optimizer is Adam(W) (megatron's); other megatron options: optim.override_optimizer_config",
    "optimizer_impl": "megarl's optimizer is megatron-core's",
    "exp_avg_dtype": "megatron's precision-aware optimizer: optim.override_optimizer_config.exp_avg_dtype",
    "exp_avg_sq_dtype": "megatron's precision-aware optimizer: optim.override_optimizer_config.exp_avg_sq_dtype",
    "main_grads_dtype": "megatron's precision-aware optimizer: optim.override_optimizer_config.main_grads_dtype",
    "use_precision_aware_optimizer": "megarl's key is optim.override_optimizer_config.use_precision_aware_optimizer",
    "use_layer_wise_distributed_optimizer": "not in megarl: megatron's distributed optimizer shards over DP",
    "lr_scheduler_type": "megarl's key is optim.lr_decay_style (constant | linear | cosine)",
    "warmup_style": "megarl's warmup is linear over optim.lr_warmup_steps",
    "lr_warmup_init": "megarl's warmup starts at 0",
    "lr_warmup_steps_ratio": "give optim.lr_warmup_steps (training steps) instead of a ratio",
    "min_lr_ratio": "give optim.min_lr (absolute) instead of a ratio",
    "num_cycles": "megarl's cosine decays once, over optim.lr_decay_steps",
    "lr_wsd_decay_style": "megarl has no warmup-stable-decay schedule: optim.lr_decay_style",
    "lr_wsd_decay_steps": "megarl has no warmup-stable-decay schedule: optim.lr_decay_style",
    "weight_decay_incr_style": "megarl keeps weight decay constant (optim.weight_decay)",
    "use_checkpoint_opt_param_scheduler": "megarl takes the schedule from the config on resume, its position from "
                                          "the checkpoint",
    "total_training_steps": "the schedule reads trainer.total_training_steps (optim.lr_decay_steps to override)",
    "zero_indexed_step": "megarl's schedule counts training steps from 0",
    # actor options
    "grad_clip": "megarl's key is <role>.optim.clip_grad",
    "strategy": "megarl's actor, critic, reference and reward model are always Megatron engines",
    "use_torch_compile": "megarl compiles its own small kernels on CUDA (MEGARL_COMPILE=0 turns that off)",
    "use_fused_kernels": "megarl fuses its log-prob and norm kernels always (on CUDA)",
    "ulysses_sequence_parallel_size": "megarl splits long sequences with <role>.megatron.context_parallel_size",
    "rollout_n": "megarl reads actor_rollout_ref.rollout.n",
    "shuffle": "not in megarl: mini-batches are taken in order (data.shuffle shuffles the prompts)",
    "data_loader_seed": "megarl's key is data.seed",
    "loss_scale_factor": "not in megarl: loss_agg_mode sets the normalisation",
    "calculate_entropy": "megarl always reports actor/entropy",
    "calculate_sum_pi_squared": "not in megarl",
    "use_prefix_grouper": "not in megarl",
    # rollout options
    "cudagraph_capture_sizes": "vLLM's own choice (actor_rollout_ref.rollout.enforce_eager=true turns graphs off)",
    "disable_log_stats": "megarl's vLLM engine never logs stats",
    "enable_chunked_prefill": "vLLM's own default (on)",
    "enable_prefix_caching": "on in megarl's vLLM engine (reset after every weight sync)",
    "full_determinism": "not in megarl: seeds per prompt (data.seed, trainer.seed) make sampling reproducible",
    "logprobs_mode": "megarl takes vLLM's processed log-probs (after temperature), what the trainer recomputes",
    "max_model_len": "megarl sets data.max_prompt_length + data.max_response_length",
    "max_num_batched_tokens": "vLLM's own default",
    "max_num_seqs": "vLLM's own default",
    "scheduling_policy": "vLLM's own default (fcfs)",
    "moe_load_balance_metrics_interval": "not in megarl",
    "router_config_path": "not in megarl",
    "seed": "megarl's keys are trainer.seed (sampling) and <role>.megatron.seed (initialisation)",
    "n_gpus_per_node": "the rollout's GPUs: trainer.rollout_gpus with trainer.placement=separate",
    "nnodes": "the rollout's GPUs: trainer.rollout_gpus with trainer.placement=separate",
    "function_tool_path": "megarl's tools come from actor_rollout_ref.rollout.multi_turn.tool_config_path",
    "num_repeat_rollouts": "megarl samples actor_rollout_ref.rollout.n conversations per prompt",
    "tokenization_sanity_check_mode": "megarl's multi-turn loop builds token ids turn by turn (no re-tokenisation)",
    "use_inference_chat_template": "megarl's multi-turn loop uses the tokenizer's chat template",
    "max_inflight_gen_batches": "megarl's key is algorithm.filter_groups.max_num_gen_batches",
    "external_lib": "not supported: megarl's bridge knows its architectures",
    "num_workers": "megarl's scoring threads: reward_model.remote.max_concurrency",
    "reward_loop_class_name": "not in megarl: reward_model.custom_function.* and reward_model.remote.*",
    "reward_loop_module_path": "not in megarl: reward_model.custom_function.* and reward_model.remote.*",
    "reward_loop_source": "not in megarl: reward_model.custom_function.* and reward_model.remote.*",
}


def explain(key: str) -> Optional[str]:
    """Why megarl does not take the verl key ``key`` and what to use instead; None for a key verl lacks too."""
    if key in FULL:
        return FULL[key]
    for prefix, reason in sorted(FULL.items(), key=lambda item: -len(item[0])):  # the most specific section
        if key.startswith(prefix + "."):
            return reason
    for segment in key.split(".")[:-1]:
        if segment in SEGMENT:
            return SEGMENT[segment]
    leaf = key.rsplit(".", 1)[-1]
    if leaf.startswith("muon_"):
        return "megarl's optimizer is Adam(W); Muon is not in megarl"
    return LEAF.get(leaf)


def markdown_table() -> str:
    """docs/verl_keys.md: every entry, as the README's rows are written."""
    rows = [f"| `{key}` | {reason} |" for key, reason in sorted(FULL.items())]
    rows += [f"| `*.{name}.*` | {reason} |" for name, reason in sorted(SEGMENT.items())]
    rows += [f"| `*.{leaf}` | {reason} |" for leaf, reason in sorted(LEAF.items())]
    rows.append("| `*.muon_*` | megarl's optimizer is Adam(W); Muon is not in megarl |")
    return ("# verl keys megarl does not take\n\n"
            "Generated from `megarl/config/verl_keys.py` (a test keeps them in step). Every other key of verl 0.9.1's\n"
            "`ppo_trainer` / `ppo_megatron_trainer` configs is megarl's own, with verl's meaning.\n\n"
            "| verl key | in megarl |\n| --- | --- |\n" + "\n".join(rows) + "\n")


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
