"""Parallel layout and RL training shape as the planner sees them, and the divisibility rules they must obey.

``check_layout`` returns human-readable errors (an empty list means the layout is well formed); the rules
follow megatron-core 0.16's own assertions (``TransformerConfig.__post_init__``, ``initialize_model_parallel``)
and vLLM's tensor-parallel rules for the rollout engine, so a layout rejected here would be rejected there.
Leaves out memory (see ``memory.py``) and Megatron's string pipeline layouts (``pipeline_model_parallel_layout``):
uneven pipelines are described with first/last stage layer counts only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megarl.models.model_dims import ModelDims
from megarl.models.parallel_layout import ParallelLayout

Recompute = Literal["none", "selective", "full"]
Placement = Literal["colocated", "separate"]


@dataclass(frozen=True)
class LayoutSpec:
    """Where the trainer and the rollout engine run, and how the trainer's model is split (``parallel``)."""

    world_size: int  # GPUs of the trainer (colocated: also the rollout GPUs)
    parallel: ParallelLayout = ParallelLayout()
    sequence_parallel: bool = True
    distributed_optimizer: bool = True
    # megatron's HybridDeviceOptimizer: this fraction of Adam's state and fp32 master weights lives on the host,
    # and the host runs their step (override_optimizer_config.optimizer_cpu_offload / optimizer_offload_fraction)
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0
    recompute: Recompute = "none"
    # full recompute's grouping (megatron's recompute_method / recompute_num_layers, megarl's defaults): "uniform"
    # recomputes groups of that many layers, keeping each group's input; "block" recomputes only the first that
    # many layers of each (virtual) stage chunk and keeps every activation of the others
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    train_mtp: bool = False  # keep the DeepSeek MTP module on the last stage and train it
    rollout_tp: int = 1  # GPUs of one rollout engine (tensor/expert parallel inside it)
    placement: Placement = "colocated"
    rollout_gpus: int = 0  # separate placement: GPUs given to rollout engines

    @property
    def dp(self) -> int:
        return self.world_size // self.parallel.model_parallel

    @property
    def expert_dp(self) -> int:
        p = self.parallel
        return self.world_size // (p.pipeline_parallel * p.expert_parallel * p.effective_expert_tensor_parallel)


@dataclass(frozen=True)
class TrainingSpec:
    """One RL step's shape: what is trained, on how many sequences of what length."""

    global_batch_size: int  # sequences per optimizer step (PPO/GRPO mini-batch)
    micro_batch_size: int = 1
    max_seq_len: int = 4096  # prompt + response tokens of one sequence
    # Response tokens per sequence: the log-prob path keeps fp32 [tokens, vocab] buffers for these only.
    # None: every position (an upper bound).
    max_response_len: int | None = None
    use_reference: bool = True
    use_critic: bool = False
    param_bytes: int = 2  # training weights: 2 bf16, 4 fp32
    grad_bytes: int = 4  # megatron's grad buffer: 4 with grad_reduce_in_fp32 (megarl's default), else param_bytes
    offload_train_state: bool = True  # actor/ref/critic states go to CPU outside their own phase
    # finer: which of the actor's parts leave the GPU while the rollout engine generates (verl's
    # megatron.{param,grad,optimizer}_offload); None: as offload_train_state says. Grads are dropped, not saved.
    offload_parts: tuple[bool, bool, bool] | None = None
    rollout_sleeps: bool = True  # colocated rollout engine frees weights + KV cache while training
    # ... but copies its weights to the host first and back at wake-up (vLLM's sleep level 1): a served LoRA
    # adapter (lora.merge=false) needs the base kept, since only the adapter comes with each sync
    rollout_keeps_weights_on_host: bool = False
    rollout_max_num_seqs: int = 256  # sequences one rollout engine decodes at once
    rollout_gpu_memory_utilization: float = 0.85  # vLLM's fraction of the GPU for weights + KV cache
    rollout_weight_bytes: int = 2  # 2: bf16 rollout weights, 1: fp8
    kv_cache_bytes: int = 2
    # LoRA (megarl.models.lora): rank 0 is full-parameter training. With adapters the base is frozen (no grads,
    # no optimizer state), the reference is the base with the adapters off (no second model)
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    # a vision-language model's tower trains (grads, optimizer state) instead of staying frozen (weights only)
    train_vision_tower: bool = False
    # sequence packing: a micro-batch is one stream of micro_batch_size x max_seq_len tokens (the token budget)
    # rather than that many padded rows, and the log-prob path scores the whole stream (no response slice copied)
    sequence_packing: bool = False
    # rows of max_seq_len in one old/reference log-prob micro-batch (its own token budget when packing);
    # None: the training micro-batch's
    log_prob_micro_batch_size: int | None = None


