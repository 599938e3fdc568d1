"""How a model is split over ranks (TP/PP/VPP/CP/EP/ETP and an uneven pipeline's end stages): one type read by
the bridge to build megatron's config and shard weights, by the engines to build megatron's process groups,
and by the planner (``megarl.plan``) to size and check a layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megarl.config.schema import MegatronConfig


@dataclass(frozen=True)
class ParallelLayout:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    virtual_pipeline_parallel: Optional[int] = None
    context_parallel: int = 1
    expert_parallel: int = 1
    expert_tensor_parallel: Optional[int] = None  # None: megatron's default, tensor_parallel
    first_stage_layers: Optional[int] = None  # megatron's num_layers_in_first_pipeline_stage
    last_stage_layers: Optional[int] = None  # megatron's num_layers_in_last_pipeline_stage

    @classmethod
    def from_megatron_config(cls, m: MegatronConfig) -> "ParallelLayout":
        return cls(
            tensor_parallel=m.tensor_model_parallel_size, pipeline_parallel=m.pipeline_model_parallel_size,
            virtual_pipeline_parallel=m.virtual_pipeline_model_parallel_size,
            context_parallel=m.context_parallel_size, expert_parallel=m.expert_model_parallel_size,
            expert_tensor_parallel=m.expert_tensor_parallel_size,
            first_stage_layers=m.num_layers_in_first_pipeline_stage,
            last_stage_layers=m.num_layers_in_last_pipeline_stage,
        )

    @property
    def model_parallel(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    @property
    def effective_expert_tensor_parallel(self) -> int:
        return self.tensor_parallel if self.expert_tensor_parallel is None else self.expert_tensor_parallel

    def data_parallel(self, world_size: int) -> int:
        if world_size % self.model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor_parallel*pipeline_parallel*"
                f"context_parallel = {self.tensor_parallel}*{self.pipeline_parallel}*{self.context_parallel}"
            )
        return world_size // self.model_parallel
