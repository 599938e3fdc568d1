"""Typed configuration of a megarl run: nested dataclasses, every field with a default.

The tree mirrors the roles of the RL loop (data, actor/rollout/reference, critic, reward, algorithm,
trainer) the way verl users know it, so `actor_rollout_ref.rollout.n=8` means what they expect.
Loading YAML and applying `a.b.c=value` overrides lives in :mod:`megarl.config.loader`; cross-field
consistency checks in :mod:`megarl.config.validate`. Nothing here reads files or touches devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional


@dataclass
class DataConfig:
    # Local parquet files, or the generated demo task: embedded:digits[?op=copy&num_digits=2&n_train=..]
    train_files: list[str] = field(default_factory=lambda: ["embedded:digits"])
    val_files: list[str] = field(default_factory=lambda: ["embedded:digits"])
    prompt_key: str = "prompt"
    image_key: str = "images"  # a multimodal row's column of {bytes, path} images (verl's key and default)
    # verl's production defaults; the CPU demo (configs/grpo_tiny.yaml) sets its own small ones
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1024  # prompts per step (each sampled rollout.n times)
    val_batch_size: int = 64
    shuffle: bool = True
    seed: int = 1
    filter_overlong_prompts: bool = True
    truncation: str = "error"  # error | left | right, for over-long prompts when not filtered
    apply_chat_template: bool = True


@dataclass
class LoRAConfig:
    """verl's Megatron LoRA block (``actor_rollout_ref.model.lora``, ``critic.model.lora``): adapters on the
    named linears, the base frozen (:mod:`megarl.models.lora`)."""

    rank: int = 0  # 0: no LoRA
    alpha: float = 32.0  # the update is scaled by alpha / rank
    dropout: float = 0.0
    # megatron linears (linear_qkv, linear_proj, linear_fc1, linear_fc2), their HF names, or all-linear
    target_modules: Any = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    exclude_modules: list[str] = field(default_factory=list)  # names or globs (decoder.layers.0.*)
    # true: the rollout engine gets the merged weights through the ordinary weight sync; false: it serves the
    # adapter (only the adapter's tensors move); null: megarl picks by model size (the choice is logged)
    merge: Optional[bool] = None
    adapter_path: Optional[str] = None  # start from a PEFT adapter directory
    type: str = "lora"  # lora (megarl has no dora / canonical_lora)


@dataclass
class ModelConfig:
    path: str = "embedded:tiny-qwen2"  # HF model dir, or embedded:<name>
    tokenizer_path: Optional[str] = None  # defaults to path
    layer_spec: str = "auto"  # auto | local | te
    # Pack each micro-batch's real tokens into one stream (megatron thd) instead of padding rows to P + R.
    use_sequence_packing: bool = False
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # verl's shorthand (its FSDP backend's keys), the same adapters as lora.{rank, alpha, target_modules,
    # exclude_modules, adapter_path}; set one spelling or the other
    lora_rank: int = 0
    lora_alpha: float = 16.0
    target_modules: Any = "all-linear"
    exclude_modules: Optional[list[str]] = None
    lora_adapter_path: Optional[str] = None


@dataclass
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    # The schedule counts training steps (as verl does): every mini-batch of a step uses that step's lr.
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"  # constant | cosine | linear
    lr_decay_steps: Optional[int] = None  # defaults to trainer.total_training_steps
    # megatron-core OptimizerConfig fields set as given, as verl passes them (e.g. optimizer_cpu_offload: true,
    # optimizer_offload_fraction: 1.0, overlap_cpu_optimizer_d2h_h2d: true, use_precision_aware_optimizer: true)
    override_optimizer_config: dict[str, Any] = field(default_factory=dict)


@dataclass
class RouterReplayConfig:
    """verl's ``<role>.megatron.router_replay``: an MoE model's routers take the experts the batch names
    (megarl.engines.megatron.routing_replay). ``disabled``; ``R2``: the update replays the routing of the trainer's
    own old-log-prob pass; ``R3``: the old-log-prob pass and the update replay the rollout's routing (needs
    ``actor_rollout_ref.rollout.enable_rollout_routing_replay=true``). The reference replays what the actor's mode
    replays."""

    mode: str = "disabled"


@dataclass
class MegatronConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    num_layers_in_first_pipeline_stage: Optional[int] = None  # uneven split (e.g. DeepSeek-V3: dense + embedding)
    num_layers_in_last_pipeline_stage: Optional[int] = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = True
    params_dtype: str = "bfloat16"  # bfloat16 | float32 (the CPU demo's)
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False
    recompute_granularity: Optional[str] = None  # None | selective | full
    recompute_method: Optional[str] = None  # uniform | block
    recompute_num_layers: Optional[int] = None
    # megatron-core DistributedDataParallelConfig fields set as given (verl's key), e.g. grad_reduce_in_fp32: false
    override_ddp_config: dict[str, Any] = field(default_factory=dict)
    # megatron-core TransformerConfig fields set as given, over megarl's own (verl's key), e.g. recompute_granularity:
    # full, recompute_method: uniform, recompute_num_layers: 1, recompute_modules: [core_attn]
    override_transformer_config: dict[str, Any] = field(default_factory=dict)
    seed: int = 42
    # Start from a megatron torch_dist checkpoint (converters/hf_to_mcore.py's output, or a Megatron-LM save)
    # instead of the HF weights; any layout loads it. The HF model path still gives config and tokenizer.
    use_dist_checkpointing: bool = False
    dist_checkpointing_path: Optional[str] = None
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)

    def recompute_settings(self) -> dict[str, Any]:
        """megatron's recompute fields for this role, as the engine builds them and the planner counts them:
        ``override_transformer_config`` (verl's) over megarl's keys; full recompute without a grouping recomputes
        every layer on its own (``uniform``, 1 layer)."""
        given = self.override_transformer_config
        granularity = given.get("recompute_granularity", self.recompute_granularity)
        if granularity != "full":
            return {"recompute_granularity": granularity} if granularity else {}
        return {"recompute_granularity": "full",
                "recompute_method": given.get("recompute_method") or self.recompute_method or "uniform",
                "recompute_num_layers": int(given.get("recompute_num_layers") or self.recompute_num_layers or 1)}


@dataclass
class PolicyLossConfig:
    """verl's ``actor_rollout_ref.actor.policy_loss`` block: which policy loss, and the options of the ones that have
    them. ``policy_loss=<mode>`` is short for ``policy_loss.loss_mode=<mode>``."""

    SHORTHAND: ClassVar[str] = "loss_mode"
    # vanilla (PPO clip with the dual clip; megarl's older names ppo_clip, dual_clip) | gspo | cispo | sapo |
    # geo_mean (GMPO) | gpg | clip_cov | kl_cov  (megarl.algorithms.policy_loss, policy_loss_variants)
    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002  # clip_cov: the fraction of valid tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # clip_cov: the covariance range the cut tokens are picked from
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: the fraction of valid tokens (highest covariance) given the KL penalty
    ppo_kl_coef: float = 0.1  # kl_cov: the penalty's coefficient on |log(pi / pi_old)|


@dataclass
class ActorConfig:
    ppo_mini_batch_size: int = 256  # prompts per optimizer step (x rollout.n responses)
    ppo_micro_batch_size_per_gpu: int = 8  # responses per forward/backward
    # With sequence packing: micro-batches by real tokens (prompt + response) instead of a row count.
    ppo_max_token_len_per_gpu: Optional[int] = None
    ppo_epochs: int = 1
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None  # defaults to clip_ratio
    clip_ratio_high: Optional[float] = None  # defaults to clip_ratio (DAPO clip-higher: e.g. 0.28)
    # Dual clip of ppo_clip, as in verl: negative-advantage tokens lose at most clip_ratio_c * |A|; null = off
    clip_ratio_c: Optional[float] = 3.0
    loss_agg_mode: str = "token-mean"
    # SAPO's gate temperatures (policy_loss.loss_mode=sapo) for positive / negative advantages, verl's keys
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    sppo_eta: float = 1.0  # SPPO's eta (policy_loss.loss_mode=sppo with algorithm.adv_estimator=sppo), verl's key
    # SPIN / online DPO (policy_loss.loss_mode=dpo with algorithm.adv_estimator=spin): beta, sigmoid | ipo, and the
    # label smoothing of the sigmoid loss
    dpo_beta: float = 0.1
    dpo_loss_type: str = "sigmoid"
    dpo_label_smoothing: float = 0.0
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    # false: start from megatron's random initialisation instead of the checkpoint's weights (verl's key); the
    # model path then needs only config.json and the tokenizer: benchmarks at any shape without big files
    load_weight: bool = True
    # a vision-language policy's vision tower (and merger) out of the update (verl's key; megarl's default is
    # frozen, verl's trains it); the language model trains either way
    freeze_vision_tower: bool = True
    optim: OptimConfig = field(default_factory=OptimConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)


@dataclass
class RolloutEngineKwargs:
    """verl's ``actor_rollout_ref.rollout.engine_kwargs``: the rollout engine's own start-up options, beside
    megarl's keys (which win: an option megarl sets is refused here)."""

    sglang: dict[str, Any] = field(default_factory=dict)  # sglang.Engine's ServerArgs fields
    # vllm.LLM's engine arguments, e.g. kv_cache_dtype=fp8 (an FP8 KV cache: half the cache's memory and reads)
    vllm: dict[str, Any] = field(default_factory=dict)


@dataclass
class SamplingOverrides:
    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    do_sample: bool = False


@dataclass
class MultiTurnConfig:
    """Multi-turn, tool-calling rollouts (:mod:`megarl.agents`); verl's ``rollout.multi_turn`` keys. Each
    response is a conversation: the model's turns, the tools' results between them (masked out of the loss),
    until a turn calls no tool, ``max_assistant_turns``, or ``data.max_response_length`` (all turns)."""

    enable: bool = False
    tool_config_path: Optional[str] = None  # a tools file: {tools: [{class_name, config, tool_schema}]}
    format: str = "hermes"  # the tool-call parser: hermes (<tool_call>{json}</tool_call>) or module.Class
    max_assistant_turns: Optional[int] = None  # None: only the response budget ends a conversation
    max_user_turns: Optional[int] = None  # rounds of tool results
    max_tokens_per_turn: Optional[int] = None  # one turn's share of data.max_response_length at most
    max_parallel_calls: int = 1  # calls run per turn; the model is told about the ones left out
    max_tool_response_length: int = 256  # characters of a tool's result the model reads
    tool_response_truncate_side: str = "middle"  # left (keep the start) | right (keep the end) | middle
    tool_timeout_s: float = 30.0  # a call past this is an error for the model, not a stalled rollout
    tool_workers: int = 32  # tool calls running at once across all conversations


@dataclass
class RolloutConfig:
    name: str = "vllm"  # vllm | sglang (GPU only) | hf (the CPU demo's and debugging engine)
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # generate max_response_length tokens whatever is sampled (benchmarks)
    tensor_model_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    kv_cache_memory_mb: Optional[int] = None  # size vLLM's KV cache directly (on CPU: instead of a RAM share)
    enforce_eager: bool = False
    # auto: the rollout engine reads the checkpoint; dummy: random weights, replaced by the first weight sync
    # (verl's key; what actor.load_weight=false needs)
    load_format: str = "auto"
    free_cache_engine: bool = True  # sleep the engine between rollouts when colocated
    dtype: str = "bfloat16"  # bfloat16 | float32
    log_prob_micro_batch_size_per_gpu: int = 16
    log_prob_max_token_len_per_gpu: Optional[int] = None  # token budget of the actor's log-prob pass
    weight_sync_bucket_mb: int = 512
    # placement=separate: broadcast (a process group with the rollout workers: NCCL/gloo) | object_store (Ray)
    weight_sync_transport: str = "broadcast"
    val_kwargs: SamplingOverrides = field(default_factory=SamplingOverrides)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    # MoE: the rollout engine returns each token's routed experts (vLLM's enable_return_routed_experts), for
    # router_replay.mode=R3 and the routing/rollout_mismatch_frac metric
    enable_rollout_routing_replay: bool = False
    # fp8: vLLM generates with FP8 weights (per-tensor, dynamic activation scales) quantized from the synced bf16
    # weights at every sync; training stays bf16. Turns on token-level TIS (algorithm.rollout_correction.rollout_is
    # =token) unless rollout_correction is configured (rollout_is=none: none). verl's key.
    quantization: Optional[str] = None
    engine_kwargs: RolloutEngineKwargs = field(default_factory=RolloutEngineKwargs)


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int = 16
    log_prob_max_token_len_per_gpu: Optional[int] = None
    param_offload: bool = False


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)


