"""Cross-field consistency checks for a :class:`MegarlConfig`, each naming the keys involved.

Checks fixed choices (engine names, placements, loggers...), that the batch sizes divide across mini-batches,
data-parallel ranks and micro-batches, and that the algorithm has what it needs (gae needs a critic).
:func:`check_config` only reads; the derived defaults it checks (critic.enable, clip_ratio_low/high, ...) are
filled before, by :mod:`megarl.config.defaults`. Leaves out the names that pick from the algorithm registries
(:mod:`megarl.run_config` checks those against the registries, and runs both) and hardware fit (the planner,
:mod:`megarl.plan`).
"""

from __future__ import annotations

from megarl.config.errors import ConfigError
from megarl.config.lora import block_lora, model_lora
from megarl.config.schema import MegarlConfig, MegatronConfig


def check_choice(value, choices, key: str) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, choices))}")


def _positive(value, key: str) -> None:
    if value is None or value <= 0:
        raise ConfigError(f"{key} must be > 0, got {value!r}")


def world_size(cfg: MegarlConfig) -> int:
    return cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node


def training_world_size(cfg: MegarlConfig) -> int:
    """Processes running the Megatron engines (all of them when colocated)."""
    if cfg.trainer.placement == "separate":
        return world_size(cfg) - cfg.trainer.rollout_gpus
    return world_size(cfg)


def _check_megatron(m: MegatronConfig, prefix: str, n_procs: int, layer_spec: str = "auto",
                    processes: str = "training processes (trainer.nnodes x trainer.n_gpus_per_node)") -> int:
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "expert_model_parallel_size"):
        _positive(getattr(m, name), f"{prefix}.{name}")
    check_choice(m.params_dtype, ("float32", "bfloat16"), f"{prefix}.params_dtype")
    check_choice(m.recompute_granularity, (None, "selective", "full"), f"{prefix}.recompute_granularity")
    if m.virtual_pipeline_model_parallel_size is not None and m.pipeline_model_parallel_size < 2:
        raise ConfigError(f"{prefix}.virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size >= 2")
    model_parallel = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
    if n_procs % model_parallel:
        raise ConfigError(
            f"{n_procs} {processes} are not divisible by "
            f"{prefix}.tensor_model_parallel_size x pipeline_model_parallel_size x context_parallel_size "
            f"= {model_parallel}"
        )
    dp = n_procs // model_parallel
    expert_tp = m.expert_tensor_parallel_size or m.tensor_model_parallel_size
    expert_group = m.expert_model_parallel_size * expert_tp
    if (dp * m.tensor_model_parallel_size * m.context_parallel_size) % expert_group:
        raise ConfigError(
            f"{prefix}.expert_model_parallel_size x expert_tensor_parallel_size = {expert_group} must divide "
            f"data x tensor x context parallel = {dp * m.tensor_model_parallel_size * m.context_parallel_size}"
        )
    if m.context_parallel_size > 1 and layer_spec == "te":
        raise ConfigError(f"{prefix}.context_parallel_size={m.context_parallel_size} runs on the local layer spec's "
                          f"SDPA attention; actor_rollout_ref.model.layer_spec=te with context parallelism is not "
                          f"supported (use auto or local)")
    if m.context_parallel_size > 1 and m.sequence_parallel:
        raise ConfigError(f"{prefix}.context_parallel_size={m.context_parallel_size} runs on the local layer spec, "
                          f"which has no sequence-parallel norm: set {prefix}.sequence_parallel=false")
    if m.sequence_parallel and m.tensor_model_parallel_size == 1:
        raise ConfigError(f"{prefix}.sequence_parallel needs tensor_model_parallel_size > 1")
    check_choice(m.router_replay.mode, ("disabled", "R2", "R3"), f"{prefix}.router_replay.mode")
    if m.router_replay.mode != "disabled" and prefix not in ("actor_rollout_ref.actor.megatron", "critic.megatron"):
        raise ConfigError(f"{prefix}.router_replay.mode: routing replay is for the policy, its reference and the "
                          f"critic (actor_rollout_ref.actor.megatron / critic.megatron)")
    if m.use_dist_checkpointing and not m.dist_checkpointing_path:
        raise ConfigError(f"{prefix}.use_dist_checkpointing=true needs {prefix}.dist_checkpointing_path (a "
                          f"torch_dist checkpoint, e.g. converters/hf_to_mcore.py's output)")
    if m.use_dist_checkpointing and prefix != "actor_rollout_ref.actor.megatron":
        raise ConfigError(f"{prefix}.use_dist_checkpointing: only the actor (and its reference) start from a "
                          f"torch_dist checkpoint; the {prefix.split('.')[0]} loads the HF weights and its own head")
    return dp


