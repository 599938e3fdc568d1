"""Layout and memory planner: parameter counts from HF configs, divisibility rules, per-GPU memory per RL phase.

Pure arithmetic on config dicts: imports neither torch, megatron nor ray. CLI: ``python -m megarl.plan``.
"""

from megarl.plan.actor_update import plan_actor_update
from megarl.plan.layout import LayoutSpec, TrainingSpec, check_layout, split_pipeline_layers
from megarl.plan.memory import (
    KernelSpec, PhaseMemory, PlanReport, layer_activation_bytes, logits_bytes, pad_vocab, plan_layout,
)
from megarl.models.model_dims import ModelDims, read_model_dims
from megarl.plan.param_count import LayerParams, ParamCount, count_parameters

__all__ = [
    "KernelSpec", "LayerParams", "LayoutSpec", "ModelDims", "ParamCount", "PhaseMemory", "PlanReport", "TrainingSpec",
    "check_layout", "count_parameters", "layer_activation_bytes", "logits_bytes", "pad_vocab", "plan_actor_update", "plan_layout", "read_model_dims",
    "split_pipeline_layers",
]