def split_pipeline_layers(num_layers: int, layout: LayoutSpec) -> tuple[list[int], list[str]]:
    """Decoder layers on each pipeline stage, and the errors if the split is not possible."""
    p = layout.parallel
    pp, vpp, first, last = p.pipeline_parallel, p.virtual_pipeline_parallel, p.first_stage_layers, p.last_stage_layers
    errors: list[str] = []
    if pp == 1:
        if first is not None or last is not None:
            errors.append("first_stage_layers/last_stage_layers need pp > 1")
        return [num_layers], errors
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    for name, value in (("first_stage_layers", first), ("last_stage_layers", last)):
        if value is not None and value <= 0:
            errors.append(f"{name}={value} must be > 0")
        if value is not None and vpp and value % vpp:
            errors.append(f"{name}={value} is not divisible by vpp={vpp}")
    if middle_layers < 0 or bool(middle_layers) != bool(middle_stages):
        errors.append(
            f"pipeline split: {middle_layers} layers left for {middle_stages} middle stages "
            f"(num_layers={num_layers}, pp={pp}, first_stage_layers={first}, last_stage_layers={last})"
        )
        return [], errors
    if middle_stages and middle_layers % middle_stages:
        if first or last:
            errors.append(
                f"{middle_layers} layers left after first_stage_layers={first}/last_stage_layers={last} are not "
                f"divisible by the {middle_stages} middle pipeline stages"
            )
        else:
            errors.append(
                f"num_layers={num_layers} is not divisible by pp={pp}; "
                "set first_stage_layers/last_stage_layers for an uneven split"
            )
        return [], errors
    per_middle = middle_layers // middle_stages if middle_stages else 0
    if vpp and per_middle % vpp:
        errors.append(f"layers per pipeline stage ({per_middle}) are not divisible by vpp={vpp}")
    stages = [per_middle] * middle_stages
    if first is not None:
        stages.insert(0, first)
    if last is not None:
        stages.append(last)
    return stages, errors


def _check_positive(layout: LayoutSpec, training: TrainingSpec) -> list[str]:
    errors = []
    p = layout.parallel
    required = {"layout.world_size": layout.world_size, "layout.rollout_tp": layout.rollout_tp,
                "layout.parallel.tensor_parallel": p.tensor_parallel,
                "layout.parallel.pipeline_parallel": p.pipeline_parallel,
                "layout.parallel.context_parallel": p.context_parallel,
                "layout.parallel.expert_parallel": p.expert_parallel}
    optional = {"layout.parallel.expert_tensor_parallel": p.expert_tensor_parallel,
                "layout.parallel.virtual_pipeline_parallel": p.virtual_pipeline_parallel}
    for name in ("global_batch_size", "micro_batch_size", "max_seq_len", "rollout_max_num_seqs"):
        required[f"training.{name}"] = getattr(training, name)
    for name, value in [*required.items(), *((n, v) for n, v in optional.items() if v is not None)]:
        if not isinstance(value, int) or value < 1:
            errors.append(f"{name} must be a positive integer, got {value!r}")
    if training.max_response_len is not None and not 0 < training.max_response_len < training.max_seq_len:
        errors.append(
            f"training.max_response_len={training.max_response_len} must be in [1, max_seq_len="
            f"{training.max_seq_len}) (a sequence is prompt + response)"
        )
    if training.param_bytes not in (2, 4):
        errors.append(f"training.param_bytes must be 2 (bf16) or 4 (fp32), got {training.param_bytes!r}")
    if not 0 < training.rollout_gpu_memory_utilization <= 1:
        errors.append(
            f"training.rollout_gpu_memory_utilization must be in (0, 1], got {training.rollout_gpu_memory_utilization}"
        )
    return errors