def _check_batches(prefix: str, mini: int, micro: int, train_batch: int, n: int, dp: int,
                   by_tokens: bool = False) -> None:
    _positive(mini, f"{prefix}.ppo_mini_batch_size")
    _positive(micro, f"{prefix}.ppo_micro_batch_size_per_gpu")
    if train_batch % mini:
        raise ConfigError(
            f"data.train_batch_size={train_batch} is not divisible by {prefix}.ppo_mini_batch_size={mini}"
        )
    responses = mini * n
    if responses % dp:
        raise ConfigError(
            f"{prefix}.ppo_mini_batch_size x actor_rollout_ref.rollout.n = {responses} responses cannot be "
            f"split over {dp} data-parallel ranks"
        )
    if not by_tokens and (responses // dp) % micro:
        per_rank = responses // dp
        fits = max(d for d in range(1, min(micro, per_rank) + 1) if per_rank % d == 0)
        raise ConfigError(
            f"{per_rank} responses per data-parallel rank per mini-batch ({prefix}.ppo_mini_batch_size={mini} x "
            f"{n} per prompt (actor_rollout_ref.rollout.n; SPIN: its pair) / {dp} rank(s)) are not divisible by "
            f"{prefix}.ppo_micro_batch_size_per_gpu={micro}: set it to a divisor of {per_rank} (e.g. "
            f"{prefix}.ppo_micro_batch_size_per_gpu={fits}), or raise ppo_mini_batch_size"
        )


def _check_token_budgets(cfg: MegarlConfig) -> None:
    """Token budgets need packing, and must hold the longest possible row (prompt + response). A budget is
    per GPU: with context parallelism a micro-batch holds ``cp`` times as many tokens, each row rounded up to
    a multiple of ``2 * cp``."""
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    actor_cp, critic_cp = arr.actor.megatron.context_parallel_size, critic.megatron.context_parallel_size
    budgets = [
        ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", arr.actor.ppo_max_token_len_per_gpu,
         arr.model.use_sequence_packing, "actor_rollout_ref.model.use_sequence_packing", actor_cp),
        ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", arr.rollout.log_prob_max_token_len_per_gpu,
         arr.model.use_sequence_packing, "actor_rollout_ref.model.use_sequence_packing", actor_cp),
        ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", arr.ref.log_prob_max_token_len_per_gpu,
         arr.model.use_sequence_packing, "actor_rollout_ref.model.use_sequence_packing", actor_cp),
        ("critic.ppo_max_token_len_per_gpu", critic.ppo_max_token_len_per_gpu, critic.use_sequence_packing,
         "critic.use_sequence_packing", critic_cp),
    ]
    for key, budget, packing, packing_key, cp in budgets:
        if budget is None:
            continue
        if not packing:
            raise ConfigError(f"{key}={budget} groups rows by tokens and needs {packing_key}=true")
        row = -(-longest // (2 * cp)) * (2 * cp) if cp > 1 else longest
        if budget * cp < row:
            per_cp = f" (context_parallel_size={cp}: a row of {row} tokens over {cp} GPUs)" if cp > 1 else ""
            raise ConfigError(
                f"{key}={budget} is smaller than the longest possible row: data.max_prompt_length + "
                f"data.max_response_length = {longest}{per_cp}; use at least {-(-row // cp)}"
            )


def reward_model_world_size(cfg: MegarlConfig) -> int:
    """Processes of the reward model group: its own pool, or every training process (colocated)."""
    rm = cfg.reward_model
    return rm.nnodes * rm.n_gpus_per_node if rm.enable_resource_pool else training_world_size(cfg)


def _check_model_rewards(cfg: MegarlConfig) -> None:
    """The reward model, the judge and how their scores combine with the reward functions'."""
    import re

    rm, judge = cfg.reward_model, cfg.reward_model.judge
    if judge.enable:
        check_choice(judge.on_unparsable, ("zero", "fail"), "reward_model.judge.on_unparsable")
        _positive(judge.max_tokens, "reward_model.judge.max_tokens")
        if judge.temperature < 0:
            raise ConfigError(f"reward_model.judge.temperature must be >= 0, got {judge.temperature}")
        try:
            judge.prompt_template.format(question="", response="", reference="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(f"reward_model.judge.prompt_template: only {{question}}, {{response}} and "
                              f"{{reference}} can be filled in ({type(exc).__name__}: {exc})") from exc
        if "{response}" not in judge.prompt_template:
            raise ConfigError("reward_model.judge.prompt_template must contain {response}")
        try:
            groups = re.compile(judge.score_pattern).groups
        except re.error as exc:
            raise ConfigError(f"reward_model.judge.score_pattern is not a regular expression: {exc}") from exc
        if groups < 1:
            raise ConfigError("reward_model.judge.score_pattern needs a group around the number, e.g. "
                              "'Score: (\\d+)'")
    if rm.enable:
        if not rm.model.path:
            raise ConfigError("reward_model.enable=true needs reward_model.model.path (a HF *ForSequenceClassification "
                              "dir with num_labels=1)")
        if cfg.trainer.backend == "inprocess":
            raise ConfigError("reward_model.enable=true runs a reward model worker group: it needs trainer.backend=ray")
        _positive(rm.micro_batch_size_per_gpu, "reward_model.micro_batch_size_per_gpu")
        _positive(rm.forward_max_token_len_per_gpu, "reward_model.forward_max_token_len_per_gpu")
        if rm.max_length is not None:
            _positive(rm.max_length, "reward_model.max_length")
        if rm.score_clip is not None:
            _positive(rm.score_clip, "reward_model.score_clip")
        if rm.enable_resource_pool:
            _positive(rm.nnodes, "reward_model.nnodes")
            _positive(rm.n_gpus_per_node, "reward_model.n_gpus_per_node")
        processes = ("reward model processes (reward_model.nnodes x reward_model.n_gpus_per_node)"
                     if rm.enable_resource_pool else "training processes (trainer.nnodes x trainer.n_gpus_per_node)")
        _check_megatron(rm.megatron, "reward_model.megatron", reward_model_world_size(cfg),
                        cfg.actor_rollout_ref.model.layer_spec, processes=processes)
    if (rm.enable or judge.enable) and rm.function_weight == 0:
        configured = [key for key, value in (("reward_model.custom_function.path", rm.custom_function.path),
                                             ("reward_model.remote.url", rm.remote.url)) if value]
        if configured:
            raise ConfigError(f"{configured[0]} is set but reward_model.function_weight=0: with a reward model or "
                              f"judge on, the reward functions count only with a weight; set function_weight")


def _check_async_training(cfg: MegarlConfig) -> None:
    a = cfg.async_training
    mode = a.mode
    check_choice(mode, ("sync", "one_step_off", "fully_async"), "async_training.mode")
    if mode == "sync":
        return
    if mode == "fully_async":
        check_choice(a.stale_policy, ("drop", "reweight"), "async_training.stale_policy")
        _positive(a.max_staleness, "async_training.max_staleness")
        _positive(a.trigger_parameter_sync_step, "async_training.trigger_parameter_sync_step")
        _positive(a.partial_rollout_chunk, "async_training.partial_rollout_chunk")
        if a.trigger_parameter_sync_step > a.max_staleness:
            raise ConfigError(f"async_training.trigger_parameter_sync_step={a.trigger_parameter_sync_step} pushes "
                              f"weights less often than async_training.max_staleness={a.max_staleness} allows a "
                              f"sample to lag: every sample would be too stale")
        if a.stale_policy == "reweight" and cfg.algorithm.rollout_correction.rollout_is is None:
            raise ConfigError("async_training.stale_policy=reweight keeps stale samples for the importance weights "
                              "of algorithm.rollout_correction.rollout_is (token or sequence): set it")
    needs = {"trainer.placement=separate (the rollout needs devices of its own to overlap with training)":
             cfg.trainer.placement == "separate",
             "trainer.backend=ray": cfg.trainer.backend == "ray",
             "algorithm.filter_groups.enable=false (its extra generation rounds wait for the policy)":
             not cfg.algorithm.filter_groups.enable,
             "an estimator other than remax (its greedy baseline is generated with the current policy)":
             cfg.algorithm.adv_estimator != "remax"}
    for need, met in needs.items():
        if not met:
            raise ConfigError(f"async_training.mode={mode} needs {need}")


def _check_multi_turn(cfg: MegarlConfig) -> None:
    m = cfg.actor_rollout_ref.rollout.multi_turn
    if not m.enable:
        return
    key = "actor_rollout_ref.rollout.multi_turn"
    if not m.tool_config_path:
        raise ConfigError(f"{key}.enable=true needs {key}.tool_config_path (a tools file, "
                          f"e.g. configs/tools/calculator_python.yaml)")
    if m.format != "hermes" and "." not in m.format:
        raise ConfigError(f"{key}.format={m.format!r} is neither 'hermes' nor a module.Class tool-call parser")
    check_choice(m.tool_response_truncate_side, ("left", "right", "middle"), f"{key}.tool_response_truncate_side")
    for name in ("max_parallel_calls", "max_tool_response_length", "tool_timeout_s", "tool_workers"):
        _positive(getattr(m, name), f"{key}.{name}")
    for name in ("max_assistant_turns", "max_user_turns", "max_tokens_per_turn"):
        if getattr(m, name) is not None:
            _positive(getattr(m, name), f"{key}.{name}")
    if not cfg.data.apply_chat_template:
        raise ConfigError(f"{key}.enable=true writes tool results with the chat template: it needs "
                          f"data.apply_chat_template=true and chat-message prompts")
    if cfg.actor_rollout_ref.rollout.ignore_eos:
        raise ConfigError(f"{key}.enable=true ends each turn at the model's end-of-turn token: "
                          f"actor_rollout_ref.rollout.ignore_eos=true would never end one")
    if cfg.async_training.mode == "fully_async":
        raise ConfigError(f"{key}.enable=true with async_training.mode=fully_async is not supported (its "
                          f"partial rollouts resume single responses); use sync or one_step_off")


def critic_enabled(cfg: MegarlConfig) -> bool:
    return bool(cfg.critic.enable)


def check_config(cfg: MegarlConfig) -> None:
    """Raise :class:`ConfigError` on the first inconsistency of a config whose derived defaults are filled;
    ``cfg`` is not changed. The names it picks from registries are checked against them by
    :func:`megarl.run_config.check_registered_names`."""
    alg, arr, t, data = cfg.algorithm, cfg.actor_rollout_ref, cfg.trainer, cfg.data
    actor, rollout = arr.actor, arr.rollout

    check_choice(alg.kl_ctrl.type, ("fixed", "adaptive"), "algorithm.kl_ctrl.type")
    check_choice(actor.optim.lr_decay_style, ("constant", "cosine", "linear"), "actor_rollout_ref.actor.optim.lr_decay_style")
    check_choice(rollout.name, ("hf", "vllm", "sglang"), "actor_rollout_ref.rollout.name")
    _check_sglang_rollout(cfg)
    check_choice(rollout.load_format, ("auto", "dummy"), "actor_rollout_ref.rollout.load_format")
    check_choice(rollout.quantization, (None, "fp8"), "actor_rollout_ref.rollout.quantization")
    if rollout.quantization is not None and rollout.name != "vllm":
        raise ConfigError(f"actor_rollout_ref.rollout.quantization={rollout.quantization} is vLLM's: it needs "
                          f"actor_rollout_ref.rollout.name=vllm (got {rollout.name!r})")
    if rollout.engine_kwargs.vllm and rollout.name != "vllm":
        raise ConfigError(f"actor_rollout_ref.rollout.engine_kwargs.vllm is set ({sorted(rollout.engine_kwargs.vllm)}) "
                          f"and the rollout engine is {rollout.name!r}: set actor_rollout_ref.rollout.name=vllm")
    check_choice(cfg.algorithm.filter_groups.metric, ("score",), "algorithm.filter_groups.metric")
    if cfg.algorithm.filter_groups.max_num_gen_batches < 0:
        raise ConfigError(f"algorithm.filter_groups.max_num_gen_batches must be >= 0 (0 = no limit), got "
                          f"{cfg.algorithm.filter_groups.max_num_gen_batches}")
    if cfg.algorithm.filter_groups.enable and rollout.n < 2:
        raise ConfigError("algorithm.filter_groups.enable keeps groups whose scores differ: it needs "
                          f"actor_rollout_ref.rollout.n >= 2, got {rollout.n}")
    overlong = cfg.reward_model.overlong_buffer
    if overlong.enable and not 0 < overlong.len <= data.max_response_length:
        raise ConfigError(f"reward_model.overlong_buffer.len={overlong.len} must be in (0, data.max_response_length="
                          f"{data.max_response_length}]")
    if overlong.enable and overlong.penalty_factor < 0:
        raise ConfigError(f"reward_model.overlong_buffer.penalty_factor must be >= 0, got {overlong.penalty_factor}")
    check_choice(rollout.weight_sync_transport, ("broadcast", "object_store"), "actor_rollout_ref.rollout.weight_sync_transport")
    check_choice(arr.model.layer_spec, ("auto", "local", "te"), "actor_rollout_ref.model.layer_spec")
    check_choice(data.truncation, ("error", "left", "right"), "data.truncation")
    check_choice(cfg.reward_model.on_error, ("fail", "zero"), "reward_model.on_error")
    correction = cfg.algorithm.rollout_correction
    if correction.bypass_mode:
        raise ConfigError("algorithm.rollout_correction.bypass_mode=true (rollout log-probs standing in for "
                          "old_log_probs) is not supported; the decoupled mode (false) is")
    remote = cfg.reward_model.remote
    if remote.url is not None and cfg.reward_model.custom_function.path:
        raise ConfigError("reward_model.remote.url and reward_model.custom_function.path both score every "
                          "sample: set one")
    _check_model_rewards(cfg)
    _check_async_training(cfg)
    _check_multi_turn(cfg)
    check_choice(t.device, ("auto", "cuda", "cpu"), "trainer.device")
    if t.log_val_generations < 0:
        raise ConfigError(f"trainer.log_val_generations must be >= 0, got {t.log_val_generations}")
    profiler = cfg.global_profiler
    check_choice(profiler.tool, (None, "torch", "nsys"), "global_profiler.tool")
    if profiler.tool is not None and not profiler.steps:
        raise ConfigError(f"global_profiler.tool={profiler.tool} profiles global_profiler.steps: name them (e.g. [2])")
    if profiler.tool == "nsys" and t.device == "cpu":
        raise ConfigError("global_profiler.tool=nsys captures CUDA: trainer.device=cpu has none (use tool=torch)")
    check_choice(t.placement, ("colocate", "separate"), "trainer.placement")
    check_choice(t.backend, ("ray", "inprocess"), "trainer.backend")
    if t.backend == "inprocess" and world_size(cfg) != 1:
        raise ConfigError(f"trainer.backend=inprocess runs one rank; trainer.nnodes x trainer.n_gpus_per_node = "
                          f"{world_size(cfg)}")
    for i, name in enumerate(t.logger):
        check_choice(name, ("console", "tensorboard", "jsonl", "wandb", "mlflow", "swanlab"), f"trainer.logger[{i}]")
    for key in ("data.max_prompt_length", "data.max_response_length", "data.train_batch_size",
                "actor_rollout_ref.rollout.n", "trainer.nnodes", "trainer.n_gpus_per_node"):
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        _positive(node, key)
    if rollout.temperature < 0:
        raise ConfigError(f"actor_rollout_ref.rollout.temperature must be >= 0, got {rollout.temperature}")
    if not 0 < rollout.top_p <= 1:
        raise ConfigError(f"actor_rollout_ref.rollout.top_p must be in (0, 1], got {rollout.top_p}")

    check_distillation(cfg)
    check_self_play(cfg)
    if alg.adv_estimator == "gae" and not cfg.critic.enable:
        raise ConfigError("algorithm.adv_estimator=gae needs a critic, but critic.enable=false")
    if t.critic_warmup < 0:
        raise ConfigError(f"trainer.critic_warmup must be >= 0, got {t.critic_warmup}")
    if t.critic_warmup > 1 and not cfg.critic.enable:
        raise ConfigError(f"trainer.critic_warmup={t.critic_warmup} holds the actor back while the critic "
                          f"trains, and this run has no critic (algorithm.adv_estimator="
                          f"{alg.adv_estimator!r}, critic.enable=false)")
    if (actor.policy_loss.loss_mode in ("vanilla", "ppo_clip", "dual_clip") and actor.clip_ratio_c is not None
            and actor.clip_ratio_c <= 1.0):
        raise ConfigError(f"actor_rollout_ref.actor.clip_ratio_c (the dual clip, on by default as in verl) must be "
                          f"> 1, or null to turn it off; got {actor.clip_ratio_c}")

    if t.placement == "separate":
        if not 0 < t.rollout_gpus < world_size(cfg):
            raise ConfigError(
                f"trainer.placement=separate needs 0 < trainer.rollout_gpus < {world_size(cfg)} processes, "
                f"got {t.rollout_gpus}"
            )
        if t.nnodes > 1 and t.rollout_gpus % t.n_gpus_per_node:
            raise ConfigError(
                f"trainer.placement=separate on {t.nnodes} nodes gives the rollout whole nodes: trainer.rollout_gpus="
                f"{t.rollout_gpus} must be a multiple of trainer.n_gpus_per_node={t.n_gpus_per_node}"
            )
    _check_token_budgets(cfg)
    _check_router_replay(cfg)
    lora = model_lora(arr.model)
    if lora is not None and lora.merge is False and t.placement != "colocate":
        raise ConfigError("actor_rollout_ref.model.lora.merge=false (the rollout engine serves the adapter) needs "
                          "trainer.placement=colocate; separate rollout workers get merged weights (merge: true)")
    if cfg.critic.enable:
        block_lora(cfg.critic.model.lora, "critic.model.lora")
    n_train = training_world_size(cfg)
    dp = _check_megatron(actor.megatron, "actor_rollout_ref.actor.megatron", n_train, arr.model.layer_spec)
    _check_batches("actor_rollout_ref.actor", actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu,
                   data.train_batch_size, cfg.responses_trained_per_prompt, dp, by_tokens=actor.ppo_max_token_len_per_gpu is not None)
    if cfg.critic.enable:
        critic_dp = _check_megatron(cfg.critic.megatron, "critic.megatron", n_train, arr.model.layer_spec)
        _check_batches("critic", cfg.critic.ppo_mini_batch_size, cfg.critic.ppo_micro_batch_size_per_gpu,
                       data.train_batch_size, rollout.n, critic_dp,
                       by_tokens=cfg.critic.ppo_max_token_len_per_gpu is not None)
    _positive(rollout.tensor_model_parallel_size, "actor_rollout_ref.rollout.tensor_model_parallel_size")
    if rollout.tensor_model_parallel_size > 1 and (rollout.name == "hf" or t.placement != "colocate"):
        raise ConfigError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout.tensor_model_parallel_size} needs "
            f"actor_rollout_ref.rollout.name=vllm or sglang and trainer.placement=colocate (got {rollout.name!r}, "
            f"{t.placement!r}): the HF engine and separate rollout workers serve a whole replica per rank")
    if rollout.name == "sglang" and t.n_gpus_per_node % rollout.tensor_model_parallel_size:
        raise ConfigError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout.tensor_model_parallel_size} must divide "
            f"trainer.n_gpus_per_node={t.n_gpus_per_node} with rollout.name=sglang: SGLang serves a replica from its "
            "first rank, on that rank's node's GPUs")
    rollout_procs = t.rollout_gpus if t.placement == "separate" else n_train
    if rollout_procs % rollout.tensor_model_parallel_size:
        raise ConfigError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout.tensor_model_parallel_size} must divide "
            f"the {rollout_procs} rollout processes"
        )
    if t.save_freq == 0 or t.test_freq == 0:
        raise ConfigError("trainer.save_freq and trainer.test_freq must be positive or -1 (never)")