@dataclass
class CriticModelConfig:
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # adapters on the value model's trunk (its head trains)


@dataclass
class CriticConfig:
    enable: Optional[bool] = None  # None: on exactly when the advantage estimator needs values (gae)
    model_path: Optional[str] = None  # defaults to the actor's model
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    ppo_mini_batch_size: int = 256
    ppo_micro_batch_size_per_gpu: int = 8
    use_sequence_packing: Optional[bool] = None  # defaults to actor_rollout_ref.model.use_sequence_packing
    ppo_max_token_len_per_gpu: Optional[int] = None  # token budget of value passes and updates
    ppo_epochs: int = 1
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    megatron: MegatronConfig = field(default_factory=MegatronConfig)


@dataclass
class CustomRewardConfig:
    path: Optional[str] = None
    name: str = "compute_score"


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment: responses in the last ``len`` tokens before data.max_response_length
    lose up to ``penalty_factor`` of score, linearly."""

    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0


@dataclass
class RemoteRewardConfig:
    """A reward service over HTTP scores every sample (megarl.rewards.remote: the protocol, retries)."""

    url: Optional[str] = None
    batch_size: int = 64  # samples per request
    max_concurrency: int = 8  # requests in flight at once
    timeout_s: float = 30.0  # per request
    max_retries: int = 3  # connection errors, timeouts, HTTP 429/5xx, malformed answers
    backoff_s: float = 0.5  # before the first retry; doubles each time


@dataclass
class RewardModelPathConfig:
    """The reward model's weights and, as in verl, the policy tokenizer its inputs are decoded with."""

    path: Optional[str] = None  # a HF *ForSequenceClassification dir (num_labels=1), or embedded:tiny-qwen2-rm
    # Set: responses are always decoded with this (the policy's) tokenizer and re-tokenized with the reward
    # model's own chat template (verl's meaning). Unset: the same happens only when the two vocabularies differ.
    input_tokenizer: Optional[str] = None


