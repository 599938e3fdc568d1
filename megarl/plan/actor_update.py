"""Planner estimate for one process running one megarl ``ActorEngine.update_policy`` at TP=PP=DP=1.

This is the configuration the measured runs use (``bench/train_throughput.py`` on a GPU,
``bench/plan_vs_measured.py`` on the CPU): no reference, critic or rollout engine, the non-distributed
optimizer, every row of the step in one mini-batch. It returns the planner's "actor train" phase, whose total
is the peak the allocator should see: training state + all layers' saved activations of one micro-batch +
that micro-batch's logits at the log-prob function's forward peak + attention side buffers.
Leaves out: anything ``plan_layout`` leaves out; TP/PP/DP > 1 (use ``plan_layout`` directly).
"""

from __future__ import annotations

from typing import Any, Mapping

from megarl.plan.layout import LayoutSpec, TrainingSpec
from megarl.plan.memory import KernelSpec, PhaseMemory, plan_layout


def plan_actor_update(
    hf_config: Mapping[str, Any], *, rows: int, micro_batch_size: int, prompt_len: int, response_len: int,
    param_bytes: int, kernels: KernelSpec, framework_overhead_gib: float = 0.0,
) -> PhaseMemory:
    """The planner's "actor train" phase for this single-process update (``framework_overhead_gib`` added)."""
    layout = LayoutSpec(world_size=1, distributed_optimizer=False)
    training = TrainingSpec(
        global_batch_size=rows, micro_batch_size=micro_batch_size, max_seq_len=prompt_len + response_len,
        max_response_len=response_len, use_reference=False, param_bytes=param_bytes, rollout_max_num_seqs=1,
    )
    # The GPU size only decides FITS / DOES NOT FIT, which this estimate does not use.
    report = plan_layout(hf_config, layout, training, 1e6, framework_overhead_gib=framework_overhead_gib,
                         kernels=kernels)
    if report.errors:
        raise ValueError(f"plan_actor_update: {'; '.join(report.errors)}")
    return next(p for p in report.phases if p.phase == "actor train")