def _check_sglang_rollout(cfg: MegarlConfig) -> None:
    """What megarl's SGLang engine leaves out (megarl/engines/rollout/sglang_engine.py), refused at start-up."""
    arr = cfg.actor_rollout_ref
    rollout = arr.rollout
    if rollout.name != "sglang":
        if rollout.engine_kwargs.sglang:
            raise ConfigError(f"actor_rollout_ref.rollout.engine_kwargs.sglang is set ({sorted(rollout.engine_kwargs.sglang)})"
                              f" and the rollout engine is {rollout.name!r}: set actor_rollout_ref.rollout.name=sglang")
        return
    lora = model_lora(arr.model)
    refused = {
        "actor_rollout_ref.rollout.stop": (bool(rollout.stop), "stop strings need a tokenizer in the engine; use "
                                           "stop_token_ids"),
        "actor_rollout_ref.rollout.enable_rollout_routing_replay": (
            rollout.enable_rollout_routing_replay, "the experts an MoE model routed to come from vLLM"),
        "actor_rollout_ref.model.lora.merge": (lora is not None and lora.merge is False,
                                               "a served LoRA adapter is vLLM's; merge: true syncs merged weights"),
    }
    for key, (set_, why) in refused.items():
        if set_:
            raise ConfigError(f"{key} is not supported with actor_rollout_ref.rollout.name=sglang: {why}")


