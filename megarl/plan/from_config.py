"""A run config as the planner's inputs: the model's HF config, the layout, the step's shape."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Optional

from megarl.models.parallel_layout import ParallelLayout
from megarl.plan.layout import LayoutSpec, TrainingSpec

REFERENCE_CONFIGS = Path(__file__).resolve().parents[1] / "models" / "reference_configs"
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp8": 1}


def read_hf_config(path: str | Path) -> dict:
    """Load config.json from ``path`` (the file or the model directory holding it)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        names = ", ".join(sorted(p.name for p in REFERENCE_CONFIGS.iterdir() if (p / "config.json").is_file()))
        shown = (REFERENCE_CONFIGS.relative_to(Path.cwd()) if REFERENCE_CONFIGS.is_relative_to(Path.cwd())
                 else REFERENCE_CONFIGS)
        raise SystemExit(f"megarl.plan: no HF config.json at {file} (the model path must be an HF model directory; "
                         f"to plan without the weights, give actor_rollout_ref.model.path={shown}/<name>, <name> one "
                         f"of: {names})")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise SystemExit(f"megarl.plan: {file} is not valid JSON: {exc}") from exc


def planning_config_dir(model_path: str) -> tuple[Path, Optional[str]]:
    """Where the planner reads the model's config.json, and a note when that is not ``model_path`` itself: an
    embedded test model's built directory, or, for a recipe whose checkpoint is not on this machine yet, the
    shipped reference config of the same model (matched by name: ``checkpoints/hf/Qwen2.5-7B-Instruct`` ->
    ``reference_configs/qwen2_5_7b_instruct``), so every shipped recipe plans as written."""
    if model_path.startswith("embedded:"):
        from megarl.models.embedded import resolve_model_path

        return resolve_model_path(model_path), None
    path = Path(model_path)
    if (path / "config.json").is_file() or path.is_file():
        return path, None
    squash = lambda name: re.sub(r"[^a-z0-9]", "", name.lower())  # noqa: E731
    wanted = squash(path.name)
    matches = [ref for ref in REFERENCE_CONFIGS.iterdir()
               if (ref / "config.json").is_file() and wanted.startswith(squash(ref.name))]
    if not matches:
        return path, None  # read_hf_config names the missing file and the shipped configs
    best = max(matches, key=lambda ref: len(ref.name))
    return best, (f"no config.json at {path}: planned with the shipped {best.name} config "
                  f"(megarl/models/reference_configs/{best.name})")


def specs_from_run_config(cfg) -> tuple[dict, LayoutSpec, TrainingSpec]:
    """Translate a :class:`megarl.config.schema.MegarlConfig` into the planner's inputs."""
    from megarl.config.lora import model_lora, resolve_targets
    from megarl.config.validate import critic_enabled, training_world_size

    arr = cfg.actor_rollout_ref
    model_path, note = planning_config_dir(arr.model.path)
    if note:
        print(f"megarl.plan: {note}")
    m = arr.actor.megatron
    optim_overrides = arr.actor.optim.override_optimizer_config
    recompute = m.recompute_settings()  # what the engine builds (config.schema.MegatronConfig)
    layout = LayoutSpec(
        world_size=training_world_size(cfg),
        parallel=ParallelLayout.from_megatron_config(m),
        sequence_parallel=m.sequence_parallel,
        distributed_optimizer=m.use_distributed_optimizer,
        # optimizer_offload (verl's meaning) parks Adam's state on the host while vLLM generates (offload_parts);
        # megatron's optimizer_cpu_offload keeps a share of it there and steps it on the host
        optimizer_cpu_offload=bool(optim_overrides.get("optimizer_cpu_offload", False)),
        optimizer_offload_fraction=float(optim_overrides.get("optimizer_offload_fraction", 1.0)),
        recompute=recompute.get("recompute_granularity") or "none",
        recompute_method=recompute.get("recompute_method", "uniform"),
        recompute_num_layers=recompute.get("recompute_num_layers", 1),
        rollout_tp=arr.rollout.tensor_model_parallel_size,
        placement="colocated" if cfg.trainer.placement == "colocate" else "separate",
        rollout_gpus=cfg.trainer.rollout_gpus,
    )
    max_seq_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    micro_batch_size = arr.actor.ppo_micro_batch_size_per_gpu
    global_batch_size = arr.actor.ppo_mini_batch_size * arr.rollout.n
    packed = bool(arr.model.use_sequence_packing and arr.actor.ppo_max_token_len_per_gpu)
    log_prob_micro_batch_size = None
    if packed:
        # a token budget holds this many longest-possible rows' worth of activations, and budgets make as many
        # micro-batches as the tokens need: the rows are rounded up to whole budgets for the planner's arithmetic
        # (it counts micro-batches in flight, which pipeline stages hold)
        micro_batch_size = -(-arr.actor.ppo_max_token_len_per_gpu // max_seq_len)
        per_step = micro_batch_size * layout.dp
        global_batch_size = -(-global_batch_size // per_step) * per_step
        # the old-log-prob (and reference) passes pack to budgets of their own: the larger one
        budgets = [arr.rollout.log_prob_max_token_len_per_gpu, arr.ref.log_prob_max_token_len_per_gpu]
        if any(budgets):
            log_prob_micro_batch_size = -(-max(b or 0 for b in budgets) // max_seq_len)
    lora = model_lora(arr.model)
    training = TrainingSpec(
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        max_seq_len=max_seq_len,
        use_reference=arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward,
        use_critic=critic_enabled(cfg),
        param_bytes=_DTYPE_BYTES[m.params_dtype],
        grad_bytes=4 if m.override_ddp_config.get("grad_reduce_in_fp32", True) else _DTYPE_BYTES[m.params_dtype],
        offload_train_state=m.param_offload and m.grad_offload and m.optimizer_offload,
        offload_parts=(m.param_offload, m.grad_offload, m.optimizer_offload),
        rollout_sleeps=arr.rollout.free_cache_engine,
        rollout_keeps_weights_on_host=(lora is not None and lora.merge is False and arr.rollout.free_cache_engine
                                       and layout.placement == "colocated"),
        rollout_gpu_memory_utilization=arr.rollout.gpu_memory_utilization,
        rollout_weight_bytes=_DTYPE_BYTES.get(arr.rollout.dtype, 2),
        lora_rank=lora.rank if lora else 0,
        lora_targets=resolve_targets(lora.target_modules) if lora else TrainingSpec.lora_targets,
        train_vision_tower=not arr.actor.freeze_vision_tower and lora is None,
        sequence_packing=packed,
        log_prob_micro_batch_size=log_prob_micro_batch_size,
    )
    hf_config = read_hf_config(model_path)
    quantization = hf_config.get("quantization_config") or {}
    if quantization.get("quant_method") == "fp8" or arr.rollout.quantization == "fp8":
        # vLLM serves an fp8 checkpoint (DeepSeek-V3) in fp8 whatever the activation dtype, and quantizes a bf16
        # one to fp8 with rollout.quantization=fp8
        training = replace(training, rollout_weight_bytes=1)
    if str(arr.rollout.engine_kwargs.vllm.get("kv_cache_dtype", "auto")).startswith("fp8"):
        training = replace(training, kv_cache_bytes=1)
    return hf_config, layout, training
