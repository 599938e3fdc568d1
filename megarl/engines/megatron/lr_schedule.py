"""The learning-rate schedule of a trainable engine: megatron's ``OptimizerParamScheduler`` from
:class:`LRScheduleConfig` (warmup, constant/linear/cosine/inverse-square-root decay, min lr)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LRScheduleConfig:
    """Megatron ``OptimizerParamScheduler`` settings; the peak lr is ``OptimizerConfig.lr``."""

    warmup_steps: int = 0
    decay_steps: Optional[int] = None  # None: warmup_steps + 1 (only matters for non-constant styles)
    decay_style: str = "constant"  # constant | linear | cosine | inverse-square-root
    min_lr: float = 0.0
    init_lr: float = 0.0  # lr at step 0 of the warmup

    def __post_init__(self):
        styles = ("constant", "linear", "cosine", "inverse-square-root")
        if self.decay_style not in styles:
            raise ValueError(f"LRScheduleConfig.decay_style {self.decay_style!r} not in {styles}")
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ValueError(
                f"LRScheduleConfig.decay_steps ({self.decay_steps}) must exceed warmup_steps ({self.warmup_steps})"
            )


def build_lr_scheduler(optimizer, optimizer_config, schedule: LRScheduleConfig):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = schedule.decay_steps or schedule.warmup_steps + 1
    return OptimizerParamScheduler(
        optimizer,
        init_lr=schedule.init_lr if schedule.warmup_steps > 0 else optimizer_config.lr,
        max_lr=optimizer_config.lr,
        min_lr=schedule.min_lr,
        lr_warmup_steps=schedule.warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=schedule.decay_style,
        start_wd=optimizer_config.weight_decay,
        end_wd=optimizer_config.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
        # On resume the schedule comes from this run's config (a run extended to more steps, or given a new lr,
        # gets them) and only the position (steps done) from the checkpoint: megatron-LM's
        # --override-opt_param-scheduler. megatron's default keeps the checkpoint's values without a word.
        override_opt_param_scheduler=True,
        use_checkpoint_opt_param_scheduler=False,
    )