def _check_router_replay(cfg: MegarlConfig) -> None:
    """R3 replays the rollout's routing, which the rollout engine must be asked for."""
    arr = cfg.actor_rollout_ref
    modes = {"actor_rollout_ref.actor.megatron": arr.actor.megatron.router_replay.mode}
    if cfg.critic.enable:
        modes["critic.megatron"] = cfg.critic.megatron.router_replay.mode
    for prefix, mode in modes.items():
        if mode == "R3" and not arr.rollout.enable_rollout_routing_replay:
            raise ConfigError(f"{prefix}.router_replay.mode=R3 replays the rollout's routing: set "
                              f"actor_rollout_ref.rollout.enable_rollout_routing_replay=true")
    if modes.get("critic.megatron") == "R2":
        raise ConfigError("critic.megatron.router_replay.mode=R2 is not supported: the critic replays the rollout's "
                          "routing (R3) or routes itself (disabled)")


def check_distillation(cfg: MegarlConfig) -> None:
    """On-policy distillation's teachers and loss settings (``distillation.*``), read-only."""
    d = cfg.distillation
    if not d.enabled:
        return
    if not d.teacher_models:
        raise ConfigError("distillation.enabled=true needs a teacher: distillation.teacher_models.<name>.model_path")
    for name, teacher in d.teacher_models.items():
        if not teacher.model_path:
            raise ConfigError(f"distillation.teacher_models.{name}.model_path is not set")
    keys = [t.key for t in d.teacher_models.values()]
    if len(keys) > 1 and (None in keys or len(set(keys)) < len(keys)):
        raise ConfigError(f"distillation.teacher_models: with several teachers each needs its own key (the "
                          f"distillation.teacher_key={d.teacher_key!r} value of the rows it scores); got "
                          f"{dict(zip(d.teacher_models, keys))}")
    loss = d.distillation_loss
    if loss.policy_loss_mode != "vanilla":
        raise ConfigError(f"distillation.distillation_loss.policy_loss_mode={loss.policy_loss_mode!r}: only vanilla "
                          f"(PPO clip), as in verl")
    if loss.loss_mode in ("k1", "kl") and not loss.use_policy_gradient:
        raise ConfigError("distillation.distillation_loss.loss_mode=k1 with use_policy_gradient=false: the gradient "
                          "of k1 does not depend on the teacher; use k3, or use_policy_gradient=true")
    if cfg.trainer.backend == "inprocess":
        raise ConfigError("distillation.enabled=true: the teachers are worker groups of their own; "
                          "trainer.backend=inprocess holds one worker (use trainer.backend=ray)")