@dataclass
class JudgeConfig:
    """An LLM judge: the policy's rollout engine answers a judging prompt per sample, parsed to a score."""

    enable: bool = False
    # {question}, {response} and {reference} are filled in (str.format); the judge answers after it
    prompt_template: str = ("Question: {question}\nReference answer: {reference}\nResponse: {response}\n"
                            "Rate the response from 0 to 10. Answer as 'Score: <number>'.\n")
    score_pattern: str = r"[Ss]core\s*[:=]\s*(-?\d+(?:\.\d+)?)"  # the first group is the score
    score_scale: float = 0.1  # the parsed number times this is the judge's score (0-10 -> 0-1)
    max_tokens: int = 16  # the judgement's length
    temperature: float = 0.0  # greedy
    weight: float = 1.0  # its share of the combined score
    on_unparsable: str = "zero"  # zero (score 0, counted) | fail


@dataclass
class RewardConfig:
    # --- the model-based reward (verl's reward_model.* keys where verl has them)
    enable: bool = False  # a reward model worker group scores every sample
    model: RewardModelPathConfig = field(default_factory=RewardModelPathConfig)
    micro_batch_size_per_gpu: int = 8
    use_dynamic_bsz: bool = False  # micro-batches by token budget (packed sequences) instead of rows
    forward_max_token_len_per_gpu: int = 16384  # that budget
    max_length: Optional[int] = None  # reward-model input tokens; longer inputs lose their start (left-truncated)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # its layout; param_offload between scorings
    enable_resource_pool: bool = False  # own GPUs (nnodes x n_gpus_per_node) instead of the actor's
    n_gpus_per_node: int = 0
    nnodes: int = 0
    rm_weight: float = 1.0  # combined score = rm_weight * RM + function_weight * function (+ judge.weight * judge)
    function_weight: float = 0.0  # the reward functions / remote service (reward_manager); 0: not called
    normalize_scores: bool = False  # RM scores whitened over the batch (mean 0, std 1) before clipping
    score_clip: Optional[float] = None  # RM scores clamped to [-score_clip, score_clip]
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    # --- reward functions
    reward_manager: str = "naive"
    on_error: str = "fail"  # fail | zero
    # with on_error=zero: a batch where more than this fraction of the samples failed still fails the run
    max_error_fraction: float = 0.5
    custom_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling: keep only groups whose scores differ, generate until train_batch_size remain."""

    enable: bool = False
    metric: str = "score"  # score: the reward function's sequence score (after overlong shaping)
    max_num_gen_batches: int = 10  # generation rounds per step before failing; 0 = no limit


@dataclass
class RolloutCorrectionConfig:
    """verl's ``algorithm.rollout_correction`` in its decoupled mode (megarl.algorithms.rollout_correction):
    importance weights and rejection from the rollout engine's log-probs vs the trainer's."""

    rollout_is: Optional[str] = None  # null | token | sequence
    rollout_is_threshold: str = "2.0"  # a number: truncate above it (TIS); "lower_upper": zero outside (IcePop)
    rollout_is_batch_normalize: bool = False
    rollout_rs: Optional[str] = None  # comma list: token_k1..k3, seq_sum_k1..k3, seq_mean_k1..k3, seq_max_k2/k3
    rollout_rs_threshold: Optional[str] = None  # k1: "lower_upper" ratio bounds (or u: [1/u, u]); k2/k3: upper
    bypass_mode: bool = False  # verl's bypass mode (rollout log-probs as old_log_probs) is not supported
    loss_type: str = "ppo_clip"  # bypass mode's loss in verl; without bypass mode PPO's own loss applies

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or bool(self.rollout_rs)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # gae | grpo | dr_grpo | rloo | reinforce_plus_plus | ... | remax | opo
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class TrainerConfig:
    project_name: str = "megarl"
    # SPIN: every this many steps the reference becomes the actor (the next iteration's opponent); 0: never
    ref_update_freq: int = 0
    # verl's: the actor updates from step critic_warmup on (steps count from 1; before it only the critic trains)
    critic_warmup: int = 0
    # None: <adv_estimator>_<model directory name>, so a run without a name never writes into another run's folder
    experiment_name: Optional[str] = None
    total_epochs: int = 1
    total_training_steps: Optional[int] = None  # defaults to epochs x batches per epoch
    save_freq: int = -1  # steps between checkpoints; -1 = never
    # also write the actor as a Hugging Face checkpoint (safetensors + tokenizer) into each checkpoint's actor_hf/
    save_hf: bool = False
    test_freq: int = -1  # steps between validations; -1 = never
    val_before_train: bool = False
    default_local_dir: str = "outputs/${trainer.project_name}/${trainer.experiment_name}"
    resume_mode: str = "auto"  # auto | disable | <checkpoint dir>
    # resume a checkpoint that a run with another algorithm, model, data or batch shape wrote (the differences
    # are printed); false refuses it, listing them (megarl.trainer.resume_guard)
    resume_allow_changes: bool = False
    max_ckpt_to_keep: Optional[int] = 2
    logger: list[str] = field(default_factory=lambda: ["console", "tensorboard", "jsonl"])
    nnodes: int = 1
    n_gpus_per_node: int = 1  # worker processes per node (CPU processes when device=cpu)
    device: str = "auto"  # auto | cuda | cpu
    placement: str = "colocate"  # colocate | separate
    rollout_gpus: int = 0  # with placement=separate: how many of the processes serve rollout
    backend: str = "ray"  # ray | inprocess (one rank in the driver process, no Ray: debugging, GPU box)
    ray_address: Optional[str] = None  # None: start a local cluster; "auto" or host:port to attach
    worker_timeout_s: float = 600.0
    seed: int = 1
    progress_bar: bool = True
    # refuse at start-up a run that python -m megarl.plan says does not fit this machine's GPU or host memory
    # (checked where the driver sees the GPUs: one node); false starts it anyway
    check_memory_plan: bool = True
    # what the policy wrote (megarl.trainer.rollout_traces; verl's keys): every training step's rows as
    # <rollout_data_dir>/<step>.jsonl, every validation's as <validation_data_dir>/<step>.jsonl, and
    # log_val_generations validation samples per validation as a table to the loggers
    rollout_data_dir: Optional[str] = None
    validation_data_dir: Optional[str] = None
    log_val_generations: int = 0


@dataclass
class AsyncTrainingConfig:
    """Overlap of rollout and training (needs trainer.placement=separate).

    ``one_step_off``: the rollout workers generate the batch of step k+1, with the weights before step k's
    update, while the actor trains on step k; the weights reach them between two generations. Every batch is
    then exactly one update older than the policy that trains on it (``rollout/weight_lag``).
    ``fully_async``: the rollout workers generate continuously into a buffer the trainer takes batches from
    (:mod:`megarl.trainer.rollout_producer`); weights are pushed every ``trigger_parameter_sync_step`` steps,
    and with ``partial_rollout`` a push interrupts generations, which go on with the new weights. Pair either
    with ``algorithm.rollout_correction`` to correct for the stale samples."""

    mode: str = "sync"  # sync | one_step_off | fully_async
    # fully_async: a group whose oldest token is more than this many updates behind the policy training on it
    # is dropped (stale_policy=drop) or kept for the rollout correction to reweight (reweight)
    max_staleness: int = 1
    stale_policy: str = "drop"  # drop | reweight
    trigger_parameter_sync_step: int = 1  # fully_async: push weights to the rollout every this many steps
    partial_rollout: bool = True  # fully_async: generate in chunks, so a weight push interrupts generations
    partial_rollout_chunk: int = 64  # tokens per response per rollout call with partial rollouts


@dataclass
class TeacherModelConfig:
    """One teacher of on-policy distillation (verl's ``distillation.teacher_models.<name>``): a frozen Megatron
    engine that scores the student's rollouts token by token. Its tokenizer must be the student's."""

    model_path: Optional[str] = None
    # the rows this teacher scores: those whose ``distillation.teacher_key`` field has this value (a single
    # teacher with no key scores every row)
    key: Optional[str] = None
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # its own layout; param_offload between uses
    micro_batch_size_per_gpu: int = 8
    log_prob_max_token_len_per_gpu: Optional[int] = None  # with use_sequence_packing: micro-batches by tokens
    use_sequence_packing: bool = False


@dataclass
class DistillationLossConfig:
    """verl's ``distillation.distillation_loss``: how the teacher's log-probs of the student's tokens train it."""

    # a per-token estimator of KL(student || teacher) (megarl.algorithms.kl: k1/kl, k2/mse, k3/low_var_kl, abs)
    loss_mode: str = "k3"
    topk: Optional[int] = 128  # forward_kl_topk's (not in megarl: refused when loss_mode asks for it)
    use_task_rewards: bool = True  # true: the task's policy loss + distillation_loss_coef * distillation loss
    distillation_loss_coef: float = 1.0
    loss_max_clamp: Optional[float] = 10.0  # the per-token estimate clamped to [-x, x]
    log_prob_min_clamp: Optional[float] = -10.0  # student and teacher log-probs clamped below at this
    # true: the negated per-token estimate is the advantage of a PPO-clip loss (Thinking Machines' on-policy
    # distillation; loss_mode=k1 recommended); false: the estimate itself is the loss (GKD; k3)
    use_policy_gradient: bool = True
    policy_loss_mode: str = "vanilla"  # the policy loss of use_policy_gradient (verl takes vanilla only)
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None  # defaults to clip_ratio
    clip_ratio_high: Optional[float] = None  # defaults to clip_ratio


@dataclass
class DistillationConfig:
    """On-policy distillation (verl's ``distillation`` section): teachers score the student's own rollouts and
    the student is trained toward them, alone or beside the task's reward."""

    enabled: bool = False
    teacher_models: dict[str, TeacherModelConfig] = field(default_factory=dict)
    teacher_key: str = "data_source"  # the row field (data_source, or a key of extra_info) routing rows to teachers
    n_gpus_per_node: int = 0  # > 0: the teachers get their own pool (nnodes x n_gpus_per_node), else the actor's
    nnodes: int = 0
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)


@dataclass
class GlobalProfilerConfig:
    """verl's ``global_profiler``: the training ``steps`` every worker captures with ``tool`` (torch: a Chrome trace
    per worker process under ``save_path``/step_<n>/; nsys: a CUDA profiler capture range, for ``nsys profile
    --capture-range=cudaProfilerApi``), each worker method a named range (megarl.controller.profiling)."""

    tool: Optional[str] = None  # None | torch | nsys
    steps: list[int] = field(default_factory=list)
    save_path: Optional[str] = None  # default: <trainer.default_local_dir>/profile


@dataclass
class MegarlConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    global_profiler: GlobalProfilerConfig = field(default_factory=GlobalProfilerConfig)

    @property
    def responses_trained_per_prompt(self) -> int:
        """Rows of a prompt in the update: its ``rollout.n`` responses, or SPIN's one (chosen, rejected) pair."""
        return 2 if self.algorithm.adv_estimator == "spin" else self.actor_rollout_ref.rollout.n