def check_layout(dims: ModelDims, layout: LayoutSpec, training: TrainingSpec) -> list[str]:
    """Every divisibility rule ``layout`` breaks for this model and batch, as messages."""
    errors = _check_positive(layout, training)
    if errors:
        return errors
    p = layout.parallel
    tp, pp, cp, ep = p.tensor_parallel, p.pipeline_parallel, p.context_parallel, p.expert_parallel
    etp = p.effective_expert_tensor_parallel
    model_parallel = tp * pp * cp
    if layout.world_size % model_parallel:
        errors.append(f"world_size={layout.world_size} is not divisible by tp*pp*cp={tp}*{pp}*{cp}={model_parallel}")
    if dims.num_heads % tp:
        errors.append(f"num_attention_heads={dims.num_heads} is not divisible by tp={tp}")
    # Megatron: kv heads split over TP, or (fewer kv heads than TP ranks) each kv head replicated on tp/kv ranks.
    if dims.num_kv_heads % tp and tp % dims.num_kv_heads:
        errors.append(f"num_key_value_heads={dims.num_kv_heads} must be a multiple or a divisor of tp={tp}")
    if pp == 1 and p.virtual_pipeline_parallel:
        errors.append("vpp needs pp > 1")
    _, pipeline_errors = split_pipeline_layers(dims.num_layers, layout)
    errors += pipeline_errors

    if dims.moe is None:
        if ep != 1:
            errors.append(f"ep={ep} but {dims.model_type} is a dense model (no experts): use ep=1")
    else:
        if dims.moe.num_experts % ep:
            errors.append(f"num_experts={dims.moe.num_experts} is not divisible by ep={ep}")
        expert_grid = etp * ep * pp
        if layout.world_size % expert_grid:
            errors.append(
                f"world_size={layout.world_size} is not divisible by etp*ep*pp={etp}*{ep}*{pp}"
                f"={expert_grid} (Megatron's expert grid: etp*ep*expert_dp*pp = world_size)"
            )
        if tp > 1 and ep > 1 and not layout.sequence_parallel:
            errors.append("MoE with tp>1 and ep>1 needs sequence_parallel=True (Megatron requires it)")

    if cp > 1 and training.max_seq_len % (2 * cp):
        errors.append(
            f"max_seq_len={training.max_seq_len} is not divisible by 2*cp={2 * cp} "
            "(load-balanced context parallel splits each sequence into 2*cp chunks)"
        )
    if not errors:
        per_step = training.micro_batch_size * layout.dp
        if training.global_batch_size % per_step:
            errors.append(
                f"global_batch_size={training.global_batch_size} is not divisible by "
                f"micro_batch_size*dp={training.micro_batch_size}*{layout.dp}={per_step}"
            )

    rtp = layout.rollout_tp
    if dims.num_heads % rtp:
        errors.append(f"num_attention_heads={dims.num_heads} is not divisible by rollout_tp={rtp}")
    if dims.mla is None and dims.num_kv_heads % rtp and rtp % dims.num_kv_heads:
        errors.append(
            f"num_key_value_heads={dims.num_kv_heads} must be a multiple or a divisor of rollout_tp={rtp} (vLLM rule)"
        )
    if layout.placement == "colocated":
        if layout.rollout_gpus:
            errors.append("rollout_gpus is only for placement='separate' (colocated rollout uses the trainer GPUs)")
        if layout.world_size % rtp:
            errors.append(f"world_size={layout.world_size} is not divisible by rollout_tp={rtp}")
    elif layout.placement == "separate":
        if layout.rollout_gpus < 1 or layout.rollout_gpus % rtp:
            errors.append(f"rollout_gpus={layout.rollout_gpus} must be a positive multiple of rollout_tp={rtp}")
    else:
        errors.append(f"placement must be 'colocated' or 'separate', got {layout.placement!r}")
    if layout.recompute not in ("none", "selective", "full"):
        errors.append(f"recompute must be 'none', 'selective' or 'full', got {layout.recompute!r}")
    if layout.recompute_method not in ("uniform", "block"):
        errors.append(f"recompute_method must be 'uniform' or 'block', got {layout.recompute_method!r}")
    if layout.recompute_num_layers < (0 if layout.recompute_method == "block" else 1):
        errors.append(f"recompute_num_layers={layout.recompute_num_layers} is too small for "
                      f"recompute_method={layout.recompute_method!r}")
    if layout.train_mtp and not dims.mtp_layers:
        errors.append(f"train_mtp=True but {dims.model_type} has no MTP layers (num_nextn_predict_layers)")
    return errors