def check_self_play(cfg: MegarlConfig) -> None:
    """SPIN's pieces go together: online pairs (adv_estimator=spin), the DPO loss over them, pairs kept whole in
    every micro-batch, and a reference of its own to refresh."""
    actor = cfg.actor_rollout_ref.actor
    spin, dpo = cfg.algorithm.adv_estimator == "spin", actor.policy_loss.loss_mode == "dpo"
    if spin != dpo:
        raise ConfigError(f"SPIN is algorithm.adv_estimator=spin with actor_rollout_ref.actor.policy_loss.loss_mode="
                          f"dpo (the pairs' labels and their loss); got adv_estimator={cfg.algorithm.adv_estimator!r}, "
                          f"loss_mode={actor.policy_loss.loss_mode!r}")
    if dpo:
        if actor.ppo_micro_batch_size_per_gpu % 2:
            raise ConfigError(f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu="
                              f"{actor.ppo_micro_batch_size_per_gpu}: DPO's (chosen, rejected) pairs must not be split: "
                              f"use an even number")
        if cfg.actor_rollout_ref.model.use_sequence_packing and actor.ppo_max_token_len_per_gpu:
            raise ConfigError("actor_rollout_ref.actor.ppo_max_token_len_per_gpu with sequence packing groups rows by "
                              "length, which splits DPO's pairs: leave it unset for SPIN")
        if actor.dpo_beta <= 0:
            raise ConfigError(f"actor_rollout_ref.actor.dpo_beta must be > 0, got {actor.dpo_beta}")
    if cfg.trainer.ref_update_freq < 0:
        raise ConfigError(f"trainer.ref_update_freq must be >= 0 (0: never), got {cfg.trainer.ref_update_freq}")
    if cfg.trainer.ref_update_freq > 0 and model_lora(cfg.actor_rollout_ref.model) is not None:
        raise ConfigError("trainer.ref_update_freq: with LoRA the reference is the frozen base, which cannot "
                          "become the actor")
